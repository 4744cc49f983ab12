"""The README's Python snippet on a busy CPU (issue 38.1): the engine API in a program that sets
nothing, beside other CPU-bound processes.

Each run is a fresh process that executes the README's first ``python`` block (read from
README.md, so it is the snippet a user pastes) from the repository root, with ``--busy N``
other processes spinning on the same cores (``while True: pass``, started before it, stopped
after). Arms, interleaved run by run:

* ``fitted``: the library as it is (``EngineConfig.cpu_threads=None``: the engine fits its
  intra-op threads to the idle cores, ``engine/cpu_threads.py``);
* ``passive``: the fitting off and ``OMP_WAIT_POLICY=PASSIVE`` set by hand (what the README told
  users to do before);
* ``defaults``: the fitting off, nothing set (the library before issue 38: libgomp's defaults).

"The fitting off" replaces ``engine_cpu_threads`` with a function that returns ``None`` before the
snippet runs. Recorded per run: wall time from spawn to exit, the snippet's own time (after
imports), the 1-minute load average before, how often the engine changed its thread count. Medians per (arm, busy) and the ratios the issue
asks for go to ``benchmarks/results/busy_cpu.json``::

    .venv/bin/python benchmarks/busy_cpu.py --busy 0 1 2 --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("fitted", "passive", "defaults")
WRAPPER = """
import sys, time
start = time.perf_counter()
from lazyattn_rag.engine import cpu_threads
fitters = []
init = cpu_threads.CpuThreads.__init__
def record(self, *args, **kwargs):
    init(self, *args, **kwargs)
    fitters.append(self)
cpu_threads.CpuThreads.__init__ = record
if {off}:
    import lazyattn_rag.engine.engine as engine_module
    engine_module.engine_cpu_threads = lambda cpu_threads, device: None
import runpy
runpy.run_path({snippet!r}, run_name="__main__")
print("SNIPPET_S", time.perf_counter() - start, file=sys.stderr)
print("THREAD_CHANGES", sum(f.num_changes for f in fitters), file=sys.stderr)
"""


def readme_snippet() -> str:
    """The README's first ``python`` code block."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    if match is None:
        raise SystemExit("README.md has no ```python block")
    return match.group(1)


def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_once(arm: str, busy: int, snippet_path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if arm == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    wrapper = WRAPPER.format(off=arm != "fitted", snippet=snippet_path)
    others = spinners(busy)
    try:
        time.sleep(0.5)  # the spinners are running
        load = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", wrapper], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1800)
        wall = time.perf_counter() - start
    finally:
        for p in others:
            p.kill()
            p.wait()
    if done.returncode != 0:
        raise SystemExit(f"{arm} busy={busy} failed:\n{done.stderr[-3000:]}")
    snippet_s = float(re.search(r"SNIPPET_S ([\d.]+)", done.stderr).group(1))
    changes = int(re.search(r"THREAD_CHANGES (\d+)", done.stderr).group(1))
    return {"arm": arm, "busy": busy, "wall_s": round(wall, 2), "snippet_s": round(snippet_s, 2),
            "load_1min_before": round(load, 2), "thread_changes": changes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2], help="competing spinners per condition")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "busy_cpu.json")
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(readme_snippet())
    records = []
    for busy in args.busy:
        for i in range(args.runs):
            for arm in args.arms:
                record = run_once(arm, busy, f.name)
                records.append(record)
                print(json.dumps(record), flush=True)
    medians = {}
    for busy in args.busy:
        for arm in args.arms:
            runs = [r["snippet_s"] for r in records if r["arm"] == arm and r["busy"] == busy]
            medians[f"{arm}_busy{busy}_snippet_s"] = round(statistics.median(runs), 2)
    ratios = {}
    for busy in args.busy:
        if "fitted" in args.arms and "passive" in args.arms:
            ratios[f"fitted_over_passive_busy{busy}"] = round(
                medians[f"fitted_busy{busy}_snippet_s"] / medians[f"passive_busy{busy}_snippet_s"], 2)
        if "fitted" in args.arms and "defaults" in args.arms:
            ratios[f"fitted_over_defaults_busy{busy}"] = round(
                medians[f"fitted_busy{busy}_snippet_s"] / medians[f"defaults_busy{busy}_snippet_s"], 2)
    result = {"command": "python benchmarks/busy_cpu.py " + " ".join(sys.argv[1:]),
              "machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                          "platform": platform.platform(), "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d"), "records": records, "medians": medians, "ratios": ratios}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"medians": medians, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
