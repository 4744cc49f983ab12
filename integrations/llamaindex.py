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

:class:`LazyAttentionSynthesizer` (``integrations/llamaindex_query.py``, importable from here) is the id path: it hands nodes to the engine by id in the
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
import functools
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

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
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode
from pydantic import ConfigDict, PrivateAttr

from lazyattn_rag.types.documents import Document
from lazyattn_rag.types.errors import PromptTooLongError
from lazyattn_rag.integrations import llamaindex_events
from lazyattn_rag.integrations.call_options import WrapperSettings, call_sampling, with_sampling
from lazyattn_rag.integrations.requests import EngineRequest, PromptMatcher, deserves_warning, rag_request
from lazyattn_rag.llm import LazyAttention
from lazyattn_rag.types.outputs import StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams
from lazyattn_rag.types.structured_output import StructuredOutputParams

METADATA_KEY = "lazyattn"
DOCUMENTS_KEY = "lazyattn_documents"  # a ChatMessage's additional_kwargs key: documents placed by id
SAMPLING_KEY = "lazyattn_sampling"  # and: SamplingParams fields of the call (the synthesizer's own)
logger = logging.getLogger("lazyattn_rag.integrations")

__all__ = ["DOCUMENTS_KEY", "METADATA_KEY", "SAMPLING_KEY", "LazyAttentionLLM", "node_document"]
# the id path (synthesizer, retriever, warmer, query engine) lives in llamaindex_query.py; its names
# are importable from here too (looked up on first use: that module builds on this one)
_QUERY_NAMES = ("FaissRetriever", "KVCacheWarmer", "LazyAttentionSynthesizer", "as_query_engine")


def __getattr__(name: str):
    if name in _QUERY_NAMES:
        from lazyattn_rag.integrations import llamaindex_query

        return getattr(llamaindex_query, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        engine: the engine to run on; ``None``: the shared one of the settings, built on first use.
        sampling: the calls' default :class:`SamplingParams` (else the settings' fields).
        **settings: :class:`~lazyattn_rag.integrations.call_options.WrapperSettings`' fields
            (``model``, ``temperature``, ``max_tokens``...) and LlamaIndex's own.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    _margin: int | None = PrivateAttr(default=None)
    _matcher: PromptMatcher | None = PrivateAttr(default=None)
    _warned: bool = PrivateAttr(default=False)

    def __init__(self, engine: LazyAttention | None = None, sampling: SamplingParams | None = None, **kwargs: Any):
        super().__init__(**with_sampling(sampling, kwargs))
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
        return rag_request(question, documents).stream(self.engine, sampling or self.sampling, self.namespace,
                                                        self.remedies)

    async def astream_rag(self, question: str, documents: Sequence[Document],
                          sampling: SamplingParams | None = None) -> AsyncIterator[StreamDelta]:
        """Async :meth:`stream_rag` (through ``AsyncLazyAttention``; the event loop is never blocked)."""
        async for delta in rag_request(question, documents).astream(self.engine, sampling or self.sampling,
                                                                    self.namespace, self.remedies):
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
            return request.stream(self.engine, sampling, self.namespace, self.remedies)
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
            async for delta in request.astream(self.engine, sampling, self.namespace, self.remedies):
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
    def structured_predict(self, output_cls: type, prompt: Any, llm_kwargs: dict[str, Any] | None = None,
                           **prompt_args: Any) -> Any:
        """LlamaIndex's structured prediction (``as_structured_llm`` and the text completion
        program use it), with ``output_cls``' JSON schema enforced while sampling (a token mask,
        ``SamplingParams.structured_output``) rather than only asked for in the prompt."""
        return super().structured_predict(output_cls, prompt, _schema_kwargs(output_cls, llm_kwargs), **prompt_args)

    async def astructured_predict(self, output_cls: type, prompt: Any, llm_kwargs: dict[str, Any] | None = None,
                                  **prompt_args: Any) -> Any:
        """Async :meth:`structured_predict`."""
        return await super().astructured_predict(output_cls, prompt, _schema_kwargs(output_cls, llm_kwargs),
                                                 **prompt_args)

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


def _schema_kwargs(output_cls: type, llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``llm_kwargs`` with ``output_cls``' JSON schema as the answer's constraint (one given wins)."""
    return {"structured_output": StructuredOutputParams(json=output_cls.model_json_schema()), **(llm_kwargs or {})}
