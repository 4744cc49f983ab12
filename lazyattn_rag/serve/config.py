"""How ``lazyattn serve`` runs: replicas, routing and HTTP limits (issue 18)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTERS = ("affinity", "default")


@dataclass(frozen=True)
class ServeConfig:
    """The Ray Serve application's settings (the engine's are an
    :class:`~lazyattn_rag.types.config.EngineConfig`, the same as ``lazyattn chat`` takes).

    Attributes:
        num_replicas: engine replicas, each with its own engine and KV cache.
        num_gpus_per_replica: GPUs each replica reserves (1 on a GPU machine: one engine per GPU;
            0 for CPU replicas).
        num_cpus_per_replica: CPUs each replica reserves in Ray's accounting.
        router: ``"affinity"`` (:class:`~lazyattn_rag.serve.router.DocumentAffinityRouter`: a
            request goes to the replica that owns most of its documents) or ``"default"`` (Ray
            Serve's power-of-two-choices router), for comparisons.
        imbalanced_threshold: the affinity router sends a request to the least-loaded replica
            instead when its owner's queue is longer than the shortest by more than this many
            requests.
        max_ongoing_requests: requests one replica runs at once (Ray Serve queues the rest);
            the engine batches them continuously.
        host, port: where the HTTP API listens.
        max_body_bytes: request bodies larger than this are refused with 413.
        app_name: the Ray Serve application's name.
        num_ingress_replicas: HTTP ingress replicas (they share the registry below).
        max_logprobs: the most ``top_logprobs`` a request may ask for (vLLM's ``--max-logprobs``,
            default 20 as OpenAI's limit); ``-1`` lets a request ask for ``-1``, the whole
            vocabulary (fidelity measurements: ``benchmarks/quality.py --http``).
        registry: where registered documents persist (``lazyattn_rag/serve/registry.py``):
            ``"auto"`` (the engine's Redis server when ``CacheConfig.redis_url`` is set, else a
            SQLite file ``registry/<app_name>.sqlite3`` under the engine's cache dir), a
            ``redis://`` URL, a file path, or ``"memory"`` (this ingress only; gone on restart).
        log_level: the replicas' log level (Ray Serve's ``LoggingConfig``); ``"INFO"`` adds
            one access-log line per request.
        api_keys: keys a request may carry (``Authorization: Bearer <key>``), each allowed every
            namespace (``lazyattn_rag/serve/auth.py``); never shown in ``repr``.
        api_key_file: a JSON file binding keys to namespaces and to the right to manage
            documents (format in ``lazyattn_rag/serve/auth.py``).
        allow_unauthenticated: with no key configured, serve clients that are not on loopback
            too; without it such a server must listen on a loopback ``host``.
        allowed_origins, allowed_methods, allowed_headers: CORS (Starlette's ``CORSMiddleware``,
            vLLM's ``--allowed-origins`` etc.): the origins a browser page may call the API from
            (``("*",)``: any; empty, the default: no CORS headers, so browsers refuse
            cross-origin calls), and the methods and headers such a call may use.
        served_model_name: the model's name in the API (``/v1/models``, every answer's
            ``model``; requests naming another are 404); ``None``: the engine's model name.
        health_timeout_s: how long ``GET /health`` waits for an engine replica to answer before
            it answers 503 (keep it under a probe's own timeout, e.g. Kubernetes' default 1 s).
        switch_interval_ms: Python's thread switch interval in each engine replica's process
            (``sys.setswitchinterval``), ms. A replica runs its engine thread beside the threads
            that plan plain prompts, hand requests over and stream tokens back; a thread that
            wakes for the GIL waits up to this long while another holds it (Python's default:
            5 ms, paid at every hand-over of a request and its first token; issue 36's trace,
            docs/benchmarks.md). ``None``: leave Python's setting alone.
        ray_address: the Ray cluster to run on (``ray.init(address=...)``: ``"auto"`` or
            ``"ray://..."``/``"host:port"``, for several nodes); ``None``: a private local
            cluster whose processes listen on 127.0.0.1 only, with no dashboard.
    Raises:
        ValueError: at construction, for a value out of range (named), or a ``host`` other
            than loopback with no key and no ``allow_unauthenticated``.
    """

    num_replicas: int = 1
    num_gpus_per_replica: float = 0.0
    num_cpus_per_replica: float = 1.0
    router: str = "affinity"
    imbalanced_threshold: int = 8
    max_ongoing_requests: int = 64
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 16 << 20
    app_name: str = "lazyattn"
    log_level: str = "WARNING"
    num_ingress_replicas: int = 1
    registry: str = "auto"
    max_logprobs: int = 20
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_file: str | None = None
    allow_unauthenticated: bool = False
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    served_model_name: str | None = None
    health_timeout_s: float = 5.0
    switch_interval_ms: float | None = 0.5
    ray_address: str | None = None

    def __post_init__(self):
        for name in ("api_keys", "allowed_origins", "allowed_methods", "allowed_headers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if any(not isinstance(v, str) or not v for name in ("allowed_origins", "allowed_methods", "allowed_headers")
               for v in getattr(self, name)):
            raise ValueError("allowed_origins, allowed_methods and allowed_headers must be non-empty strings")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name.strip()):
            raise ValueError(f"served_model_name must be a non-empty string, got {self.served_model_name!r}")
        if any(not isinstance(k, str) or not k.strip() for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
        if not self.authenticates and not self.allow_unauthenticated and not _is_loopback(self.host):
            raise ValueError(f"host {self.host!r} is not loopback: give API keys (--api-key or --api-key-file) so "
                             "that only their holders are served, or --allow-unauthenticated to serve anyone who "
                             "can reach it")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}")
        if not isinstance(self.registry, str) or not self.registry:
            raise ValueError(f"registry must be 'auto', 'memory', a redis:// URL or a file path, got {self.registry!r}")
        for name in ("num_replicas", "max_ongoing_requests", "max_body_bytes", "num_ingress_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if not isinstance(self.imbalanced_threshold, int) or self.imbalanced_threshold < 0:
            raise ValueError(f"imbalanced_threshold must be an integer >= 0, got {self.imbalanced_threshold!r}")
        if self.num_gpus_per_replica < 0 or self.num_cpus_per_replica < 0:
            raise ValueError("num_gpus_per_replica and num_cpus_per_replica must be >= 0")
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if not isinstance(self.health_timeout_s, (int, float)) or not 0 < self.health_timeout_s <= 3600:
            raise ValueError(f"health_timeout_s must be in (0, 3600] seconds, got {self.health_timeout_s!r}")
        if self.switch_interval_ms is not None and (
                isinstance(self.switch_interval_ms, bool) or not isinstance(self.switch_interval_ms, (int, float))
                or not 0.01 <= self.switch_interval_ms <= 100):
            raise ValueError(f"switch_interval_ms must be in [0.01, 100] ms or None, got {self.switch_interval_ms!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port!r}")

    @property
    def authenticates(self) -> bool:
        """Whether requests must carry a key."""
        return bool(self.api_keys) or self.api_key_file is not None


def _is_loopback(host: str) -> bool:
    from lazyattn_rag.serve.auth import is_loopback

    return is_loopback(host)


def uses_cuda(device: str) -> bool:
    """Whether an engine on ``device`` (``auto``: CUDA where there is one) runs on a GPU."""
    if device == "cpu":
        return False
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
