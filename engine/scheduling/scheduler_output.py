"""What one engine step runs: the scheduler's typed output, the only contract between the
scheduler and the model runner (as vLLM v1's ``SchedulerOutput``).

Jobs carry block ids and RoPE offsets (``delta``), never packed block-table words: the
runner's input preparation (``engine/worker/input_prep.py``) packs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lazyattn_rag.engine.kv.block_table import BlockEntry
from lazyattn_rag.engine.tiers.chunk_format import ChunkKV
from lazyattn_rag.engine.scheduling.request import Request


@dataclass
class ChunkPrefillJob:
    """Encode a piece of one chunk alone, in this step's forward pass.

    ``token_ids`` are the chunk's tokens ``start .. start + len(token_ids)`` at positions
    ``local_start + start ..``; they attend ``context`` (the anchor), the chunk's first
    ``start`` tokens (already in ``block_ids``, written by earlier steps) and themselves,
    causally. ``final``: the piece completes the chunk (it is read from this step's pass on).
    """

    key: str
    token_ids: tuple[int, ...]
    local_start: int
    block_ids: list[int]
    context: list[BlockEntry]
    start: int = 0
    final: bool = True


@dataclass
class ChunkPrefillTask:
    """A chunk being encoded across steps (chunked encoding), in pieces under the step budget.

    The task holds the pending entry's first pin (taken by ``insert_pending``) until its final
    piece ran: requests that wait for the chunk pin it too, and may leave meanwhile.
    """

    key: str
    token_ids: tuple[int, ...]
    local_start: int
    block_ids: list[int]
    context: list[BlockEntry]
    num_done: int = 0  # tokens scheduled in earlier steps

    def next_piece(self, budget: int) -> ChunkPrefillJob:
        n = min(len(self.token_ids) - self.num_done, budget)
        job = ChunkPrefillJob(self.key, self.token_ids[self.num_done:self.num_done + n], self.local_start, self.block_ids,
                        self.context, self.num_done, self.num_done + n == len(self.token_ids))
        self.num_done += n
        return job


@dataclass
class CopyJob:
    """Copy a positioned chunk to a new offset: K rotated by ``delta``, V as is (``block_attention``)."""

    src_key: str
    dst_key: str
    src_blocks: list[int]
    dst_blocks: list[int]
    num_tokens: int
    delta: int


@dataclass
class SlotCopyJob:
    """Copy slots ``first_slot .. first_slot + num_slots`` of a chunk's block into the same slots
    of a request's private block, K rotated by ``delta`` to its global positions (the cached
    tokens behind a recomputed chunk head that ends inside a block; a fork's prompt end; a block
    selective recompute overwrites in part)."""

    src_block: int
    dst_block: int
    first_slot: int
    num_slots: int
    delta: int


@dataclass
class HeadSeedJob:
    """Copy an earlier plain prompt's cached exact-prefix blocks (``PromptPlan.head_prefix_keys``)
    into the first blocks of a prompt head being encoded (the pending entry ``dst_key``), as they
    are (rotation 0, same positions), before the pass; the head's encode starts after them. The
    sources (``src_keys``) are pinned for this step only: unpinned once it ran or was abandoned
    (and then the head's pending entry goes too). ``complete``: the blocks are the whole head
    (nothing to encode): it is readable from this step's pass on."""

    dst_key: str
    src_keys: list[str]
    src_blocks: list[int]
    dst_blocks: list[int]
    complete: bool = False


@dataclass
class SelectionJob:
    """Measure which document tokens ``request`` recomputes (selective recompute,
    ``engine/scheduling/selective_recompute.py``), before the pass; the runner fills ``selected`` (chunk
    index in the plan -> local token indices) and the scheduler applies it when the request is
    promoted. ``chunks``: per document chunk ``(chunk index, block ids, num_tokens, delta)``."""

    request: Request
    chunks: list[tuple[int, list[int], int, int]]
    selected: dict[int, tuple[int, ...]] | None = None


@dataclass
class LoadJob:
    """Write a chunk found in a storage tier (``tier``) into new blocks, before the pass."""

    key: str
    block_ids: list[int]
    chunk: ChunkKV
    tier: str


@dataclass
class ComputeJob:
    """Compute ``num_tokens`` private tokens of ``request`` from index ``start``; sample if ``sample``.
    ``num_selected``: the request's selected document tokens (``Request.selected_queries``),
    computed first in the same pass (its first job only; selective recompute)."""

    request: Request
    start: int
    num_tokens: int
    sample: bool
    num_selected: int = 0


@dataclass
class SchedulerOutput:
    """Everything one step runs.

    Attributes:
        chunk_prefills: pieces of chunks to prefill alone (each attends the anchor and its earlier pieces).
        copies: positioned chunks to copy to a new offset (``block_attention`` mode), before the pass.
        loads: chunks found in a storage tier below the pool, written into their blocks before
            the pass (``engine/tiers/chunk_tiers.py``).
        head_seeds: cached exact-prefix blocks copied into prompt heads being encoded, after the
            loads and copies, before the pass.
        slot_copies: cached slots copied after the loads and copies, before the pass (a forked
            answer's prompt end, selective recompute's block copies).
        head_copies: cached tokens copied behind recomputed chunk heads, in every layer of the
            pass between its K/V write and its attention, so that a chunk the same pass encodes
            is copied from (``AttentionMetadata.slot_copies``).
        selections: requests whose document tokens to recompute are measured before the pass
            (selective recompute).
        computes: requests' private tokens (query prefill, text segments, one decode token).
        failed: requests refused while acquiring their chunks, with the error each gets.
        warmed: warm-up requests whose chunks are all written (they finish now).
        released_ids: running requests released (finished, failed, aborted, preempted) since the
            previous output: the runner drops their packed block tables.
    """

    chunk_prefills: list[ChunkPrefillJob] = field(default_factory=list)
    copies: list[CopyJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    head_seeds: list[HeadSeedJob] = field(default_factory=list)
    slot_copies: list[SlotCopyJob] = field(default_factory=list)
    head_copies: list[SlotCopyJob] = field(default_factory=list)
    selections: list[SelectionJob] = field(default_factory=list)
    computes: list[ComputeJob] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    warmed: list[Request] = field(default_factory=list)
    released_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.chunk_prefills) + \
            sum(c.num_tokens + c.num_selected for c in self.computes)

    @property
    def is_empty(self) -> bool:
        return not (self.chunk_prefills or self.copies or self.loads or self.head_seeds or self.selections
                    or self.computes)

    def written_keys(self) -> set[str]:
        """Chunks this step completes: their last piece encoded in its forward pass (each layer
        writes the batch's K/V before its attention reads any of it), or copied, loaded or
        seeded whole before that pass."""
        return ({e.key for e in self.chunk_prefills if e.final} | {c.dst_key for c in self.copies}
                | {j.key for j in self.loads} | {s.dst_key for s in self.head_seeds if s.complete})
