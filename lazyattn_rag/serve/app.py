"""The Ray Serve application: one ingress in front of engine replicas (issue 18).

::

    HTTP -> Ingress (FastAPI: OpenAI chat completions, documents, metrics; one replica)
              -> DeploymentHandle + DocumentAffinityRouter -> EngineReplica x N (one engine each,
                 one GPU each on a GPU machine; a shared Redis tier, if configured, lets a chunk
                 computed on one replica be loaded, not recomputed, on another)

Example::

    from lazyattn_rag import EngineConfig
    from lazyattn_rag.serve import ServeConfig, run

    run(EngineConfig(), ServeConfig(num_replicas=2, num_gpus_per_replica=1, port=8000),
        ready=lambda: print("ready"))  # serves until interrupted
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from lazyattn_rag.serve.config import ServeConfig
from lazyattn_rag.serve.ingress import make_ingress
from lazyattn_rag.serve.replica import EngineReplica
from lazyattn_rag.types.config import EngineConfig


def build_app(engine_config: EngineConfig | None, config: ServeConfig = ServeConfig(), build=None):
    """The Serve application (``serve.run`` it): ``config.num_replicas`` engine replicas of
    ``engine_config`` (or each built by ``build()``, see :class:`EngineReplica`) behind one
    ingress, routed by ``config.router``."""
    from ray import serve
    from ray.serve.schema import LoggingConfig

    logging_config = LoggingConfig(log_level=config.log_level, enable_access_log=config.log_level in ("DEBUG", "INFO"))
    options = {"name": "engine", "num_replicas": config.num_replicas, "logging_config": logging_config,
               "max_ongoing_requests": config.max_ongoing_requests,
               "ray_actor_options": {"num_gpus": config.num_gpus_per_replica, "num_cpus": config.num_cpus_per_replica}}
    if config.router == "affinity":
        from ray.serve.config import RequestRouterConfig

        from lazyattn_rag.serve.router import DocumentAffinityRouter

        options["request_router_config"] = RequestRouterConfig(
            request_router_class=DocumentAffinityRouter,
            request_router_kwargs={"imbalanced_threshold": config.imbalanced_threshold})
    engine = serve.deployment(**options)(EngineReplica)
    ingress = serve.deployment(name="ingress", num_replicas=config.num_ingress_replicas,
                               max_ongoing_requests=4 * config.max_ongoing_requests,
                               ray_actor_options={"num_cpus": 0}, logging_config=logging_config)(
        make_ingress(config, engine_config))
    return ingress.bind(engine.bind(engine_config, build, config.switch_interval_ms))


def start_ray(address: str | None = None, **init_options) -> None:
    """Connect to the Ray cluster at ``address``, or, with ``None``, start a private one: a
    local cluster whose processes (GCS, raylet, workers, agents, Serve's controller and proxy)
    listen on 127.0.0.1 only, without a dashboard.

    Ray resolves a node address of 127.0.0.1 to the machine's outward address (so that other
    nodes can join) unless its cluster mode is off, as it is on macOS and Windows; it is turned
    off here while the local cluster starts (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` for the
    processes it starts, and the constant Ray read from it at import). Every server then binds
    the node address. ``tests/test_serve_security.py`` lists the listening sockets to check it.
    ``init_options`` go to ``ray.init`` (``num_cpus``, ``log_to_driver``...).
    """
    import os

    import ray

    if address is not None:
        ray.init(address=address, **{"logging_level": "WARNING", **init_options})
        return
    from ray._private import ray_constants

    variable = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    saved_env, saved_constant = os.environ.get(variable), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[variable], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        # ERROR: the driver's Ray logs (token authentication is on, Serve started) are said in
        # one line by `lazyattn serve`
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 **{"logging_level": "ERROR", **init_options})
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_constant
        if saved_env is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved_env


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run(engine_config: EngineConfig, config: ServeConfig = ServeConfig(), ready: Callable[[], None] | None = None):
    """Start Ray (:func:`start_ray`: a private local cluster unless ``config.ray_address``
    names one; a cluster this process already joined is used as it is), Serve's
    HTTP proxy on ``config.host:config.port`` and the application, call ``ready()`` once it
    answers, and serve until interrupted (``KeyboardInterrupt``, or SIGTERM); with ``ready=None``, return
    the ingress's handle instead of blocking."""
    import logging

    import ray
    from ray import serve

    from ray.serve.schema import LoggingConfig

    if not ray.is_initialized():
        start_ray(config.ray_address)
    if ready is not None:
        # SIGTERM (what systemd, Docker and Kubernetes send) stops as Ctrl-C does, from here on:
        # it replaces the handler Ray's core worker installed, which printed a stack dump and
        # skipped the cleanup below
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        # the driver's "Started Serve", "connecting to existing Serve app" (ours, just started):
        # said by `lazyattn serve`'s own start line; Serve's controller and proxy log at the app's level
        serve_logger = logging.getLogger("ray.serve")
        serve_logger.setLevel(max(serve_logger.getEffectiveLevel(), logging.WARNING))
        serve.start(http_options={"host": config.host, "port": config.port},
                    logging_config=LoggingConfig(log_level=config.log_level))
        serve_logger.setLevel(logging.ERROR)
        handle = serve.run(build_app(engine_config, config), name=config.app_name, route_prefix="/", blocking=False)
        if ready is None:
            return handle
        ready()
        while True:
            time.sleep(3600)
    finally:  # here, not in an exit handler a second Ctrl-C would interrupt
        if ready is not None:  # (with ready=None the caller keeps the cluster and the handle's life)
            if config.ray_address is not None:  # a shared cluster: take our app off it, leave the rest
                serve.delete(config.app_name)
            # a private cluster goes with its processes (serve.shutdown() first would kill Serve's
            # controller under its own graceful_shutdown call, which Ray then logs as a failure)
            ray.shutdown()
