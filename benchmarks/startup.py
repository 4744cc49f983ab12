"""Start-up and first-question latency of ``lazyattn ask`` on the CPU (issue 15.3).

Each run is a fresh process, as a user's command is. Kinds of run (``--runs`` of each):

* ``cli_greedy`` / ``cli_sampled``: ``lazyattn ask QUESTION --doc DOC --json`` on the converted
  default model, greedy (``--temperature 0``: the issue's trial, a 32-token answer) or with the
  model's recommended sampling and ``--seed 0`` (the default since issue 15.1; 49 tokens).
  Recorded: wall time from spawn to exit, the child's CPU time (user + sys), the 1-minute load
  average and the other processes' running threads just before (what the command's OpenMP
  settings see, ``lazyattn_rag/cli_runtime.py``), and the answer's stats (TTFT, tokens).
* ``api`` (``--api``): the same engine through the Python API in one process (the library sets
  no OpenMP variables): import time, ``LazyAttention()``, three questions (the first over DOC,
  a second over another cold document as long, a third over DOC again: a hit) and
  ``LazyAttention.stats()``: ``startup_ms``, its parts, ``first_request_ttft_ms``. It tells
  whether the first question pays anything later cold ones do not.
* ``first_start_cli_greedy`` and ``first_start_api`` (``--first-start``): the same in a fresh
  cache directory holding only links to the converted models and a copy of the hash memo, so a
  first start's work besides the conversion itself (timed by its own progress bar) runs: the
  self-check against transformers and the memo of transformers' config and tokenizer.

Results go into ``benchmarks/results/startup_cpu.json`` under ``--label`` (``after`` by
default): per-run records and medians. ``--baseline DIR`` also runs another checkout's code
(its ``lazyattn_rag`` package first on ``PYTHONPATH``), e.g. the commit before a change, under
``before``, each of its runs right after the working tree's:

    git archive BASE | tar -x -C /tmp/base && for p in engine kernels integrations; do
        ln -s ../$p /tmp/base/lazyattn_rag/$p; done
    .venv/bin/python benchmarks/startup.py --baseline /tmp/base --baseline-note "BASE" --api --first-start

The machine may be shared: each record carries its load, and medians are of runs.
``--busy N`` measures a busy machine on purpose: N other processes spin during the runs.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "startup_cpu.json"
QUESTION = "When was the Eiffel Tower completed?"
DOC = ROOT / "examples" / "data" / "eiffel.txt"
# How the CLI samples: greedy (the trial: 32 tokens), or the model's recommended sampling
# (its default since issue 15.1) with a fixed seed, so every run gives the same answer (49 tokens).
SAMPLING = {"greedy": ["--temperature", "0"], "sampled": ["--seed", "0"]}

# The API probe, run by the interpreter of the benchmark in a fresh process; prints one JSON line.
_API_PROBE = r"""
import json, sys, time
start = time.perf_counter()
from lazyattn_rag import EngineConfig, LazyAttention, SamplingParams
imported = time.perf_counter()
llm = LazyAttention(EngineConfig(cache_dir=sys.argv[4] if len(sys.argv) > 4 else None))
built = time.perf_counter()
question, doc = sys.argv[1], open(sys.argv[2]).read()
params = SamplingParams(max_tokens=int(sys.argv[3]))
llm.add_document("doc", doc)
llm.add_document("other", doc.replace("Eiffel", "Gustave"))  # a second cold document, as long
asked = [llm.generate(question, [d], sampling=params).stats for d in ("doc", "other", "doc")]
stats = llm.stats()
print(json.dumps({
    "import_s": imported - start, "constructor_s": built - imported,
    "ttft_ms": {"first_cold": asked[0].ttft_ms, "second_cold": asked[1].ttft_ms, "hit": asked[2].ttft_ms},
    "docs_hit": [s.docs_hit for s in asked],
    "stats": {k: stats.get(k) for k in ("startup_ms", "startup_parts_ms", "self_check", "first_request_ttft_ms")},
}))
"""


_BUSY: list[int] = []


def others_running() -> int:
    """Running threads of other processes now, as ``lazyattn_rag/cli_runtime.py`` counts them
    (not imported: importing it sets this process's OpenMP variables, which the runs would inherit)."""
    counts = []
    for _ in range(5):
        with open("/proc/stat") as f:
            counts.append(next(int(line.split()[1]) for line in f if line.startswith("procs_running")))
        time.sleep(0.002)
    return max(0, min(counts) - 1)


def _wait_quiet(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while others_running() > 0 and time.monotonic() < deadline:
        time.sleep(2.0)


def _load() -> float:
    return os.getloadavg()[0]


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(argv: list[str], env: dict[str, str], cwd: Path = ROOT) -> tuple[float, float, float, str]:
    """Run ``argv``; (wall s, child CPU s, load average before, stdout). Raises on failure."""
    load, cpu = _load(), _child_cpu()
    _BUSY.append(others_running())  # what the command's OpenMP settings see (lazyattn_rag/cli_runtime.py)
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])}... exited {proc.returncode}: {proc.stderr[-2000:]}")
    return wall, _child_cpu() - cpu, load, proc.stdout


def _cli_argv(sampling: str) -> list[str]:
    return ["lazyattn", "ask", QUESTION, "--doc", str(DOC.relative_to(ROOT)), *SAMPLING[sampling], "--json"]


def _cli_record(env: dict[str, str], sampling: str, extra: list[str]) -> dict:
    argv = [str(Path(sys.executable).parent / "lazyattn"), *_cli_argv(sampling)[1:], *extra]
    wall, cpu, load, out = _run(argv, env)
    stats = json.loads(out)["stats"]
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "load_1min": load, "others_running": _BUSY[-1],
            "ttft_ms": stats["ttft_ms"],
            "num_prompt_tokens": stats["num_prompt_tokens"], "num_output_tokens": stats["num_output_tokens"]}


def _first_start_cache(default_cache: Path) -> Path:
    """A cache directory with links to the converted models and a copy of the hash memo only."""
    cache = Path(tempfile.mkdtemp(prefix="lazyattn-first-start-"))
    (cache / "models").mkdir()
    for model in (default_cache / "models").iterdir():
        (cache / "models" / model.name).symlink_to(model)
    if (default_cache / "hashes.json").is_file():
        shutil.copy(default_cache / "hashes.json", cache / "hashes.json")
    return cache


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def _machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    versions = subprocess.run([sys.executable, "-c", "import torch, transformers; print(torch.__version__, "
                               "transformers.__version__, torch.get_num_threads())"],
                              capture_output=True, text=True).stdout.split()
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": versions[0] if versions else None, "transformers": versions[1] if versions else None,
            "torch_threads": int(versions[2]) if versions else None,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def main(
    label: Annotated[str, typer.Option(help="key of the working tree's results in the JSON file")] = "after",
    baseline: Annotated[Optional[Path], typer.Option(help="also run this checkout's lazyattn_rag, each run "
                                                          "right after the working tree's, as 'before'")] = None,
    baseline_note: Annotated[str, typer.Option(help="what the baseline is (e.g. its commit), recorded")] = "",
    runs: Annotated[int, typer.Option(help="runs of each kind")] = 3,
    api: Annotated[bool, typer.Option("--api", help="also run the API probe (start-up parts, 3 questions)")] = False,
    first_start_runs: Annotated[bool, typer.Option("--first-start", help="also run with fresh caches")] = False,
    max_tokens: Annotated[int, typer.Option(help="the API probe's answer length")] = 32,
    quiet_wait: Annotated[float, typer.Option(help="before each run, wait up to this many seconds until no "
                                                  "other process runs")] = 0.0,
    busy: Annotated[int, typer.Option(help="keep this many other processes spinning during the runs (a busy "
                                            "machine); labels get a _busyN suffix")] = 0,
    out: Annotated[Path, typer.Option(help="JSON file to update")] = RESULTS,
) -> None:
    suffix = f"_busy{busy}" if busy else ""
    sides = {label + suffix: dict(os.environ)}
    if baseline is not None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(baseline.resolve()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        sides["before" + suffix] = env
    sys.path.insert(0, str(ROOT))
    from lazyattn_rag.types.config import EngineConfig

    default_cache = EngineConfig().resolved_cache_dir()
    machine = _machine()
    results: dict[str, dict] = {}
    for name, env in sides.items():
        _cli_record(env, "greedy", [])  # unmeasured: converts the default model if needed, pages in the files
        results[name] = {"machine": machine, "source": f"{baseline} {baseline_note}".strip() if name.startswith("before") else "working tree",
                         "busy_processes": busy,
                         "commands": {kind: " ".join(_cli_argv(kind)) for kind in SAMPLING},
                         "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def api_record(env: dict[str, str], cache: Path | None) -> dict:
        argv = [sys.executable, "-c", _API_PROBE, QUESTION, str(DOC), str(max_tokens), *([str(cache)] if cache else [])]
        # Not from the repository: `python -c` puts the working directory first on sys.path, which would
        # shadow the baseline's package on PYTHONPATH.
        wall, cpu, load, stdout = _run(argv, env, cwd=Path(tempfile.gettempdir()))
        return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "load_1min": load, "others_running": _BUSY[-1],
                **json.loads(stdout.strip().splitlines()[-1])}

    def in_first_start_cache(record):  # a cache directory of its own
        cache = _first_start_cache(default_cache)
        try:
            return record(cache)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    kinds = {f"cli_{sampling}": (lambda env, sampling=sampling: _cli_record(env, sampling, [])) for sampling in SAMPLING}
    if first_start_runs:
        kinds["first_start_cli_greedy"] = lambda env: in_first_start_cache(
            lambda cache: _cli_record(env, "greedy", ["--cache-dir", str(cache)]))
    if api:
        kinds["api"] = lambda env: api_record(env, None)
        if first_start_runs:
            kinds["first_start_api"] = lambda env: in_first_start_cache(lambda cache: api_record(env, cache))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        for kind, record in kinds.items():
            for _ in range(runs):
                for name, env in sides.items():  # interleaved: drift in the machine's speed hits both alike
                    if not busy:
                        _wait_quiet(quiet_wait)
                    results[name].setdefault(kind, []).append(record(env))
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    data = json.loads(out.read_text()) if out.is_file() else {}
    for name, result in results.items():
        result["median"] = {kind: {key: _median(records, key) for key in ("wall_s", "cpu_s", "ttft_ms", "load_1min")}
                            for kind, records in result.items() if kind.startswith(("cli_", "first_start_cli"))}
        data[name] = result
        print(json.dumps({"label": name, "median": result["median"]}, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    typer.run(main)
