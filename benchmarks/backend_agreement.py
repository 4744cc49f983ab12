"""The triton backend gives the same greedy text as the torch backend on the default model (CUDA).

Runs the default SmolLM2 twice on the GPU, once per attention backend, over the same
documents and questions (documents at different offsets, cache hits and misses), and
compares the greedy token ids. float32 is the strict check (both backends compute the same
function; only summation order differs); bfloat16 is reported as an agreement rate.

    python benchmarks/backend_agreement.py --dtype float32 --dtype bfloat16
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import typer

from lazyattn_rag import EngineConfig, SamplingParams
from lazyattn_rag.llm import LazyAttention

DOCS = {
    "eiffel": "The Eiffel Tower is a wrought-iron lattice tower in Paris, France. It was completed in 1889.",
    "fuji": "Mount Fuji is the highest mountain in Japan, at 3,776 metres. It last erupted in 1707.",
    "python": "Python is a programming language created by Guido van Rossum and first released in 1991.",
    "amazon": "The Amazon is the largest rainforest on Earth and spans nine countries in South America.",
}
QUESTIONS = [
    ("When was the Eiffel Tower completed?", ["fuji", "eiffel"]),
    ("Who created Python?", ["python", "amazon", "eiffel"]),
    ("How high is Mount Fuji?", ["eiffel", "python", "fuji"]),
    ("Where is the Amazon rainforest?", ["amazon"]),
    ("When was Python first released?", ["amazon", "fuji", "python", "eiffel"]),
    ("When did Mount Fuji last erupt?", ["fuji", "fuji", "eiffel"]),
]


def run(backend: str, dtype: str, max_tokens: int) -> list[list[int]]:
    llm = LazyAttention(EngineConfig(device="cuda", dtype=dtype, attention_backend=backend))
    llm.add_documents(list(DOCS.items()))
    params = SamplingParams(max_tokens=max_tokens)
    outs = [llm.generate(q, ids, sampling=params) for q, ids in QUESTIONS]
    outs += [llm.generate(q, ids, sampling=params) for q, ids in reversed(QUESTIONS)]  # now all hits
    llm.shutdown()
    return [o.token_ids for o in outs], [o.text for o in outs]


def main(dtype: list[str] = typer.Option(["float32", "bfloat16"]), max_tokens: int = 32,
         out: str = "benchmarks/results/backend_agreement_h200.json") -> None:
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    for dt in dtype:
        ref_ids, ref_text = run("torch", dt, max_tokens)
        tri_ids, tri_text = run("triton", dt, max_tokens)
        same = [a == b for a, b in zip(ref_ids, tri_ids)]
        report[dt] = {"identical_greedy_outputs": sum(same), "num_prompts": len(same),
                      "texts": [{"torch": a, "triton": b} for a, b in zip(ref_text, tri_text)]}
        print(dt, f"{sum(same)}/{len(same)} identical")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1))
    if not all(report[dt]["identical_greedy_outputs"] == report[dt]["num_prompts"] for dt in dtype if dt == "float32"):
        raise SystemExit("float32 greedy outputs differ between backends")


if __name__ == "__main__":
    typer.run(main)
