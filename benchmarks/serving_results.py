"""The serving benchmark's results: JSON files under ``benchmarks/results/`` (or any ``.json``
path), the environment they were measured in, resuming a cut-short command from its file, and
the per-cell medians of a sweep's repeats."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import typer

RESULTS = Path(__file__).resolve().parent / "results"
SUMMARY_METRICS = ("ttft_ms_median", "ttft_ms_p99", "tpot_ms_median", "request_throughput_per_s",
                   "total_token_throughput_per_s", "doc_hit_ratio", "token_hit_ratio", "kv_cached_bytes")


def environment() -> dict:
    """Versions, date and the device the results were measured on."""
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        import triton

        info["triton"] = triton.__version__
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def command_line() -> str:
    """The command being run, as recorded in the results' ``command``/``commands`` fields."""
    return " ".join(sys.argv)


def result_path(name: str) -> Path:
    """Where ``--out name`` writes: ``benchmarks/results/<name>.json``, or ``name`` itself when it
    is a path ending in ``.json`` (relative to the working directory)."""
    return Path(name) if name.endswith(".json") else RESULTS / f"{name}.json"


def write(name: str, payload: dict) -> Path:
    path = result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return path


def write_runs(name: str, setting: dict, commands: list[str], **fields) -> Path:
    """Write a resumable command's file: the environment, its ``setting`` at the top level (what
    ``--resume`` compares), every command that added runs to it, then ``fields``."""
    return write(name, {"environment": environment(), **setting, "commands": commands, **fields})


def previous_results(name: str, setting: dict) -> dict:
    """What an earlier (cut-short) run of the same command wrote to ``name`` (empty if nothing).

    Raises:
        typer.BadParameter: the file was written with another ``setting`` (workload, engine
            limits; the files hold them at their top level): resuming would mix runs that are
            not comparable.
    """
    path = result_path(name)
    if not path.exists():
        return {}
    previous = json.loads(path.read_text())
    differ = {k: (previous[k], v) for k, v in setting.items() if k in previous and previous[k] != v}
    if differ:
        raise typer.BadParameter(f"--resume: {path} was written with other settings "
                                 f"({', '.join(f'{k}: {old!r} there, {new!r} now' for k, (old, new) in differ.items())}); "
                                 "pass another --out or the same options")
    return previous


def resumed(name: str, setting: dict, resume: bool) -> dict:
    """Where a resumable command starts: with ``resume``, what :func:`previous_results` read, else
    nothing; its ``runs`` (a list) to go on from and its ``commands`` with this one appended."""
    previous = previous_results(name, setting) if resume else {}
    return {**previous, "runs": previous.get("runs", []), "commands": previous.get("commands", []) + [command_line()]}


def cell_medians(runs: list[dict]) -> list[dict]:
    """One row per (mode, alpha, budget): each metric's median over that cell's repeats."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["mode"], r["alpha"], r["budget_gb"]), []).append(r)
    return [{"mode": m, "alpha": a, "budget_gb": gb, "num_repeats": len(rows),
             **{k: _median_of(rows, k) for k in SUMMARY_METRICS}} for (m, a, gb), rows in cells.items()]


def _median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None
