"""The document registry: document id -> text, tokens and content key, bound in the chunk cache.

A document is validated and tokenized once, when it is registered (the planner's
:meth:`~lazyattn_rag.engine.planner.PromptPlanner.prepare_document`); a prompt then places it by
id. Registering several documents is all or none, and inline documents of one request are
bound only once the request's plan stands (:meth:`DocumentRegistry.inline`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from lazyattn_rag.engine.chunk_cache import ChunkCache
from lazyattn_rag.types.errors import UnknownDocumentError


@dataclass(frozen=True)
class RegisteredDocument:
    """A registered document: its text, its tokens (special-token text tokenized literally) and
    its chunk's content key (model fingerprint + anchor + tokens)."""

    text: str
    token_ids: tuple[int, ...]
    key: str


class DocumentRegistry:
    """Registered documents, bound to their chunks in the cache.

    Args:
        cache: the chunk cache (a document's binding lets a changed or removed document's stale
            chunk be dropped once no request reads it).
        prepare: ``prepare(doc_id, text) -> RegisteredDocument``; validates and tokenizes,
            raising ``EmptyInputError`` / ``DocumentTooLongError`` naming the document.
    """

    def __init__(self, cache: ChunkCache, prepare: Callable[[str, str], RegisteredDocument]):
        self.cache, self.prepare = cache, prepare
        self._documents: dict[str, RegisteredDocument] = {}
        self.version = 0  # grows whenever a document is added, changed or removed

    def __contains__(self, doc_id: str) -> bool:
        return doc_id in self._documents

    def __len__(self) -> int:
        return len(self._documents)

    def __getitem__(self, doc_id: str) -> RegisteredDocument:
        return self._documents[doc_id]

    def ids(self) -> list[str]:
        return list(self._documents)

    def texts(self, doc_ids: list[str] | None = None) -> dict[str, str]:
        """``{id: text}`` of every registered document, or of those of ``doc_ids`` that are."""
        ids = self._documents if doc_ids is None else [d for d in doc_ids if d in self._documents]
        return {d: self._documents[d].text for d in ids}

    def check_ids(self, doc_ids: list[str]) -> None:
        """Raises ``UnknownDocumentError`` naming the first id that is not registered."""
        for d in doc_ids:
            if d not in self._documents:
                raise UnknownDocumentError(f"unknown document id {d!r}: register it first (add_document)")

    def add(self, documents: list[tuple[str, str]]) -> int:
        """Register (or update) documents, all or none: each is validated before any is bound.

        Returns:
            How many were new or changed.
        Raises:
            what ``prepare`` raises, naming the first bad document; nothing is registered then.
        """
        return self._bind([(doc_id, self.prepare(doc_id, text)) for doc_id, text in documents])

    def remove(self, doc_id: str) -> None:
        """Forget a document; its cached K/V is dropped once no running request reads it.

        Raises:
            UnknownDocumentError: the id is not registered.
        """
        if doc_id not in self._documents:
            raise UnknownDocumentError(f"unknown document id {doc_id!r}")
        del self._documents[doc_id]
        self.version += 1
        self.cache.unbind_document(doc_id)

    @contextlib.contextmanager
    def inline(self, documents: list[tuple[str, str]]) -> Iterator[None]:
        """Inside the block, ``documents`` read as registered but nothing is bound; on a normal
        exit they are bound (as :meth:`add`). When the block raises (a refused plan), the
        registry and the cache stay as they were, cached K/V included."""
        prepared = [(doc_id, self.prepare(doc_id, text)) for doc_id, text in documents]
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
            self.cache.bind_document(doc_id, doc.key)
            changed += old is None or old.key != doc.key
        self.version += bool(changed)
        return changed
