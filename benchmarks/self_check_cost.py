"""Start-up cost of the self-check (``engine/self_check/checks.py``): first run vs cached verdict.

For one model directory (or the offline default SmolLM2) and one device/dtype/backend, each
round builds ``LazyAttention`` three times in one process, sharing one cache directory (so
the weights' hash memo is warm): with ``self_check=False``, with the check and no verdict
(the ``self_check/`` folder removed: the first run), and with the check again (the cached
verdict). One unmeasured load comes first, so file pages and kernels are warm. The check's
own report (its parts' seconds, max errors, tolerances) comes from the verdict file.
Prints one JSON object; ``--out`` also writes it.

    python benchmarks/self_check_cost.py --device cpu --dtype float32 --backend torch
    python benchmarks/self_check_cost.py --model DIR --device cuda --dtype bfloat16 --backend triton
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

from lazyattn_rag import CacheConfig, EngineConfig
from lazyattn_rag.llm import LazyAttention


def _load_seconds(config: EngineConfig) -> float:
    start = time.perf_counter()
    llm = LazyAttention(config)
    seconds = time.perf_counter() - start
    llm.shutdown()
    return seconds


def main(model: Annotated[str | None, typer.Option(help="model directory; default: the offline SmolLM2")] = None,
         device: str = "cpu", dtype: str = "float32", backend: str = "torch", rounds: int = 3,
         num_blocks: int = 256, out: Annotated[Path | None, typer.Option(help="also write the JSON here")] = None,
         ) -> None:
    cache_dir = Path(tempfile.mkdtemp(prefix="self-check-cost-"))
    default_cache = EngineConfig().resolved_cache_dir() if model is None else None
    if default_cache is not None and (default_cache / "models").is_dir():  # reuse the converted default model
        shutil.copytree(default_cache / "models", cache_dir / "models", symlinks=True)
        if (default_cache / "hashes.json").is_file():
            shutil.copy(default_cache / "hashes.json", cache_dir / "hashes.json")

    def config(check: bool) -> EngineConfig:
        return EngineConfig(model=model, device=device, dtype=dtype, attention_backend=backend, cache_dir=cache_dir,
                            self_check=check, cache=CacheConfig(num_blocks=num_blocks))

    _load_seconds(config(False))  # warm-up: page in the weights, compile kernels
    times: dict[str, list[float]] = {"no_check": [], "first_run": [], "cached_verdict": []}
    for _ in range(rounds):
        times["no_check"].append(_load_seconds(config(False)))
        shutil.rmtree(cache_dir / "self_check", ignore_errors=True)
        times["first_run"].append(_load_seconds(config(True)))
        times["cached_verdict"].append(_load_seconds(config(True)))
    verdicts = list((cache_dir / "self_check").glob("*.json"))
    report = json.loads(verdicts[0].read_text())["report"] if verdicts else None
    result = {
        "model": model or "SmolLM2-135M-Instruct (default)",
        "device": device, "dtype": dtype, "backend": backend, "rounds": rounds,
        "median_load_seconds": {k: round(statistics.median(v), 3) for k, v in times.items()},
        "load_seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "check_report": report,
        "host": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
                 "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
    }
    shutil.rmtree(cache_dir, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


if __name__ == "__main__":
    typer.run(main)
