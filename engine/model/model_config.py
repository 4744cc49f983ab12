"""A model directory's transformers config and tokenizer, memoized under the cache dir.

Building transformers' config class and tokenizer costs a large part of a start-up; their
results (the config's public attributes, the tokenizer's files) are kept as JSON under
``<cache_dir>/resolved/``, keyed by the directory's files and the transformers version, and
read back on later starts. The real config object is loaded only where it is needed (the
self-check, :func:`transformers_config`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger(__name__)

RESOLVED_FORMAT = 1  # bump when the memo's content changes: every memo is then rebuilt


class ResolvedConfig(SimpleNamespace):
    """A model directory's transformers config as :func:`load_config_and_tokenizer` memoized it:
    every public attribute its config class gave it (defaults and ``attribute_map`` aliases
    included), without the class's methods. ``model_dir`` is the directory;
    :func:`transformers_config` loads the real object when one is needed (the self-check)."""


def load_config_and_tokenizer(path: Path, cache_dir: Path) -> tuple[Any, Any]:
    """transformers' config and tokenizer of a model directory, as ``AutoConfig`` and
    ``AutoTokenizer`` load them.

    The first load runs both and memoizes what they resolved under
    ``<cache_dir>/resolved/<key>.json``: the config's attributes and the tokenizer class
    ``AutoTokenizer`` chose. Later loads of the same files (key: the directory's file names,
    sizes and mtimes, and the transformers version) build a :class:`ResolvedConfig` from the memo
    and call that tokenizer class directly. That skips importing the config class's module, whose
    import chain (transformers' model registry, ``torch.distributed.tensor``, sympy) was a large
    part of a 2-core start (0.9 s; 0.15 s from the memo).
    A config whose RoPE frequencies come from transformers' own functions (any
    ``rope_type`` but ``default``) is never memoized: those functions need the real class.

    Returns:
        ``(config, tokenizer)``; the config is a :class:`ResolvedConfig` or transformers' own.
    """
    import transformers

    memo_path = cache_dir / "resolved" / f"{_resolution_key(path, transformers.__version__)}.json"
    try:
        memo = json.loads(memo_path.read_text())
        tokenizer_cls = _transformers_class(memo["tokenizer_class"])
        hf_config = ResolvedConfig(**memo["config"], model_dir=str(path))
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        memo = None
    if memo is not None:
        return hf_config, tokenizer_cls.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, config=hf_config)
    if _default_rope(hf_config):
        _write_json(memo_path, {"format": RESOLVED_FORMAT, "transformers": transformers.__version__,
                                "model_dir": str(path), "config": _config_attributes(hf_config),
                                "tokenizer_class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"})
    return hf_config, tokenizer


def transformers_config(hf_config: Any) -> Any:
    """transformers' own config object: ``hf_config`` itself, or for a :class:`ResolvedConfig`
    the one ``AutoConfig`` loads from its directory."""
    if not isinstance(hf_config, ResolvedConfig):
        return hf_config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_config.model_dir, local_files_only=True)


def _resolution_key(path: Path, transformers_version: str) -> str:
    from hashlib import sha256

    files = []
    for f in sorted(path.resolve().iterdir()):
        if f.is_file():
            stat = f.stat()
            files.append((f.name, stat.st_size, stat.st_mtime_ns))
    return sha256(json.dumps([RESOLVED_FORMAT, transformers_version, str(path.resolve()), files]).encode()).hexdigest()[:32]


def _config_attributes(hf_config: Any) -> dict[str, Any]:
    """Every attribute ``hf_config`` serializes (its class's defaults filled in), plus the
    aliases of its class's ``attribute_map`` (e.g. GPT-2's ``num_attention_heads`` for ``n_head``)."""
    attributes = json.loads(hf_config.to_json_string(use_diff=False))
    for alias in getattr(type(hf_config), "attribute_map", {}):
        attributes[alias] = getattr(hf_config, alias)
    attributes.pop("model_dir", None)
    return attributes


def _default_rope(hf_config: Any) -> bool:
    from lazyattn_rag.kernels.rope import RotaryEmbedding, UnsupportedRopeError

    try:
        return RotaryEmbedding.from_hf_config(hf_config).rope_type == "default"
    except (UnsupportedRopeError, AttributeError, KeyError, TypeError, ValueError):
        return False


def _transformers_class(qualified_name: str) -> type:
    """The class ``transformers.<module>.<name>`` (only transformers' own: the memo names it)."""
    import importlib

    module, _, name = qualified_name.rpartition(".")
    if not module.startswith("transformers."):
        raise ImportError(f"{qualified_name!r} is not a transformers class")
    return getattr(importlib.import_module(module), name)


def _write_json(path: Path, data: dict) -> None:
    """Write ``data`` atomically; a cache directory that cannot hold it costs only the memo."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as error:
        logger.info("cannot save %s (%s): transformers' config and tokenizer load in full next time", path, error)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


