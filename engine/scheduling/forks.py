"""Several answers from one prompt (``SamplingParams.n``): forking a request after its prompt.

When a request with ``n > 1`` samples its first token, the prompt's K/V is complete. Each other
answer becomes a request that shares it: the same context entries (chunks and prefix blocks,
pinned under its own id too), the parent's private blocks with one more reference each, and a
copy of the prompt's last block when the prompt ends inside it (the answers write their own
tokens after it). The copy is a slot copy (rotation 0) the runner does before the next pass.
So the prompt is computed once, as vLLM computes it once for its ``n`` children with prefix
caching, and the answers then decode independently; a preempted answer recomputes its prompt
alone like any request.
"""

from __future__ import annotations

from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.scheduling.request import Request
from lazyattn_rag.engine.scheduling.scheduler_output import SlotCopyJob


class RequestForks:
    """Shares a parent's prompt with its other answers, and holds their block copies until the
    next step is scheduled.

    Args:
        cache: the chunk cache (pins and block allocation).
    """

    def __init__(self, cache: ChunkCache):
        self.cache, self.block_size = cache, cache.block_size
        self._copies: dict[str, SlotCopyJob] = {}  # child id -> the copy of the prompt's last block

    def share(self, parent: Request, child: Request) -> bool:
        """Give ``child`` the parent's computed prompt; ``False`` (nothing taken) when that is not
        possible: the parent recomputes selected document tokens in blocks of its own
        (selective recompute), or no block is free for the copy."""
        bs = self.block_size
        tail = parent.private_runs(bs)[-1]
        filled = parent.num_computed - tail.start  # the tail's tokens written (the whole prompt's)
        num_shared = tail.first_block + filled // bs
        partial = filled % bs
        if parent.plan.selective_ratio or (partial and not self.cache.can_allocate(1)):
            return False
        shared = parent.private_blocks[:num_shared]
        self.cache.pool.incref(shared)
        child.private_blocks = list(shared)
        if partial:
            [block] = self.cache.allocate(1)
            child.private_blocks.append(block)
            self._copies[child.request_id] = SlotCopyJob(parent.private_blocks[num_shared], block, 0, partial, 0)
        for key in self.cache.pins_of(parent.request_id):
            self.cache.pin(key, allow_dead=True, holder=child.request_id)
        child.context_entries, child.context_len = list(parent.context_entries), parent.context_len
        child.num_prefix_tokens, child.num_prefix_registered = parent.num_prefix_tokens, parent.num_prefix_registered
        child.num_computed, child.first_scheduled_time = parent.num_computed, parent.first_scheduled_time
        return True

    def take_copies(self) -> list[SlotCopyJob]:
        """The copies of forks made since the last call (for this step, before its pass)."""
        copies, self._copies = list(self._copies.values()), {}
        return copies

    def drop(self, request_id: str) -> None:
        """Forget a released child's pending copy (its block went back to the pool)."""
        self._copies.pop(request_id, None)
