"""The document registry: document id -> text, tokens and content key; each key it uses is counted in
the chunk cache (``retain_key`` / ``release_key``), so a changed or removed document's stale chunk goes.

A document is validated and tokenized once, when it is registered (the planner's
:meth:`~lazyattn_rag.engine.planning.planner.PromptPlanner.prepare_document`); a prompt then places it by
id. Registering several documents is all or none, and inline documents of one request are
bound only once the request's plan stands (:meth:`DocumentRegistry.inline`).

**Namespaces** (tenancy): every method takes ``namespace`` (``""``, the default, is shared).
Document ids are looked up within their namespace only, and the namespace is part of the
chunk's content key (the planner's), so one tenant is never served another tenant's document,
nor its cached K/V, in the KV pool or in any storage tier, even for identical text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
import re
from dataclasses import dataclass

from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.types.errors import UnknownDocumentError

NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9_.:@/-]{1,128}")


def check_namespace(namespace: str) -> str:
    """``namespace`` if valid: ``""`` (shared) or 1-128 of letters, digits and ``_.:@/-``.

    Raises:
        ValueError: anything else (named).
    """
    if namespace == "" or (isinstance(namespace, str) and NAMESPACE_PATTERN.fullmatch(namespace)):
        return namespace
    raise ValueError(f"namespace must be '' or 1-128 letters, digits and _.:@/- characters, got {namespace!r}")


def scoped_id(doc_id: str, namespace: str) -> str:
    """The registry's key of ``doc_id`` in ``namespace`` (the id itself in the shared one)."""
    return f"{namespace}\x00{doc_id}" if namespace else doc_id


def split_scoped_id(key: str) -> tuple[str, str]:
    """``(namespace, doc_id)`` of a :func:`scoped_id` key."""
    namespace, _, doc_id = key.rpartition("\x00")
    return namespace, doc_id


@dataclass(frozen=True)
class RegisteredDocument:
    """A registered document: its text, its tokens (special-token text tokenized literally) and
    its chunk's content key (model fingerprint + anchor + namespace + tokens)."""

    text: str
    token_ids: tuple[int, ...]
    key: str


class DocumentRegistry:
    """Registered documents; the chunk cache counts the documents using each key.

    Args:
        cache: the chunk cache (when no document uses a key any more, its stale chunk is
            dropped once no request reads it).
        prepare: ``prepare(doc_id, text, namespace) -> RegisteredDocument``; validates and
            tokenizes, raising ``EmptyInputError`` / ``DocumentTooLongError`` naming the document.
        on_replaced: called with a replaced text, its document's id and namespace once the new
            text is registered (the engine deletes the old chunk from the storage tiers:
            ``engine/document_removal.py``); ``None``: nothing to do.
    """

    def __init__(self, cache: ChunkCache, prepare: Callable[[str, str, str], RegisteredDocument],
                 on_replaced: Callable[[RegisteredDocument, str, str], None] | None = None):
        self.cache, self.prepare, self.on_replaced = cache, prepare, on_replaced
        self._documents: dict[str, RegisteredDocument] = {}
        self.version = 0  # grows whenever a document is added, changed or removed

    def __len__(self) -> int:
        return len(self._documents)

    def __contains__(self, doc_id: str) -> bool:  # the shared namespace
        return self.contains(doc_id)

    def __getitem__(self, doc_id: str) -> RegisteredDocument:  # the shared namespace
        return self.get(doc_id)

    def contains(self, doc_id: str, namespace: str = "") -> bool:
        return scoped_id(doc_id, namespace) in self._documents

    def get(self, doc_id: str, namespace: str = "") -> RegisteredDocument:
        """The registered document. Raises ``KeyError`` if it is not registered (in ``namespace``)."""
        return self._documents[scoped_id(doc_id, namespace)]

    def ids(self, namespace: str = "") -> list[str]:
        """Ids registered in ``namespace``."""
        if not namespace:
            return [d for d in self._documents if "\x00" not in d]
        prefix = scoped_id("", namespace)
        return [d[len(prefix):] for d in self._documents if d.startswith(prefix)]

    def texts(self, doc_ids: list[str] | None = None, namespace: str = "") -> dict[str, str]:
        """``{id: text}`` of every document registered in ``namespace``, or of those of
        ``doc_ids`` that are."""
        ids = self.ids(namespace) if doc_ids is None else [d for d in doc_ids if self.contains(d, namespace)]
        return {d: self.get(d, namespace).text for d in ids}

    def check_ids(self, doc_ids: list[str], namespace: str = "") -> None:
        """Raises ``UnknownDocumentError`` naming the first id that is not registered (in ``namespace``)."""
        for d in doc_ids:
            if not self.contains(d, namespace):
                where = f" in namespace {namespace!r}" if namespace else ""
                raise UnknownDocumentError(f"unknown document id {d!r}{where}: register it first (add_document)")

    def add(self, documents: list[tuple[str, str]], namespace: str = "") -> int:
        """Register (or update) documents, all or none: each is validated before any is bound.

        Returns:
            How many were new or changed.
        Raises:
            what ``prepare`` raises, naming the first bad document; nothing is registered then.
        """
        return self._bind(self._prepare(documents, namespace))

    def _prepare(self, documents: list[tuple[str, str]], namespace: str) -> list[tuple[str, RegisteredDocument]]:
        """Each document validated and tokenized, except one registered with this very text (a
        server sends a request's documents with every request: they are compared, not tokenized
        again)."""
        check_namespace(namespace)
        out = []
        for doc_id, text in documents:
            old = self._documents.get(scoped_id(doc_id, namespace)) if isinstance(doc_id, str) else None
            doc = old if old is not None and old.text == text else self.prepare(doc_id, text, namespace)
            out.append((scoped_id(doc_id, namespace), doc))
        return out

    def remove(self, doc_id: str, namespace: str = "") -> None:
        """Forget a document; its cached K/V is dropped once no running request reads it.

        Raises:
            UnknownDocumentError: the id is not registered (in ``namespace``).
        """
        self.check_ids([doc_id], namespace)
        doc = self._documents.pop(scoped_id(doc_id, namespace))
        self.version += 1
        self.cache.release_key(doc.key)

    def uses_key(self, key: str) -> bool:
        """Whether a registered document (of any namespace) has the chunk key ``key``."""
        return any(doc.key == key for doc in self._documents.values())

    @contextlib.contextmanager
    def inline(self, documents: list[tuple[str, str]], namespace: str = "") -> Iterator[None]:
        """Inside the block, ``documents`` read as registered but nothing is bound; on a normal
        exit they are bound (as :meth:`add`). When the block raises (a refused plan), the
        registry and the cache stay as they were, cached K/V included."""
        prepared = self._prepare(documents, namespace)
        before = {doc_id: self._documents.get(doc_id) for doc_id, _ in prepared}
        self._documents.update(prepared)
        try:
            yield
        finally:  # back as it was: refused, nothing changed; planned, _bind compares with it
            for doc_id, old in before.items():
                if old is None:
                    del self._documents[doc_id]
                else:
                    self._documents[doc_id] = old
        self._bind(prepared)

    def _bind(self, prepared: list[tuple[str, RegisteredDocument]]) -> int:
        changed = 0
        for doc_id, doc in prepared:
            old = self._documents.get(doc_id)
            self._documents[doc_id] = doc
            if old is not None and old.key == doc.key:
                continue
            self.cache.retain_key(doc.key)
            if old is not None:
                self.cache.release_key(old.key)
            changed += 1
            if old is not None and self.on_replaced is not None:
                namespace, plain_id = split_scoped_id(doc_id)
                self.on_replaced(old, plain_id, namespace)
        self.version += bool(changed)
        return changed
