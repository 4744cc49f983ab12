"""Process settings of the ``lazyattn`` command: ``lazyattn_rag/cli.py`` imports this module
first, before anything loads torch. A program that embeds :class:`~lazyattn_rag.LazyAttention`
needs none of it: the engine fits its own intra-op threads to the idle cores between steps
(``engine/cpu_threads.py``); the command also picks libgomp's passive waiting when the machine is
busy as it starts, which only an environment variable read before torch loads can set.

* **OpenMP threads fit the idle cores.** A forward pass on the CPU is a few hundred short
  parallel regions with Python work between them; libgomp's threads spin while they wait for
  the next region and for each other. That is fastest on a quiet machine, and ruinous on a busy
  one: a pool thread that loses its core stalls every region, and the spinning ones take the
  cores the others need. Decode steps of the default SmolLM2 on 2 cores beside one busy
  process are several times slower with libgomp's defaults than with one thread
  (215-546 against 65-74 ms a step). So when other processes are running now
  (``procs_running`` of ``/proc/stat``, the least of a few samples over ~10 ms: what stays busy, not a blip), the
  pool gets the cores left (at least one) and waits passively (``OMP_NUM_THREADS``,
  ``OMP_WAIT_POLICY=PASSIVE``); a quiet machine keeps libgomp's defaults. Either variable set
  in the environment is left alone, and then nothing is changed. libgomp reads them once, when
  torch loads it. (The load average would be a minute late: it counts the command's own
  previous runs.)
* **No full garbage collection at exit.** The interpreter's final collections walk the ~300k
  objects that torch and transformers leave (a noticeable part of a short command's time on
  2 cores: docs/history/benchmarks-log.md, "Start-up (CPU)"); the command is over, so
  the last exit handler freezes them (``gc.freeze``) instead. Not when triton is loaded (CUDA):
  its nanobind bindings print a "leaked" line for each of its objects left uncollected.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys

from lazyattn_rag.engine import cpu_threads  # no torch: /proc readings only


def openmp_settings(environ: dict[str, str], cores: int, busy_threads: int) -> dict[str, str]:
    """The OpenMP variables to set on a machine with ``cores`` usable cores where
    ``busy_threads`` threads of other processes are running (none when ``environ`` sets
    either variable, or when nothing else runs)."""
    if "OMP_NUM_THREADS" in environ or "OMP_WAIT_POLICY" in environ or busy_threads < 1:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, cores - busy_threads)), "OMP_WAIT_POLICY": "PASSIVE"}


def others_running() -> int:
    """Threads of other processes running or runnable now: the least of 5 reads ~2 ms apart
    (:func:`~lazyattn_rag.engine.cpu_threads.others_running`, the engine's own measure)."""
    return cpu_threads.others_running(samples=5, interval_s=0.002)


os.environ.update(openmp_settings(os.environ, cpu_threads.usable_cores(), others_running()))


@atexit.register  # registered before the engine's own handler, so it runs after it
def _freeze_at_exit() -> None:
    if "triton" not in sys.modules:
        gc.freeze()
