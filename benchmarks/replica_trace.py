"""Where a serving replica's time goes (issue 36's diagnosis): timestamps written by the
replica's own process, for ``benchmarks/http_reuse.py --trace-replica``.

:func:`install` (called where the replica builds its engine) wraps, in that process only:

* every command queued to the engine thread (``EngineLoop.call`` / ``post``): when it was
  queued, when the engine thread started it and when it ended (``cmd`` records);
* every engine step: start and end (``step``);
* the replica's asyncio loop: how late a 1 ms sleep wakes (``loop_lag``, per second:
  count, median, p90, max), and each request's submission and first delta (``request``);
* a plain thread's 1 ms sleep, the time to get the GIL back (``gil_lag``, per second).

Records are JSON lines appended to ``path`` once a second. :func:`summarize` reads them back.
All times are wall-clock seconds (``time.time()``); lags are ms.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

_RECORDS: list[dict] = []
_LOCK = threading.Lock()


def _add(record: dict) -> None:
    with _LOCK:
        _RECORDS.append(record)


def _flush(path: str) -> None:
    with _LOCK:
        records, _RECORDS[:] = list(_RECORDS), []
    if records:
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def _lag_summary(kind: str, lags_ms: list[float], t: float) -> dict:
    lags_ms = sorted(lags_ms)
    return {"kind": kind, "t": t, "count": len(lags_ms), "median_ms": statistics.median(lags_ms),
            "p90_ms": lags_ms[int(0.9 * (len(lags_ms) - 1))], "max_ms": lags_ms[-1]}


def _gil_monitor(path: str) -> None:
    lags, window = [], time.time()
    while True:
        start = time.perf_counter()
        time.sleep(0.001)
        lags.append((time.perf_counter() - start - 0.001) * 1e3)
        if time.time() - window >= 1.0:
            _add(_lag_summary("gil_lag", lags, window))
            lags, window = [], time.time()
            _flush(path)


async def _loop_monitor() -> None:
    lags, window = [], time.time()
    while True:
        start = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append((time.perf_counter() - start - 0.001) * 1e3)
        if time.time() - window >= 1.0:
            _add(_lag_summary("loop_lag", lags, window))
            lags, window = [], time.time()


def install(path: str) -> None:
    """Wrap the engine loop, the engine's step and the async front in this process (see the
    module docstring); records go to ``path``."""
    from lazyattn_rag.async_llm import AsyncLazyAttention
    from lazyattn_rag.engine.engine import LLMEngine
    from lazyattn_rag.engine.loop import EngineLoop

    def timed_command(fn):
        queued = time.time()

        def run(*args, **kwargs):
            started = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                _add({"kind": "cmd", "name": getattr(fn, "__qualname__", repr(fn)), "queued": queued,
                      "started": started, "ended": time.time()})
        return run

    call, post, step, submit = EngineLoop.call, EngineLoop.post, LLMEngine.step, AsyncLazyAttention._submit
    EngineLoop.call = lambda self, fn, *a, **k: call(self, timed_command(fn), *a, **k)
    EngineLoop.post = lambda self, fn, *a: post(self, timed_command(fn), *a)

    def timed_step(self):
        started = time.time()
        try:
            return step(self)
        finally:
            _add({"kind": "step", "started": started, "ended": time.time(),
                  "num_running": len(self.outputs.requests)})

    monitor: list = []

    async def timed_submit(self, make):
        if not monitor:
            monitor.append(asyncio.get_running_loop().create_task(_loop_monitor()))
        record = {"kind": "request", "submitted": time.time()}
        try:
            async for item in submit(self, make):
                record.setdefault("first_delta", time.time())
                yield item
        finally:
            _add(record)

    LLMEngine.step, AsyncLazyAttention._submit = timed_step, timed_submit
    threading.Thread(target=_gil_monitor, args=(path,), daemon=True, name="trace-gil").start()


def summarize(path: str) -> dict:
    """Medians and p90s of what :func:`install` recorded at ``path`` (ms); ``{}`` when the
    replica wrote nothing there. A line the replica is still writing is left out."""
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        return {}
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the replica's flush in progress: its last line
            continue

    def stats(xs):
        xs = sorted(xs)
        return {"count": len(xs), "median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))],
                "max": xs[-1]} if xs else {}

    by = lambda kind: [r for r in records if r["kind"] == kind]  # noqa: E731
    commands: dict[str, list] = {}
    for r in by("cmd"):
        commands.setdefault(r["name"], []).append(r)
    steps = by("step")
    return {
        "step_ms": stats([(r["ended"] - r["started"]) * 1e3 for r in steps]),
        "between_steps_ms": stats([(b["started"] - a["ended"]) * 1e3 for a, b in zip(steps, steps[1:])]),
        "commands": {name: {"wait_ms": stats([(r["started"] - r["queued"]) * 1e3 for r in rs]),
                            "run_ms": stats([(r["ended"] - r["started"]) * 1e3 for r in rs])}
                     for name, rs in commands.items()},
        "request_submitted_to_first_delta_ms": stats([(r["first_delta"] - r["submitted"]) * 1e3
                                                      for r in by("request") if "first_delta" in r]),
        "loop_lag_median_ms": stats([r["median_ms"] for r in by("loop_lag")]),
        "loop_lag_p90_ms": stats([r["p90_ms"] for r in by("loop_lag")]),
        "gil_lag_median_ms": stats([r["median_ms"] for r in by("gil_lag")]),
        "gil_lag_p90_ms": stats([r["p90_ms"] for r in by("gil_lag")]),
    }
