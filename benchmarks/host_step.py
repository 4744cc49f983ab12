"""Host (Python) time of an engine step, by part, on a serving workload (issue 19).

The engine's step is schedule -> input preparation -> attention metadata -> forward ->
output processing; on a GPU everything but the forward is host work that the device waits
for (CUDA-graph replay is asynchronous, sampling syncs). This measures that host work with wall
timers around each part while the serving workload of ``benchmarks/serving.py`` runs (Zipf
documents, closed loop at ``--concurrency``), on the CPU with the ``tiny`` random model so that
the forward is short and the run is quick; each part's mean ms per step is reported. The timers
wrap the engine's own methods for the run (no profiler: its overhead would distort the shares).

    python benchmarks/host_step.py --out host_step_cpu

Writes ``benchmarks/results/<out>.json``; write-up in docs/benchmarks.md ("Host time per step").
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import typer

import lazyattn_rag.engine.worker.runner as runner_module
from benchmarks.serving_results import command_line, environment, write
from benchmarks.serving_setup import Bench, make_engine, release
from benchmarks.serving_timing import drive
from benchmarks.serving_workload import Workload
from lazyattn_rag import SamplingParams
from lazyattn_rag.engine.worker.input_prep import InputPreparer
from lazyattn_rag.engine.output.output_processor import OutputProcessor
from lazyattn_rag.engine.scheduling.scheduler import Scheduler

app = typer.Typer(add_completion=False, help=__doc__)
PARTS = {"schedule": (Scheduler, "schedule"), "input_prep": (InputPreparer, "prepare"),
         "output": (OutputProcessor, "process")}


def timed(seconds: list[float], fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)
    return wrapper


def instrument() -> tuple[dict[str, list[float]], callable]:
    """Wrap each part with a timer; returns the per-call seconds and a function that unwraps."""
    seconds = {name: [] for name in (*PARTS, "metadata")}
    originals = {name: getattr(cls, attr) for name, (cls, attr) in PARTS.items()}
    for name, (cls, attr) in PARTS.items():
        setattr(cls, attr, timed(seconds[name], originals[name]))
    build = runner_module.build_attention_metadata
    runner_module.build_attention_metadata = timed(seconds["metadata"], build)

    def restore():
        for name, (cls, attr) in PARTS.items():
            setattr(cls, attr, originals[name])
        runner_module.build_attention_metadata = build
    return seconds, restore


@app.command()
def main(arch: str = "tiny", mode: str = "lazy", num_docs: int = 200, doc_tokens: int = 512, num_requests: int = 120,
         warm_up_requests: int = 20, concurrency: int = 16, output_tokens: int = 32, repeats: int = 3,
         out: str = "host_step_cpu") -> None:
    """Mean host ms per step of each part over the trace's requests after the first
    ``warm_up_requests``, ``repeats`` runs on one engine."""
    if not 0 <= warm_up_requests < num_requests:
        raise typer.BadParameter(f"--warm-up-requests {warm_up_requests} must be in [0, --num-requests {num_requests})")
    torch.set_num_threads(1)  # the forward of the tiny model; the host parts are single-threaded Python
    bench = Bench.build(arch, "cpu", "float32")
    llm = make_engine(bench, mode, 256 * 2**20, "cpu", 16384, concurrency, backend="torch", cuda_graphs=False)
    workload = Workload(num_docs, doc_tokens, 5, 2.1, 64, output_tokens, num_requests, 0)
    llm.add_documents(list(workload.documents().items()))
    requests = workload.requests()
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    asyncio.run(drive(llm, requests[:warm_up_requests], params, concurrency, None, 0))  # warm-up, hot documents
    runs = []
    for rep in range(repeats):
        seconds, restore = instrument()
        try:
            _, wall = asyncio.run(drive(llm, requests[warm_up_requests:], params, concurrency, None, rep + 1))
        finally:
            restore()
        num_steps = len(seconds["schedule"])  # schedule() runs once per engine step
        if num_steps == 0:
            raise RuntimeError("the trace ran no engine step: nothing to time")
        row = {"repeat": rep, "num_steps": num_steps, "wall_s": wall,
               **{f"{name}_ms_per_step": 1e3 * sum(s) / num_steps for name, s in seconds.items()}}
        row["host_ms_per_step"] = sum(row[f"{name}_ms_per_step"] for name in seconds)
        runs.append(row)
        print(row, flush=True)
    release(llm)
    keys = [k for k in runs[0] if k.endswith("_ms_per_step")]
    write(out, {"environment": environment(), "command": command_line(), "arch": arch, "mode": mode,
                "concurrency": concurrency, "runs": runs,
                "median": {k: statistics.median(r[k] for r in runs) for k in keys}})


if __name__ == "__main__":
    app()
