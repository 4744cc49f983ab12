"""Deleting a document from everywhere this engine keeps its K/V (issue 37).

A document's chunk may sit in the KV pool (and, in ``block_attention`` mode, as positioned
copies), in the host-memory tier, on the local disk and in Redis. Removing the document drops
all of them, unless another registered document has the same text (then the K/V serves it and
only the id goes). The passages a plain prompt may have taught the engine from the document's
text (``engine/planning/passage_learning.py``: its pieces between blank lines, rules and labels, keyed by
content) go too, each unless a registered document has that very text. A chunk that running
requests read stays until they finish, dead (no new plan finds it, and the engine writes no dead
chunk to a tier), and is freed when the last one releases it; queued tier writes are finished
before the tiers are cleaned, so none lands after the delete.

Not removed: exact-prefix blocks of plain prompts that contained the text (keyed by the whole
prompt before them, found only by an identical prompt of the same namespace, never stored in a
tier; they go by eviction), and the chunks of texts a request gave inline under no registered id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazyattn_rag.types.documents import RemovedDocument

if TYPE_CHECKING:
    from lazyattn_rag.engine.engine import LLMEngine
    from lazyattn_rag.engine.planning.registry import RegisteredDocument


def remove_document(engine: LLMEngine, doc_id: str, namespace: str = "") -> RemovedDocument:
    """Unregister ``doc_id`` and purge its chunk (see the module docstring). Engine thread.

    Raises:
        UnknownDocumentError: the id is not registered in ``namespace``.
    """
    engine.documents.check_ids([doc_id], namespace)
    doc = engine.documents.get(doc_id, namespace)
    num_free = engine.cache.pool.num_free
    engine.documents.remove(doc_id, namespace)  # drops the unpinned entries no other id binds
    return purge_key(engine, doc.key, doc_id, namespace, num_free, piece_keys(engine, doc.text, namespace))


def purge_text(engine: LLMEngine, doc_id: str, text: str, namespace: str = "") -> RemovedDocument:
    """Purge the chunk a document with ``text`` in ``namespace`` would have (a server replica
    that never registered the deleted document may still hold it: a learned passage of the same
    text, a chunk loaded from a shared tier); unregisters ``doc_id`` too where it is registered
    with that text. Engine thread."""
    if engine.documents.contains(doc_id, namespace) and engine.documents.get(doc_id, namespace).text == text:
        return remove_document(engine, doc_id, namespace)
    key = engine.planner.prepare_passage(text, namespace).key
    return purge_key(engine, key, doc_id, namespace, engine.cache.pool.num_free, piece_keys(engine, text, namespace))


def purge_replaced(engine: LLMEngine, old: RegisteredDocument, doc_id: str, namespace: str) -> None:
    """A document's text was replaced: its old chunk and passages leave the pool and the tiers
    as a deleted document's do (unless another registered document has that text)."""
    purge_key(engine, old.key, doc_id, namespace, engine.cache.pool.num_free, piece_keys(engine, old.text, namespace))


def piece_keys(engine: LLMEngine, text: str, namespace: str) -> list[str]:
    """The chunk keys of the passages the learner could have taken from ``text``: its pieces
    (``engine/planning/passages.py``), separators and the whole text excepted."""
    from lazyattn_rag.engine.planning.passages import split_passages

    pieces = {p.text for p in split_passages(text) if not p.separator and p.text != text.strip()}
    return [engine.planner.prepare_passage(piece, namespace).key for piece in sorted(pieces)]


def purge_key(engine: LLMEngine, key: str, doc_id: str, namespace: str, num_free: int,
              passage_keys: list[str] = ()) -> RemovedDocument:
    """Drop chunk ``key`` (and the learned passages ``passage_keys``) from the KV pool and every
    storage tier, each unless a registered document still uses it; ``num_free``: the pool's free
    blocks before the removal began (the report counts the blocks freed since)."""
    shared = engine.documents.uses_key(key)
    keys = [k for k in ([] if shared else [key]) + list(passage_keys) if not engine.documents.uses_key(k)]
    num_in_use = sum(engine.cache.purge(k)[1] for k in keys)
    num_blocks = engine.cache.pool.num_free - num_free
    removed = []
    if engine.tiers is not None and keys:
        engine.tiers.flush()  # a queued write of these chunks lands first, then is deleted
        for tier in engine.tiers.tiers:
            held = [k for k in keys if k in tier]
            for k in held:
                tier.delete(k)
            if held:
                removed.append(tier.name)
    return RemovedDocument(doc_id, namespace, num_blocks, num_in_use, tuple(removed), shared)


def holds_text(engine: LLMEngine, text: str, namespace: str = "") -> list[str]:
    """Where this engine holds the chunk of ``text`` in ``namespace``: ``"kv"`` (the pool) and
    the names of the tiers that store it."""
    key = engine.planner.prepare_passage(text, namespace).key
    where = ["kv"] if engine.cache.holds_key(key) else []
    return where + [t.name for t in (engine.tiers.tiers if engine.tiers is not None else ()) if key in t]
