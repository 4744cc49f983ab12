"""Options shared by the CLI commands (``lazyattn ask``, ``info``, ``chat``) and their engine config."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperCommand, TyperGroup

from lazyattn_rag.types.config import ANCHOR_MODES, CacheConfig, EngineConfig
from lazyattn_rag.types.sampling_params import CHAT_LOOP_GUARD_NGRAM

MODEL = typer.Option(None, help="A local Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3) or a .gguf "
                     "file, converted once (default: the offline SmolLM2-135M-Instruct).")
DEVICE = typer.Option("auto", help="auto, cpu or cuda.")
BACKEND = typer.Option("auto", help="Attention backend: auto, torch or triton.")
ANCHOR = typer.Option(CacheConfig().anchor, help=f"Chunk encoding anchor: one of {', '.join(ANCHOR_MODES)}.")
# Help as click prints it (argparse's layout, as ``vllm serve --help``): typer's rich panels cut
# long option names short in an 80-column terminal ("--served-model-n…").
HELP_MARKUP = None
# An empty metavar shows a boolean flag as the flag it is ("--json", not "--json BOOLEAN").
FLAG = ""


class _FlagHelp:
    """``--help`` shown as the flag it is: typer gives its built-in help option no metavar, so
    its rich help prints ``--help <bool>``."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = FLAG
        return option


class Group(_FlagHelp, TyperGroup):
    """The ``lazyattn`` command group (``typer.Typer(cls=Group)``)."""


class Command(_FlagHelp, TyperCommand):
    """A ``lazyattn`` command (``app.command(cls=Command)``)."""




# Storage tiers below the KV cache (docs/architecture.md, "Storage tiers"). The commands keep
# computed document chunks on disk by default, so a second run (or `lazyattn cache warm`) loads
# them instead of computing them again (SmolLM2 on a 2-core CPU: a 512-token chunk loads from disk in
# 47.7 ms, recomputing it takes 892 ms).
DEFAULT_DISK_CACHE_BYTES = "2GiB"
DISK_CACHE = typer.Option(None, "--disk-cache", metavar="DIR",
                          help="Where computed document chunks are kept for later runs (default: chunks/ under the "
                               "cache dir).")
NO_DISK_CACHE = typer.Option(False, "--no-disk-cache", metavar=FLAG, help="Keep no chunks on disk.")
DISK_CACHE_BYTES = typer.Option(DEFAULT_DISK_CACHE_BYTES, "--disk-cache-bytes", metavar="SIZE",
                                help="Budget of the disk cache, e.g. 500MiB or 4GiB; the least recently used go.")
HOST_CACHE_BYTES = typer.Option("0", "--host-cache-bytes", metavar="SIZE",
                                help="Budget of a host-memory tier for chunks evicted from the KV cache (default "
                                     "0: off).")
REDIS_URL = typer.Option(None, "--redis-url", metavar="URL",
                         help="A Redis server shared by processes and machines, e.g. redis://localhost:6379/0 "
                              "(needs the redis extra).")
KV_CACHE_DTYPE = typer.Option("auto", "--kv-cache-dtype", metavar="DTYPE",
                              help="The stored K/V's type: auto (the model's dtype), fp8 (= fp8_e4m3) or fp8_e5m2: "
                                   "one byte a value plus a float32 scale per token and KV head, about twice the "
                                   "documents in the same memory (docs/quality.md has what it costs in fidelity).")
RECOMPUTE_HEAD = typer.Option(0, "--recompute-chunk-head-tokens", min=0, metavar="K",
                              help="Compute the first K tokens of each placed document in the request (chunk-head "
                                   "recompute): answers closer to full attention for K more tokens of prefill "
                                   "per document (default 0: plain reuse; docs/quality.md).")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(text: str, what: str) -> int:
    """``"2GiB"`` -> 2147483648 (B, kB/KiB, MB/MiB, GB/GiB, TB/TiB; case-insensitive; a plain number is bytes).

    Raises:
        ValueError: not a size (the message names the option ``what``).
    """
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{what} must be a size such as 512MiB or 4GiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def tier_settings(cache_dir: Optional[Path], disk_cache: Optional[Path], no_disk_cache: bool,
                  disk_cache_bytes: str, host_cache_bytes: str, redis_url: Optional[str]) -> dict:
    """The :class:`CacheConfig` fields the tier options set (the disk tier under the cache dir unless
    ``--no-disk-cache``). Raises ``ValueError`` for a malformed size or URL."""
    settings = {"host_memory_bytes": parse_bytes(host_cache_bytes, "--host-cache-bytes"), "redis_url": redis_url}
    if not no_disk_cache:
        root = EngineConfig(cache_dir=cache_dir).resolved_cache_dir()
        settings.update(disk_dir=str(disk_cache or root / "chunks"),
                        disk_bytes=parse_bytes(disk_cache_bytes, "--disk-cache-bytes"))
    CacheConfig(**settings)  # validates now, before any model loads
    return settings


def engine_config(model: Optional[str], device: str, backend: str, anchor: str,
                  cache_dir: Optional[Path], tiers: dict | None = None) -> EngineConfig:
    """The :class:`EngineConfig` the shared options describe (``tiers``: :func:`tier_settings`).

    Raises:
        FileNotFoundError: ``model`` is neither a ``.gguf`` file nor a directory with a
            ``config.json`` (checked now, before documents are embedded or anything loads).
    """
    if model is not None:
        path = Path(model).expanduser()
        if not (path.is_file() and path.suffix.lower() == ".gguf") and not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {model!r} is not a .gguf file or a local model directory with a "
                                    "config.json (no model hub is used)")
    return EngineConfig(model=model, device=device, attention_backend=backend, cache_dir=cache_dir,
                        cache=CacheConfig(anchor=anchor, **(tiers or {})))


@dataclass(frozen=True)
class EngineOptions:
    """The model, device and cache options of every command that loads the model (see
    :func:`with_engine_options`); the fields are the options' values."""

    model: Optional[str] = None
    device: str = "auto"
    backend: str = "auto"
    anchor: str = CacheConfig().anchor
    cache_dir: Optional[Path] = None
    disk_cache: Optional[Path] = None
    no_disk_cache: bool = False
    disk_cache_bytes: str = DEFAULT_DISK_CACHE_BYTES
    host_cache_bytes: str = "0"
    redis_url: Optional[str] = None
    recompute_chunk_head_tokens: int = 0
    kv_cache_dtype: str = "auto"

    def config(self, **cache_fields) -> EngineConfig:
        """The :class:`EngineConfig` they describe, with ``cache_fields`` set on its ``CacheConfig``.

        Raises:
            ValueError: a malformed size or URL; FileNotFoundError: no such model (both checked
            before anything loads).
        """
        tiers = tier_settings(self.cache_dir, self.disk_cache, self.no_disk_cache, self.disk_cache_bytes,
                              self.host_cache_bytes, self.redis_url)
        remedy = {"recompute_chunk_head_tokens": self.recompute_chunk_head_tokens, "kv_cache_dtype": self.kv_cache_dtype}
        return engine_config(self.model, self.device, self.backend, self.anchor, self.cache_dir,
                             tiers | remedy | cache_fields)


def _engine_option_params(cache_dir_help: str, host_tier: bool) -> list[inspect.Parameter]:
    options = {"model": (Optional[str], MODEL), "device": (str, DEVICE), "backend": (str, BACKEND),
               "anchor": (str, ANCHOR), "cache_dir": (Optional[Path], typer.Option(None, help=cache_dir_help)),
               "disk_cache": (Optional[Path], DISK_CACHE), "no_disk_cache": (bool, NO_DISK_CACHE),
               "disk_cache_bytes": (str, DISK_CACHE_BYTES), "host_cache_bytes": (str, HOST_CACHE_BYTES),
               "redis_url": (Optional[str], REDIS_URL), "recompute_chunk_head_tokens": (int, RECOMPUTE_HEAD),
               "kv_cache_dtype": (str, KV_CACHE_DTYPE)}
    if not host_tier:
        del options["host_cache_bytes"]
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
            for name, (kind, option) in options.items()]


def with_engine_options(cache_dir_help: str = "Where converted models are cached.", host_tier: bool = True,
                        after: tuple[str, ...] = ()):
    """Give a command the :class:`EngineOptions` options (``--model``, ``--device``, ... ``--redis-url``):
    typer sees them as the command's own, after its other parameters but before those named in
    ``after``; the command receives them as one ``engine: EngineOptions`` argument.
    ``host_tier=False`` leaves ``--host-cache-bytes`` out."""
    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)  # typer passes every value by name
               for p in signature.parameters.values() if p.name != "engine"]
        added = _engine_option_params(cache_dir_help, host_tier)
        names = [p.name for p in added]

        @functools.wraps(command)
        def run(**kwargs):
            return command(**{k: v for k, v in kwargs.items() if k not in names},
                           engine=EngineOptions(**{k: kwargs[k] for k in names}))

        params = [p for p in own if p.name not in after] + added + [p for p in own if p.name in after]
        run.__signature__ = signature.replace(parameters=params)
        run.__annotations__ = {p.name: p.annotation for p in params} | {"return": signature.return_annotation}
        return run

    return decorate


TEMPERATURE = typer.Option(None, help="Sampling temperature, 0 for greedy (default: the model's recommended, from "
                                      "its generation config; SmolLM2: 0.2).")
TOP_P = typer.Option(None, "--top-p", help="Nucleus sampling mass in (0, 1] (default: the model's).")
REPETITION_PENALTY = typer.Option(None, "--repetition-penalty",
                                  help="> 1 discourages repeating tokens (default: the model's, usually 1).")
LOOP_GUARD = typer.Option(CHAT_LOOP_GUARD_NGRAM, "--loop-guard", min=0, metavar="N",
                          help="End an answer before it repeats a run of N tokens it already said (0: off).")


def sampling_overrides(temperature: Optional[float], top_p: Optional[float], repetition_penalty: Optional[float],
                       **fixed) -> dict:
    """The sampling fields the user set on the command line, plus ``fixed`` ones (e.g. ``max_tokens``);
    the rest stay the model's recommended ones.

    Raises:
        ValueError: a value out of range (checked now, before any model loads).
    """
    from lazyattn_rag.types.sampling_params import SamplingParams

    overrides = {k: v for k, v in (("temperature", temperature), ("top_p", top_p),
                                   ("repetition_penalty", repetition_penalty)) if v is not None}
    overrides.update(fixed)
    SamplingParams(**overrides)  # validates
    return overrides


def with_overrides(default, overrides: dict):
    """``default`` (a :class:`SamplingParams`, the model's) with the user's ``overrides``."""
    import dataclasses

    return dataclasses.replace(default, **overrides)
