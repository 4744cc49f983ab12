"""An application builder for Ray Serve's own tools: ``serve run``, ``serve deploy`` config files
and KubeRay's RayService start the same app ``lazyattn serve`` starts.

::

    serve run lazyattn_rag.serve.builder:app model=/models/llama-3.1-8b replicas=2 served_model_name=rag
    serve deploy examples/serve_config.yaml        # applications[].import_path + args

The arguments are :class:`ServeArgs` (``lazyattn serve``'s flag names, with underscores); Ray
Serve validates them against it before building (``key=value`` strings are converted, an unknown
key or a bad value is refused by name). Serve's own ``http_options`` place the HTTP proxy; the
key gate still answers only loopback clients unless keys or ``allow_unauthenticated`` are given.
"""
# no `from __future__ import annotations`: Ray Serve reads the builder's argument annotation as a class

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lazyattn_rag.types.config import CacheConfig, EngineConfig


class ServeArgs(BaseModel):
    """The app's arguments: ``lazyattn serve``'s flags (``--max-model-len`` is ``max_model_len``);
    ``lazyattn serve`` builds its configurations through this class too, so the two cannot drift."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: str | None = None
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"
    max_model_len: int | None = Field(default=None, ge=2)
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float | None = Field(default=None, gt=0, lt=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    anchor: str = CacheConfig().anchor
    cache_dir: str | None = None
    disk_cache: str | None = None
    redis_url: str | None = None
    learn_passages: bool = True
    enable_prefix_caching: bool = True
    recompute_chunk_head_tokens: int = Field(default=0, ge=0)
    replicas: int = Field(default=1, ge=1)
    gpus_per_replica: float | None = Field(default=None, ge=0)
    router: Literal["affinity", "default"] = "affinity"
    imbalanced_threshold: int = Field(default=8, ge=0)
    registry: str = "auto"
    ingress_replicas: int = Field(default=1, ge=1)
    max_logprobs: int = Field(default=20, ge=-1)
    health_timeout_s: float = Field(default=5.0, gt=0, le=3600)
    switch_interval_ms: float | None = Field(default=0.5, ge=0.01, le=100)  # None: Python's own
    api_key: list[str] = Field(default_factory=list)
    api_key_file: str | None = None
    allow_unauthenticated: bool = False
    allowed_origins: list[str] = Field(default_factory=list)
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])
    log_level: Literal["debug", "info", "warning", "error", "DEBUG", "INFO", "WARNING", "ERROR"] = "warning"

    def engine_config(self, base: EngineConfig | None = None) -> EngineConfig:
        """The replicas' :class:`EngineConfig`: ``base`` (``lazyattn serve``'s engine options) or
        this object's own engine fields (a disk tier only with ``disk_cache``), with the serving
        flags applied."""
        if base is None:
            base = EngineConfig(model=self.model, device=self.device, attention_backend=self.backend,
                                cache_dir=self.cache_dir, cache=CacheConfig(anchor=self.anchor, redis_url=self.redis_url,
                                                                            disk_dir=self.disk_cache))
        fraction = {"kv_cache_fraction": self.gpu_memory_utilization} if self.gpu_memory_utilization is not None else {}
        cache = dataclasses.replace(base.cache, kv_cache_dtype=self.kv_cache_dtype, learn_passages=self.learn_passages,
                                    prefix_caching=self.enable_prefix_caching,
                                    recompute_chunk_head_tokens=self.recompute_chunk_head_tokens, **fraction)
        scheduler = {k: v for k, v in (("max_num_seqs", self.max_num_seqs),
                                       ("max_num_batched_tokens", self.max_num_batched_tokens)) if v is not None}
        return dataclasses.replace(base, max_model_len=self.max_model_len, dtype=self.dtype, cache=cache,
                                   scheduler=dataclasses.replace(base.scheduler, **scheduler))

    def serve_config(self, **place):
        """The app's :class:`~lazyattn_rag.serve.config.ServeConfig`; ``place``: ``host``, ``port``
        and ``ray_address`` (``lazyattn serve``'s; Ray Serve's own tools place the app themselves)."""
        from lazyattn_rag.serve.config import ServeConfig, uses_cuda

        gpus = self.gpus_per_replica if self.gpus_per_replica is not None else float(uses_cuda(self.device))
        return ServeConfig(num_replicas=self.replicas, num_gpus_per_replica=gpus, router=self.router,
                           imbalanced_threshold=self.imbalanced_threshold, registry=self.registry,
                           num_ingress_replicas=self.ingress_replicas, max_logprobs=self.max_logprobs,
                           health_timeout_s=self.health_timeout_s, switch_interval_ms=self.switch_interval_ms,
                           api_keys=tuple(self.api_key), api_key_file=self.api_key_file,
                           allow_unauthenticated=self.allow_unauthenticated, served_model_name=self.served_model_name,
                           allowed_origins=tuple(self.allowed_origins), allowed_methods=tuple(self.allowed_methods),
                           allowed_headers=tuple(self.allowed_headers), log_level=self.log_level.upper(), **place)


def app(args: ServeArgs):
    """The Serve application for ``args`` (Ray Serve passes them validated as :class:`ServeArgs`).

    Raises:
        ValueError: a value the engine or server configuration refuses (named).
    """
    from lazyattn_rag.serve.app import build_app

    return build_app(args.engine_config(), args.serve_config())

