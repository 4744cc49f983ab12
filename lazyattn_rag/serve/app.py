"""The Ray Serve application: one ingress in front of engine replicas (issue 18).

::

    HTTP -> Ingress (FastAPI: OpenAI chat completions, documents, metrics; one replica)
              -> DeploymentHandle + DocumentAffinityRouter -> EngineReplica x N (one engine each,
                 one GPU each on a GPU machine; a shared Redis tier, if configured, lets a chunk
                 computed on one replica be loaded, not recomputed, on another)

Example::

    from lazyattn_rag import EngineConfig
    from lazyattn_rag.serve import ServeConfig, run

    run(EngineConfig(), ServeConfig(num_replicas=2, num_gpus_per_replica=1, port=8000))
"""

from __future__ import annotations

from lazyattn_rag.serve.config import ServeConfig
from lazyattn_rag.serve.ingress import make_ingress
from lazyattn_rag.serve.replica import EngineReplica
from lazyattn_rag.types.config import EngineConfig


def build_app(engine_config: EngineConfig | None, config: ServeConfig = ServeConfig(), build=None):
    """The Serve application (``serve.run`` it): ``config.num_replicas`` engine replicas of
    ``engine_config`` (or each built by ``build()``, see :class:`EngineReplica`) behind one
    ingress, routed by ``config.router``."""
    from ray import serve

    options = {"name": "engine", "num_replicas": config.num_replicas,
               "max_ongoing_requests": config.max_ongoing_requests,
               "ray_actor_options": {"num_gpus": config.num_gpus_per_replica, "num_cpus": config.num_cpus_per_replica}}
    if config.router == "affinity":
        from ray.serve.config import RequestRouterConfig

        from lazyattn_rag.serve.router import DocumentAffinityRouter

        options["request_router_config"] = RequestRouterConfig(
            request_router_class=DocumentAffinityRouter,
            request_router_kwargs={"imbalanced_threshold": config.imbalanced_threshold})
    engine = serve.deployment(**options)(EngineReplica)
    ingress = serve.deployment(name="ingress", num_replicas=1, max_ongoing_requests=4 * config.max_ongoing_requests,
                               ray_actor_options={"num_cpus": 0})(make_ingress(config))
    return ingress.bind(engine.bind(engine_config, build))


def run(engine_config: EngineConfig, config: ServeConfig = ServeConfig(), blocking: bool = True):
    """Start Ray (a local cluster unless one is running or ``RAY_ADDRESS`` names one), Serve's
    HTTP proxy on ``config.host:config.port`` and the application; with ``blocking``, serve until
    interrupted. Returns the ingress's handle."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(include_dashboard=False, logging_level="WARNING")
    serve.start(http_options={"host": config.host, "port": config.port})
    return serve.run(build_app(engine_config, config), name=config.app_name, route_prefix="/", blocking=blocking)
