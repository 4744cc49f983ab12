"""Intra-op CPU threads fitted to the idle cores, on the engine thread (issue 38).

A forward pass on the CPU is a few hundred short parallel regions with Python work between
them. libgomp's pool threads spin while they wait for the next region and for each other: the
fastest on a quiet machine, ruinous beside another busy process, where a pool thread that loses
its core stalls every region (decode steps of the default SmolLM2 on 2 cores: 40 ms quiet,
215-546 ms beside one busy process with 2 threads, 65-74 ms with 1). libgomp's wait policy is
fixed when torch loads it, but the thread count is
not: :class:`CpuThreads` counts, every ``interval_s`` between steps, the threads of *other*
processes that are running (``procs_running`` of ``/proc/stat`` less this process's running
threads; one read, ~0.1 ms, no sleep on the engine thread) and gives the engine thread's
parallel regions the idle cores, at least one and at most the count the process started with
(``OMP_NUM_THREADS``, ``torch.set_num_threads``, or the cores). A change takes two agreeing
looks, so a blip or a passing job does not make it flap. A quiet machine keeps the count it
started with.

OpenMP's thread count is a per-thread setting: it is applied on the engine thread, the one that
runs every forward pass. torch also remembers the last count set in the process and gives it to
a thread on its first parallel region, so a thread of the program that starts its torch work
after a change begins with the engine's count. The most an engine takes is the count the process
had before any engine changed it (recorded once: a second engine is not held to a first one's
reduced count).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def running_threads(path: str = "/proc/stat") -> int | None:
    """``procs_running`` of ``/proc/stat``: threads running or runnable on the machine now
    (``None`` where there is no ``/proc``)."""
    try:
        with open(path) as f:
            return next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
    except (OSError, StopIteration, ValueError):
        return None


def own_running_threads(task_dir: str = "/proc/self/task") -> int:
    """Threads of this process in state ``R`` (running or runnable) now."""
    count = 0
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        count += stat[stat.rfind(")") + 2: stat.rfind(")") + 3] == "R"  # the state follows "(comm) "
    return count


def others_running(samples: int = 1, interval_s: float = 0.001) -> int:
    """Threads of other processes running or runnable: the least, over ``samples`` reads
    ``interval_s`` apart, of the machine's running threads less this process's; 0 where there is
    no ``/proc``. The engine reads once per look (no sleep on its thread); the ``lazyattn``
    command, once at start, takes the least of several (``lazyattn_rag/cli_runtime.py``)."""
    counts = []
    for i in range(samples):
        total = running_threads()
        if total is None:
            return 0
        counts.append(total - own_running_threads())
        if i + 1 < samples:
            time.sleep(interval_s)
    return max(0, min(counts))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def fitted_threads(cores: int, others: int, max_threads: int) -> int:
    """The intra-op threads for ``cores`` usable cores with ``others`` threads of other processes
    running: the idle cores, at least 1, at most ``max_threads``."""
    return max(1, min(max_threads, cores - others))


class CpuThreads:
    """Keeps the engine thread's intra-op thread count at the idle cores (module docstring).

    Args:
        max_threads: the most threads to use (the count the engine thread started with).
        interval_s: seconds between looks (each costs ~0.1 ms).
        cores: usable cores (default: this process's CPU affinity).
        others: counts other processes' running threads (default :func:`others_running`).
        set_threads, get_threads: default ``torch.set_num_threads`` / ``torch.get_num_threads``.
    """

    def __init__(self, max_threads: int, interval_s: float = 0.5, cores: int | None = None,
                 others: Callable[[], int] = others_running, set_threads: Callable[[int], None] | None = None,
                 get_threads: Callable[[], int] | None = None):
        import torch

        self.max_threads, self.interval_s = max(1, max_threads), interval_s
        self.cores = cores or usable_cores()
        self._others = others
        self._set = set_threads or torch.set_num_threads
        self._get = get_threads or torch.get_num_threads
        self._next_look = 0.0
        self._pending: int | None = None
        self.num_changes = 0

    def maybe_fit(self, now: float | None = None) -> None:
        """Look again if ``interval_s`` has passed; change the count on a second agreeing look."""
        now = time.monotonic() if now is None else now
        if now < self._next_look:
            return
        self._next_look = now + self.interval_s
        want = fitted_threads(self.cores, self._others(), self.max_threads)
        if want == self._get():
            self._pending = None
        elif want == self._pending:
            self._set(want)
            self._pending = None
            self.num_changes += 1
        else:
            self._pending = want


def engine_cpu_threads(cpu_threads: int | None, device) -> CpuThreads | None:
    """Called on the engine thread at start-up (``EngineConfig.cpu_threads``): on the CPU, a
    fixed count is set now and ``None`` returned; ``None`` gives the :class:`CpuThreads` that
    fits the count between steps. On CUDA nothing is done (the forward pass runs on the GPU)."""
    import torch

    if torch.device(device).type != "cpu":
        return None
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
        return None
    global _START_THREADS
    if _START_THREADS is None:
        _START_THREADS = torch.get_num_threads()
    return CpuThreads(_START_THREADS)


_START_THREADS: int | None = None  # the process's count before any engine changed it
