"""LlamaIndex's id path: a response synthesizer that hands retrieved nodes to the engine by id, a
retriever over :class:`~lazyattn_rag.integrations.faiss_store.FaissDocumentStore`, a postprocessor
that warms nodes' K/V, and :func:`as_query_engine` wiring them (the names are importable from
``lazyattn_rag.integrations.llamaindex`` too, beside :class:`LazyAttentionLLM`)."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate, ChatPromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.types import BasePydanticVectorStore
from pydantic import Field

from lazyattn_rag.integrations import llamaindex_events
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
from lazyattn_rag.integrations.llamaindex import DOCUMENTS_KEY, SAMPLING_KEY, LazyAttentionLLM, node_document
from lazyattn_rag.integrations.requests import rag_request
from lazyattn_rag.types.documents import Document, content_id
from lazyattn_rag.types.sampling_params import SamplingParams

__all__ = ["FaissRetriever", "KVCacheWarmer", "LazyAttentionSynthesizer", "as_query_engine"]
_dispatcher = get_dispatcher(__name__)

_SYNTH_NODES: contextvars.ContextVar[list[NodeWithScore] | None] = contextvars.ContextVar(
    "lazyattn_synthesizer_nodes", default=None)


class LazyAttentionSynthesizer(BaseSynthesizer):
    """A response synthesizer that passes each node to the engine as ``(node_id, text)``.

    Nodes are placed in retrieval order, all in one call, in the engine's RAG prompt; a node
    whose K/V is cached costs no prefill at any rank. It emits LlamaIndex's synthesize and LLM
    events like the default synthesizers, and ``response.metadata["lazyattn"]`` holds the
    :class:`~lazyattn_rag.integrations.reuse_report.ReuseSummary` (``doc_ids``, ``stats``,
    ``finish_reason``; filled in when a stream ends).

    ``text_qa_template`` (``get_prompts``/``update_prompts``): ``None`` (default) uses the
    engine's prompt; a LlamaIndex prompt template is formatted with ``context_str`` and
    ``query_str`` and its nodes are placed from the cache wherever they occur in it. Empty
    retrieval answers through the prompt with no documents (no "Empty Response").

    Args:
        llm: the :class:`LazyAttentionLLM`.
        streaming: return a ``StreamingResponse`` (or ``AsyncStreamingResponse`` from ``asynthesize``).
        sampling: overrides ``llm.sampling`` for this synthesizer.
        text_qa_template: see above.
    """

    def __init__(self, llm: LazyAttentionLLM, streaming: bool = False, sampling: SamplingParams | None = None,
                 text_qa_template: BasePromptTemplate | None = None):
        if not isinstance(llm, LazyAttentionLLM):
            raise TypeError(f"LazyAttentionSynthesizer needs a LazyAttentionLLM, got {type(llm).__name__}")
        super().__init__(llm=llm, streaming=streaming)
        self._sampling = sampling or llm.sampling
        self._text_qa_template = text_qa_template

    def _get_prompts(self) -> dict:
        return {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts: dict) -> None:
        if "text_qa_template" in prompts:
            self._text_qa_template = prompts["text_qa_template"]

    def synthesize(self, query, nodes: list[NodeWithScore], additional_source_nodes=None, **kwargs: Any):
        token = _SYNTH_NODES.set(list(nodes))
        try:
            if nodes:
                return super().synthesize(query, nodes, additional_source_nodes, **kwargs)
            return self._synthesize_without_nodes(query, additional_source_nodes, **kwargs)
        finally:
            _SYNTH_NODES.reset(token)

    async def asynthesize(self, query, nodes: list[NodeWithScore], additional_source_nodes=None, **kwargs: Any):
        token = _SYNTH_NODES.set(list(nodes))
        try:
            if nodes:
                return await super().asynthesize(query, nodes, additional_source_nodes, **kwargs)
            return await self._asynthesize_without_nodes(query, additional_source_nodes, **kwargs)
        finally:
            _SYNTH_NODES.reset(token)

    def _synthesize_without_nodes(self, query, additional_source_nodes, **kwargs: Any):
        """Empty retrieval: the same events as a synthesis with nodes, the answer from no documents."""
        query = QueryBundle(query) if isinstance(query, str) else query
        _dispatcher.event(SynthesizeStartEvent(query=query))
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: query.query_str}) as event:
            text = self.get_response(query.query_str, [], **kwargs)
            response = self._prepare_response_output(text, list(additional_source_nodes or []))
            event.on_end(payload={EventPayload.RESPONSE: response})
        _dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    async def _asynthesize_without_nodes(self, query, additional_source_nodes, **kwargs: Any):
        query = QueryBundle(query) if isinstance(query, str) else query
        _dispatcher.event(SynthesizeStartEvent(query=query))
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: query.query_str}) as event:
            text = await self.aget_response(query.query_str, [], **kwargs)
            response = self._prepare_response_output(text, list(additional_source_nodes or []))
            event.on_end(payload={EventPayload.RESPONSE: response})
        _dispatcher.event(SynthesizeEndEvent(query=query, response=response))
        return response

    def _documents(self, text_chunks: Sequence[str]) -> list[dict]:
        """The documents behind ``text_chunks``: the synthesized nodes (ids), else content ids."""
        nodes = _SYNTH_NODES.get()
        if nodes is not None and len(nodes) == len(text_chunks):
            docs = [node_document(n) for n in nodes]
        else:
            docs = _content_documents(text_chunks)
        return [{"id": d.id, "text": d.text} for d in rag_request("", docs).documents]

    def _prompt(self, query_str: str, text_chunks: Sequence[str]) -> ChatPromptTemplate:
        """The call's messages as a template without variables (``LLM.predict`` then emits the
        same events as for LlamaIndex's own synthesizers). The id path's one message carries the
        documents by id; a custom template is formatted with ``context_str`` and ``query_str``
        and its nodes are found in it. The last message carries this synthesizer's sampling."""
        sampling = {SAMPLING_KEY: dataclasses.asdict(self._sampling)}
        if self._text_qa_template is None:
            extra = {DOCUMENTS_KEY: self._documents(text_chunks), **sampling}
            messages = [ChatMessage(role=MessageRole.USER, content=query_str, additional_kwargs=extra)]
        else:
            llamaindex_events.add_retrieved(_SYNTH_NODES.get() or [])  # placed wherever the template puts them
            context = "\n\n".join(c.strip() for c in text_chunks)
            messages = self._text_qa_template.format_messages(context_str=context, query_str=query_str)
            last = messages[-1]
            messages[-1] = last.model_copy(update={"additional_kwargs": {**last.additional_kwargs, **sampling}})
        return ChatPromptTemplate(message_templates=messages)

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any):
        prompt = self._prompt(query_str, text_chunks)
        return self._llm.stream(prompt) if self._streaming else self._llm.predict(prompt)

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any):
        prompt = self._prompt(query_str, text_chunks)
        return await (self._llm.astream(prompt) if self._streaming else self._llm.apredict(prompt))


def _content_documents(text_chunks: Sequence[str]) -> list[Document]:
    return [Document(content_id(t), t) for t in text_chunks if t.strip()]


class FaissRetriever(BaseRetriever):
    """A LlamaIndex retriever over a :class:`FaissDocumentStore`; node ids are the document ids.

    Args:
        store: the document store.
        similarity_top_k: how many documents to return (fewer when the store holds fewer).
    Raises:
        ValueError: ``similarity_top_k < 1``.
    """

    def __init__(self, store: FaissDocumentStore, similarity_top_k: int = 3, **kwargs: Any):
        if not isinstance(similarity_top_k, int) or similarity_top_k < 1:
            raise ValueError(f"similarity_top_k must be an integer >= 1, got {similarity_top_k!r}")
        super().__init__(**kwargs)
        self.store = store
        self.similarity_top_k = similarity_top_k

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        from lazyattn_rag.integrations.llamaindex_store import node_from_document  # (it imports this module)

        hits = self.store.search(query_bundle.query_str, self.similarity_top_k)
        return [NodeWithScore(node=node_from_document(doc), score=score) for doc, score in hits]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


class KVCacheWarmer(BaseNodePostprocessor):
    """A node postprocessor that registers nodes with the engine and encodes their K/V now.

    Retrieved nodes are found in prompts without it (see the module docstring); use it, or
    :meth:`warm` on ingested nodes, to pay their prefill before the first query. Nodes pass
    through unchanged.
    """

    llm: LazyAttentionLLM = Field(description="The LLM whose engine caches the nodes.")

    @classmethod
    def class_name(cls) -> str:
        return "KVCacheWarmer"

    def warm(self, nodes: Sequence[NodeWithScore | TextNode]) -> list[str]:
        """Register and encode ``nodes``; returns the ids encoded now (the others were cached).

        Blank nodes are skipped, as in a request.

        Raises:
            ValueError: one node id with two different texts (as the synthesizer does).
        """
        docs = rag_request("", [node_document(n) for n in nodes]).documents
        engine = self.llm.engine
        engine.add_documents(docs)
        return engine.warm([d.id for d in docs])

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None):
        self.warm(nodes)
        return nodes

    async def _apostprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None):
        await asyncio.to_thread(self.warm, nodes)
        return nodes


def as_query_engine(index_or_retriever: Any, llm: LazyAttentionLLM, similarity_top_k: int = 3,
                    streaming: bool = False, node_postprocessors: Sequence[BaseNodePostprocessor] = (),
                    sampling: SamplingParams | None = None, embed_model: Any = None) -> RetrieverQueryEngine:
    """A query engine that passes retrieved node ids to the engine (:class:`LazyAttentionSynthesizer`).

    ``index.as_query_engine(llm=llm)`` reuses cached documents too (through the prompt); this
    one also skips the text matching.

    Args:
        index_or_retriever: a ``VectorStoreIndex`` (any LlamaIndex index with
            ``as_retriever``), a LlamaIndex vector store (e.g.
            :class:`~lazyattn_rag.integrations.llamaindex_store.FaissVectorStore`), a LlamaIndex
            ``BaseRetriever``, or a :class:`FaissDocumentStore`.
        llm: the :class:`LazyAttentionLLM`.
        similarity_top_k: documents per query (ignored for a ready retriever).
        streaming: responses stream (``response.response_gen``).
        node_postprocessors: applied to retrieved nodes before synthesis.
        sampling: overrides ``llm.sampling``.
        embed_model: embeds queries for a vector store (default: the offline MiniLM,
            :func:`~lazyattn_rag.integrations.embeddings.llamaindex_embedding`).
    Raises:
        TypeError: ``index_or_retriever`` is none of the above.
    """
    if isinstance(index_or_retriever, BasePydanticVectorStore):
        from lazyattn_rag.integrations.embeddings import llamaindex_embedding
        from llama_index.core import VectorStoreIndex

        index = VectorStoreIndex.from_vector_store(index_or_retriever,
                                                   embed_model=embed_model or llamaindex_embedding())
        retriever = index.as_retriever(similarity_top_k=similarity_top_k)
    elif isinstance(index_or_retriever, BaseRetriever):
        retriever = index_or_retriever
    elif isinstance(index_or_retriever, FaissDocumentStore):
        retriever = FaissRetriever(index_or_retriever, similarity_top_k)
    elif hasattr(index_or_retriever, "as_retriever"):
        retriever = index_or_retriever.as_retriever(similarity_top_k=similarity_top_k)
    else:
        raise TypeError("as_query_engine needs a LlamaIndex index, vector store or BaseRetriever, or a "
                        f"FaissDocumentStore, got {type(index_or_retriever).__name__}")
    return RetrieverQueryEngine(retriever, LazyAttentionSynthesizer(llm, streaming, sampling),
                                node_postprocessors=list(node_postprocessors))
