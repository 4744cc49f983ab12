"""LlamaIndex integration: an LLM, a response synthesizer that passes node ids, a FAISS retriever,
a KV-warming node postprocessor and a one-call query engine.

The synthesizer hands each retrieved node to the engine as ``(node_id, text)``: the engine
resolves the id to the node's cached, position-agnostic K/V, so a node retrieved again (at any
rank, any offset) costs no prefill. Anything that only hands the LLM a formatted prompt (e.g.
``ContextChatEngine``, LlamaIndex's default synthesizers) goes through the plain-prompt
fallback: registered node texts found in the prompt are reused by id.

Empty retrieval: the question is answered through the RAG prompt with no documents (no
exception, no "Empty Response" placeholder); ``source_nodes`` is empty.

Example::

    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM, as_query_engine
    llm = LazyAttentionLLM.from_config()                        # offline SmolLM2
    engine = as_query_engine(index, llm, similarity_top_k=3)    # a VectorStoreIndex or a retriever
    response = engine.query("What does the else clause of a for loop do?")
    print(response, response.metadata["lazyattn"]["stats"]["docs_hit"])
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from pydantic import ConfigDict, Field, PrivateAttr

from lazyattn_rag.config import EngineConfig
from lazyattn_rag.documents import Document
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
from lazyattn_rag.integrations.requests import EngineRequest, rag_request, text_request
from lazyattn_rag.llm import LazyAttention
from lazyattn_rag.outputs import StreamDelta
from lazyattn_rag.sampling import SamplingParams

METADATA_KEY = "lazyattn"

__all__ = ["FaissRetriever", "KVCacheWarmer", "LazyAttentionLLM", "LazyAttentionSynthesizer", "METADATA_KEY",
           "as_query_engine", "node_document"]


def node_document(node: NodeWithScore | TextNode) -> Document:
    """The engine document of a node: its ``node_id`` and its text as LlamaIndex shows it to an LLM."""
    node = node.node if isinstance(node, NodeWithScore) else node
    return Document(node.node_id, node.get_content(metadata_mode=MetadataMode.LLM), dict(node.metadata))


class LazyAttentionLLM(CustomLLM):
    """A LlamaIndex LLM over a :class:`~lazyattn_rag.llm.LazyAttention` engine.

    ``complete``/``chat`` (and their streaming and native async forms) take formatted text;
    registered documents found in it are reused from the KV cache (the fallback), otherwise the
    text is completed in the model's chat template. :meth:`stream_rag` is the id-passing path
    that :class:`LazyAttentionSynthesizer` uses. Each final response carries
    ``additional_kwargs["lazyattn"] = {"stats": RequestStats.as_dict(), "doc_ids": [...],
    "prompt_match": {...}}`` (``prompt_match`` only for formatted text).

    Args:
        engine: the :class:`LazyAttention` to run on.
        sampling: default :class:`SamplingParams`; per call ``sampling=`` overrides it.

    Async methods stream through :class:`~lazyattn_rag.async_llm.AsyncLazyAttention` and never
    block the event loop; concurrent requests share the engine's batches.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Default sampling parameters.")
    _engine: LazyAttention = PrivateAttr()

    def __init__(self, engine: LazyAttention, sampling: SamplingParams | None = None, **kwargs: Any):
        super().__init__(sampling=sampling or SamplingParams(), **kwargs)
        self._engine = engine

    @classmethod
    def from_config(cls, config: EngineConfig | None = None,
                    sampling: SamplingParams | None = None) -> "LazyAttentionLLM":
        """Load an engine (``None``: the offline default SmolLM2) and wrap it."""
        return cls(LazyAttention(config), sampling)

    @classmethod
    def class_name(cls) -> str:
        return "LazyAttentionLLM"

    @property
    def engine(self) -> LazyAttention:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self._engine.max_model_len, num_output=self.sampling.max_tokens,
                           is_chat_model=True, model_name=self._engine.model_name)

    # --- the id-passing path ----------------------------------------------------------------
    def stream_rag(self, question: str, documents: Sequence[Document],
                   sampling: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Stream the answer to ``question`` over ``documents`` placed by id (registered first)."""
        return rag_request(question, documents).stream(self._engine, sampling or self.sampling)

    async def astream_rag(self, question: str, documents: Sequence[Document],
                          sampling: SamplingParams | None = None) -> AsyncIterator[StreamDelta]:
        """Async :meth:`stream_rag` (through ``AsyncLazyAttention``; the event loop is never blocked)."""
        async for delta in rag_request(question, documents).astream(self._engine, sampling or self.sampling):
            yield delta

    # --- completion ---------------------------------------------------------------------------
    def _completion_request(self, prompt: str) -> EngineRequest:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        return text_request(self._engine, [("user", prompt)])

    def _chat_request(self, messages: Sequence[ChatMessage]) -> EngineRequest:
        return text_request(self._engine, [(_role(m.role), m.content or "") for m in messages])

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        *_, last = self.stream_complete(prompt, formatted, **kwargs)
        return last

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        request = self._completion_request(prompt)
        return _completions(request, request.stream(self._engine, kwargs.get("sampling") or self.sampling))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        last = None
        async for last in await self.astream_complete(prompt, formatted, **kwargs):
            pass
        return last

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        request = await asyncio.to_thread(self._completion_request, prompt)
        return _acompletions(request, request.astream(self._engine, kwargs.get("sampling") or self.sampling))

    # --- chat -------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        *_, last = self.stream_chat(messages, **kwargs)
        return last

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        request = self._chat_request(messages)
        deltas = request.stream(self._engine, kwargs.get("sampling") or self.sampling)
        return (_chat_response(c) for c in _completions(request, deltas))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        last = None
        async for last in await self.astream_chat(messages, **kwargs):
            pass
        return last

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        request = await asyncio.to_thread(self._chat_request, messages)
        deltas = request.astream(self._engine, kwargs.get("sampling") or self.sampling)

        async def gen() -> ChatResponseAsyncGen:
            async for c in _acompletions(request, deltas):
                yield _chat_response(c)

        return gen()


def _role(role: MessageRole | str) -> str:
    value = role.value if isinstance(role, MessageRole) else str(role)
    return {"model": "assistant", "chatbot": "assistant", "developer": "system"}.get(value, value)


def _completion(request: EngineRequest, text: str, delta: StreamDelta) -> CompletionResponse:
    extra = {}
    if delta.finished:
        extra = {METADATA_KEY: {**request.extra(), "stats": delta.stats.as_dict(),
                                "finish_reason": delta.finish_reason}}
    return CompletionResponse(text=text, delta=delta.text, additional_kwargs=extra)


def _completions(request: EngineRequest, deltas: Iterator[StreamDelta]) -> CompletionResponseGen:
    text = ""
    for d in deltas:
        text += d.text
        if d.text or d.finished:
            yield _completion(request, text, d)


async def _acompletions(request: EngineRequest, deltas: AsyncIterator[StreamDelta]) -> CompletionResponseAsyncGen:
    text = ""
    async for d in deltas:
        text += d.text
        if d.text or d.finished:
            yield _completion(request, text, d)


def _chat_response(c: CompletionResponse) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=c.text), delta=c.delta,
                        additional_kwargs=c.additional_kwargs)


class LazyAttentionSynthesizer(BaseSynthesizer):
    """A response synthesizer that passes each node to the engine as ``(node_id, text)``.

    Nodes are placed in retrieval order; a node whose K/V is cached costs no prefill at any rank.
    The response's ``metadata["lazyattn"]`` holds ``{"doc_ids", "stats", "finish_reason"}``
    (for a streaming response it is filled in when the stream ends).

    Args:
        llm: the :class:`LazyAttentionLLM`.
        streaming: return a :class:`StreamingResponse` (or ``AsyncStreamingResponse`` from
            ``asynthesize``).
        sampling: overrides ``llm.sampling`` for this synthesizer.
    """

    def __init__(self, llm: LazyAttentionLLM, streaming: bool = False, sampling: SamplingParams | None = None):
        if not isinstance(llm, LazyAttentionLLM):
            raise TypeError(f"LazyAttentionSynthesizer needs a LazyAttentionLLM, got {type(llm).__name__}")
        super().__init__(llm=llm, streaming=streaming)
        self._sampling = sampling or llm.sampling

    def _get_prompts(self) -> dict:
        return {}

    def _update_prompts(self, prompts: dict) -> None:
        pass

    def synthesize(self, query: str | QueryBundle, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None, **kwargs: Any):
        question = query.query_str if isinstance(query, QueryBundle) else query
        docs = [node_document(n) for n in nodes]
        sources = list(nodes) + list(additional_source_nodes or [])
        meta: dict = {METADATA_KEY: {"doc_ids": rag_request(question, docs).doc_ids}}  # as placed
        deltas = self._llm.stream_rag(question, docs, self._sampling)
        if self._streaming:
            return StreamingResponse(_texts(deltas, meta[METADATA_KEY]), source_nodes=sources, metadata=meta)
        return Response("".join(_texts(deltas, meta[METADATA_KEY])), source_nodes=sources, metadata=meta)

    async def asynthesize(self, query: str | QueryBundle, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None, **kwargs: Any):
        question = query.query_str if isinstance(query, QueryBundle) else query
        docs = [node_document(n) for n in nodes]
        sources = list(nodes) + list(additional_source_nodes or [])
        meta: dict = {METADATA_KEY: {"doc_ids": rag_request(question, docs).doc_ids}}  # as placed
        texts = _atexts(self._llm.astream_rag(question, docs, self._sampling), meta[METADATA_KEY])
        if self._streaming:
            return AsyncStreamingResponse(texts, source_nodes=sources, metadata=meta)
        return Response("".join([t async for t in texts]), source_nodes=sources, metadata=meta)

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> str:
        """Answer over bare text chunks (ids derived from their content: equal text, one id)."""
        return "".join(_texts(self._llm.stream_rag(query_str, _content_documents(text_chunks), self._sampling), {}))

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> str:
        deltas = self._llm.astream_rag(query_str, _content_documents(text_chunks), self._sampling)
        return "".join([t async for t in _atexts(deltas, {})])


def _content_documents(text_chunks: Sequence[str]) -> list[Document]:
    import hashlib

    return [Document("sha256:" + hashlib.sha256(t.encode()).hexdigest()[:32], t) for t in text_chunks if t.strip()]


def _texts(deltas: Iterator[StreamDelta], meta: dict) -> Iterator[str]:
    for d in deltas:
        if d.finished:
            meta.update(stats=d.stats.as_dict(), finish_reason=d.finish_reason)
        if d.text:
            yield d.text


async def _atexts(deltas: AsyncIterator[StreamDelta], meta: dict) -> AsyncIterator[str]:
    async for d in deltas:
        if d.finished:
            meta.update(stats=d.stats.as_dict(), finish_reason=d.finish_reason)
        if d.text:
            yield d.text


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
        hits = self.store.search(query_bundle.query_str, self.similarity_top_k)
        return [NodeWithScore(node=_text_node(doc), score=score) for doc, score in hits]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return await asyncio.to_thread(self._retrieve, query_bundle)


def _text_node(doc: Document) -> TextNode:
    keys = list(doc.metadata)  # metadata is shown to neither the LLM nor the embedder: text == content
    return TextNode(id_=doc.id, text=doc.text, metadata=dict(doc.metadata), excluded_llm_metadata_keys=keys,
                    excluded_embed_metadata_keys=keys)


class KVCacheWarmer(BaseNodePostprocessor):
    """A node postprocessor that registers nodes with the engine and encodes their K/V now.

    Put it in a query engine or ``ContextChatEngine`` (``node_postprocessors=[KVCacheWarmer(llm=llm)]``)
    so retrieved nodes are registered, which lets the plain-prompt fallback find them; or call
    :meth:`warm` on ingested nodes to pay their prefill before the first query. Nodes pass
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
                    sampling: SamplingParams | None = None) -> RetrieverQueryEngine:
    """A query engine that passes retrieved node ids to the engine.

    Args:
        index_or_retriever: a ``VectorStoreIndex`` (any LlamaIndex index with
            ``as_retriever``), a LlamaIndex ``BaseRetriever``, or a :class:`FaissDocumentStore`.
        llm: the :class:`LazyAttentionLLM`.
        similarity_top_k: documents per query (ignored for a ready retriever).
        streaming: responses stream (``response.response_gen``).
        node_postprocessors: applied to retrieved nodes before synthesis.
        sampling: overrides ``llm.sampling``.
    Raises:
        TypeError: ``index_or_retriever`` is none of the above.
    """
    if isinstance(index_or_retriever, BaseRetriever):
        retriever = index_or_retriever
    elif isinstance(index_or_retriever, FaissDocumentStore):
        retriever = FaissRetriever(index_or_retriever, similarity_top_k)
    elif hasattr(index_or_retriever, "as_retriever"):
        retriever = index_or_retriever.as_retriever(similarity_top_k=similarity_top_k)
    else:
        raise TypeError("as_query_engine needs a LlamaIndex index, a BaseRetriever or a FaissDocumentStore, "
                        f"got {type(index_or_retriever).__name__}")
    return RetrieverQueryEngine(retriever, LazyAttentionSynthesizer(llm, streaming, sampling),
                                node_postprocessors=list(node_postprocessors))
