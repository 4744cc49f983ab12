"""Prometheus metrics for a running engine (optional extra: ``pip install lazyattn-rag[metrics]``).

The collector reads :meth:`LazyAttention.stats` at scrape time, so the engine keeps no
Prometheus state of its own and nothing is double-counted.

Example::

    from prometheus_client import REGISTRY, start_http_server
    from lazyattn_rag.metrics import register_metrics

    register_metrics(llm, REGISTRY)
    start_http_server(9400)
"""

from __future__ import annotations

from typing import Any

_COUNTERS = {
    "num_requests_finished": ("requests_finished", "Requests that finished (stop or length)."),
    "num_requests_failed": ("requests_failed", "Requests that failed with an error."),
    "num_requests_aborted": ("requests_aborted", "Requests cancelled by the caller."),
    "num_prompt_tokens": ("prompt_tokens", "Prompt tokens of finished requests."),
    "num_cached_prompt_tokens": ("cached_prompt_tokens", "Prompt tokens served from the chunk cache."),
    "num_output_tokens": ("output_tokens", "Generated tokens."),
    "num_evictions": ("chunk_evictions", "Chunks evicted from the cache."),
    "num_preemptions": ("preemptions", "Requests preempted (blocks freed, recomputed later)."),
    "num_steps": ("engine_steps", "Engine forward steps."),
}
_GAUGES = {
    "num_requests_waiting": ("requests_waiting", "Requests queued."),
    "num_requests_running": ("requests_running", "Requests holding KV resources."),
    "token_hit_ratio": ("token_hit_ratio", "Cached prompt tokens / prompt tokens, since start."),
    "doc_hit_ratio": ("doc_hit_ratio", "Document placements served from cache / all placements, since start."),
    "num_blocks_total": ("kv_blocks_total", "KV blocks in the pool."),
    "num_blocks_free": ("kv_blocks_free", "Free KV blocks."),
    "num_blocks_cached": ("kv_blocks_cached", "KV blocks held by cached chunks."),
    "num_blocks_in_use": ("kv_blocks_in_use", "KV blocks held by running requests' own tokens."),
    "num_cached_chunks": ("cached_chunks", "Chunks in the cache."),
    "num_documents": ("documents", "Registered documents."),
}


class EngineCollector:
    """A ``prometheus_client`` collector over one :class:`LazyAttention` (metrics prefixed ``lazyattn_``).

    Args:
        llm: the engine facade (anything with ``stats() -> dict``).
        namespace: metric name prefix.
    """

    def __init__(self, llm: Any, namespace: str = "lazyattn"):
        self.llm = llm
        self.namespace = namespace

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.llm.stats()
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(f"{self.namespace}_{name}", doc, value=stats[key])
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(f"{self.namespace}_{name}", doc, value=stats[key])


def register_metrics(llm: Any, registry=None, namespace: str = "lazyattn") -> EngineCollector:
    """Register an :class:`EngineCollector` (default registry: ``prometheus_client.REGISTRY``).

    Raises:
        ImportError: prometheus-client is not installed (``pip install lazyattn-rag[metrics]``).
    """
    try:
        from prometheus_client import REGISTRY
    except ImportError as e:
        raise ImportError("Prometheus metrics need prometheus-client: pip install 'lazyattn-rag[metrics]'") from e
    collector = EngineCollector(llm, namespace)
    (registry or REGISTRY).register(collector)
    return collector
