"""What a request's blocks cost against the KV pool: the arithmetic the scheduler, admission and
the engine's admission check share."""

from __future__ import annotations

import logging

from lazyattn_rag.engine.kv.block_table import BlockEntry
from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.scheduling.request import Request
from lazyattn_rag.engine.scheduling.selective_schedule import SelectiveRecompute
from lazyattn_rag.types.errors import CacheCapacityError, PromptTooLongError

logger = logging.getLogger(__name__)


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


def check_capacity(request: Request, budget: BlockBudget, max_model_len: int) -> None:
    """Admission rule: refuse a request whose prompt and ``max_tokens`` could never fit the KV
    cache, even alone, before it runs (never part-way through its stream).

    Raises:
        CacheCapacityError: naming the blocks needed, prompt tokens, max_tokens and the cache.
        PromptTooLongError: with ``SamplingParams.strict_max_tokens``, the prompt plus
            ``max_tokens`` exceed ``max_model_len``.
    """
    plan, params = request.plan, request.params
    if params.strict_max_tokens and plan.num_prompt_tokens + params.max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's context is {max_model_len} tokens, but the request asks for "
            f"{plan.num_prompt_tokens + params.max_tokens} ({plan.num_prompt_tokens} in the prompt, "
            f"max_tokens={params.max_tokens}): shorten the prompt or lower max_tokens")
    num_outputs = 0 if request.warm_only else min(params.max_tokens, max_model_len - plan.num_prompt_tokens)
    need = budget.num_blocks_needed(request, request.num_private_tokens + num_outputs)
    if need > budget.num_usable_blocks:
        num_docs = sum(c.doc_id is not None for c in plan.chunks)
        raise CacheCapacityError(
            f"request needs {need} KV blocks for {plan.num_prompt_tokens} prompt tokens ({num_docs} documents) "
            f"and up to {num_outputs} output tokens (max_tokens={params.max_tokens}), but the cache has "
            f"{budget.describe()}: lower max_tokens, place fewer documents, or give the cache more memory")


def fit_max_model_len(max_model_len: int, budget: BlockBudget, explicit: bool) -> int:
    """The context limit the KV cache can hold for one request (start-up check).

    One request of ``max_model_len`` tokens needs its blocks plus one for the boundary between
    its cached head and its private tail. An ``explicit`` limit (``EngineConfig.max_model_len``)
    that does not fit raises; one taken from the model is lowered to what fits, with a log line.

    Raises:
        CacheCapacityError: the explicit limit does not fit, or not even two tokens do.
    """
    bs, capacity = budget.block_size, budget.describe()
    fits = (budget.num_usable_blocks - 1) * bs
    if max_model_len <= fits:
        return max_model_len
    advice = ("give the cache more memory (CacheConfig.kv_cache_bytes or num_blocks) or lower "
              f"max_model_len to at most {fits}" if fits >= 2 else
              "it holds no request at all: give the cache more memory (CacheConfig.kv_cache_bytes or num_blocks)")
    if fits < 2 or explicit:
        raise CacheCapacityError(f"max_model_len={max_model_len} needs {-(-max_model_len // bs) + 1} KV blocks "
                                 f"for one request but the cache has {capacity}: {advice}")
    logger.info("the model's context of %d tokens does not fit the KV cache (%s); serving up to %d tokens "
                "per request", max_model_len, capacity, fits)
    return fits
