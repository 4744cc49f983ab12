"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property

from lazyattn_rag.engine.kv.block_table import BlockEntry, SelectedQuery
from lazyattn_rag.types.outputs import RequestStats
from lazyattn_rag.engine.planning.prompt_plan import PromptPlan
from lazyattn_rag.types.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # holds nothing; (re)acquires its chunks when scheduled
    ACQUIRED = "acquired"  # chunks pinned, some still being encoded
    RUNNING = "running"  # chunks ready; private tokens being computed / decoded
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request: its scheduling state. What turns its tokens into text and where
    they go (sink, detokenizer, sampling RNG, stop ids) is the output processor's
    (``engine/output/output_state.py``).

    Attributes:
        request_id: engine-wide id.
        plan: the prompt plan (chunks and query tail).
        params: sampling parameters.
        stats: per-request stats.
        arrival_time: ``time.perf_counter()`` at submission.
        prefilled_keys: chunk keys this request encoded (its misses).
        loaded_tiers: chunk keys this request loaded from a storage tier, and the tier's name.
        context_entries: block-table entries of everything before the query tail: its chunks
            (``delta = g - l`` each) and its text segments' blocks (``delta = 0``), in prompt
            order, set once the chunks are all written (the runner packs them once);
            ``context_len`` their valid slots.
        private_blocks: blocks of the private tokens (delta 0): each text segment's blocks in
            order (each segment starts a block), then the query tail's and generated tokens'.
        num_computed: private tokens whose K/V is written (text segments first, then the tail).
        output_ids: generated tokens (EOS and stop tokens excluded): the next steps' input.
        num_preemptions: times its blocks were taken back for others.
        warm_only: a warm-up request (acquire chunks, then finish; no query).
    """

    request_id: str
    plan: PromptPlan
    params: SamplingParams
    stats: RequestStats
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    prefilled_keys: set[str] = field(default_factory=set)
    loaded_tiers: dict[str, str] = field(default_factory=dict)  # chunk key -> the tier it was loaded from
    context_len: int = 0
    context_entries: list[BlockEntry] = field(default_factory=list)
    private_blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    warm_only: bool = False
    num_prefix_tokens: int = 0  # prefix mode: prompt tokens served by cached prefix blocks
    num_prefix_registered: int = 0  # prefix mode: own full blocks handed to the cache
    num_seeded_tokens: int = 0  # its prompt head's tokens copied from cached exact-prefix blocks, not encoded
    # selective recompute: chunk index -> selected local token indices (None: not measured yet),
    # the request's copies of the blocks holding them, and one query per selected token
    selected_tokens: dict[int, tuple[int, ...]] | None = None
    selected_blocks: list[int] = field(default_factory=list)
    selected_queries: list[SelectedQuery] = field(default_factory=list)

    @cached_property
    def prompt_token_ids(self) -> list[int]:
        """The whole prompt as one id list (for repetition penalties)."""
        return self.plan.token_ids()

    @cached_property
    def _text_token_ids(self) -> list[int]:
        return [t for seg in self.plan.texts for t in seg.token_ids]

    @property
    def private_token_ids(self) -> list[int]:
        """Text segments, query tail, then generated tokens (the last one's K/V is written by the next step)."""
        return self._text_token_ids + list(self.plan.query_token_ids[self.num_prefix_tokens:]) + self.output_ids

    @property
    def tail_position(self) -> int:
        """Global position of the first private tail token (after any prefix-cache hit)."""
        return self.plan.tail_start + self.num_prefix_tokens

    @property
    def num_private_tokens(self) -> int:
        """``len(private_token_ids)``, without building the list (it is read every step)."""
        return len(self._text_token_ids) + len(self.plan.query_token_ids) - self.num_prefix_tokens \
            + len(self.output_ids)

    def private_token_slice(self, start: int, end: int) -> list[int]:
        """``private_token_ids[start:end]`` for ``0 <= start <= end``, built from the parts it
        overlaps only (a decode step reads one token of a prompt that may be 20k long)."""
        query = self.plan.query_token_ids
        parts = ((self._text_token_ids, 0), (query, self.num_prefix_tokens), (self.output_ids, 0))
        out, offset = [], 0
        for part, skip in parts:  # part[skip:] is this part's share of the private tokens
            size = len(part) - skip
            lo, hi = max(start - offset, 0), min(end - offset, size)
            if lo < hi:
                out += part[skip + lo:skip + hi]
            offset += size
        return out

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_private_tokens - self.num_computed

    def private_runs(self, block_size: int) -> list[PrivateRun]:
        """Where the private tokens go: one run per text segment, then the tail (open-ended)."""
        runs, index, block = [], 0, 0
        for seg in self.plan.texts:
            runs.append(PrivateRun(index, seg.global_start, block, len(seg.token_ids)))
            index += len(seg.token_ids)
            block += -(-len(seg.token_ids) // block_size)
        runs.append(PrivateRun(index, self.tail_position, block, None))
        return runs

    def num_private_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks that hold the first ``num_tokens`` private tokens (text segments start blocks of their own)."""
        total = 0
        for run in self.private_runs(block_size):
            n = min(num_tokens - run.start, run.length if run.length is not None else num_tokens)
            if n <= 0:
                break
            total = run.first_block + -(-n // block_size)
        return total


@dataclass(frozen=True)
class PrivateRun:
    """A contiguous run of a request's private tokens.

    Attributes:
        start: index of its first token among the request's private tokens.
        global_start: its first token's position in the request.
        first_block: index of its first block in ``Request.private_blocks``.
        length: tokens in the run; ``None`` for the tail (which grows as tokens are generated).
    """

    start: int
    global_start: int
    first_block: int
    length: int | None
