"""Deleting a document from everywhere this engine keeps its K/V (issue 37).

A document's chunk may sit in the KV pool (and, in ``block_attention`` mode, as positioned
copies), in the host-memory tier, on the local disk and in Redis. Removing the document drops
all of them, unless another registered document has the same text (then the K/V serves it and
only the id goes). A chunk that running requests read stays until they finish, dead (no new plan
finds it, and the engine writes no dead chunk to a tier), and is freed when the last one
releases it; queued tier writes are finished before the tiers are cleaned, so none lands after
the delete.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazyattn_rag.types.documents import RemovedDocument

if TYPE_CHECKING:
    from lazyattn_rag.engine.engine import LLMEngine


def remove_document(engine: LLMEngine, doc_id: str, namespace: str = "") -> RemovedDocument:
    """Unregister ``doc_id`` and purge its chunk (see the module docstring). Engine thread.

    Raises:
        UnknownDocumentError: the id is not registered in ``namespace``.
    """
    engine.documents.check_ids([doc_id], namespace)
    key = engine.documents.get(doc_id, namespace).key
    num_free = engine.cache.pool.num_free
    engine.documents.remove(doc_id, namespace)  # drops the unpinned entries no other id binds
    return purge_key(engine, key, doc_id, namespace, num_free)


def purge_text(engine: LLMEngine, doc_id: str, text: str, namespace: str = "") -> RemovedDocument:
    """Purge the chunk a document with ``text`` in ``namespace`` would have (a server replica
    that never registered the deleted document may still hold it: a learned passage of the same
    text, a chunk loaded from a shared tier); unregisters ``doc_id`` too where it is registered
    with that text. Engine thread."""
    if engine.documents.contains(doc_id, namespace) and engine.documents.get(doc_id, namespace).text == text:
        return remove_document(engine, doc_id, namespace)
    key = engine.planner.prepare_passage(text, namespace).key
    return purge_key(engine, key, doc_id, namespace, engine.cache.pool.num_free)


def purge_key(engine: LLMEngine, key: str, doc_id: str, namespace: str, num_free: int) -> RemovedDocument:
    """Drop chunk ``key`` from the KV pool and every storage tier, unless a registered document
    still uses it; ``num_free``: the pool's free blocks before the removal began (the report
    counts the blocks freed since)."""
    if engine.documents.uses_key(key):
        return RemovedDocument(doc_id, namespace, shared=True)
    _, num_in_use = engine.cache.purge(key)
    num_blocks = engine.cache.pool.num_free - num_free
    removed = []
    if engine.tiers is not None:
        engine.tiers.flush()  # a queued write of this chunk lands first, then is deleted
        for tier in engine.tiers.tiers:
            if key in tier:
                tier.delete(key)
                removed.append(tier.name)
    return RemovedDocument(doc_id, namespace, num_blocks, num_in_use, tuple(removed))


def holds_text(engine: LLMEngine, text: str, namespace: str = "") -> list[str]:
    """Where this engine holds the chunk of ``text`` in ``namespace``: ``"kv"`` (the pool) and
    the names of the tiers that store it."""
    key = engine.planner.prepare_passage(text, namespace).key
    where = ["kv"] if engine.cache.holds_key(key) else []
    return where + [t.name for t in (engine.tiers.tiers if engine.tiers is not None else ()) if key in t]
