"""Progress and wording for the one-time steps a first run pays (model conversion, embedding, index build).

:func:`stage` prints what a step does and, when it ends, how long it took; while it runs on an
interactive terminal, the elapsed time ticks every half second, so a step of tens of seconds is
never silent. Output goes to ``stderr`` (``file``), never to the answer stream.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


@contextmanager
def stage(what: str, file: TextIO | None = None, tick_s: float = 0.5, has_own_bar: bool = False) -> Iterator[None]:
    """Report a step: ``what ...`` now, ticking elapsed seconds on a terminal, then ``done in X s``
    (or ``failed after X s`` if it raises; the exception propagates).

    ``has_own_bar``: the step draws a progress bar of its own (e.g. transformers' or tqdm's), so
    the line ends at once and the result gets a line of its own, and nothing ticks over the bar.
    """
    out = file or sys.stderr
    if has_own_bar:
        out.write(f"{what} ...\n")
        out.flush()
        start = time.perf_counter()
        outcome = "failed after"
        try:
            yield
            outcome = "done in"
        finally:
            out.write(f"{what}: {outcome} {time.perf_counter() - start:.1f} s\n")
            out.flush()
        return
    interactive = out.isatty() if hasattr(out, "isatty") else False
    start = time.perf_counter()
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(tick_s):
            out.write(f"\r{what} ... {time.perf_counter() - start:.0f} s")
            out.flush()

    out.write(f"{what} ...")
    out.flush()
    ticker = threading.Thread(target=tick, daemon=True) if interactive else None
    if ticker is not None:
        ticker.start()
    outcome = "failed after"
    try:
        yield
        outcome = "done in"
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        prefix = f"\r{what} ..." if interactive else ""
        out.write(f"{prefix} {outcome} {time.perf_counter() - start:.1f} s\n")
        out.flush()


def directory_bytes(path: Path) -> int:
    """Total size of the files under ``path`` (0 if it does not exist)."""
    path = Path(path)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def format_bytes(num_bytes: int) -> str:
    """``517 MB`` style (decimal units, as ``du -h --si`` and file managers show)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.0f} {unit}" if num_bytes >= 10 * scale else f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 text``, ``2 texts``; ``words`` for an irregular plural."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


@contextmanager
def no_transformers_bars() -> Iterator[None]:
    """transformers' progress bars off inside the block ("Loading weights" of a small model that
    loads in a blink: noise in the chat's output), as they were after it."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
