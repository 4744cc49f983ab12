"""What the ingress's ``GET /metrics`` exports: HTTP responses by route, method and status, the answers
each replica finished, retries, and each replica's engine stats as of its last finished request."""

from lazyattn_rag.serve.middleware import RESPONSES


class IngressMetrics:
    """Prometheus collector over the ingress's counts and the replicas' last reports."""

    def __init__(self, ingress):
        self.ingress = ingress

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

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
        yield from engine_stat_families("lazyattn", self.ingress.replica_stats)
