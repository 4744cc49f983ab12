"""The engine's counters, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from lazyattn_rag.types.histogram import REQUEST_BUCKETS_S, Histogram

LATENCIES = ("ttft", "tpot", "e2e", "queue")  # RequestStats' *_ms fields, observed in seconds


def _latency_histograms() -> dict[str, Histogram]:
    return {name: Histogram(REQUEST_BUCKETS_S) for name in LATENCIES}


@dataclass
class EngineCounters:
    """Engine-wide counters since start, in one place (the scheduler counts preemptions here,
    the output processor everything else; the chunk cache keeps its own evictions).

    Prompt tokens and documents count finished requests (a preempted request counts once)."""

    num_requests_finished: int = 0
    num_requests_failed: int = 0
    num_requests_aborted: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_exact_prefix_tokens: int = 0  # of the cached ones: reused where they were computed
    num_shifted_tokens: int = 0  # of the cached ones: documents and passages at new offsets
    num_computed_prompt_tokens: int = 0
    num_recomputed_tokens: int = 0  # of the computed ones: fidelity remedies' document tokens
    doc_placements: dict[str, int] = field(default_factory=dict)  # by RequestStats.doc_sources
    num_doc_lookups: int = 0
    num_doc_hits: int = 0
    num_output_tokens: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_key_collisions: int = 0  # cached entries whose tokens differed from a request's: served as misses
    first_request_ttft_ms: float | None = None  # of the first request that produced a token
    # finished requests' TTFT, TPOT (requests of 2+ tokens), end-to-end and queue times, in seconds
    latencies: dict[str, Histogram] = field(default_factory=_latency_histograms)
