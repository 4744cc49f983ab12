"""The slot copies behind recomputed chunk heads (chunk-head recompute, ``PromptPlan.head_recompute_copy``).

A recomputed head that ends inside a block makes that block the text segment's last one; the
block's other slots (the chunk's cached tokens after the head) are copied from the chunk's own
block, K rotated to the request's positions, in the pass that first reads them: in every layer
after that layer's K/V write (``AttentionBackend.copy_step_slots``), so the chunk may be encoded
by the same pass.
"""

from __future__ import annotations

from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.scheduling.request import Request
from lazyattn_rag.engine.scheduling.scheduler_output import SlotCopyJob


def head_slot_copies(cache: ChunkCache, request: Request, start: int, end: int) -> list[SlotCopyJob]:
    """The copies behind ``request``'s recomputed chunk heads whose last token is among its private
    tokens ``start .. end - 1`` scheduled now (that token's block is allocated by then)."""
    jobs, bs = [], cache.block_size
    for run, text in zip(request.private_runs(bs), request.plan.texts):
        copy = request.plan.head_recompute_copy(text, bs)
        if copy is None or not start < run.start + run.length <= end:
            continue
        chunk, first, num = copy
        entry = cache.held(chunk.key)
        jobs.append(SlotCopyJob(entry.block_ids[chunk.num_skipped // bs],
                                request.private_blocks[run.first_block + -(-run.length // bs) - 1],
                                first, num, chunk.global_start - entry.local_start))
    return jobs

