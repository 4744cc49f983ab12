"""Deleting a document removes its K/V everywhere the engine keeps it (issue 37): the KV pool, the
host-memory tier, the disk tier and Redis; a request running over it finishes with its old text
and its blocks are freed after; another document with the same text keeps the K/V.

The tiers are checked through their own files and server (the disk directory's files, a real
``redis-server``'s keys), not only through the engine's view of them.
"""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import redis

from lazyattn_rag import SamplingParams
from lazyattn_rag.client import question_request
from lazyattn_rag.engine.document_removal import holds_text
from lazyattn_rag.types.errors import UnknownDocumentError
from tests.observe import settle
from tests.tiny import words

DOC_TOKENS = 100  # 7 blocks of 16
GREEDY = SamplingParams(max_tokens=3)


def doc(i: int) -> tuple[str, str]:
    return f"d{i}", words(DOC_TOKENS, start=10 + 7 * i)


@pytest.fixture
def tiered(make_llm, tmp_path, redis_server):
    """An engine with all three tiers below a 40-block pool."""
    disk = tmp_path / "disk"
    _, llm = make_llm(num_blocks=40, host_memory_bytes=1 << 26, disk_dir=str(disk), redis_url=redis_server.url)
    return llm, disk, redis.Redis.from_url(redis_server.url)


def files(disk: Path) -> set[str]:
    return {p.name for p in disk.rglob("*") if p.is_file() and not p.name.startswith(".")}


def stored_keys(server: redis.Redis) -> set[str]:
    """Chunk keys on the Redis server (its keys are ``<prefix><chunk key>``)."""
    return {k.decode()[-64:] for k in server.keys()}


def doc_key(llm, doc_id: str) -> str:
    return llm.client.call(lambda engine: engine.documents[doc_id].key)


def where(llm, text: str, namespace: str = "") -> list[str]:
    return llm.client.call(lambda engine: holds_text(engine, text, namespace))


def flush(llm) -> None:
    llm.client.call(lambda engine: engine.tiers.flush())


def num_free_blocks(llm) -> int:
    return llm.client.call(lambda engine: engine.cache.pool.num_free)


def check_integrity(llm) -> None:
    llm.client.call(lambda engine: engine.cache.check_integrity())


def test_a_removed_document_leaves_the_pool_and_every_tier(tiered):
    llm, disk, server = tiered
    llm.add_documents([doc(0), doc(1)])
    for doc_id in ("d0", "d1"):
        assert llm.generate("w5 w6", [doc_id], sampling=GREEDY).stats.doc_tiers == {doc_id: "computed"}
    settle(llm)
    flush(llm)
    llm.client.call(lambda engine: engine.cache.evict(engine.documents["d0"].key))  # written back to host memory
    flush(llm)
    assert where(llm, doc(0)[1]) == ["host", "disk", "redis"] and where(llm, doc(1)[1]) == ["kv", "disk", "redis"]
    k0, k1 = doc_key(llm, "d0"), doc_key(llm, "d1")
    disk_files, redis_keys = files(disk), stored_keys(server)
    assert {f"{k0}.lakv", f"{k1}.lakv"} <= disk_files and {k0, k1} <= redis_keys  # with the prompt head's chunk

    removed = llm.remove_document("d0")
    assert (removed.tiers, removed.num_kv_blocks, removed.num_in_use, removed.shared) == (
        ("host", "disk", "redis"), 0, 0, False)
    assert files(disk) == disk_files - {f"{k0}.lakv"} and stored_keys(server) == redis_keys - {k0}

    free = num_free_blocks(llm)
    removed = llm.remove_document("d1")
    assert (removed.tiers, removed.num_kv_blocks) == (("disk", "redis"), 7)
    assert num_free_blocks(llm) == free + 7
    assert files(disk) == disk_files - {f"{k0}.lakv", f"{k1}.lakv"} and stored_keys(server) == redis_keys - {k0, k1}
    assert where(llm, doc(0)[1]) == [] and where(llm, doc(1)[1]) == []
    check_integrity(llm)
    with pytest.raises(UnknownDocumentError, match="'d1'"):
        llm.generate("w5 w6", ["d1"], sampling=GREEDY)
    with pytest.raises(UnknownDocumentError, match="'d1'"):
        llm.remove_document("d1")


def test_a_document_with_the_same_text_keeps_the_kv(tiered):
    llm, disk, server = tiered
    text = doc(2)[1]
    llm.add_documents([("a", text), ("b", text)])
    llm.generate("w5 w6", ["a"], sampling=GREEDY)
    settle(llm)
    flush(llm)
    removed = llm.remove_document("a")
    assert removed.shared and removed.tiers == () and removed.num_kv_blocks == 0
    assert where(llm, text) == ["kv", "disk", "redis"]
    assert llm.generate("w5 w6", ["b"], sampling=GREEDY).stats.doc_tiers == {"b": "kv"}


def test_a_request_running_over_a_removed_document_finishes_with_its_text_and_nothing_is_stored_after(tiered):
    """The delete lands on the engine thread right after the request is queued, before its
    document is computed: the request computes it, reads it to the end and answers what an
    untouched engine answers; the chunk is never written to a tier and its blocks are freed."""
    llm, disk, server = tiered
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    llm.add_documents([doc(3)])
    expected = llm.generate("w5 w6", ["d3"], sampling=sampling)
    llm.remove_document("d3")
    settle(llm)
    assert where(llm, doc(3)[1]) == []
    llm.add_documents([doc(3)])
    key, head_files, head_keys = doc_key(llm, "d3"), files(disk), stored_keys(server)
    free = num_free_blocks(llm)
    deltas: queue.SimpleQueue = queue.SimpleQueue()

    def submit_then_remove(engine):
        request = question_request("w5 w6", ["d3"], [], sampling)(engine, deltas.put)
        from lazyattn_rag.engine.document_removal import remove_document
        return request, remove_document(engine, "d3")

    _, removed = llm.client.call(submit_then_remove)
    assert removed.num_kv_blocks == 0  # its entry is inserted when the request is scheduled, after this
    pieces = []
    while not (pieces and pieces[-1].finished):
        piece = deltas.get(timeout=60)
        assert not isinstance(piece, BaseException), piece
        pieces.append(piece)
    assert "".join(p.text for p in pieces) == expected.text
    assert pieces[-1].stats.doc_tiers == {"d3": "computed"}
    settle(llm)
    flush(llm)
    assert where(llm, doc(3)[1]) == [] and files(disk) == head_files and stored_keys(server) == head_keys
    assert f"{key}.lakv" not in head_files and key not in head_keys
    assert num_free_blocks(llm) >= free  # the document's 7 blocks came back (and the request's own)
    check_integrity(llm)


def test_a_text_registered_again_after_its_delete_is_computed_and_stored_again(tiered):
    llm, disk, server = tiered
    llm.add_documents([doc(4)])
    llm.generate("w5 w6", ["d4"], sampling=GREEDY)
    settle(llm)
    llm.remove_document("d4")
    llm.add_documents([doc(4)])
    assert llm.generate("w5 w6", ["d4"], sampling=GREEDY).stats.doc_tiers == {"d4": "computed"}
    settle(llm)
    flush(llm)
    assert where(llm, doc(4)[1]) == ["kv", "disk", "redis"]


def test_a_chunk_a_running_request_reads_is_freed_when_it_finishes(tiered):
    """One engine step runs the request (its document computed and pinned), then the delete:
    the chunk is reported in use, dead (no new plan finds it), and freed at the request's end."""
    llm, disk, server = tiered
    llm.add_documents([doc(5)])
    deltas: queue.SimpleQueue = queue.SimpleQueue()

    def step_then_remove(engine):
        from lazyattn_rag.engine.document_removal import remove_document

        question_request("w5 w6", ["d5"], [], SamplingParams(max_tokens=20, ignore_eos=True))(engine, deltas.put)
        engine.step()
        engine.tiers.flush()
        return remove_document(engine, "d5"), holds_text(engine, doc(5)[1])

    removed, held = llm.client.call(step_then_remove)
    assert (removed.num_in_use, removed.num_kv_blocks, removed.tiers) == (1, 0, ("disk", "redis"))
    assert held == ["kv"]  # until the request ends
    while not (piece := deltas.get(timeout=60)).finished:
        assert not isinstance(piece, BaseException), piece
    settle(llm)
    flush(llm)
    assert where(llm, doc(5)[1]) == []
    check_integrity(llm)


def test_passages_learned_from_the_documents_text_go_with_it(tiered):
    """Plain prompts that pasted the document's text taught the engine its two paragraphs as
    passages; deleting the document removes them too (pool and tiers), not only its whole-text
    chunk, while a registered document with the same text as one paragraph keeps that one."""
    llm, disk, server = tiered
    p1, p2, p3 = words(32, start=3), words(32, start=77), words(32, start=141)
    for order in ((p1, p2, p3), (p3, p1, p2), (p2, p3, p1)):  # seen twice at new offsets: learned
        llm.chat([{"role": "user", "content": "Context:\n\n" + "\n\n".join(order) + "\n\nQuestion: w5 w6?"}],
                 sampling=GREEDY)
    settle(llm)
    flush(llm)
    assert all(where(llm, p) == ["kv", "disk", "redis"] for p in (p1, p2, p3))
    llm.add_documents([("whole", f"{p1}\n\n{p2}\n\n{p3}"), ("third", p3)])
    removed = llm.remove_document("whole")
    assert removed.tiers == ("disk", "redis") and removed.num_kv_blocks == 2 * 2  # two 32-token passages
    assert where(llm, p1) == [] and where(llm, p2) == [] and where(llm, p3) == ["kv", "disk", "redis"]
    check_integrity(llm)


def test_a_replaced_text_leaves_the_pool_and_the_tiers(tiered):
    llm, disk, server = tiered
    old, new = doc(6)[1], doc(7)[1]
    llm.add_documents([("upd", old)])
    llm.generate("w5 w6", ["upd"], sampling=GREEDY)
    settle(llm)
    flush(llm)
    assert where(llm, old) == ["kv", "disk", "redis"]
    llm.add_documents([("upd", new)])
    assert where(llm, old) == []
    assert llm.generate("w5 w6", ["upd"], sampling=GREEDY).stats.doc_tiers == {"upd": "computed"}
    check_integrity(llm)
