"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from lazyattn_rag.detokenizer import IncrementalDetokenizer
from lazyattn_rag.outputs import RequestStats, StreamDelta
from lazyattn_rag.prompt import PromptPlan
from lazyattn_rag.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # holds nothing; (re)acquires its chunks when scheduled
    ACQUIRED = "acquired"  # chunks pinned, some still being encoded
    RUNNING = "running"  # chunks ready; private tokens being computed / decoded
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request.

    Attributes:
        request_id: engine-wide id.
        plan: the prompt plan (chunks and query tail).
        params: sampling parameters.
        sink: called with each :class:`StreamDelta` (from the engine thread), or with an
            exception that ends the request.
        stats: per-request stats.
        arrival_time: ``time.perf_counter()`` at submission.
        pinned: chunk keys this request holds pins on.
        encoded_keys: chunk keys this request encoded (its misses).
        context_words: packed block-table words of its chunks (``delta = g - l`` each), set once
            they are all written; ``context_len`` their valid slots.
        private_blocks: blocks of the query tail and generated tokens (delta 0).
        num_computed: private tokens whose K/V is written.
        output_ids: generated tokens (EOS and stop tokens excluded).
        num_preemptions: times its blocks were taken back for others.
        stop_token_ids: ids that end generation (the request's own and, unless ``ignore_eos``, EOS).
        warm_only: a warm-up request (acquire chunks, then finish; no query).
    """

    request_id: str
    plan: PromptPlan
    params: SamplingParams
    sink: Callable[[StreamDelta | BaseException], None]
    stats: RequestStats
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    stop_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    pinned: list[str] = field(default_factory=list)
    encoded_keys: set[str] = field(default_factory=set)
    context_words: torch.Tensor | None = None
    context_len: int = 0
    private_blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    warm_only: bool = False
    finish_reason: str | None = None
    num_prefix_tokens: int = 0  # prefix mode: prompt tokens served by cached prefix blocks
    num_prefix_registered: int = 0  # prefix mode: own full blocks handed to the cache

    @cached_property
    def prompt_token_ids(self) -> list[int]:
        """The whole prompt as one id list (for repetition penalties)."""
        return self.plan.token_ids()

    @property
    def private_token_ids(self) -> list[int]:
        """Query tail then generated tokens (the last one's K/V is written by the next step)."""
        return list(self.plan.query_token_ids[self.num_prefix_tokens:]) + self.output_ids

    @property
    def first_private_position(self) -> int:
        return self.plan.num_cached_prompt_tokens + self.num_prefix_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        return len(self.private_token_ids) - self.num_computed
