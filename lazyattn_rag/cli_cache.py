"""``lazyattn cache info | clear | warm``: the storage tiers below the KV cache, from the shell.

``info`` and ``clear`` load no model: they read the disk tier's directory and the Redis
server's keys. ``warm`` loads the model and the chatbot's corpus (``--docs`` as ``lazyattn
chat``) and computes every chunk into the disk tier (and Redis, if given), so a later
``lazyattn chat`` loads them instead of computing them.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from lazyattn_rag import cli_options as cli_opts

app = typer.Typer(add_completion=False, no_args_is_help=True, cls=cli_opts.Group, rich_markup_mode=cli_opts.HELP_MARKUP,
                  help="Inspect, clear or fill the chunk caches below the KV cache (disk, Redis).")
CACHE_DIR = typer.Option(None, help="The cache dir whose chunks/ folder is the default disk cache.")
_NO_LIMIT = 1 << 62  # opening a directory to read or clear it must evict nothing


def _disk_dir(cache_dir: Optional[Path], disk_cache: Optional[Path]) -> Path:
    return Path(cli_opts.tier_settings(cache_dir, disk_cache, False, "1", "0", None)["disk_dir"])


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def disk_summary(directory: Path) -> dict:
    """Chunks, bytes and chunks per model digest (first 12 hex digits) of a disk tier's directory."""
    from lazyattn_rag.engine.tiers.chunk_format import CorruptChunkError, read_metadata
    from lazyattn_rag.engine.tiers.chunk_store import SUFFIX

    files = sorted(directory.glob(f"*{SUFFIX}")) if directory.is_dir() else []
    models: Counter = Counter()
    for f in files:
        try:
            models[read_metadata(f).get("model", "?")[:12]] += 1
        except (CorruptChunkError, OSError):
            models["unreadable"] += 1
    return {"location": str(directory), "num_chunks": len(files),
            "num_bytes": sum(f.stat().st_size for f in files), "chunks_by_model": dict(models)}


def redis_summary(url: str) -> dict:
    """Chunks and bytes under the project's key prefix on a Redis server (``available`` false if down)."""
    from lazyattn_rag.engine.tiers.redis_store import RedisStore

    store = RedisStore(url)
    try:
        keys = store.keys()
        return {"location": store.location, "available": store.available, "num_chunks": len(keys),
                "num_bytes": store.num_bytes}
    finally:
        store.close()


def _each_tier(cache_dir: Optional[Path], disk_cache: Optional[Path], redis_url: Optional[str],
               on_disk: Callable[[Path], Any], on_redis: Callable[[str], Any]) -> dict[str, Any]:
    """``{"disk": on_disk(directory), "redis": on_redis(url)}`` (Redis only with ``redis_url``);
    a tier's ``ValueError``, ``ImportError`` or ``OSError`` ends the command with its message and
    what the tiers before it gave (e.g. the disk chunks deleted before Redis failed)."""
    out: dict[str, Any] = {}
    try:
        out["disk"] = on_disk(_disk_dir(cache_dir, disk_cache))
        if redis_url:
            out["redis"] = on_redis(redis_url)
    except (ValueError, ImportError, OSError) as e:
        done = f" (before it, disk: {json.dumps(out['disk'])})" if out else ""
        raise _fail(f"{e}{done}") from e
    return out


@app.command(cls=cli_opts.Command)
def info(
    cache_dir: Optional[Path] = CACHE_DIR,
    disk_cache: Optional[Path] = cli_opts.DISK_CACHE,
    redis_url: Optional[str] = cli_opts.REDIS_URL,
) -> None:
    """Print what the disk cache (and a Redis server, with --redis-url) holds, as JSON."""
    typer.echo(json.dumps(_each_tier(cache_dir, disk_cache, redis_url, disk_summary, redis_summary), indent=2))


@app.command(cls=cli_opts.Command)
def clear(
    cache_dir: Optional[Path] = CACHE_DIR,
    disk_cache: Optional[Path] = cli_opts.DISK_CACHE,
    redis_url: Optional[str] = cli_opts.REDIS_URL,
) -> None:
    """Delete every chunk in the disk cache (and this project's keys on a Redis server, with --redis-url)."""
    counts = _each_tier(cache_dir, disk_cache, redis_url, _clear_disk, _clear_redis)
    typer.echo(", ".join(f"{tier}: {n} chunks deleted" for tier, n in counts.items()))


def _clear_disk(directory: Path) -> int:
    from lazyattn_rag.engine.tiers.disk_store import DiskStore

    return DiskStore(directory, _NO_LIMIT).clear() if directory.is_dir() else 0


def _clear_redis(url: str) -> int:
    from lazyattn_rag.engine.tiers.redis_store import RedisStore

    store = RedisStore(url)
    try:
        count = store.clear()
        if not store.available:
            raise ValueError(f"the Redis server at {store.location} did not answer; nothing deleted there")
        return count
    finally:
        store.close()


@app.command(cls=cli_opts.Command)
@cli_opts.with_engine_options("Where converted models, indexes and chunks are cached.", host_tier=False)
def warm(
    docs: Optional[Path] = typer.Option(None, "--docs", metavar="PATH", help="As lazyattn chat --docs (default: "
                                        "Python's language reference)."),
    engine: cli_opts.EngineOptions = cli_opts.EngineOptions(),
) -> None:
    """Compute the chatbot's corpus (or --docs) into the disk cache and Redis, for lazyattn chat to load."""
    try:
        from lazyattn_rag.integrations.chatbot import ChatOptions, warm_corpus

        result = warm_corpus(ChatOptions(docs=docs, engine=engine.config()))
    except ModuleNotFoundError as e:
        raise _fail(f"{e}. Warming the chatbot's corpus needs the integration extras: pip install "
                    "'lazyattn-rag[all]'") from e
    except (ValueError, FileNotFoundError) as e:
        raise _fail(str(e)) from e
    except KeyboardInterrupt as e:
        raise _fail("interrupted", 130) from e
    typer.echo(json.dumps(_without_histograms(result), indent=2))


def _without_histograms(value):
    """``value`` without the tiers' latency histograms (``*_seconds``: Prometheus shows them)."""
    if isinstance(value, dict):
        return {k: _without_histograms(v) for k, v in value.items() if not k.endswith("_seconds")}
    return value
