"""The engine-wide stats dictionary (``LLMEngine.stats()``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazyattn_rag.engine.engine import LLMEngine


def engine_stats(engine: LLMEngine) -> dict:
    """Hit ratios (tokens, documents), blocks, evictions, preemptions, queues,
    ``first_request_ttft_ms`` (the first request to produce a token; ``None`` before),
    ``latency``: histograms of finished requests' ``ttft``, ``tpot``, ``e2e`` and ``queue``
    seconds (:meth:`Histogram.as_dict`), and
    ``tiers``: per storage tier below the pool, :meth:`ChunkTiers.stats` (empty without tiers)."""
    c, cache, sched, tiers = engine.counters, engine.cache, engine.scheduler, engine.tiers
    pool, cached_blocks = cache.pool, cache.num_cached_blocks
    return {
        "num_requests_finished": c.num_requests_finished,
        "num_requests_failed": c.num_requests_failed,
        "num_requests_aborted": c.num_requests_aborted,
        "num_requests_waiting": len(sched.waiting),
        "num_requests_running": len(sched.running) + len(sched.acquired),
        "token_hit_ratio": c.num_cached_prompt_tokens / c.num_prompt_tokens if c.num_prompt_tokens else 0.0,
        "doc_hit_ratio": c.num_doc_hits / c.num_doc_lookups if c.num_doc_lookups else 0.0,
        "num_prompt_tokens": c.num_prompt_tokens,
        "num_cached_prompt_tokens": c.num_cached_prompt_tokens,
        "num_exact_prefix_tokens": c.num_exact_prefix_tokens,
        "num_shifted_tokens": c.num_shifted_tokens,
        "num_computed_prompt_tokens": c.num_computed_prompt_tokens,
        "num_recomputed_tokens": c.num_recomputed_tokens,
        "doc_placements": dict(c.doc_placements),
        "num_passages_remembered": len(engine.passages.history) if engine.passages is not None else 0,
        "num_output_tokens": c.num_output_tokens,
        "num_blocks_total": pool.num_blocks,
        "num_blocks_free": pool.num_free,
        "num_blocks_cached": cached_blocks,
        "num_blocks_in_use": pool.num_blocks - pool.num_free - cached_blocks,
        "num_blocks_evictable": cache.num_evictable_blocks,
        "num_cached_chunks": cache.num_entries,
        "num_documents": len(engine.documents),
        "num_evictions": cache.num_evictions,
        "num_preemptions": c.num_preemptions,
        "num_key_collisions": c.num_key_collisions,
        "num_steps": c.num_steps,
        "first_request_ttft_ms": c.first_request_ttft_ms,
        "latency": {name: h.as_dict() for name, h in c.latencies.items()},
        "tiers": tiers.stats() if tiers is not None else {},
        "num_tier_writes_dropped": tiers.num_dropped_writes if tiers is not None else 0,
    }
