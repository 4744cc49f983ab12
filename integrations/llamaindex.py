"""LlamaIndex integration: an LLM that reuses documents' cached K/V in the idioms people write.

``index.as_query_engine()`` (every response mode, streaming, ``aquery``), ``as_chat_engine``
(``context``, ``condense_plus_context``), ``RetrieverQueryEngine`` with postprocessors: nothing
to wire. :class:`LazyAttentionLLM` installs LlamaIndex instrumentation handlers
(``llamaindex_events``) that record the nodes each query retrieves; when the LLM receives
the formatted prompt it finds those nodes inside (``prompt_match``), places each from its
cached, position-agnostic K/V and computes the template's text around them as the request's
own tokens. Documents registered with the engine (a store with ``engine=``, the warmer) are
found the same way. When a RAG-looking prompt places nothing the LLM logs one warning naming
why; every response's ``metadata["lazyattn"]`` reports what was reused.

:class:`LazyAttentionSynthesizer` is the id path: it hands nodes to the engine by id in the
engine's own RAG prompt, no text matching. It also answers an empty retrieval from the LLM;
LlamaIndex's own synthesizers (``index.as_query_engine()``, the context chat engines) return
"Empty Response" for one without calling any LLM (``BaseSynthesizer.synthesize`` checks first).

Example::

    from llama_index.core import Settings, VectorStoreIndex
    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM
    Settings.llm = LazyAttentionLLM(max_tokens=128)      # offline SmolLM2, shared engine
    engine = index.as_query_engine(similarity_top_k=3)
    response = engine.query("What does the else clause of a for loop do?")
    print(response, response.metadata["lazyattn"]["stats"]["docs_hit"])
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
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
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate, ChatPromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.types import BasePydanticVectorStore
from pydantic import ConfigDict, Field, PrivateAttr

from lazyattn_rag.types.documents import Document, content_id
from lazyattn_rag.types.errors import PromptTooLongError
from lazyattn_rag.integrations import llamaindex_events
from lazyattn_rag.integrations.call_options import WrapperSettings, call_sampling, split_sampling
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
from lazyattn_rag.integrations.requests import EngineRequest, PromptMatcher, deserves_warning, rag_request
from lazyattn_rag.llm import LazyAttention
from lazyattn_rag.types.outputs import StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams

METADATA_KEY = "lazyattn"
DOCUMENTS_KEY = "lazyattn_documents"  # a ChatMessage's additional_kwargs key: documents placed by id
SAMPLING_KEY = "lazyattn_sampling"  # and: SamplingParams fields of the call (the synthesizer's own)
logger = logging.getLogger("lazyattn_rag.integrations")
_dispatcher = get_dispatcher(__name__)

__all__ = ["DOCUMENTS_KEY", "SAMPLING_KEY", "FaissRetriever", "KVCacheWarmer", "LazyAttentionLLM",
           "LazyAttentionSynthesizer",
           "METADATA_KEY", "as_query_engine", "node_document"]


def node_document(node: NodeWithScore | TextNode) -> Document:
    """The engine document of a node: its ``node_id`` and its text as LlamaIndex shows it to an LLM."""
    node = node.node if isinstance(node, NodeWithScore) else node
    return Document(node.node_id, node.get_content(metadata_mode=MetadataMode.LLM), dict(node.metadata))


class LazyAttentionLLM(CustomLLM, WrapperSettings):
    """A LlamaIndex LLM over a :class:`~lazyattn_rag.llm.LazyAttention` engine.

    Constructible from settings (``LazyAttentionLLM(model=..., temperature=..., max_tokens=...,
    context_window=...)``: the engine is :meth:`LazyAttention.shared` for that configuration,
    built on first use) or around an engine (``LazyAttentionLLM(engine)``). ``to_dict`` /
    ``from_dict`` round-trip the settings.

    Every call (``complete``/``chat``, streaming, async) finds known documents in its prompt
    (see the module docstring) and emits one LLM start/end event pair. A final response carries
    ``additional_kwargs["lazyattn"]`` (``doc_ids``, ``prompt_match``, ``stats``,
    ``finish_reason``) and ``raw["usage"]`` (``prompt_tokens``, ``completion_tokens``,
    ``cached_tokens``). Per call, any :class:`SamplingParams` field may be passed by keyword
    (``max_tokens=2``, ``temperature``, ``stop``...) or a whole ``sampling=``; other keywords
    raise ``TypeError`` naming the accepted ones.

    Args:
        engine: a ready engine (else one is built from the settings).
        sampling: default sampling as one :class:`SamplingParams` (else the settings' fields).
        **settings: the fields of :class:`~lazyattn_rag.integrations.call_options.WrapperSettings`
            (``model``, ``context_window``, ``temperature``, ``max_tokens``, ``top_p``, ``stop``,
            ``sampling_kwargs``, ``engine_kwargs``) and the framework's own.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    _margin: int | None = PrivateAttr(default=None)
    _matcher: PromptMatcher | None = PrivateAttr(default=None)
    _warned: bool = PrivateAttr(default=False)

    def __init__(self, engine: LazyAttention | None = None, sampling: SamplingParams | None = None, **kwargs: Any):
        if sampling is not None:
            kwargs = {**split_sampling(sampling), **kwargs}
        super().__init__(**kwargs)
        self._use_settings(engine)
        llamaindex_events.install()

    @classmethod
    def from_config(cls, config: Any = None, sampling: SamplingParams | None = None) -> "LazyAttentionLLM":
        """Wrap :meth:`LazyAttention.shared` for ``config`` (``None``: the offline default SmolLM2)."""
        return cls(LazyAttention.shared(config), sampling)

    @classmethod
    def class_name(cls) -> str:
        return "LazyAttentionLLM"

    @property
    def metadata(self) -> LLMMetadata:
        """``context_window`` is the engine's limit less a margin (see :meth:`_window_margin`), so
        a prompt LlamaIndex fills to the window fits the engine."""
        window = self.engine.max_model_len - self._window_margin()
        return LLMMetadata(context_window=window, num_output=min(self.max_tokens, window - 1), is_chat_model=True,
                           model_name=self.model or self.engine.model_name)

    def _window_margin(self) -> int:
        """Tokens LlamaIndex's count of a prompt misses: the chat template's markup around a system
        and a user turn, plus 1/64 of the window (at least 64) for the token boundaries at each
        placed document (a document is tokenized on its own, so its edges do not merge with the
        text around it as in one string)."""
        if self._margin is None:
            markup = self.engine.plan_chat([("system", ""), ("user", "")]).num_prompt_tokens
            self._margin = markup + max(64, self.engine.max_model_len // 64)
        return self._margin

    # --- the id path ------------------------------------------------------------------------
    def stream_rag(self, question: str, documents: Sequence[Document],
                   sampling: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Stream the answer to ``question`` over ``documents`` placed by id (registered first),
        in the engine's RAG prompt; no LlamaIndex events (the synthesizer's path emits them)."""
        return rag_request(question, documents).stream(self.engine, sampling or self.sampling, self.namespace)

    async def astream_rag(self, question: str, documents: Sequence[Document],
                          sampling: SamplingParams | None = None) -> AsyncIterator[StreamDelta]:
        """Async :meth:`stream_rag` (through ``AsyncLazyAttention``; the event loop is never blocked)."""
        async for delta in rag_request(question, documents).astream(self.engine, sampling or self.sampling,
                                                                    self.namespace):
            yield delta

    # --- requests --------------------------------------------------------------------------
    def _sampling_for(self, kwargs: dict, messages: Sequence[ChatMessage] = ()) -> SamplingParams:
        """The call's sampling: the defaults, a synthesizer's own (on its message), the keywords."""
        base = self.sampling
        if messages and SAMPLING_KEY in messages[-1].additional_kwargs:
            base = SamplingParams(**messages[-1].additional_kwargs[SAMPLING_KEY])
        return call_sampling(base, kwargs, "LazyAttentionLLM")

    def _request(self, messages: Sequence[ChatMessage]) -> EngineRequest:
        """The engine request of ``messages``: the id path when the last one carries documents,
        else the formatted text with the documents the matcher finds (registered or retrieved)."""
        last = messages[-1] if messages else None
        if last is not None and DOCUMENTS_KEY in last.additional_kwargs:
            docs = [Document(d["id"], d["text"]) for d in last.additional_kwargs[DOCUMENTS_KEY]]
            preamble = [(_role(m.role), m.content or "") for m in messages[:-1]]  # e.g. the LLM's system_prompt
            request = rag_request(last.content or "", docs, preamble, self.engine.config.prompt)
        else:
            if self._matcher is None or self._matcher.llm is not self.engine:
                self._matcher = PromptMatcher(self.engine, self.namespace)
            retrieved = llamaindex_events.retrieved_candidates()
            turns = [(_role(m.role), m.content or "") for m in messages]
            request = self._matcher.request(turns, retrieved)
            self._warn_once(request, turns, bool(retrieved))
        llamaindex_events.record_call(request.report)
        return request

    def _warn_once(self, request: EngineRequest, turns: list[tuple[str, str]], retrieved: bool) -> None:
        if self._warned:
            return
        nested = llamaindex_events.in_framework_query(f"{type(self).__name__}.")
        if not deserves_warning(request.match, [t for _, t in turns], retrieved, nested):
            return
        self._warned = True
        logger.warning("lazyattn-rag: this prompt reuses no cached document: %s. Retrieve through a LlamaIndex "
                       "retriever or index (their nodes are found in the prompt), or register the documents with "
                       "the engine (lazyattn_rag.integrations.llamaindex_store.FaissVectorStore(engine=...), "
                       "KVCacheWarmer). Said once per LLM; the reason of each call is in its "
                       "metadata['lazyattn']['prompt_match'].", request.match.reason)

    def _completion_request(self, prompt: str) -> EngineRequest:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        return self._request([ChatMessage(role=MessageRole.USER, content=prompt)])

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer, for ``Settings.tokenizer = llm.tokenizer``: LlamaIndex then sizes
        prompts (compact/refine repacking, truncation) in this model's tokens rather than
        tiktoken's, so a full context window never exceeds the engine's limit. Against a server
        it is the server model's tokenizer (one ``/tokenize`` request per call), as the callable
        LlamaIndex makes of a Hugging Face tokenizer."""
        if getattr(self.engine, "is_remote", False):
            return functools.partial(self.engine.tokenizer.encode, add_special_tokens=False)
        return self.engine.tokenizer

    def _stream(self, request: EngineRequest, sampling: SamplingParams) -> Iterator[StreamDelta]:
        try:
            return request.stream(self.engine, sampling, self.namespace)
        except PromptTooLongError as error:
            raise _sized_elsewhere(error, self) from error

    def _stream_completion(self, prompt: str, kwargs: dict) -> CompletionResponseGen:
        sampling = self._sampling_for(kwargs)
        request = self._completion_request(prompt)
        return _completions(request, self._stream(request, sampling))

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict) -> ChatResponseGen:
        sampling = self._sampling_for(kwargs, messages)
        request = self._request(messages)
        return (_chat_response(c) for c in _completions(request, self._stream(request, sampling)))

    async def _astream(self, request: EngineRequest, sampling: SamplingParams) -> AsyncIterator[StreamDelta]:
        try:
            async for delta in request.astream(self.engine, sampling, self.namespace):
                yield delta
        except PromptTooLongError as error:
            raise _sized_elsewhere(error, self) from error

    async def _astream_completion(self, prompt: str, kwargs: dict) -> CompletionResponseAsyncGen:
        sampling = self._sampling_for(kwargs)
        request = await asyncio.to_thread(self._completion_request, prompt)  # (copies the context: the active span)
        return _acompletions(request, self._astream(request, sampling))

    async def _astream_chat(self, messages: Sequence[ChatMessage], kwargs: dict) -> ChatResponseAsyncGen:
        sampling = self._sampling_for(kwargs, messages)
        request = await asyncio.to_thread(self._request, messages)
        completions = _acompletions(request, self._astream(request, sampling))

        async def gen() -> ChatResponseAsyncGen:
            async for c in completions:
                yield _chat_response(c)

        return gen()

    # --- the LlamaIndex LLM interface (one event pair per public call) -------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        *_, last = self._stream_completion(prompt, kwargs)
        return last

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_completion(prompt, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        last = None
        async for last in await self._astream_completion(prompt, kwargs):
            pass
        return last

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        return await self._astream_completion(prompt, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        *_, last = self._stream_chat(messages, kwargs)
        return last

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        last = None
        async for last in await self._astream_chat(messages, kwargs):
            pass
        return last

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return await self._astream_chat(messages, kwargs)


def _sized_elsewhere(error: PromptTooLongError, llm: LazyAttentionLLM) -> PromptTooLongError:
    """The engine's length error, with the fix when LlamaIndex counts tokens with another tokenizer."""
    from llama_index.core import Settings

    tokenizer = Settings.tokenizer
    if getattr(tokenizer, "__self__", None) is llm.engine.tokenizer or (
            getattr(tokenizer, "func", None) is not None and getattr(tokenizer.func, "__self__", None)
            is llm.engine.tokenizer):
        return error
    return PromptTooLongError(f"{error}. LlamaIndex sized this prompt with its own tokenizer (Settings.tokenizer, "
                              "tiktoken unless set), which counts fewer tokens than this model's: set "
                              "`Settings.tokenizer = llm.tokenizer` so it fits the prompt to the engine's limit")


def _role(role: MessageRole | str) -> str:
    value = role.value if isinstance(role, MessageRole) else str(role)
    return {"model": "assistant", "chatbot": "assistant", "developer": "system", "tool": "user",
            "function": "user"}.get(value, value)


def _completion(request: EngineRequest, text: str, delta: StreamDelta) -> CompletionResponse:
    extra, raw = {}, None
    if delta.finished:
        s = delta.stats
        extra = {METADATA_KEY: request.report}
        raw = {"usage": {"prompt_tokens": s.num_prompt_tokens, "completion_tokens": s.num_output_tokens,
                         "cached_tokens": s.num_cached_tokens}}
    return CompletionResponse(text=text, delta=delta.text, additional_kwargs=extra, raw=raw)


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
                        additional_kwargs=c.additional_kwargs, raw=c.raw)


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
