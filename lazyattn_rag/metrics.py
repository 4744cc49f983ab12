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
    "num_exact_prefix_tokens": ("exact_prefix_tokens", "Cached prompt tokens reused where they were computed "
                                                      "(prompt heads, exact-prefix blocks)."),
    "num_shifted_tokens": ("shifted_tokens", "Cached prompt tokens of documents and learned passages read from "
                                             "their chunks (each encoded alone) at the prompt's offsets."),
    "num_computed_prompt_tokens": ("computed_prompt_tokens", "Prompt tokens computed by their requests."),
    "num_recomputed_tokens": ("recomputed_tokens", "Computed prompt tokens of cached documents a fidelity remedy "
                                                   "computed again."),
    "num_output_tokens": ("output_tokens", "Generated tokens."),
    "num_evictions": ("chunk_evictions", "Chunks evicted from the cache."),
    "num_preemptions": ("preemptions", "Requests preempted (blocks freed, recomputed later)."),
    "num_key_collisions": ("key_collisions", "Cached chunks whose tokens differed from a request's under one key "
                                             "(served as misses)."),
    "num_steps": ("engine_steps", "Engine forward steps."),
    "num_tier_writes_dropped": ("tier_writes_dropped", "Chunk writes to the storage tiers dropped: the writer's queue was full."),
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


# Per storage tier (label ``tier``: host, disk, redis), from ``stats()["tiers"]``.
_TIER_COUNTERS = {
    "num_hits": ("tier_hits", "Chunks found in the tier."),
    "num_misses": ("tier_misses", "Chunks looked up and not found (or not readable)."),
    "num_puts": ("tier_puts", "Chunks written to the tier."),
    "num_evictions": ("tier_evictions", "Chunks the tier evicted for room (not Redis: the server evicts)."),
    "num_errors": ("tier_errors", "Failed reads and writes, and corrupt payloads deleted."),
    "num_corrupt": ("tier_corrupt", "Payloads that failed the format, model, key or checksum checks (deleted)."),
    "num_outages": ("tier_outages", "Times the tier became unreachable."),
    "num_too_large": ("tier_too_large", "Chunks not stored: one alone exceeds the tier's budget."),
    "num_bytes_read": ("tier_read_bytes", "Chunk bytes read (encoded; for host memory, the pages)."),
    "num_bytes_written": ("tier_written_bytes", "Chunk bytes written (encoded; for host memory, the pages)."),
}
_TIER_HISTOGRAMS = {
    "load_seconds": ("tier_load_seconds", "Time to read, decode and check a chunk from the tier."),
    "store_seconds": ("tier_store_seconds", "Time to encode and write a chunk to the tier (writer thread)."),
}


_LATENCIES = {  # vLLM's names (vllm:time_to_first_token_seconds, ...), from stats()["latency"]
    "ttft": ("time_to_first_token_seconds", "Time to first token of finished requests, from submission."),
    "tpot": ("time_per_output_token_seconds", "Mean time per output token after the first, of finished requests "
                                              "with two or more."),
    "e2e": ("e2e_request_latency_seconds", "Submission to finish of finished requests."),
    "queue": ("request_queue_time_seconds", "Submission to first scheduling of finished requests."),
}
_PLACEMENTS = ("document_placements", "Documents placed in finished requests, by how they came to be placed: id "
                                      "(named), matched (their text found in a plain prompt), learned (a recurring "
                                      "passage).")
ENGINE_STAT_KEYS = (*_COUNTERS, *_GAUGES, "doc_placements", "latency", "tiers")  # the keys of stats() exported


def _histogram(family, labels: list[str], h: dict) -> None:
    """Add one histogram (``Histogram.as_dict()``) to ``family``: cumulative buckets."""
    buckets, total = [], 0
    for bound, count in zip([*map(str, h["buckets_s"]), "+Inf"], h["counts"]):
        total += count
        buckets.append((bound, total))
    family.add_metric(labels, buckets, h["sum_s"])


def engine_stat_families(namespace: str, stats_by_replica: dict[str | None, dict], model_name: str):
    """Prometheus families of one or several engines' ``stats()`` dicts: counters, gauges, the
    request latency histograms, document placements and the storage tiers, each labelled
    ``model_name`` and, unless the only key is ``None`` (one engine in this process),
    ``replica`` (``lazyattn serve``). Keys a dict lacks are left out."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["model_name"] + (["replica"] if list(stats_by_replica) != [None] else [])
    rows = [([model_name] + ([replica] if len(labels) == 2 else []), stats)
            for replica, stats in sorted(stats_by_replica.items(), key=lambda kv: kv[0] or "")]

    def family(kind, name: str, doc: str, extra: tuple[str, ...] = ()):
        return kind(f"{namespace}_{name}", doc, labels=[*labels, *extra])

    for table, kind in ((_COUNTERS, CounterMetricFamily), (_GAUGES, GaugeMetricFamily)):
        for key, (name, doc) in table.items():
            f = family(kind, name, doc)
            for values, stats in rows:
                if stats.get(key) is not None:
                    f.add_metric(values, stats[key])
            yield f
    for key, (name, doc) in _LATENCIES.items():
        f = family(HistogramMetricFamily, name, doc)
        for values, stats in rows:
            if key in stats.get("latency", {}):
                _histogram(f, values, stats["latency"][key])
        yield f
    placements = family(CounterMetricFamily, *_PLACEMENTS, extra=("source",))
    for values, stats in rows:
        for source in ("id", "matched", "learned"):
            placements.add_metric([*values, source], (stats.get("doc_placements") or {}).get(source, 0))
    yield placements
    yield from _tier_families(family, rows)


def _tier_families(family, rows: list[tuple[list[str], dict]]):
    """Per storage tier (label ``tier``), from each engine's ``stats()["tiers"]``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    tiers = [(values, tier, t) for values, stats in rows for tier, t in sorted((stats.get("tiers") or {}).items())]
    if not tiers:
        return
    for key, (name, doc) in _TIER_COUNTERS.items():
        f = family(CounterMetricFamily, name, doc, ("tier",))
        for values, tier, t in tiers:
            f.add_metric([*values, tier], t[key])
        yield f
    up = family(GaugeMetricFamily, "tier_available", "1 when the tier answers, 0 during an outage.", ("tier",))
    held = family(GaugeMetricFamily, "tier_bytes", "Encoded chunk bytes held (in-process tiers).", ("tier",))
    for values, tier, t in tiers:
        up.add_metric([*values, tier], float(t["available"]))
        if t["num_bytes"] is not None:
            held.add_metric([*values, tier], t["num_bytes"])
    yield up
    yield held
    for key, (name, doc) in _TIER_HISTOGRAMS.items():
        f = family(HistogramMetricFamily, name, doc, ("tier",))
        for values, tier, t in tiers:
            _histogram(f, [*values, tier], t[key])
        yield f


class EngineCollector:
    """A ``prometheus_client`` collector over one :class:`LazyAttention` (metrics prefixed
    ``lazyattn_``, labelled ``model_name``), read from its ``stats()`` at each scrape.

    Args:
        llm: the engine facade (anything with ``stats() -> dict`` and ``model_name``).
        namespace: metric name prefix.
    """

    def __init__(self, llm: Any, namespace: str = "lazyattn"):
        self.llm = llm
        self.namespace = namespace

    def collect(self):
        yield from engine_stat_families(self.namespace, {None: self.llm.stats()},
                                        getattr(self.llm, "model_name", "") or "")


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
