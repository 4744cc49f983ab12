"""Watching an engine through its public hooks, and breaking one function of it for a test.

Observation goes through :meth:`LazyAttention.add_step_listener` (each step's scheduler output
and its compute jobs' logits) and ``llm.loop.call`` (a call on the engine thread between
steps), never by replacing engine, runner or scheduler methods. Fault injection replaces the
one function it breaks through pytest's ``monkeypatch``, so a failing test leaves nothing behind.
"""

from __future__ import annotations

from typing import Any

import torch

from lazyattn_rag.engine.engine import StepResult
from lazyattn_rag.engine.scheduling.request import Request
from lazyattn_rag.engine.scheduling.scheduler_output import SchedulerOutput
from lazyattn_rag.llm import LazyAttention


def assert_no_leak(llm: LazyAttention) -> None:
    """Once the engine is idle: the cache's invariants hold, no request is left, no entry is
    pinned (but the anchor, pinned for good), and every block is free or held by a cached chunk
    (no private block left)."""
    engine = llm.engine
    llm.loop.call(lambda: None)  # let the engine thread settle
    engine.cache.check_integrity()
    assert not engine.has_unfinished() and not engine.outputs.requests
    assert all(e.pin_count == 0 for e in engine.cache.entries() if e.key != engine.planner.anchor_key)
    pool = engine.cache.pool
    assert pool.num_free + engine.cache.num_cached_blocks == pool.num_blocks  # no private block left


def settle(llm: LazyAttention) -> None:
    """Return once the engine thread has finished the step it is in, listeners included.

    A step streams its tokens before its listeners run, so a caller that has just read a
    request's last token may be ahead of the listeners; after this it is not. A loop that
    was shut down has run its last listeners already.
    """
    try:
        llm.loop.call(lambda: None)
    except RuntimeError:  # shut down: its thread ended after its last step
        pass


class StepLog:
    """Every step one engine runs from now on, through a step listener.

    Args:
        llm: the engine to watch.
        logits: also keep each step's compute-job logits (a copy: ``[len(computes), vocab]``).

    The lists are read after :func:`settle` (the properties do that), in step order.
    """

    def __init__(self, llm: LazyAttention, logits: bool = False):
        self.llm = llm
        self._keep_logits = logits
        self._outputs: list[SchedulerOutput] = []
        self._logits: list[torch.Tensor] = []
        self.remove = llm.add_step_listener(self._record)

    def _record(self, step: StepResult) -> None:
        self._outputs.append(step.output)
        if self._keep_logits:
            self._logits.append(step.logits.clone())  # the engine may reuse the buffer next step

    @property
    def outputs(self) -> list[SchedulerOutput]:
        """Each step's scheduler output."""
        settle(self.llm)
        return self._outputs

    @property
    def logits(self) -> list[torch.Tensor]:
        """Each step's compute-job logits (the last row is the step's last compute job's)."""
        settle(self.llm)
        return self._logits

    @property
    def requests(self) -> list[Request]:
        """The requests that computed (warm-ups aside), in the order of their first compute job."""
        seen: dict[int, Request] = {}
        for out in self.outputs:
            for job in out.computes:
                if not job.request.warm_only:
                    seen.setdefault(id(job.request), job.request)
        return list(seen.values())


def fail_first_call(monkeypatch, owner: Any, name: str, message: str) -> list[int]:
    """Make ``owner.<name>`` raise ``RuntimeError(message)`` on its first call only (a device
    fault); ``monkeypatch`` puts the original back after the test. Returns the length of each
    call's first argument (the batch, or the blocks copied; 1 for an argument without one), in order."""
    original, calls = getattr(owner, name), []

    def fail_once(*args):
        calls.append(len(args[0]) if hasattr(args[0], "__len__") else 1)
        if len(calls) == 1:
            raise RuntimeError(message)
        return original(*args)

    monkeypatch.setattr(owner, name, fail_once)
    return calls
