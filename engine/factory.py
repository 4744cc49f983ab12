"""Building an :class:`LLMEngine` from an :class:`EngineConfig` (or an in-memory model).

The factory resolves and loads the model (``engine/model/model_loading.py``), picks the device,
dtype and attention backend, sizes the KV cache, builds the runner, the chunk cache and the
engine, captures CUDA graphs when asked, and runs the start-up self-check
(``engine/self_check/checks.py``). Each part is timed (:class:`Startup`). It runs on the engine
thread (``engine/loop.py``), so loading and every forward pass share one thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from lazyattn_rag.engine.worker.attention import get_backend_class
from lazyattn_rag.engine.kv.block_pool import BlockPool
from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.tiers.chunk_store import HostMemoryStore
from lazyattn_rag.engine.tiers.disk_store import DiskStore
from lazyattn_rag.engine.tiers.host_arena import HostArena
from lazyattn_rag.engine.tiers.chunk_tiers import ChunkTiers
from lazyattn_rag.engine.worker.cuda_graphs import graph_batch_sizes, graph_block_table_width
from lazyattn_rag.engine.engine import LLMEngine
from lazyattn_rag.engine.kv.eviction import make_policy
from lazyattn_rag.engine.planning.fingerprint import ModelFingerprint, tensors_sha256
from lazyattn_rag.engine.model.transformer import CausalLM, ModelArchConfig
from lazyattn_rag.engine.model.packed_linear import onednn_available, pack_linears, unpack_linears
from lazyattn_rag.engine.kv.kv_layout import KVLayout
from lazyattn_rag.engine.worker.runner import ModelRunner
from lazyattn_rag.engine.self_check.checks import run_self_check
from lazyattn_rag.kernels.launch import ChunkScaling
from lazyattn_rag.kernels.rope import RotaryEmbedding
from lazyattn_rag.types.config import CacheConfig, EngineConfig
from lazyattn_rag.types.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_BYTES = 512 * 2**20


class Startup:
    """Milliseconds of the named parts of an engine's start-up, lap by lap."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.parts: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = round((now - self.last) * 1e3, 1)
        self.last = now

    def summary(self, self_check: str) -> dict:
        return {"startup_ms": round((time.perf_counter() - self.start) * 1e3, 1),
                "startup_parts_ms": dict(self.parts), "self_check": self_check}


def build_engine(config: EngineConfig) -> LLMEngine:
    """Load ``config.model`` and build its engine (see the module docstring).

    Returns:
        the engine, with ``default_sampling`` (the model's generation config under
        ``generation_config="auto"``), ``info`` and ``startup`` set.
    Raises:
        FileNotFoundError, ValueError: the model cannot be found or loaded (named).
        SelfCheckError: the model computes different logits here than in transformers.
        CacheCapacityError: ``max_model_len`` does not fit the KV cache.
    """
    clock = Startup()
    with _collect_once():
        import transformers  # noqa: F401  (its top level only, timed on its own)

        from lazyattn_rag.engine.model.model_config import load_config_and_tokenizer
        from lazyattn_rag.engine.model.model_loading import (
            declared_eos_token_ids,
            generation_defaults,
            load_state_dict,
            resolve_model,
        )

        clock.lap("import_transformers")
        source = resolve_model(config.model, config.resolved_cache_dir())
        clock.lap("resolve_model")
        hf_config, tokenizer = load_config_and_tokenizer(source.path, config.resolved_cache_dir())
        clock.lap("config_tokenizer")
        model = CausalLM.from_hf_state_dict(ModelArchConfig.from_hf_config(hf_config),
                                            RotaryEmbedding.from_hf_config(hf_config), load_state_dict(source.path))
        clock.lap("weights")
        engine = _assemble(model, tokenizer, config, source.weights_sha256, source.name,
                           declared_eos_token_ids(source.path), hf_config, clock)
        if config.generation_config == "auto":
            engine.default_sampling = SamplingParams(**generation_defaults(source.path))
        check = run_self_check(engine, hf_config, config, source.path)  # refuses a model with wrong positions
        clock.lap("self_check")
    clock.lap("collect_garbage")
    engine.startup = clock.summary(self_check=check)
    return engine


def build_engine_from_model(model: CausalLM, tokenizer: Any, config: EngineConfig, name: str = "in-memory",
                            hf_config: Any = None, weights_sha256: str | None = None) -> LLMEngine:
    """Build an engine over an already-built :class:`CausalLM` (tests, custom loading).

    The weights' hash goes into the model fingerprint that keys the cached K/V: it is computed
    from ``model.state_dict()`` (every weight copied to the host and hashed) unless
    ``weights_sha256`` (a hex digest from :func:`~lazyattn_rag.engine.planning.fingerprint.tensors_sha256`)
    is given; pass it when wrapping the same large model more than once. The self-check covers
    the rotary embedding only (there is no model directory to compare with).
    """
    from lazyattn_rag.engine.model.model_loading import token_ids_of

    clock = Startup()
    with _collect_once():
        digest = weights_sha256 or tensors_sha256(model.state_dict())
        clock.lap("weights_hash")
        eos = token_ids_of(getattr(hf_config, "eos_token_id", None))
        engine = _assemble(model, tokenizer, config, digest, name, eos, hf_config, clock)
        check = run_self_check(engine, hf_config, config)
        clock.lap("self_check")
    clock.lap("collect_garbage")
    engine.startup = clock.summary(self_check=check)
    return engine


def _assemble(model: CausalLM, tokenizer: Any, config: EngineConfig, weights_sha256: str, name: str,
              eos_ids: set[int], hf_config: Any, clock: Startup) -> LLMEngine:
    """Move the model to its device and build runner, cache and engine; ``clock`` times the parts
    ``kv_cache`` (device move, KV tensors), ``cuda_graphs`` (when captured) and ``engine_init``
    (prompt template, the anchor's encode: the first forward pass)."""
    device = _resolve_device(config.device)
    dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype, arch = DTYPES[dtype_name], model.config
    model = model.to(device=device, dtype=dtype).eval()
    _set_weight_packing(model, config.cpu_weight_packing and not config.torch_compile and device.type == "cpu"
                        and dtype == torch.float32 and onednn_available())
    window = getattr(hf_config, "sliding_window", None) if hf_config is not None else None
    limit = arch.max_position_embeddings if not window else min(window, arch.max_position_embeddings)
    max_model_len, block_size = min(config.max_model_len or limit, limit), config.cache.block_size
    backend = _make_backend(config.attention_backend, device, model, config.cache)
    if reason := backend.kv_cache_dtype_error(config.cache.kv_cache_dtype, device):
        raise ValueError(f"{reason}, not {config.cache.kv_cache_dtype!r}")
    layout = KVLayout.for_model(arch, block_size, dtype, config.cache.kv_cache_dtype)
    block_bytes = layout.bytes_per_block
    num_blocks = config.cache.num_blocks or max(1, _kv_budget(config, device) // block_bytes)
    runner = ModelRunner(model, backend, layout, num_blocks, device)
    clock.lap("kv_cache")
    if config.torch_compile:
        runner.enable_torch_compile()
    if config.cuda_graphs and device.type == "cuda" and backend.supports_cuda_graphs:
        runner.enable_cuda_graphs(graph_batch_sizes(config.scheduler.max_num_seqs),
                                  graph_block_table_width(max_model_len, block_size))
        clock.lap("cuda_graphs")
    fingerprint = ModelFingerprint(weights_sha256, dtype_name, json.dumps(model.rotary.fingerprint(), sort_keys=True),
                                   _tokenizer_sha256(tokenizer), block_size, layout.format_name())
    cache = ChunkCache(BlockPool(num_blocks), block_size, make_policy(config.cache.eviction_policy))
    tiers = build_tiers(config.cache, fingerprint.digest(), layout, device)
    engine = LLMEngine(runner, cache, tokenizer, fingerprint.digest(), config, max_model_len, eos_ids, tiers)
    engine.fingerprint = fingerprint
    engine.info = {"model": name, "model_type": arch.model_type, "device": str(device),
                   "dtype": dtype_name, "kv_cache_dtype": layout.kv_cache_dtype, "attention_backend": backend.name,
                   "block_bytes": block_bytes}
    clock.lap("engine_init")
    return engine


def build_tiers(cache: CacheConfig, model_digest: str, layout: KVLayout,
                device: torch.device | str = "cpu") -> ChunkTiers | None:
    """The storage tiers ``cache`` configures, fastest first (``None`` when none is), for a KV
    pool of ``layout`` on ``device`` (a stored chunk of another layout is refused as corrupt).
    The host tier's arena is allocated here, whole (pinned on a GPU), in pages of one block's
    keys (``layout.bytes_per_block / 2``).

    Raises:
        ImportError: ``redis_url`` is set but redis-py is not installed (the ``redis`` extra).
        ValueError: ``host_memory_bytes`` is set below two pages.
    """
    tiers: list = []
    page_bytes, bytes_per_token = layout.bytes_per_block // 2, layout.bytes_per_token
    if cache.host_memory_bytes:
        arena = HostArena(cache.host_memory_bytes, page_bytes, pin=torch.device(device).type == "cuda") \
            if cache.host_memory_bytes >= 2 * page_bytes else None
        if arena is None or arena.num_pages < 2:
            raise ValueError(f"CacheConfig.host_memory_bytes={cache.host_memory_bytes} holds no chunk: the host tier "
                             f"keeps K/V in pages of one block's keys ({page_bytes} bytes), at least 2 per chunk")
        tiers.append(HostMemoryStore(arena.capacity_bytes, make_policy(cache.tier_eviction_policy), arena))
    if cache.disk_dir:
        tiers.append(DiskStore(Path(cache.disk_dir).expanduser(), cache.disk_bytes,
                               make_policy(cache.tier_eviction_policy)))
    if cache.redis_url:
        from lazyattn_rag.engine.tiers.redis_store import RedisStore

        tiers.append(RedisStore(cache.redis_url, ttl_seconds=cache.redis_ttl_seconds))
    return ChunkTiers(tiers, model_digest, bytes_per_token, device=device,
                      always_load=cache.tier_loads == "always", layout=layout) if tiers else None


def describe(engine: LLMEngine) -> dict:
    """Model, backend and cache configuration of ``engine`` as a JSON-able dict (on its thread).

    ``tiers``: each storage tier below the KV pool, fastest first: where it keeps chunks, its
    budget (``None`` for a server's own) and whether it answers.

    ``cached_chunks`` splits ``num_cached_chunks`` into the chunks an engine caches before any
    document is named, the anchor (what every document chunk is encoded after; pinned from
    start-up) and the prompt head (the template's text before the documents, cached by the
    first question and shared by all), and the documents'.
    """
    config, cache, info, planner = engine.config, engine.cache, engine.info, engine.planner
    keys = {e.key for e in cache.entries()}
    anchors = int(planner.anchor_key in keys)
    heads = int(planner.head_key in keys and planner.head_key != planner.anchor_key)
    return {
        **{k: info[k] for k in ("model", "model_type", "device", "dtype", "kv_cache_dtype", "attention_backend")},
        "max_model_len": engine.max_model_len,
        "default_sampling": {k: v for k, v in dataclasses.asdict(engine.default_sampling).items()
                             if v != getattr(SamplingParams(), k)},
        "block_size": cache.block_size,
        "num_blocks": cache.pool.num_blocks,
        "kv_cache_bytes": cache.pool.num_blocks * info["block_bytes"],
        "anchor": config.cache.anchor,
        "anchor_tokens": len(planner.anchor_ids),
        "prompt_head_tokens": len(planner.head_ids),
        "eviction_policy": config.cache.eviction_policy,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "num_documents": len(engine.documents),
        "num_cached_chunks": cache.num_entries,
        "cached_chunks": {"anchor": anchors, "prompt_head": heads, "documents": cache.num_entries - anchors - heads},
        "num_free_blocks": cache.pool.num_free,
        "num_evictions": cache.num_evictions,
        "tiers": {t.name: {"location": str(getattr(t, "directory", "") or getattr(t, "location", "process memory")),
                           "capacity_bytes": t.capacity_bytes, "available": t.available}
                  for t in (engine.tiers.tiers if engine.tiers is not None else [])},
    }


@contextlib.contextmanager
def _collect_once():
    """Pause the cyclic garbage collector while an engine builds, then collect once.

    Building imports transformers and loads the model and tokenizer: tens of thousands of new
    long-lived objects, for which CPython would run several full collections of the whole heap.
    One collection at the end frees the same garbage and resets the collector's count, so the
    next full one is not due in the first request. The collector's state is restored (it stays
    off if it was off).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect()


def _tokenizer_sha256(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, getattr(tokenizer, "chat_template", None)])
    return hashlib.sha256((text + extra).encode()).hexdigest()


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _kv_budget(config: EngineConfig, device: torch.device) -> int:
    if config.cache.kv_cache_bytes is not None:
        return config.cache.kv_cache_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (config.cache.kv_cache_fraction or 0.4))
    return CPU_DEFAULT_KV_BYTES


def _set_weight_packing(model: CausalLM, packed: bool) -> None:
    """Pack the layers' linear weights for oneDNN, or make them dense again (a model shared by
    engines of other settings; ``engine/model/packed_linear.py``)."""
    if packed:
        pack_linears(model)
    else:
        unpack_linears(model)


def _make_backend(name: str, device: torch.device, model: CausalLM, cache: CacheConfig = CacheConfig()):
    """The attention backend (with the cache's chunk attention scaling); ``auto`` (triton on CUDA,
    torch elsewhere) falls back to ``torch`` for head layouts the kernels do not cover."""
    arch, auto = model.config, name == "auto"
    if auto:
        name = "triton" if device.type == "cuda" else "torch"
    args = (model.rotary, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5,
            ChunkScaling(cache.chunk_attention_temperature, cache.chunk_attention_weight))
    try:
        return get_backend_class(name)(*args)
    except NotImplementedError:
        if not auto:
            raise
        logger.warning("the triton kernels do not cover head_dim %d / rotary_dim %d: using the torch backend",
                       arch.head_dim, model.rotary.rotary_dim)
        return get_backend_class("torch")(*args)
