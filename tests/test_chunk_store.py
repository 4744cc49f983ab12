"""Storage tiers below the KV pool (engine/tiers/chunk_store.py): budgets, eviction order, atomic disk
writes, a restart finding what was stored, corrupt payloads discarded (issue 17 groundwork)."""

import multiprocessing
import os

import pytest
import torch

from lazyattn_rag.engine.tiers.chunk_format import ChunkKV, CorruptChunkError, decode_chunk, encode_chunk
from lazyattn_rag.engine.tiers.chunk_store import SUFFIX, HostMemoryStore
from lazyattn_rag.engine.tiers.disk_store import DiskStore
from lazyattn_rag.engine.kv.eviction import LFUAgingPolicy

MODEL = "m" * 64


def payload(key: str, num_tokens: int = 4) -> bytes:
    g = torch.Generator().manual_seed(len(key) + num_tokens)
    kv = torch.randn(2, num_tokens, 1, 4, generator=g)
    return encode_chunk(ChunkKV(key, MODEL, tuple(range(num_tokens)), 0, kv, kv + 1))


def stores(tmp_path, capacity: int):
    return [HostMemoryStore(capacity), DiskStore(tmp_path / "tier", capacity)]


@pytest.mark.parametrize("kind", [0, 1], ids=["host", "disk"])
def test_a_tier_keeps_its_budget_and_evicts_least_recently_used_first(tmp_path, kind):
    a, b, c = (payload(k) for k in ("a" * 64, "b" * 64, "c" * 64))
    size = len(a)
    assert len(b) == len(c) == size
    store = stores(tmp_path, 2 * size + size // 2)[kind]  # room for two
    assert store.put("a" * 64, a) and store.put("b" * 64, b)
    assert store.get("a" * 64) == a  # a is now the more recently used
    assert store.put("c" * 64, c)  # evicts b
    assert "b" * 64 not in store and store.get("b" * 64) is None
    assert store.get("a" * 64) == a and store.get("c" * 64) == c
    assert store.num_bytes == 2 * size <= store.capacity_bytes and len(store) == 2
    s = store.stats
    assert (s.num_puts, s.num_evictions, s.num_hits, s.num_misses) == (3, 1, 3, 1)
    assert s.num_bytes_written == 3 * size and s.num_bytes_read == 3 * size
    assert not store.put("d" * 64, b"x" * (store.capacity_bytes + 1))  # larger than the tier: refused
    assert len(store) == 2


def test_a_tier_takes_the_engines_eviction_policies(tmp_path):
    store = HostMemoryStore(3 * 10, LFUAgingPolicy())
    for key in ("a", "b", "c"):
        store.put(key, b"0123456789")
    for _ in range(3):
        store.get("a")  # popular
    store.get("c")
    store.put("d", b"0123456789")  # evicts b, the least frequently used
    assert "b" not in store and all(k in store for k in "acd")


def test_disk_writes_are_atomic_and_a_restart_finds_them(tmp_path):
    directory = tmp_path / "tier"
    first = DiskStore(directory, 10**6)
    data = {k * 64: payload(k * 64, n) for k, n in (("a", 4), ("b", 6))}
    for key, value in data.items():
        first.put(key, value)
    assert sorted(p.name for p in directory.iterdir()) == sorted(f"{k}{SUFFIX}" for k in data)  # no temporaries
    reopened = DiskStore(directory, 10**6)  # a new process on the same directory
    assert len(reopened) == 2 and reopened.num_bytes == sum(map(len, data.values()))
    for key, value in data.items():
        assert decode_chunk(reopened.get(key), key, MODEL).token_ids == tuple(range(len(decode_chunk(value, key, MODEL).token_ids)))
    small = DiskStore(directory, len(data["b" * 64]))  # reopened with less room: the oldest go
    assert len(small) == 1 and "b" * 64 in small and not (directory / f"{'a' * 64}{SUFFIX}").exists()


def test_a_corrupt_or_vanished_payload_is_counted_discarded_and_never_served(tmp_path):
    store = DiskStore(tmp_path / "tier", 10**6)
    key = "k" * 64
    store.put(key, payload(key))
    path = tmp_path / "tier" / f"{key}{SUFFIX}"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))  # damaged on disk after it was written
    with pytest.raises(CorruptChunkError, match="checksum"):
        decode_chunk(store.get(key), key, MODEL)
    store.discard(key)  # what the caller does with a payload that fails to decode
    assert key not in store and not path.exists() and store.get(key) is None and store.stats.num_errors == 1
    store.put(key, payload(key))
    path.unlink()  # removed behind the store's back (another process, a user)
    assert store.get(key) is None and key not in store and store.stats.num_errors == 2


def _write_many(directory, key, value, n):
    store = DiskStore(directory, 10**8)
    for _ in range(n):
        store.put(key, value)


def test_two_processes_writing_one_key_leave_one_whole_file(tmp_path):
    directory, key = tmp_path / "tier", "s" * 64
    value = payload(key, 64)
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_write_many, args=(directory, key, value, 20)) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    assert all(w.exitcode == 0 for w in writers)
    assert os.listdir(directory) == [f"{key}{SUFFIX}"]
    assert decode_chunk((directory / f"{key}{SUFFIX}").read_bytes(), key, MODEL).keys.shape == (2, 64, 1, 4)


def test_keys_that_are_not_content_keys_are_refused(tmp_path):
    store = DiskStore(tmp_path / "tier", 100)
    for bad in ("", "../x", ".hidden"):
        with pytest.raises(ValueError, match="not a chunk key"):
            store.put(bad, b"x")
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostMemoryStore(0)


def test_a_failed_write_leaves_no_untracked_payload(tmp_path, monkeypatch):
    """Replacing a key whose write then fails: the old payload is not left on disk, unaccounted."""
    store = DiskStore(tmp_path / "tier", 10**6)
    key = "r" * 64
    store.put(key, payload(key))

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("lazyattn_rag.engine.tiers.disk_store.os.replace", full_disk)
    assert not store.put(key, payload(key, 8))
    assert key not in store and store.num_bytes == 0 and store.stats.num_errors == 1
    assert os.listdir(tmp_path / "tier") == []  # neither the old file nor the temporary


def test_stores_sharing_a_directory_see_each_others_chunks_and_keep_one_budget(tmp_path):
    """Two processes' stores on one directory (two stores here, opened before either writes): a
    chunk one wrote is found by the other; a write re-reads the directory first, so the
    directory stays within the budget both share, and a chunk one deleted is forgotten."""
    a, b, c, d = (payload(k * 64) for k in "abcd")
    size = len(a)
    first, second = DiskStore(tmp_path / "tier", 2 * size + 10), DiskStore(tmp_path / "tier", 2 * size + 10)
    assert first.put("a" * 64, a) and first.put("b" * 64, b)
    assert "a" * 64 in second and second.get("b" * 64) == b  # written after the second opened
    assert second.put("c" * 64, c)  # the second's index now holds a, b and c: it evicts one
    files = sorted(f.name for f in (tmp_path / "tier").glob(f"*{SUFFIX}"))
    assert len(files) == 2 and sum((tmp_path / "tier" / f).stat().st_size for f in files) <= 2 * size + 10
    first.delete("c" * 64)
    assert second.put("d" * 64, d) and second.num_bytes <= second.capacity_bytes
    assert second.get("c" * 64) is None and "c" * 64 not in second  # deleted by the other: a plain miss
    assert second.num_bytes == sum(f.stat().st_size for f in (tmp_path / "tier").glob(f"*{SUFFIX}"))
