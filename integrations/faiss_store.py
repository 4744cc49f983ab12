"""A FAISS document store with stable string ids, kept in step with the engine's KV cache.

faiss-cpu holds the vectors (``IndexIDMap2`` over an exact inner-product ``IndexFlatIP``, on
unit-length embeddings: cosine similarity); this class maps each document's stable string id
to a FAISS int64 id and keeps the texts. Updating a document re-embeds it under the same id;
deleting removes its vector. When an engine is attached, every document added (or loaded) is
registered with it, so prompts that contain the document's text reuse its K/V, and updates
and deletions reach the engine's registry too, so a stale or deleted document's cached K/V is
dropped with it.

Framework-neutral: the LlamaIndex and LangChain retrievers wrap it.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lazyattn_rag.documents import Document
from lazyattn_rag.errors import UnknownDocumentError

if TYPE_CHECKING:
    from lazyattn_rag.integrations.embeddings import SentenceEmbedder
    from lazyattn_rag.llm import LazyAttention

_INDEX_FILE, _DOCS_FILE, _META_FILE = "index.faiss", "documents.jsonl", "meta.json"


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper
_FORMAT = 1


class FaissDocumentStore:
    """Documents in a FAISS inner-product index.

    Args:
        embedder: a :class:`~lazyattn_rag.integrations.embeddings.SentenceEmbedder` (or any
            object with ``name``, ``dim`` and ``encode(texts) -> float32 [n, dim]`` unit rows).
        engine: a :class:`~lazyattn_rag.llm.LazyAttention` to keep in step: :meth:`upsert`
            registers (or updates) documents with it, :meth:`delete` removes them and their K/V.

    Thread safety: every public method may be called from several threads (one lock).

    Example::

        store = FaissDocumentStore(SentenceEmbedder(), engine=llm)
        store.upsert([Document("py-for", "The for statement iterates over ...")])
        [(doc, score)] = store.search("How does a for loop work?", k=1)
    """

    def __init__(self, embedder: "SentenceEmbedder", engine: "LazyAttention | None" = None):
        import faiss

        self.embedder = embedder
        self.engine = engine
        self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(embedder.dim))
        self._docs: dict[str, Document] = {}
        self._int_ids: dict[str, int] = {}
        self._str_ids: dict[int, str] = {}
        self._next_id = 0
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._docs)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._docs

    def get(self, doc_id: str) -> Document:
        """The stored document. Raises :class:`UnknownDocumentError`."""
        try:
            return self._docs[doc_id]
        except KeyError:
            raise UnknownDocumentError(f"unknown document id {doc_id!r} in the FAISS store") from None

    @_locked
    def documents(self) -> list[Document]:
        """All documents, in insertion order."""
        return list(self._docs.values())

    @_locked
    def upsert(self, documents: Iterable[Document]) -> list[str]:
        """Add new documents and replace the text of existing ids (re-embedded, same id).

        Returns:
            ids that were added or whose text changed (unchanged documents are skipped).
        Raises:
            ValueError: an empty id or empty text, or the same id twice in one call; with an
                engine attached, what its ``add_documents`` raises (e.g. ``DocumentTooLongError``).
                Nothing is changed then.
        """
        todo: dict[str, Document] = {}
        for d in documents:
            if not isinstance(d.id, str) or not d.id:
                raise ValueError(f"document id must be a non-empty string, got {d.id!r}")
            if not d.text or not d.text.strip():
                raise ValueError(f"document {d.id!r} has empty text")
            if d.id in todo:
                raise ValueError(f"document id {d.id!r} appears twice in one upsert")
            old = self._docs.get(d.id)
            if old is None or old.text != d.text or old.metadata != d.metadata:
                todo[d.id] = d
        if not todo:
            return []
        if self.engine is not None:  # first, all or none: a document the engine refuses changes nothing
            self.engine.add_documents(list(todo.values()))
        vectors = self.embedder.encode([d.text for d in todo.values()])
        replaced = [self._int_ids[i] for i in todo if i in self._int_ids]
        if replaced:
            self.index.remove_ids(np.asarray(replaced, dtype=np.int64))
        int_ids = []
        for doc_id, doc in todo.items():
            if doc_id not in self._int_ids:
                self._int_ids[doc_id], self._str_ids[self._next_id] = self._next_id, doc_id
                self._next_id += 1
            int_ids.append(self._int_ids[doc_id])
            self._docs[doc_id] = doc
        self.index.add_with_ids(vectors, np.asarray(int_ids, dtype=np.int64))
        return list(todo)

    @_locked
    def delete(self, doc_ids: Iterable[str]) -> None:
        """Remove documents from the index (and from the attached engine with their K/V).

        Raises:
            UnknownDocumentError: an id not in the store (nothing is removed then).
        """
        ids = list(dict.fromkeys(doc_ids))
        for d in ids:
            if d not in self._docs:
                raise UnknownDocumentError(f"unknown document id {d!r} in the FAISS store")
        self.index.remove_ids(np.asarray([self._int_ids[d] for d in ids], dtype=np.int64))
        for d in ids:
            del self._docs[d]
            del self._str_ids[self._int_ids.pop(d)]
            if self.engine is not None and self.engine.has_document(d):
                self.engine.remove_document(d)

    def search(self, query: str, k: int) -> list[tuple[Document, float]]:
        """The ``k`` documents most similar to ``query``, best first, with cosine scores.

        Returns fewer than ``k`` when the store holds fewer (never padding).

        Raises:
            ValueError: ``k < 1`` or an empty query.
        """
        if not isinstance(query, str) or not query.strip():
            raise ValueError("the query is empty")
        return self.search_vector(self.embedder.encode([query])[0], k)

    @_locked
    def search_vector(self, vector: Any, k: int) -> list[tuple[Document, float]]:
        """Like :meth:`search` for a query embedding ``[dim]`` (unit length)."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        n = min(k, self.index.ntotal)
        if n == 0:
            return []
        query = np.asarray(vector, dtype=np.float32).reshape(1, -1)
        if query.shape[1] != self.embedder.dim:
            raise ValueError(f"query vector has {query.shape[1]} dimensions, the index {self.embedder.dim}")
        scores, ids = self.index.search(query, n)
        return [(self._docs[self._str_ids[int(i)]], float(s)) for s, i in zip(scores[0], ids[0]) if i != -1]

    # --- persistence ----------------------------------------------------------------------
    @_locked
    def save(self, directory: str | Path) -> Path:
        """Write the index, the documents and the embedder's name under ``directory``."""
        import faiss

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self.index, str(out / _INDEX_FILE))
        with open(out / _DOCS_FILE, "w", encoding="utf-8") as f:
            for d in self._docs.values():
                f.write(json.dumps({"id": d.id, "int_id": self._int_ids[d.id], "text": d.text,
                                    "metadata": d.metadata}, ensure_ascii=False) + "\n")
        meta = {"format": _FORMAT, "embedder": self.embedder.name, "dim": self.embedder.dim,
                "next_id": self._next_id}
        (out / _META_FILE).write_text(json.dumps(meta))
        return out

    @classmethod
    def load(cls, directory: str | Path, embedder: "SentenceEmbedder",
             engine: "LazyAttention | None" = None) -> "FaissDocumentStore":
        """Read a store written by :meth:`save`.

        Raises:
            FileNotFoundError: a file is missing.
            ValueError: written by another embedder or format, or index and documents disagree.
        """
        import faiss

        src = Path(directory)
        meta = json.loads((src / _META_FILE).read_text())
        if meta.get("format") != _FORMAT or meta.get("embedder") != embedder.name or meta.get("dim") != embedder.dim:
            raise ValueError(f"index in {src} was built with {meta.get('embedder')!r} (dim {meta.get('dim')}, "
                             f"format {meta.get('format')}); this embedder is {embedder.name!r} (dim {embedder.dim})")
        store = cls(embedder, engine)
        store.index = faiss.read_index(str(src / _INDEX_FILE))
        with open(src / _DOCS_FILE, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                store._docs[row["id"]] = Document(row["id"], row["text"], row["metadata"])
                store._int_ids[row["id"]], store._str_ids[row["int_id"]] = row["int_id"], row["id"]
        store._next_id = meta["next_id"]
        if store.index.ntotal != len(store._docs):
            raise ValueError(f"{src}: the index holds {store.index.ntotal} vectors but there are "
                             f"{len(store._docs)} documents")
        if engine is not None:
            engine.add_documents(list(store._docs.values()))
        return store
