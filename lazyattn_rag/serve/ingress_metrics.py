"""What the ingress's ``GET /metrics`` exports: HTTP responses by route, method and status, the answers
each replica finished, retries, and each replica's engine stats as it reported them at this scrape
(``EngineReplica.stats`` on every replica): counters, current gauges, request latency histograms and
storage tiers, labelled ``model_name`` and ``replica``."""

from lazyattn_rag.serve.middleware import RESPONSES


class IngressMetrics:
    """Prometheus collector over the ingress's counts and the replicas' reports.

    Args:
        ingress: the ingress (``replica_requests``, ``num_retries``, ``replica_stats``: replica id
            -> its ``stats()`` at this scrape).
        model_name: the served model name (the ``model_name`` label).
    """

    def __init__(self, ingress, model_name: str):
        self.ingress, self.model_name = ingress, model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from lazyattn_rag.metrics import engine_stat_families

        http = CounterMetricFamily("lazyattn_http_responses", "HTTP responses by route, method and status.",
                                   labels=["route", "method", "status"])
        for (route, method, status), n in sorted(RESPONSES.items()):
            http.add_metric([route, method, str(status)], n)
        yield http
        served = CounterMetricFamily("lazyattn_replica_answers", "Answers each replica finished.", labels=["replica"])
        for replica, n in sorted(self.ingress.replica_requests.items()):
            served.add_metric([replica], n)
        yield served
        yield CounterMetricFamily("lazyattn_request_retries", "Requests retried on another replica after theirs died.",
                                  value=self.ingress.num_retries)
        yield GaugeMetricFamily("lazyattn_replicas_reporting", "Engine replicas that reported at this scrape.",
                                value=len(self.ingress.replica_stats))
        yield from engine_stat_families("lazyattn", self.ingress.replica_stats, self.model_name)
