"""The FAISS document store as a LlamaIndex vector store, kept in step with the engine.

:class:`FaissVectorStore` is a ``BasePydanticVectorStore`` over a
:class:`~lazyattn_rag.integrations.faiss_store.FaissDocumentStore`, so the LlamaIndex idioms
work unchanged and every node they add is registered with an attached engine (that is how
prompts find the node for K/V reuse)::

    from llama_index.core import StorageContext, VectorStoreIndex
    from lazyattn_rag.integrations.embeddings import llamaindex_embedding
    from lazyattn_rag.integrations.llamaindex_store import FaissVectorStore

    vector_store = FaissVectorStore(engine=llm.engine)
    index = VectorStoreIndex.from_documents(
        docs, storage_context=StorageContext.from_defaults(vector_store=vector_store),
        embed_model=llamaindex_embedding())
    vector_store.persist("storage/default__vector_store")        # or storage_context.persist("storage")
    index = VectorStoreIndex.from_vector_store(FaissVectorStore.from_persist_dir("storage", engine=llm.engine),
                                               embed_model=llamaindex_embedding())

Node ids are the stable document ids the engine sees; a node's engine text is its content as
LlamaIndex shows it to an LLM (``MetadataMode.LLM``), as the synthesizer passes it. The node
itself (type, metadata, relationships, templates) is kept in the document's metadata the way
LlamaIndex's own stores keep it (``_node_content``), so retrieval returns the node that was
added. ``delete(ref_doc_id)`` removes every node of that source document from the index and
the engine. Adds and deletes are all or none across store and engine (a node the engine refuses
changes nothing); LlamaIndex's ``update_ref_doc`` is a delete then an add, so a refused new text
leaves the old nodes deleted: re-``add`` nodes under their ids to replace them all or none. Metadata filters, ``node_ids`` and ``doc_ids`` restrict a query exactly (every
vector is scored); other query modes (hybrid, MMR) are refused.

Needs the ``llamaindex`` and ``faiss`` extras.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TextNode
from llama_index.core.vector_stores.simple import DEFAULT_PERSIST_FNAME, DEFAULT_VECTOR_STORE, NAMESPACE_SEP
from llama_index.core.vector_stores.types import (
    DEFAULT_PERSIST_DIR,
    BasePydanticVectorStore,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryMode,
    VectorStoreQueryResult,
)
from llama_index.core.vector_stores.utils import (
    build_metadata_filter_fn,
    metadata_dict_to_node,
    node_to_metadata_dict,
)

from lazyattn_rag.types.documents import Document
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
from lazyattn_rag.integrations.llamaindex import node_document

if TYPE_CHECKING:
    from lazyattn_rag.llm import LazyAttention

__all__ = ["FaissVectorStore", "node_from_document", "node_to_document"]

_NODE_CONTENT = "_node_content"


def node_to_document(node: BaseNode) -> Document:
    """The stored document of a node: its id, its LLM-mode content (the engine's text), and the
    serialized node in the metadata (its raw text left out when it equals that content)."""
    doc = node_document(node)
    raw = node.get_content(metadata_mode=MetadataMode.NONE)
    meta = node_to_metadata_dict(node, remove_text=raw == doc.text, flat_metadata=False)
    return Document(doc.id, doc.text, meta)


def node_from_document(doc: Document) -> BaseNode:
    """The node of a stored document; a document added without a node (through the core store
    or LangChain) becomes a ``TextNode`` whose metadata is shown to neither LLM nor embedder."""
    if _NODE_CONTENT not in doc.metadata:
        keys = list(doc.metadata)
        return TextNode(id_=doc.id, text=doc.text, metadata=dict(doc.metadata), excluded_llm_metadata_keys=keys,
                        excluded_embed_metadata_keys=keys)
    node = metadata_dict_to_node(doc.metadata)
    if not node.get_content(metadata_mode=MetadataMode.NONE):
        node.set_content(doc.text)
    return node


def _directory(persist_path: str | Path, fs: Any) -> Path:
    """LlamaIndex names a vector store's file ``<dir>/<namespace>__vector_store.json``; ours is
    the folder of that name without ``.json``."""
    if fs is not None and type(fs).__name__ != "LocalFileSystem":
        raise NotImplementedError(f"FaissVectorStore persists to the local file system only, not {type(fs).__name__}")
    path = Path(persist_path)
    return path.with_suffix("") if path.suffix == ".json" else path


class FaissVectorStore(BasePydanticVectorStore):
    """A LlamaIndex vector store over a :class:`FaissDocumentStore` (exact cosine similarity).

    Args:
        store: the document store to expose; ``None`` = a new empty one (its dimension is the
            first embeddings').
        engine: a :class:`~lazyattn_rag.llm.LazyAttention` to keep in step: the store's
            documents are registered with it now (all or none), added nodes as they come,
            deleted ones are removed with their K/V.
        embed_model_name: the embedding model's name for a new store (recorded by
            :meth:`persist`, named in dimension errors); e.g.
            ``embedding_model_name()`` = ``"all-MiniLM-L6-v2"``.

    Raises (from :meth:`add` and :meth:`query`):
        EmbeddingDimensionError: embeddings of another dimension than the index's (the message
            names both and the index's model). ValueError: a node without an embedding, an
            unsupported query mode, a query without an embedding.
    """

    stores_text: bool = True
    flat_metadata: bool = False
    _store: FaissDocumentStore = PrivateAttr()

    def __init__(self, store: FaissDocumentStore | None = None, engine: "LazyAttention | None" = None,
                 embed_model_name: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._store = store if store is not None else FaissDocumentStore(embedder_name=embed_model_name)
        if engine is not None:
            self._store.attach_engine(engine)

    @classmethod
    def class_name(cls) -> str:
        return "LazyAttentionFaissVectorStore"

    @property
    def client(self) -> FaissDocumentStore:
        """The underlying :class:`FaissDocumentStore` (also usable by the ``FaissRetriever``s)."""
        return self._store

    # --- writing ----------------------------------------------------------------------------
    def add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        """Add or update nodes (with their embeddings) under their node ids; returns the ids."""
        nodes = list(nodes)
        vectors = []
        for n in nodes:
            if n.embedding is None:
                raise ValueError(f"node {n.node_id!r} has no embedding: add nodes through a VectorStoreIndex "
                                 "(it embeds them with its embed_model) or set node.embedding")
            vectors.append(n.embedding)
        if nodes:
            self._store.upsert([node_to_document(n) for n in nodes], vectors=vectors)
        return [n.node_id for n in nodes]

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """Remove every node whose source document is ``ref_doc_id`` (none: nothing happens)."""
        self._store.delete([d.id for d in self._store.documents() if d.metadata.get("ref_doc_id") == ref_doc_id])

    def delete_nodes(self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None,
                     **delete_kwargs: Any) -> None:
        """Remove the nodes with these ids (unknown ids are ignored) that match ``filters``.

        Raises:
            ValueError: neither ``node_ids`` nor ``filters`` (use :meth:`clear` to remove all).
        """
        if node_ids is None and filters is None:
            raise ValueError("delete_nodes needs node_ids or filters (clear() removes every node)")
        self._store.delete([d.id for d in self._selected(node_ids, filters)])

    def clear(self) -> None:
        """Remove every node (and, with an engine attached, their documents and K/V)."""
        self._store.delete([d.id for d in self._store.documents()])

    # --- reading ----------------------------------------------------------------------------
    def get_nodes(self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None) -> list[BaseNode]:
        """The stored nodes with these ids (all when ``None``) that match ``filters``."""
        return [node_from_document(d) for d in self._selected(node_ids, filters)]

    def _selected(self, node_ids: list[str] | None, filters: MetadataFilters | None) -> list[Document]:
        docs = self._store.documents()
        if node_ids is not None:
            wanted = set(node_ids)
            docs = [d for d in docs if d.id in wanted]
        if filters is not None:
            keep = build_metadata_filter_fn(lambda i: self._store.get(i).metadata, filters)
            docs = [d for d in docs if keep(d.id)]
        return docs

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """The ``query.similarity_top_k`` nodes most similar to ``query.query_embedding``, best
        first, with cosine similarities; ``filters``, ``node_ids`` and ``doc_ids`` restrict them."""
        if query.mode != VectorStoreQueryMode.DEFAULT:
            raise ValueError(f"FaissVectorStore answers dense queries only (mode 'default'), not {query.mode.value!r}")
        if query.query_embedding is None:
            raise ValueError("the query has no embedding (query_embedding is None)")
        accept = None  # empty node_ids / doc_ids restrict nothing (VectorIndexRetriever sends node_ids=[])
        if query.filters is not None or query.node_ids or query.doc_ids:
            keep = build_metadata_filter_fn(lambda i: self._store.get(i).metadata, query.filters)
            node_ids = set(query.node_ids) if query.node_ids else None
            doc_ids = set(query.doc_ids) if query.doc_ids else None

            def accept(d: Document) -> bool:
                return (keep(d.id) and (node_ids is None or d.id in node_ids)
                        and (doc_ids is None or d.metadata.get("ref_doc_id") in doc_ids))

        hits = self._store.search_vector(query.query_embedding, query.similarity_top_k, accept=accept)
        return VectorStoreQueryResult(nodes=[node_from_document(d) for d, _ in hits],
                                      similarities=[s for _, s in hits], ids=[d.id for d, _ in hits])

    # --- persistence ------------------------------------------------------------------------
    def persist(self, persist_path: str, fs: Any = None) -> None:
        """Save under the folder ``persist_path`` (a trailing ``.json``, as ``StorageContext.persist``
        passes it, is dropped). Raises NotImplementedError for a non-local ``fs``."""
        self._store.save(_directory(persist_path, fs))

    @classmethod
    def from_persist_path(cls, persist_path: str | Path, engine: "LazyAttention | None" = None,
                          fs: Any = None) -> "FaissVectorStore":
        """Load what :meth:`persist` wrote at ``persist_path``; ``engine`` as in the constructor.

        Raises:
            FileNotFoundError: nothing there. ValueError: an unreadable or inconsistent store.
        """
        return cls(FaissDocumentStore.load(_directory(persist_path, fs)), engine=engine)

    @classmethod
    def from_persist_dir(cls, persist_dir: str | Path = DEFAULT_PERSIST_DIR, engine: "LazyAttention | None" = None,
                         namespace: str = DEFAULT_VECTOR_STORE, fs: Any = None) -> "FaissVectorStore":
        """Load the store that ``StorageContext.persist(persist_dir)`` wrote for ``namespace``."""
        return cls.from_persist_path(Path(persist_dir) / f"{namespace}{NAMESPACE_SEP}{DEFAULT_PERSIST_FNAME}",
                                     engine=engine, fs=fs)
