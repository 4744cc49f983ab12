"""Process settings of the ``lazyattn`` command: ``lazyattn_rag/cli.py`` imports this module
first, before anything loads torch. The library sets nothing of the kind; a program that embeds
:class:`~lazyattn_rag.LazyAttention` decides these for its own process.

* **OpenMP threads sleep when idle** (``OMP_WAIT_POLICY=PASSIVE``, unless the environment sets
  it). A forward pass on the CPU is a few hundred short parallel regions with Python work
  between them. With libgomp's default, each idle pool thread spins for its next region; on a
  2-core machine that other processes also use, a spinning thread holds the core the engine
  thread needs, and ``lazyattn ask`` took 20-70 s of wall time (25-40 s of CPU) for a 32-token
  answer instead of 9 s (6 s of CPU) at a load average of 7-9 (``docs/benchmarks.md``, "Start-up").
  libgomp reads the variable once, when torch loads it.
* **No full garbage collection at exit.** The interpreter's final collections walk the ~300k
  objects that torch and transformers leave (0.3-0.6 s on 2 cores); the command is over, so
  the last exit handler freezes them (``gc.freeze``) instead. Not when triton is loaded (CUDA):
  its nanobind bindings print a "leaked" line for each of its objects left uncollected.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@atexit.register  # registered before the engine's own handler, so it runs after it
def _freeze_at_exit() -> None:
    if "triton" not in sys.modules:
        gc.freeze()
