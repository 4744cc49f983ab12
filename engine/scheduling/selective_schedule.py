"""The scheduler's part of selective recompute (``CacheConfig.recompute_selective_ratio``;
CacheBlend, Yao et al., EuroSys 2025).

A request with a ratio waits, once its chunks are written, for one step in which the runner
measures which of its document tokens to recompute (a :class:`SelectionJob`). When it is then
promoted, every block holding a selected token is copied into a block of the request's own (K
rotated to the request's positions: a :class:`SlotCopyJob` of the whole block), its context
reads that copy instead of the shared block, and its first compute job runs one query per
selected token before the tail; each query writes its fresh K/V over the copied slot, layer
by layer. The cached chunk and its blocks are never written.
"""

from __future__ import annotations

from lazyattn_rag.engine.kv.block_table import BlockEntry, SelectedQuery
from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.scheduling.request import Request
from lazyattn_rag.engine.scheduling.scheduler_output import SchedulerOutput, SelectionJob, SlotCopyJob
from lazyattn_rag.engine.scheduling.selective_recompute import num_selected


class SelectiveRecompute:
    """The scheduler's selective-recompute steps (see the module docstring).

    Args:
        cache: the chunk cache (the chunks' blocks, and the pool the copies come from).
    """

    def __init__(self, cache: ChunkCache):
        self.cache, self.block_size = cache, cache.block_size

    def pending(self, request: Request) -> bool:
        """Whether ``request`` still waits for its selection to be measured."""
        return bool(request.plan.selective_ratio) and request.selected_tokens is None

    def job(self, request: Request) -> SelectionJob:
        """The measurement of ``request``'s selection, for the next pass."""
        chunks = []
        for index, chunk in enumerate(request.plan.chunks):
            if chunk.doc_id is not None:
                entry = self.cache.held(chunk.key)
                chunks.append((index, list(entry.block_ids), entry.num_tokens, chunk.global_start - entry.local_start))
        return SelectionJob(request, chunks)

    def _block_keys(self, request: Request) -> list[tuple[int, int]]:
        """``(chunk index, block index)`` of every block holding a selected token, in prompt order."""
        bs, keys = self.block_size, []
        for index in sorted(request.selected_tokens or {}, key=lambda i: request.plan.chunks[i].global_start):
            for b in sorted({t // bs for t in request.selected_tokens[index]}):
                keys.append((index, b))
        return keys

    def max_blocks(self, request: Request) -> int:
        """The most blocks ``request`` copies for selective recompute (before it is measured)."""
        ratio = request.plan.selective_ratio
        if not ratio:
            return 0
        return sum(min(-(-len(c.token_ids) // self.block_size), num_selected(len(c.token_ids), ratio))
                   for c in request.plan.chunks if c.doc_id is not None)

    def apply(self, request: Request, out: SchedulerOutput, context: list[BlockEntry],
              chunk_starts: dict[int, int]) -> None:
        """Copy the blocks holding selected tokens into blocks of ``request`` (reserved at
        admission, :meth:`max_blocks`; the ones left over are given back), point
        ``context`` (its entries; ``chunk_starts``: chunk index -> its first entry) at the
        copies, and set its queries."""
        keys = self._block_keys(request)
        blocks, spare = request.selected_blocks[:len(keys)], request.selected_blocks[len(keys):]
        if spare:
            self.cache.pool.decref(spare)
        request.selected_blocks = blocks
        keys_before, total = [], 0  # valid keys before each entry (a copy keeps its block's count)
        for e in context:
            keys_before.append(total)
            total += e.num_valid
        bs, queries = self.block_size, []
        for (index, b), block in zip(keys, blocks):
            chunk = request.plan.chunks[index]
            at = chunk_starts[index] + b
            old = context[at]
            out.slot_copies.append(SlotCopyJob(self.cache.held(chunk.key).block_ids[b], block, 0, old.num_valid,
                                               old.delta))
            context[at] = BlockEntry(block, 0, old.num_valid)
            queries += [SelectedQuery(chunk.token_ids[t], chunk.global_start + t, at, keys_before[at], block, t % bs)
                        for t in request.selected_tokens[index] if t // bs == b]
        request.selected_queries = queries

    def finish(self, out: SchedulerOutput) -> None:
        """After the pass: the measured selections (applied when each request is promoted)."""
        for job in out.selections:
            job.request.selected_tokens = job.selected
            num_selected_tokens = sum(len(t) for t in job.selected.values())
            job.request.stats.num_computed_tokens += num_selected_tokens
            job.request.stats.num_recomputed_tokens += num_selected_tokens

    def release(self, request: Request) -> None:
        """Give back ``request``'s copy blocks and queries."""
        if request.selected_blocks:
            self.cache.pool.decref(request.selected_blocks)
            request.selected_blocks = []
        request.selected_queries = []
