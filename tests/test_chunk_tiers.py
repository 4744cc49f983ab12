"""Storage tiers below the KV pool, end to end (issue 17): host-memory write-back, disk and Redis
persistence across processes, damaged entries, a Redis outage, namespaces, and a soak.

Each engine is a tiny random Llama (``tests/tiny.py``); its weights come from a fixed seed, so
another process builds the same model, the same fingerprint and the same chunk keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lazyattn_rag import SamplingParams
from dataclasses import replace

from lazyattn_rag.engine.tiers.chunk_format import ChunkKV, decode_chunk, encode_chunk
from lazyattn_rag.engine.tiers.host_arena import HostChunk
from lazyattn_rag.engine.tiers.chunk_tiers import ChunkTiers, LoadCosts
from lazyattn_rag.engine.tiers.chunk_store import HostMemoryStore
from tests.observe import StepLog, settle
from tests.tiny import words

ROOT = Path(__file__).resolve().parents[1]
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GREEDY = SamplingParams(max_tokens=3)
DOC_TOKENS = 100  # 7 blocks of 16


def docs(n: int, start: int = 10) -> list[tuple[str, str]]:
    return [(f"d{i}", words(DOC_TOKENS, start=start + 7 * i)) for i in range(n)]


def answer(llm, doc_id: str, namespace: str = ""):
    """``(completion, logits of its steps [num_steps, vocab])``, the request run alone."""
    log = StepLog(llm, logits=True)
    out = llm.generate("w5 w6", [doc_id], sampling=GREEDY, namespace=namespace)
    settle(llm)
    log.remove()
    return out, torch.cat([lg[-1:] for lg in log.logits])


def flush(llm) -> None:
    llm.client.call(lambda engine: engine.tiers.flush())


def tier_stats(llm, name: str) -> dict:
    return llm.stats()["tiers"][name]


def stored_kv(llm, doc_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V the KV pool holds for ``doc_id`` now."""
    def read(engine):
        entry = engine.cache.lookup(engine.documents[doc_id].key, touch=False)
        return engine.runner.kv_pool.read(entry.block_ids, entry.num_tokens)
    return llm.client.call(read)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_host_tier_write_back_serves_evicted_chunks_bit_identical(make_llm, device):
    """A 40-block pool holds 5 documents of 7 blocks: with 6, each is evicted in turn, written back
    to host memory and loaded on its next use: its K/V bytes equal the fresh encode's, and the
    logits equal those of a hit on the fresh encode (the first answer's own pass also encoded the
    document, a batch of another shape, so its logits may differ in the last bits). On a GPU the
    host tier holds the K/V in pinned memory, copied there by the writer thread."""
    _, llm = make_llm(num_blocks=40, host_memory_bytes=1 << 26, eviction_policy="lru", device=device)
    llm.add_documents(docs(6))
    first = {}
    for doc_id, _ in docs(6):
        assert answer(llm, doc_id)[0].stats.doc_tiers == {doc_id: "computed"}
        out, logits = answer(llm, doc_id)
        assert out.stats.doc_tiers == {doc_id: "kv"}
        first[doc_id] = (out.text, logits, stored_kv(llm, doc_id))
    flush(llm)
    for doc_id, _ in docs(6):
        out, logits = answer(llm, doc_id)
        assert out.stats.doc_tiers == {doc_id: "host"} and out.stats.docs_hit == [doc_id]
        assert out.stats.num_computed_tokens == out.stats.num_prompt_tokens - DOC_TOKENS - out.stats.num_exact_prefix_tokens
        text, fresh_logits, (keys, values) = first[doc_id]
        again_keys, again_values = stored_kv(llm, doc_id)
        assert torch.equal(again_keys, keys) and torch.equal(again_values, values)
        assert torch.equal(logits, fresh_logits) and out.text == text
    stats = tier_stats(llm, "host")
    assert stats["num_hits"] == 6 and stats["num_corrupt"] == 0 and stats["load_seconds"]["count"] == 6
    assert stats["num_bytes"] <= stats["capacity_bytes"]
    held = llm.client.call(lambda engine: [engine.tiers.host.get(engine.documents[d].key) for d, _ in docs(6)])
    assert all(isinstance(h, HostChunk) and h.arena.pinned == (device == "cuda") for h in held)
    assert all(h.arena.page(p).is_pinned() == (device == "cuda") for h in held for p in h.key_pages)
    llm.client.call(lambda engine: engine.cache.check_integrity())


_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from tests.tiny import hf_and_ours, hf_config, tiny_llm, words
    from lazyattn_rag import SamplingParams
    llm = tiny_llm(hf_and_ours(hf_config())[1], **json.loads(sys.argv[1]))
    llm.add_documents([("d0", words({n}, start=10))])
    out = llm.generate("w5 w6", ["d0"], sampling=SamplingParams(max_tokens=3))
    print(json.dumps({{"tiers": out.stats.doc_tiers, "text": out.text, "computed": out.stats.num_computed_tokens,
                      "documents": out.stats.num_cached_tokens - out.stats.num_exact_prefix_tokens}}))
    llm.close()
""")


def run_child(**config) -> dict:
    """A new process builds the same tiny engine with ``config`` and asks about ``d0``."""
    script = _CHILD.format(root=str(ROOT), n=DOC_TOKENS)
    done = subprocess.run([sys.executable, "-c", script, json.dumps(config)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_restarted_process_serves_a_document_from_disk(tmp_path):
    """Process 1 computes d0 and writes it to the disk tier; process 2 (same model, same
    directory) loads it: zero document tokens computed, the same greedy answer."""
    first = run_child(disk_dir=str(tmp_path / "tier"))
    second = run_child(disk_dir=str(tmp_path / "tier"))
    assert first["tiers"] == {"d0": "computed"} and second["tiers"] == {"d0": "disk"}
    assert first["documents"] == 0 and second["documents"] == DOC_TOKENS  # no document token computed
    assert second["text"] == first["text"]
    assert not [f for f in os.listdir(tmp_path / "tier") if f.endswith(".tmp")]


def test_two_processes_share_one_redis(make_llm, redis_server):
    """This process computes d0 into Redis; a second process's first request loads it."""
    _, llm = make_llm(redis_url=redis_server.url)
    llm.add_documents(docs(1))
    out, _ = answer(llm, "d0")
    assert out.stats.doc_tiers == {"d0": "computed"}
    flush(llm)
    other = run_child(redis_url=redis_server.url)
    assert other["tiers"] == {"d0": "redis"} and other["text"] == out.text
    assert other["documents"] == DOC_TOKENS  # no document token computed


def _damage(kind: str, good: bytes, key: str, model_digest: str) -> bytes:
    if kind == "truncated":
        return good[: len(good) // 2]
    if kind == "flipped":
        bad = bytearray(good)
        bad[-40] ^= 0x01  # inside the values tensor: only the checksum can tell
        return bytes(bad)
    chunk = decode_chunk(good, key, model_digest)
    if kind == "other model":
        return encode_chunk(ChunkKV(key, "0" * 64, chunk.token_ids, chunk.local_start, chunk.keys, chunk.values))
    if kind == "other dtype":  # well formed and checksummed, but not this pool's dtype
        return encode_chunk(replace(chunk, keys=chunk.keys.bfloat16(), values=chunk.values.bfloat16()))
    if kind == "other shape":  # the same bytes as [layers, tokens, head_dim, heads]: same checksum
        layers, tokens, heads, dim = chunk.keys.shape
        return encode_chunk(replace(chunk, keys=chunk.keys.reshape(layers, tokens, dim, heads),
                                    values=chunk.values.reshape(layers, tokens, dim, heads)))
    assert kind == "other tokens"
    return encode_chunk(ChunkKV(key, model_digest, tuple(reversed(chunk.token_ids)), chunk.local_start, chunk.keys,
                                chunk.values))


def _damage_host(kind: str, good: HostChunk) -> HostChunk:
    """The host tier holds K/V in arena pages with their checksum: the same four faults in that
    form, each on a copy in pages of its own (storing it releases the good one's pages)."""
    arena = good.arena
    pages = [arena.allocate(len(p)) for p in (good.key_pages, good.value_pages)]
    for src, dst in zip((good.key_pages, good.value_pages), pages):
        for a, b in zip(src, dst):
            arena.page(b).copy_(arena.page(a))
    copy = replace(good, key_pages=tuple(pages[0]), value_pages=tuple(pages[1]))
    if kind == "truncated":  # fewer tokens' K/V than the tokens it claims
        return replace(copy, shape=(copy.shape[0], copy.shape[1] - 3, *copy.shape[2:]))
    if kind == "flipped":
        arena.page(copy.value_pages[-1])[5] ^= 0x10  # one bit of the values: only the checksum can tell
        return copy
    if kind == "other model":
        return replace(copy, meta=replace(copy.meta, model_digest="0" * 64))
    if kind == "other dtype":
        return replace(copy, dtype=torch.bfloat16)
    if kind == "other shape":
        layers, tokens, heads, dim = copy.shape
        return replace(copy, shape=(layers, tokens, dim, heads))
    assert kind == "other tokens"
    return replace(copy, meta=replace(copy.meta, token_ids=tuple(reversed(copy.meta.token_ids))))


@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
@pytest.mark.parametrize("kind", ["truncated", "flipped", "other model", "other tokens", "other dtype", "other shape"])
def test_a_damaged_entry_is_detected_deleted_and_recomputed(make_llm, tmp_path, request, tier, kind):
    """d0 is computed, evicted from the pool, and its tier entry replaced by a bad payload: the
    next request recomputes d0 (the same answer), the entry is counted as corrupt and deleted,
    nothing fails."""
    config = {"host": {"host_memory_bytes": 1 << 26}, "disk": {"disk_dir": str(tmp_path / "tier")}}.get(tier)
    if tier == "redis":
        config = {"redis_url": request.getfixturevalue("redis_server").url}
    _, llm = make_llm(**config)
    llm.add_documents(docs(1))
    expected, _ = answer(llm, "d0")
    flush(llm)

    def plant(engine):
        key = engine.documents["d0"].key
        entry = engine.cache.lookup(key, touch=False)
        keys, values = engine.runner.kv_pool.read(entry.block_ids, entry.num_tokens)
        good = encode_chunk(ChunkKV(key, engine.model_digest, entry.token_ids, entry.local_start, keys, values))
        engine.cache.evict(key)  # with a host tier this queues a (good) write-back: let it land first
        engine.tiers.flush()
        store = next(t for t in engine.tiers.tiers if t.name == tier)
        if tier == "host":  # what write-back stored: decoded K/V, bit-identical to the pool's
            held = store.get(key)
            assert isinstance(held, HostChunk) and torch.equal(held.load(key, engine.model_digest, "cpu").keys, keys)
            assert store.put(key, _damage_host(kind, held))
        else:
            assert store.put(key, _damage(kind, good, key, engine.model_digest))
        return key

    key = llm.client.call(plant)
    out, _ = answer(llm, "d0")
    assert out.stats.doc_tiers == {"d0": "computed"} and out.text == expected.text
    stats = tier_stats(llm, tier)
    assert stats["num_corrupt"] == 1 and stats["num_errors"] == 1
    flush(llm)
    stored = llm.client.call(lambda engine: next(t for t in engine.tiers.tiers if t.name == tier).get(key))
    if tier == "host":  # deleted; host memory is filled by evictions only
        assert stored is None
    else:  # deleted, then written again whole by this request's compute
        assert decode_chunk(stored, key, llm.engine.model_digest).token_ids


def test_redis_killed_and_restarted_mid_run_fails_no_request(make_llm, redis_server):
    """Requests keep being answered (recomputing) while the server is down; the tier shows
    the outage, and after a restart it is written and read again."""
    _, llm = make_llm(num_blocks=40, redis_url=redis_server.url)
    llm.add_documents(docs(8))
    for doc_id in ("d0", "d1"):
        assert answer(llm, doc_id)[0].finish_reason
    flush(llm)
    redis_server.stop()
    outs = [answer(llm, doc_id)[0] for doc_id in ("d2", "d3", "d4", "d5", "d6")]  # d0, d1 evicted meanwhile
    assert all(o.finish_reason for o in outs)
    flush(llm)
    stats = tier_stats(llm, "redis")
    assert stats["num_outages"] == 1 and not stats["available"]
    redis_server.start()

    def reconnect(engine):
        import time
        store = engine.tiers.persistent[0]
        deadline = time.monotonic() + 10
        while not store.available and time.monotonic() < deadline:
            "x" in store  # noqa: B015 - a probe: the tier retries after its pause
            time.sleep(0.1)
        return store.available
    assert llm.client.call(reconnect)
    out, _ = answer(llm, "d7")
    flush(llm)
    assert out.stats.doc_tiers == {"d7": "computed"}
    assert tier_stats(llm, "redis")["num_puts"] >= 3  # d0, d1 before; d7 after the restart


def test_namespaces_never_share_a_document_or_its_kv(make_llm, tmp_path):
    """Tenants a and b register the same id with the same text: each computes its own chunk
    (in the pool and in the disk tier); one cannot place the other's ids."""
    _, llm = make_llm(disk_dir=str(tmp_path / "tier"))
    text = words(DOC_TOKENS, start=30)
    llm.add_document("doc", text, namespace="tenant-a")
    a, _ = answer(llm, "doc", namespace="tenant-a")
    with pytest.raises(Exception, match="unknown document id 'doc' in namespace 'tenant-b'"):
        llm.generate("w5", ["doc"], namespace="tenant-b")
    with pytest.raises(Exception, match="unknown document id 'doc'"):
        llm.generate("w5", ["doc"])  # the shared namespace does not see it either
    flush(llm)
    llm.add_document("doc", text, namespace="tenant-b")
    b, _ = answer(llm, "doc", namespace="tenant-b")
    assert a.stats.doc_tiers == b.stats.doc_tiers == {"doc": "computed"}
    again, _ = answer(llm, "doc", namespace="tenant-a")
    assert again.stats.doc_tiers == {"doc": "kv"}
    keys = llm.client.call(lambda engine: {engine.documents.get("doc", ns).key for ns in ("tenant-a", "tenant-b")})
    assert len(keys) == 2
    assert llm.document_ids("tenant-a") == ["doc"] and llm.document_ids() == []
    with pytest.raises(ValueError, match="namespace"):
        llm.add_document("x", "w1", namespace="no spaces")


def test_soak_with_tiers_leaks_no_block_buffer_or_file(make_llm, tmp_path):
    """1000 requests over 12 documents in a 40-block pool with host and disk tiers (evictions,
    write-backs and loads all the time): every block comes back, the tiers keep their budgets,
    the writer's queue drains, and the disk holds exactly the files it indexes."""
    _, llm = make_llm(num_blocks=40, host_memory_bytes=300_000, disk_dir=str(tmp_path / "tier"), disk_bytes=400_000)
    corpus = docs(12)
    llm.add_documents(corpus)
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingParams(max_tokens=1)
    streams = []
    for i in range(1000):
        picks = torch.randperm(12, generator=gen)[:2].tolist()
        streams.append(llm.stream("w5", [corpus[p][0] for p in picks], sampling=sampling))
        if len(streams) == 8:
            assert all(list(s)[-1].finished for s in streams)
            streams = []
    assert all(list(s)[-1].finished for s in streams)
    flush(llm)

    def check(engine):
        engine.cache.check_integrity()
        in_use = engine.cache.pool.num_blocks - engine.cache.pool.num_free - engine.cache.num_cached_blocks
        assert in_use == 0, f"{in_use} blocks held after every request finished"
        assert engine.tiers._queued_bytes == 0
        host, disk = engine.tiers.host, engine.tiers.persistent[0]
        assert host.num_bytes <= host.capacity_bytes and disk.num_bytes <= disk.capacity_bytes
        files = sorted(f for f in os.listdir(disk.directory))
        assert files == sorted(f"{k}.lakv" for k in disk.keys())
        return engine.tiers.stats()
    stats = llm.client.call(check)
    assert stats["host"]["num_hits"] > 100 and stats["host"]["num_evictions"] > 0
    assert stats["disk"]["num_evictions"] > 0
    assert llm.stats()["num_requests_failed"] == 0


def test_load_costs_prefer_the_faster_way():
    costs = LoadCosts(bytes_per_token=1000, probe_every=4)
    assert costs.worth_loading("disk", 100)  # nothing measured: try loading
    costs.record_prefill(1000, 1.0)  # 1000 tokens/s: 100 tokens take 0.1 s
    costs.record_load("disk", 1_000_000, 0.01)  # 100 MB/s: 100 tokens (100 kB) take 1 ms
    assert costs.worth_loading("disk", 100)
    costs.record_load("slow", 1000, 1.0)  # 1 kB/s: 100 s
    assert [costs.worth_loading("slow", 100) for _ in range(8)] == [False, False, False, True] * 2  # probes
    always = LoadCosts(bytes_per_token=1000, always=True)  # CacheConfig(tier_loads="always")
    always.record_prefill(1000, 1.0)
    always.record_load("slow", 1000, 1.0)
    assert all(always.worth_loading("slow", 100) for _ in range(8))


def test_writes_past_the_queue_budget_are_dropped_and_counted():
    tiers = ChunkTiers([HostMemoryStore(1 << 20)], "m" * 64, bytes_per_token=64, max_queued_bytes=1)
    kv = torch.zeros(1, 2, 1, 8)
    assert not tiers.save(ChunkKV("k" * 64, "m" * 64, (1, 2), 0, kv, kv), tiers.tiers)
    assert tiers.num_dropped_writes == 1
    tiers.close()


def test_prometheus_metrics_carry_each_tier(make_llm, tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from lazyattn_rag.metrics import register_metrics

    # loads always (not when measured speeds favour them: timings vary on a loaded machine), and
    # each write-back lands before the next request looks (the writer is waited for, not timed)
    _, llm = make_llm(num_blocks=40, host_memory_bytes=1 << 26, disk_dir=str(tmp_path / "tier"),
                      eviction_policy="lru", tier_loads="always")
    llm.add_documents(docs(6))
    for doc_id, _ in docs(6) * 2:
        answer(llm, doc_id)
        flush(llm)
    registry = CollectorRegistry()
    register_metrics(llm, registry)
    text = generate_latest(registry).decode()
    stats = llm.stats()["tiers"]
    assert stats["host"]["num_hits"] > 0 and stats["disk"]["num_puts"] > 0
    model = f'model_name="{llm.model_name}"'
    for tier in ("host", "disk"):
        assert f'lazyattn_tier_hits_total{{{model},tier="{tier}"}} {float(stats[tier]["num_hits"])}' in text
        assert f'lazyattn_tier_puts_total{{{model},tier="{tier}"}} {float(stats[tier]["num_puts"])}' in text
        assert f'lazyattn_tier_available{{{model},tier="{tier}"}} 1.0' in text
        assert f'lazyattn_tier_bytes{{{model},tier="{tier}"}} {float(stats[tier]["num_bytes"])}' in text
    loads = stats["host"]["load_seconds"]["count"]
    assert f'lazyattn_tier_load_seconds_bucket{{le="+Inf",{model},tier="host"}} {float(loads)}' in text
    assert f'lazyattn_tier_load_seconds_count{{{model},tier="host"}} {float(loads)}' in text
    assert f"lazyattn_tier_writes_dropped_total{{{model}}} 0.0" in text
