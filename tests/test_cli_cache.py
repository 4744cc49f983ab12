"""The storage tiers from the command line (issue 17): ``lazyattn ask`` keeps computed chunks on
disk by default and a second run loads them; ``lazyattn cache info | clear | warm``.

``ask`` runs on the tiny random engine with the tier settings the command line chose; ``cache
warm`` then ``chat`` run the real default model (one slow test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lazyattn_rag.cli import app
from lazyattn_rag.engine.tiers.disk_store import DiskStore
from tests.integrations_kit import tiny_engine
from tests.tiny import words

TIER_FIELDS = ("host_memory_bytes", "disk_dir", "disk_bytes", "redis_url")


def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.fixture
def tiny_with_tiers(monkeypatch):
    """``lazyattn ask`` builds the tiny engine with the storage tiers its options configured."""
    def build(config):
        return tiny_engine(max_model_len=128, **{f: getattr(config.cache, f) for f in TIER_FIELDS})
    monkeypatch.setattr("lazyattn_rag.llm.LazyAttention", build)


def ask(doc: Path, *options: str) -> str:
    result = runner().invoke(app, ["ask", "w1 w2", "--doc", str(doc), "--max-tokens", "2", *options])
    assert result.exit_code == 0, result.output
    return result.output


def test_ask_keeps_chunks_on_disk_and_a_second_run_loads_them(tmp_path, tiny_with_tiers):
    doc = tmp_path / "doc.txt"
    doc.write_text(words(40, start=20))
    assert "docs hit 0, missed 1" in ask(doc, "--cache-dir", str(tmp_path / "cache"))
    assert "docs hit 1 (1 from disk), missed 0" in ask(doc, "--cache-dir", str(tmp_path / "cache"))
    info = json.loads(runner().invoke(app, ["cache", "info", "--cache-dir", str(tmp_path / "cache")]).output)
    disk = info["disk"]
    assert disk["location"] == str(tmp_path / "cache" / "chunks")
    assert disk["num_chunks"] == 2  # the document and the prompt head
    assert list(disk["chunks_by_model"].values()) == [2]
    assert disk["num_bytes"] == sum(f.stat().st_size for f in (tmp_path / "cache" / "chunks").iterdir())
    result = runner().invoke(app, ["cache", "clear", "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 0 and "disk: 2 chunks deleted" in result.output
    assert list((tmp_path / "cache" / "chunks").iterdir()) == []
    assert "docs hit 0, missed 1" in ask(doc, "--cache-dir", str(tmp_path / "cache"))


def test_no_disk_cache_writes_nothing_and_sizes_are_checked_first(tmp_path, tiny_with_tiers):
    doc = tmp_path / "doc.txt"
    doc.write_text(words(40, start=20))
    ask(doc, "--cache-dir", str(tmp_path / "cache"), "--no-disk-cache")
    ask(doc, "--disk-cache", str(tmp_path / "elsewhere"), "--no-disk-cache")
    assert not (tmp_path / "cache" / "chunks").exists() and not (tmp_path / "elsewhere").exists()
    result = runner().invoke(app, ["ask", "w1", "--disk-cache-bytes", "lots"])
    assert result.exit_code == 2 and "--disk-cache-bytes must be a size such as 512MiB" in result.output
    result = runner().invoke(app, ["ask", "w1", "--redis-url", "localhost:6379"])
    assert result.exit_code == 2 and "redis_url must start with redis://" in result.output


def test_a_small_disk_budget_keeps_the_most_recent_chunks(tmp_path, tiny_with_tiers):
    docs = []
    for i in range(3):
        docs.append(tmp_path / f"doc{i}.txt")
        docs[-1].write_text(words(40, start=20 + 3 * i))
        ask(docs[-1], "--disk-cache", str(tmp_path / "chunks"), "--disk-cache-bytes", "60kB")
    store = DiskStore(tmp_path / "chunks", 1 << 40)
    assert 0 < store.num_bytes <= 60_000 and len(store) < 4  # 3 documents and the head do not fit


def test_cache_info_and_clear_on_redis_touch_only_our_keys(tmp_path, redis_server):
    import redis

    from lazyattn_rag.engine.tiers.redis_store import RedisStore

    store = RedisStore(redis_server.url)
    assert store.put("a" * 64, b"x" * 100) and store.put("b" * 64, b"y" * 50)
    raw = redis.Redis.from_url(redis_server.url)
    raw.set("someone-else", b"keep me")
    out = runner().invoke(app, ["cache", "info", "--cache-dir", str(tmp_path), "--redis-url", redis_server.url])
    info = json.loads(out.output)["redis"]
    assert info["available"] and info["num_chunks"] == 2 and info["num_bytes"] == 150
    out = runner().invoke(app, ["cache", "clear", "--cache-dir", str(tmp_path), "--redis-url", redis_server.url])
    assert "redis: 2 chunks deleted" in out.output
    assert raw.get("someone-else") == b"keep me" and store.keys() == []
    redis_server.stop()
    out = runner().invoke(app, ["cache", "clear", "--cache-dir", str(tmp_path), "--redis-url", redis_server.url])
    assert out.exit_code == 2 and "did not answer" in out.output
    assert "(before it, disk: 0)" in out.output  # what was deleted before Redis failed is said
    store.close()


@pytest.mark.slow
def test_cache_warm_then_chat_loads_every_chunk_from_disk(tmp_path):
    """The real default model: ``cache warm --docs`` computes the corpus's chunks onto disk; the
    chat's first question then finds its retrieved chunks there (none computed)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "zembla.md").write_text("# Zembla\n\nThe capital city of Zembla is Onhava, a port on the western coast.\n")
    (docs / "moon.txt").write_text("The Moon orbits the Earth once every 27.3 days.\n")
    chunks = ["--disk-cache", str(tmp_path / "chunks")]
    result = runner().invoke(app, ["cache", "warm", "--docs", str(docs), "--device", "cpu", *chunks])
    assert result.exit_code == 0, result.output
    warmed = json.loads(result.output[result.output.index("{"):])
    assert warmed["num_chunks"] == 2 and warmed["num_computed"] == 2
    assert warmed["tiers"]["disk"]["num_puts"] == 3  # the two chunks and the prompt head
    result = runner().invoke(app, ["chat", "--docs", str(docs), "-q", "What is the capital of Zembla?",
                                   "--max-tokens", "4", "--top-k", "2", "--device", "cpu", *chunks])
    assert result.exit_code == 0, result.output
    assert "docs hit 2 (2 from disk), missed 0" in result.output
