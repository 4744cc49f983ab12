"""A FAISS document store with stable string ids, kept in step with the engine's KV cache.

faiss-cpu holds the vectors (``IndexIDMap2`` over an exact inner-product ``IndexFlatIP``; every
vector is L2-normalized on the way in, so scores are cosine similarities); this class maps each
document's stable string id to a FAISS int64 id and keeps the texts. Updating a document
re-embeds it under the same id; deleting removes its vector. When an engine is attached, every
document added (or loaded, or held when :meth:`FaissDocumentStore.attach_engine` is called) is
registered with it, so prompts that contain the document's text reuse its K/V, and updates and
deletions reach the engine's registry too, so a stale or deleted document's cached K/V is
dropped with it. Each change is all or none across index, documents and engine: what can fail
(embedding, the engine's checks, the FAISS write) runs before anything is kept, and the
engine's registrations are put back if the index write fails after the engine accepted.

Framework-neutral. The frameworks see it through adapters: ``llamaindex_store.FaissVectorStore``
(a LlamaIndex vector store), ``langchain_store.FaissVectorStore`` (a LangChain ``VectorStore``),
and the ``FaissRetriever`` classes. Vectors come either from the store's own embedder
(:class:`~lazyattn_rag.integrations.embeddings.SentenceEmbedder`) or from the caller (a
framework's embedding model): every batch is checked against the index's dimension, and a
mismatch raises :class:`EmbeddingDimensionError` naming both dimensions and both embedders.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lazyattn_rag.integrations.faiss_io import (EmbeddingDimensionError, read_index, read_meta, read_rows, swap_vectors,
                                                unit_vectors, write_store)
from lazyattn_rag.types.documents import Document
from lazyattn_rag.types.errors import UnknownDocumentError

if TYPE_CHECKING:
    from lazyattn_rag.integrations.embeddings import SentenceEmbedder
    from lazyattn_rag.llm import LazyAttention

logger = logging.getLogger("lazyattn_rag.integrations")
__all__ = ["EmbeddingDimensionError", "FaissDocumentStore"]


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def _check_json(doc: Document) -> None:
    try:
        json.dumps(doc.metadata)
    except (TypeError, ValueError) as error:
        raise ValueError(f"document {doc.id!r} has metadata that cannot be saved as JSON ({error}); "
                         "convert such values (dates, objects) to strings first") from None


class FaissDocumentStore:
    """Documents in a FAISS inner-product index.

    Args:
        embedder: a :class:`~lazyattn_rag.integrations.embeddings.SentenceEmbedder` (or any
            object with ``name``, ``dim`` and ``encode(texts) -> float32 [n, dim]``): embeds
            texts for :meth:`upsert` and :meth:`search`. ``None``: vectors come from the caller
            (``upsert(docs, vectors=...)``, :meth:`search_vector`), as the framework adapters do.
        engine: a :class:`~lazyattn_rag.llm.LazyAttention` to keep in step: :meth:`upsert`
            registers (or updates) documents with it, :meth:`delete` removes them and their K/V.
        dim: the vectors' dimension without an embedder; ``None`` = set by the first vectors added.
        embedder_name: the embedding model's name without an embedder (recorded by :meth:`save`
            and named in errors); with one, its ``name``.

    Raises:
        ValueError: ``dim`` disagrees with ``embedder.dim``, or is not a positive integer.

    Thread safety: every public method may be called from several threads (one lock).

    Example::

        store = FaissDocumentStore(SentenceEmbedder(), engine=llm)
        store.upsert([Document("py-for", "The for statement iterates over ...")])
        [(doc, score)] = store.search("How does a for loop work?", k=1)
    """

    def __init__(self, embedder: "SentenceEmbedder | None" = None, engine: "LazyAttention | None" = None, *,
                 dim: int | None = None, embedder_name: str | None = None):
        if embedder is not None:
            if dim is not None and dim != embedder.dim:
                raise ValueError(f"dim={dim} but the embedder {embedder.name!r} gives {embedder.dim}")
            dim, embedder_name = int(embedder.dim), embedder.name
        if dim is not None and (not isinstance(dim, int) or dim < 1):
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        self.embedder = embedder
        self.engine = engine
        self.embedder_name = embedder_name
        self.index = self._new_index(dim) if dim is not None else None
        self._docs: dict[str, Document] = {}
        self._int_ids: dict[str, int] = {}
        self._str_ids: dict[int, str] = {}
        self._next_id = 0
        self._lock = threading.RLock()

    @staticmethod
    def _new_index(dim: int):
        import faiss

        return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))

    @property
    def dim(self) -> int | None:
        """The vectors' dimension (``None`` until the first vectors of a store built without one)."""
        return None if self.index is None else int(self.index.d)

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
    def attach_engine(self, engine: "LazyAttention") -> None:
        """Register every stored document with ``engine`` (all or none), then keep it in step
        (later upserts and deletions reach it). Raises what ``engine.add_documents`` raises."""
        engine.add_documents(list(self._docs.values()))
        self.engine = engine

    # --- vectors ----------------------------------------------------------------------------
    def _encoder(self, embed: Callable[[list[str]], Any] | None) -> Callable[[list[str]], Any]:
        if embed is not None:
            return embed
        if self.embedder is None:
            raise ValueError("this store has no embedder: pass vectors= (or embed=), or go through a framework "
                             "adapter (llamaindex_store / langchain_store)")
        return self.embedder.encode

    def _embed_documents(self, docs: list[Document], embed: Callable[[list[str]], Any] | None) -> Any:
        """Embed ``docs``' texts; the store's own :class:`SentenceEmbedder` is told their ids, so
        its warning about a text longer than its input names the document."""
        from lazyattn_rag.integrations.embeddings import SentenceEmbedder

        texts = [d.text for d in docs]
        if embed is None and isinstance(self.embedder, SentenceEmbedder):
            return self.embedder.encode(texts, ids=[d.id for d in docs])
        return self._encoder(embed)(texts)

    # --- writing ----------------------------------------------------------------------------
    @_locked
    def upsert(self, documents: Iterable[Document], vectors: Any = None, *,
               embed: Callable[[list[str]], Any] | None = None, embedder_name: str | None = None) -> list[str]:
        """Add new documents and replace the text of existing ids (re-embedded, same id).

        Args:
            documents: the documents; unchanged ones (same text and metadata) are skipped.
            vectors: their embeddings, ``[len(documents), dim]`` (any float array-like), aligned
                with ``documents``; ``None`` = embed the changed texts with ``embed`` or the
                store's embedder.
            embed: ``texts -> [len(texts), dim]`` used instead of the store's embedder.
            embedder_name: the model behind ``vectors`` / ``embed``, for error messages and for
                a store that has no name yet.
        Returns:
            ids that were added or whose text changed (unchanged documents are skipped).
        Raises:
            ValueError: an empty id or empty text, the same id twice in one call, metadata that
                cannot be saved as JSON (a ``date``, say: convert it first); no embedder and no
                vectors. EmbeddingDimensionError: vectors of another dimension than the
                index's. With an engine attached, what its ``add_documents`` raises (e.g.
                ``DocumentTooLongError``). Nothing is changed in any of these cases, in the store
                or the engine: the engine checks the whole batch before the index changes, and an
                error while the index is written (out of memory) puts the engine's registrations
                back.
        Warns:
            EmbeddingTruncationWarning: the store's own :class:`SentenceEmbedder` embeds a text
                longer than its input (one warning per document, naming it and both lengths).
        """
        documents = list(documents)
        todo: dict[str, Document] = {}
        for d in documents:
            if not isinstance(d.id, str) or not d.id:
                raise ValueError(f"document id must be a non-empty string, got {d.id!r}")
            if not isinstance(d.text, str) or not d.text.strip():
                raise ValueError(f"document {d.id!r} has empty text")
            if d.id in todo:
                raise ValueError(f"document id {d.id!r} appears twice in one upsert")
            _check_json(d)
            old = self._docs.get(d.id)
            if old is None or old.text != d.text or old.metadata != d.metadata:
                todo[d.id] = d
        source = embedder_name or (self.embedder_name if vectors is None and embed is None else None)
        if vectors is not None:
            arr = unit_vectors(vectors, len(documents), self.dim, self.embedder_name, source, "the vectors")
            rows = {d.id: i for i, d in enumerate(documents)}
            arr = arr[[rows[i] for i in todo]]
        elif todo:
            arr = unit_vectors(self._embed_documents(list(todo.values()), embed), len(todo), self.dim,
                               self.embedder_name, source, "the embeddings")
        if not todo:
            return []
        # Everything that can fail is done before anything changes: the index made (a store
        # without a dimension takes the first vectors'), then the engine (all or none), then the
        # index (all or none: new vectors go in under fresh FAISS ids before the old ones leave),
        # and only then the maps, by plain assignment.
        index = self.index if self.index is not None else self._new_index(arr.shape[1])
        fresh = {doc_id: self._next_id + k for k, doc_id in enumerate(todo)}
        stale = [self._int_ids[i] for i in todo if i in self._int_ids]
        before = self._engine_texts(list(todo))
        if self.engine is not None:
            self.engine.add_documents(list(todo.values()))
        try:
            swap_vectors(index, arr, list(fresh.values()), stale)
        except BaseException:
            self._restore_engine(before)
            raise
        if self.index is None:
            self.index = index
            self.embedder_name = self.embedder_name or source
        for doc_id, int_id in fresh.items():
            if doc_id in self._int_ids:
                del self._str_ids[self._int_ids[doc_id]]
            self._int_ids[doc_id], self._str_ids[int_id] = int_id, doc_id
            self._docs[doc_id] = todo[doc_id]
        self._next_id += len(fresh)
        return list(todo)

    @_locked
    def delete(self, doc_ids: Iterable[str]) -> None:
        """Remove documents from the index (and from the attached engine with their K/V).

        All or none: the engine's registrations go first; if the engine refuses one (shut down,
        say), those already removed are registered again and the store is unchanged.

        Raises:
            UnknownDocumentError: an id not in the store (nothing is removed then). What the
            engine's ``remove_document`` raises (nothing is removed then).
        """
        ids = list(dict.fromkeys(doc_ids))
        for d in ids:
            if d not in self._docs:
                raise UnknownDocumentError(f"unknown document id {d!r} in the FAISS store")
        if not ids:
            return
        before = self._engine_texts(ids)
        try:
            for d, text in (before or {}).items():
                if text is not None:
                    try:
                        self.engine.remove_document(d)
                    except UnknownDocumentError:  # removed meanwhile by someone else: gone either way
                        pass
            swap_vectors(self.index, None, [], [self._int_ids[d] for d in ids])
        except BaseException:
            self._restore_engine(before)
            raise
        for d in ids:
            del self._docs[d]
            del self._str_ids[self._int_ids.pop(d)]

    # --- keeping the engine in step ---------------------------------------------------------
    def _engine_texts(self, doc_ids: list[str]) -> dict[str, str | None] | None:
        """The attached engine's registered text of each id (``None``: not registered), to put
        back if a change fails part way; ``None`` without an engine."""
        if self.engine is None:
            return None
        texts = self.engine.document_texts(doc_ids)
        return {d: texts.get(d) for d in doc_ids}

    def _restore_engine(self, before: dict[str, str | None] | None) -> None:
        """Put the engine's registrations of these ids back as :meth:`_engine_texts` found them.
        A failure here is logged, not raised: the caller re-raises the error that started it."""
        if before is None:
            return
        try:
            back = [(d, text) for d, text in before.items() if text is not None]
            if back:
                self.engine.add_documents(back)
            for d, text in before.items():
                if text is None and self.engine.has_document(d):
                    self.engine.remove_document(d)
        except Exception:
            logger.exception("could not restore the engine's registrations of %s after a failed store change; "
                             "call attach_engine(engine) again to re-register the store's documents", list(before))

    # --- searching --------------------------------------------------------------------------
    def search(self, query: str, k: int) -> list[tuple[Document, float]]:
        """The ``k`` documents most similar to ``query``, best first, with cosine scores.

        Returns fewer than ``k`` when the store holds fewer (never padding).

        Raises:
            ValueError: ``k < 1``, an empty query, or a store without an embedder.
            EmbeddingDimensionError: the embedder's vector does not fit the index.
        """
        if not isinstance(query, str) or not query.strip():
            raise ValueError("the query is empty")
        return self.search_vector(self._encoder(None)([query]), k, embedder_name=self.embedder_name)

    @_locked
    def search_vector(self, vector: Any, k: int, embedder_name: str | None = None,
                      accept: Callable[[Document], bool] | None = None) -> list[tuple[Document, float]]:
        """Like :meth:`search` for a query embedding ``[dim]`` (or ``[1, dim]``).

        Args:
            vector: the query's embedding (normalized here).
            k: at most this many results.
            embedder_name: the model behind ``vector``, named in a dimension error.
            accept: keep only documents it returns true for (exact: every vector is scored).
        Raises:
            ValueError: ``k < 1``. EmbeddingDimensionError: ``vector`` does not fit the index.
        """
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        if self.index is None:  # nothing was ever added: no dimension to check against
            return []
        query = unit_vectors(vector, 1, self.dim, self.embedder_name, embedder_name, "the query embedding")
        n = self.index.ntotal if accept is not None else min(k, self.index.ntotal)
        if n == 0:
            return []
        scores, ids = self.index.search(query, n)
        hits = [(self._docs[self._str_ids[int(i)]], float(s)) for s, i in zip(scores[0], ids[0]) if i != -1]
        if accept is not None:
            hits = [h for h in hits if accept(h[0])]
        return hits[:k]

    # --- persistence ------------------------------------------------------------------------
    @_locked
    def save(self, directory: str | Path) -> Path:
        """Write the index, the documents and the embedder's name under ``directory``
        (``integrations/faiss_io.py``).

        Raises:
            ValueError: the store never received a vector (its dimension is unknown).
        """
        if self.index is None:
            raise ValueError("nothing to save: the store has no dimension yet (add documents first)")
        rows = ({"id": d.id, "int_id": self._int_ids[d.id], "text": d.text, "metadata": d.metadata}
                for d in self._docs.values())
        meta = {"embedder": self.embedder_name, "dim": self.dim, "next_id": self._next_id}
        return write_store(Path(directory), self.index, rows, meta)

    @classmethod
    def load(cls, directory: str | Path, embedder: "SentenceEmbedder | None" = None,
             engine: "LazyAttention | None" = None, *, embedder_name: str | None = None) -> "FaissDocumentStore":
        """Read a store written by :meth:`save`.

        Args:
            directory: what :meth:`save` wrote.
            embedder: the store's embedder (must be the one it was built with); ``None`` for a
                store fed with vectors by a framework adapter.
            engine: registers every loaded document with it (all or none) and stays attached.
            embedder_name: without an embedder, the model the caller will embed with; checked
                against the saved name when both are known.
        Raises:
            FileNotFoundError: a file is missing.
            ValueError: written by another embedder or format, or index and documents disagree
                (EmbeddingDimensionError when only the dimension differs).
        """
        src = Path(directory)
        meta = read_meta(src, embedder.name if embedder is not None else embedder_name,
                         embedder.dim if embedder is not None else None)
        store = cls(embedder, None, dim=None if embedder is not None else int(meta["dim"]),
                    embedder_name=meta.get("embedder") if embedder is None else None)
        store.index = read_index(src)
        for row in read_rows(src):
            store._docs[row["id"]] = Document(row["id"], row["text"], row["metadata"])
            store._int_ids[row["id"]], store._str_ids[row["int_id"]] = row["int_id"], row["id"]
        store._next_id = meta["next_id"]
        if store.index.ntotal != len(store._docs) or store.dim != meta["dim"]:
            raise ValueError(f"{src}: the index holds {store.index.ntotal} vectors of dimension {store.dim} but "
                             f"there are {len(store._docs)} documents of dimension {meta['dim']}")
        if engine is not None:
            store.attach_engine(engine)
        return store
