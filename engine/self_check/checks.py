"""Start-up self-check: a model whose positions we would compute wrongly must not serve.

Deferred RoPE is only as right as our rotary tables and the K/V path that moves a cached
chunk to its offset. Both are compared at start-up with transformers, the independent
reference (``docs/architecture.md``, "Start-up self-check"):

* **rotary** (every start with an HF config, about a millisecond): transformers' own rotary
  module of the model's architecture (``LlamaRotaryEmbedding``, ``Qwen2RotaryEmbedding``, ...,
  built from the config, no weights) and its ``apply_rotary_pos_emb`` encode probe vectors at
  positions 0, 1, 17, 4095, ``max_position_embeddings - 1``, 2^20 - 1 and 2^24 - 1; the
  model's :class:`~lazyattn_rag.kernels.rope.RotaryEmbedding` must encode them the same way,
  and its pure rotation ``R_delta`` must move a vector encoded at ``j`` to where transformers
  encodes it at ``j + delta`` (and back), for offsets up to the model's context length.
* **logits** (model directories whose float32 copy fits :func:`~lazyattn_rag.engine.self_check.logits.reference_budget_bytes`): a
  real request on a small probe engine that shares the loaded model (its device, dtype and
  attention backend): a head, one document chunk encoded alone (anchor ``none``), warmed
  first so the request reads it from the cache at offset ``delta = len(head) != 0``, a
  question tail and :data:`PROBE_TOKENS` greedy tokens. transformers runs the same token ids
  in one forward pass with normal position ids and a 4D mask in which the document attends
  only to itself (it was encoded alone) and every other token causally to everything before
  it. Every sampled row's full logits are compared. Cache modes without chunk reuse
  (``full``, ``prefix``) probe a plain prompt instead.

A passing verdict is written to ``<cache_dir>/self_check/<key>.json``; the key covers the
model fingerprint (weights, dtype, RoPE, tokenizer, block size), :data:`CHECK_VERSION`, the
package, transformers and torch versions, the device type, the attention backend and
whether chunks are reused, so the check runs once per model and code version. A failure is
never cached: it raises :class:`~lazyattn_rag.types.errors.SelfCheckError` naming what differed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from lazyattn_rag.engine.self_check.logits import REUSE_MODES, check_logits
from lazyattn_rag.engine.self_check.rotary import check_rotary
from lazyattn_rag.types.config import EngineConfig
from lazyattn_rag.types.errors import SelfCheckError

logger = logging.getLogger(__name__)

CHECK_VERSION = 1  # bump when the check changes: every cached verdict is then re-checked


def run_self_check(engine, hf_config: Any, config: EngineConfig, model_dir: Path | None = None) -> str:
    """Self-check a freshly built engine.

    Args:
        engine: the :class:`~lazyattn_rag.engine.engine.LLMEngine` just built (model on its device).
        hf_config: the model's transformers config; ``None`` skips the check (nothing to compare with).
        config: the engine configuration (``self_check``, ``cache_dir``, cache mode).
        model_dir: the model's directory: enables the logits part and the cached verdict. Without
            it (``LazyAttention.from_model``) only the rotary part runs, every time.
    Returns:
        What ran: ``"off"`` (``EngineConfig.self_check=False`` or no config), ``"rotary"`` (no
        directory: the rotary part), ``"cached"`` (a cached passing verdict, nothing ran) or
        ``"ran"`` (both parts ran now and the verdict was cached: the first start of a model).
    Raises:
        SelfCheckError: our positions differ from transformers' (the message says where and by
            how much, and how to proceed).
    """
    if not config.self_check or hf_config is None:
        return "off"
    if model_dir is None:
        report = {"rotary": check_rotary(engine.runner.model.rotary, hf_config)}
        _raise_on_failure(report, hf_config, engine, config)
        return "rotary"
    path = verdict_path(engine, config)
    if read_verdict(path) is not None:
        return "cached"
    from lazyattn_rag.engine.model.model_config import transformers_config

    hf_config = transformers_config(hf_config)  # the real class: the check builds transformers' rotary from it
    # Shown (the CLI configures no logging: warnings reach stderr) because it makes this start slower.
    logger.warning("first start of this model: checking its positions against transformers once "
                   "(a few seconds on a CPU; later starts read the verdict from %s)", path.parent)
    start = time.perf_counter()
    report: dict[str, Any] = {"rotary": check_rotary(engine.runner.model.rotary, hf_config)}
    report["rotary"]["seconds"] = round(time.perf_counter() - start, 4)
    if report["rotary"]["passed"]:
        report["logits"] = check_logits(engine, Path(model_dir))
    report["seconds"] = round(time.perf_counter() - start, 3)
    _raise_on_failure(report, hf_config, engine, config)
    write_verdict(path, verdict_key(engine, config), report)
    logger.info("self-check passed in %.2f s (verdict cached in %s)", report["seconds"], path)
    return "ran"


# --- verdict cache ---------------------------------------------------------------------------
def verdict_key(engine, config: EngineConfig) -> dict:
    """What a cached verdict is valid for (JSON-able)."""
    from importlib.metadata import version

    import transformers

    return {
        "check_version": CHECK_VERSION,
        "package": version("lazyattn-rag"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model": engine.model_digest,
        "device": engine.runner.device.type,
        "backend": engine.runner.backend.name,
        "reuse": config.cache.mode in REUSE_MODES,
    }


def verdict_path(engine, config: EngineConfig) -> Path:
    """``<cache_dir>/self_check/<sha256 of the verdict key, 32 hex digits>.json``."""
    key = json.dumps(verdict_key(engine, config), sort_keys=True)
    return config.resolved_cache_dir() / "self_check" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def read_verdict(path: Path) -> dict | None:
    """The cached passing verdict at ``path``, or ``None`` (absent, unreadable or not a pass)."""
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and verdict.get("passed") is True else None


def write_verdict(path: Path, key: dict, report: dict) -> None:
    """Write a passing verdict atomically (a temporary file renamed over the target). A cache dir
    that cannot hold it (read-only, or a file where a folder should be) costs only the cache:
    the check runs again next time, and a warning says why."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"passed": True, "key": key, "report": report,
                                   "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1))
        tmp.replace(path)
    except OSError as error:
        logger.warning("the self-check passed but its verdict cannot be saved in %s (%s); it will run again "
                       "at the next start", path.parent, error)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


# --- the error --------------------------------------------------------------------------------
def _raise_on_failure(report: dict, hf_config: Any, engine, config: EngineConfig) -> None:
    failed = {part: r for part, r in report.items() if isinstance(r, dict) and not r.get("passed", True)}
    if not failed:
        return
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    lines = [(f"start-up self-check failed: this model's positions differ from transformers' (model_type "
              f"{getattr(hf_config, 'model_type', None)!r}, rope {rope!r}, head_dim "
              f"{engine.runner.model.rotary.head_dim}, max_position_embeddings "
              f"{getattr(hf_config, 'max_position_embeddings', None)}), so cached chunks would be placed at "
              "silently wrong positions and the engine refuses to start.")]
    lines += [f"- {part}: {r['problem']}" for part, r in failed.items()]
    if "rotary" in failed:
        lines.append("To proceed: fix the model's RoPE configuration (config.json) or report it as unsupported; "
                     "EngineConfig(self_check=False) skips this check at your own risk (every position, not only "
                     "cached chunks, would then differ from transformers).")
    else:
        lines.append("To proceed: CacheConfig(mode='full') serves without chunk reuse (the check then probes a "
                     "plain prompt), another attention_backend may not have the fault, or EngineConfig("
                     "self_check=False) skips this check at your own risk.")
    raise SelfCheckError("\n".join(lines), report)
