"""The FAISS document store as a LangChain ``VectorStore``, kept in step with the engine.

:class:`FaissVectorStore` wraps a :class:`~lazyattn_rag.integrations.faiss_store.FaissDocumentStore`
with LangChain's interface (``add_texts``, ``add_documents``, ``similarity_search`` and
``..._with_score``, ``delete``, ``get_by_ids``, ``from_texts``, ``as_retriever``), so the
LangChain idioms work unchanged and every text they add is registered with an attached engine
(that is how prompts find it for K/V reuse)::

    from lazyattn_rag.integrations.embeddings import langchain_embeddings
    from lazyattn_rag.integrations.langchain import ChatLazyAttention, rag_chain
    from lazyattn_rag.integrations.langchain_store import FaissVectorStore

    store = FaissVectorStore.from_texts(texts, langchain_embeddings(), ids=ids, engine=engine)
    chain = rag_chain(store.as_retriever(search_kwargs={"k": 3}), ChatLazyAttention(engine=engine))
    store.save_local("my_index");  store = FaissVectorStore.load_local("my_index", langchain_embeddings())

Ids are stable strings (a random UUID where none is given); adding an existing id replaces its
text (upsert), as ``InMemoryVectorStore`` does. Retrieved ``Document``s carry their id, which
the chat model uses to place the document's cached K/V. Scores are cosine similarities
(``similarity_search_with_relevance_scores`` maps them to ``[0, 1]`` as ``(1 + s) / 2``).
Persistence is the store's own format (FAISS index, JSON lines, no pickle).

Needs the ``langchain`` and ``faiss`` extras.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from langchain_core.documents import Document as LCDocument
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from lazyattn_rag.types.documents import Document
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore

if TYPE_CHECKING:
    from lazyattn_rag.llm import LazyAttention

__all__ = ["FaissVectorStore", "embeddings_name"]


def embeddings_name(embedding: Embeddings) -> str:
    """A name for a LangChain embeddings object: ``embedding_model_name`` of its ``model_name``
    folder where it has one (``HuggingFaceEmbeddings``), else its class name."""
    from lazyattn_rag.integrations.embeddings import embedding_model_name

    model = getattr(embedding, "model_name", None) or getattr(embedding, "model", None)
    if isinstance(model, str) and model:
        return embedding_model_name(model) if Path(model).is_dir() else model
    return type(embedding).__name__


def _lc_document(doc: Document) -> LCDocument:
    return LCDocument(id=doc.id, page_content=doc.text, metadata=dict(doc.metadata))


class FaissVectorStore(VectorStore):
    """A LangChain ``VectorStore`` over a :class:`FaissDocumentStore` (exact cosine similarity).

    Args:
        embedding: the LangChain ``Embeddings`` for texts and queries (e.g.
            :func:`~lazyattn_rag.integrations.embeddings.langchain_embeddings`).
        store: the document store to expose; ``None`` = a new empty one.
        engine: a :class:`~lazyattn_rag.llm.LazyAttention` to keep in step: the store's
            documents are registered with it now (all or none), added texts as they come,
            deleted ones are removed with their K/V.

    Raises (from adding and searching):
        EmbeddingDimensionError: ``embedding`` gives vectors of another dimension than the
            index's (the message names both dimensions and both models).
    """

    def __init__(self, embedding: Embeddings, store: FaissDocumentStore | None = None,
                 engine: "LazyAttention | None" = None):
        self.embedding = embedding
        self.embedding_name = embeddings_name(embedding)
        self.store = store if store is not None else FaissDocumentStore(embedder_name=self.embedding_name)
        if engine is not None:
            self.store.attach_engine(engine)

    @property
    def embeddings(self) -> Embeddings:
        return self.embedding

    # --- writing ----------------------------------------------------------------------------
    def add_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, *,
                  ids: list[str | None] | None = None, **kwargs: Any) -> list[str]:
        """Embed and add (or replace) texts; returns their ids (a UUID where an id is ``None``).

        Raises:
            ValueError: ``metadatas`` / ``ids`` of another length than ``texts``, an empty text,
                an id twice. EmbeddingDimensionError: see the class.
        """
        texts = list(texts)
        for name, values in (("metadatas", metadatas), ("ids", ids)):
            if values is not None and len(values) != len(texts):
                raise ValueError(f"{len(texts)} texts but {len(values)} {name}")
        ids = [i if i else str(uuid.uuid4()) for i in (ids or [None] * len(texts))]
        metadatas = metadatas or [{} for _ in texts]
        docs = [Document(i, t, dict(m or {})) for i, t, m in zip(ids, texts, metadatas)]
        self.store.upsert(docs, embed=self.embedding.embed_documents, embedder_name=self.embedding_name)
        return ids

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        """Remove documents by id (all of them when ``ids`` is ``None``), from the store and an
        attached engine; ids the store does not hold are skipped (LangChain's contract: deleting
        what is not there is no error). Returns ``True``."""
        self.store.delete([d.id for d in self.store.documents()] if ids is None else
                          [i for i in ids if i in self.store])
        return True

    # --- reading ----------------------------------------------------------------------------
    def get_by_ids(self, ids: Sequence[str], /) -> list[LCDocument]:
        """The documents with these ids, in that order; unknown ids are skipped."""
        return [_lc_document(self.store.get(i)) for i in ids if i in self.store]

    def similarity_search_with_score_by_vector(self, embedding: list[float], k: int = 4,
                                               filter: dict | Callable[[dict], bool] | None = None,
                                               **kwargs: Any) -> list[tuple[LCDocument, float]]:
        """The ``k`` documents most similar to a query vector, best first, with cosine scores.

        ``filter``: a dict of metadata values every result must equal, or a predicate on the
        metadata (exact: every vector is scored).
        """
        accept = None
        if callable(filter):
            accept = lambda d: filter(d.metadata)  # noqa: E731
        elif filter:
            accept = lambda d: all(d.metadata.get(key) == value for key, value in filter.items())  # noqa: E731
        hits = self.store.search_vector(embedding, k, embedder_name=self.embedding_name, accept=accept)
        return [(_lc_document(d), s) for d, s in hits]

    def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> list[tuple[LCDocument, float]]:
        """The ``k`` documents most similar to ``query``, best first, with cosine scores."""
        return self.similarity_search_with_score_by_vector(self.embedding.embed_query(query), k, **kwargs)

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, **kwargs: Any) -> list[LCDocument]:
        return [d for d, _ in self.similarity_search_with_score_by_vector(embedding, k, **kwargs)]

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[LCDocument]:
        """The ``k`` documents most similar to ``query``, best first (fewer if the store holds fewer)."""
        return [d for d, _ in self.similarity_search_with_score(query, k, **kwargs)]

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return lambda cosine: (1.0 + cosine) / 2.0

    # --- construction and persistence -------------------------------------------------------
    @classmethod
    def from_texts(cls, texts: list[str], embedding: Embeddings, metadatas: list[dict] | None = None, *,
                   ids: list[str] | None = None, engine: "LazyAttention | None" = None,
                   **kwargs: Any) -> "FaissVectorStore":
        """A new store holding ``texts`` (``engine`` as in the constructor)."""
        store = cls(embedding, engine=engine)
        store.add_texts(texts, metadatas, ids=ids)
        return store

    def save_local(self, folder_path: str | Path) -> Path:
        """Write the index and documents under ``folder_path`` (the store's own format)."""
        return self.store.save(folder_path)

    @classmethod
    def load_local(cls, folder_path: str | Path, embeddings: Embeddings,
                   engine: "LazyAttention | None" = None) -> "FaissVectorStore":
        """Read what :meth:`save_local` (or ``FaissDocumentStore.save``) wrote.

        Raises:
            FileNotFoundError: nothing there. ValueError: built with another embedding model (by
                name), or an inconsistent store.
        """
        name = embeddings_name(embeddings)
        return cls(embeddings, FaissDocumentStore.load(folder_path, embedder_name=name), engine=engine)
