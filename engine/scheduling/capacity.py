"""What a request's blocks cost against the KV pool: the arithmetic the scheduler, admission and
the engine's admission check share."""

from __future__ import annotations

from lazyattn_rag.engine.kv.block_table import BlockEntry
from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.scheduling.request import Request
from lazyattn_rag.engine.scheduling.selective_schedule import SelectiveRecompute


class BlockBudget:
    """Blocks of the pool a request may hold and how many it needs.

    Args:
        cache: the chunk cache (its pool's size and block size).
        anchor_context: block-table entries of the anchor (pinned for good: not a request's).
        anchor_key: the anchor's chunk key (its blocks are not counted against requests).
        selective: selective recompute's part (the block copies a request reserves).
    """

    def __init__(self, cache: ChunkCache, anchor_context: list[BlockEntry], anchor_key: str | None,
                 selective: SelectiveRecompute):
        self.cache, self.anchor_context, self.anchor_key, self.selective = cache, anchor_context, anchor_key, selective
        self.block_size = cache.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks ``num_tokens`` tokens fill (the last may be partly filled)."""
        return -(-num_tokens // self.block_size)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request may ever hold: the pool less the anchor's (pinned for good)."""
        return self.cache.pool.num_blocks - len(self.anchor_context)

    def describe(self) -> str:
        """The pool in words, for errors: ``"N blocks of B tokens[, A of them held by the anchor]"``."""
        anchor = f", {len(self.anchor_context)} of them held by the anchor" if self.anchor_context else ""
        return f"{self.cache.pool.num_blocks} blocks of {self.block_size} tokens{anchor}"

    def num_blocks_needed(self, request: Request, num_private_tokens: int) -> int:
        """Blocks ``request`` holds at once with ``num_private_tokens`` private tokens (text
        segments, tail, generated) written: its chunks' (each starts a block; the anchor's are
        not counted) plus its private blocks and selective recompute's copies."""
        chunks = {c.key: c for c in request.plan.chunks if c.key != self.anchor_key}
        return (sum(self.blocks_for(len(c.token_ids)) for c in chunks.values())
                + request.num_private_blocks(num_private_tokens, self.block_size)
                + self.selective.max_blocks(request))
