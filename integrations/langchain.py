"""LangChain integration: a chat model that reuses documents' cached K/V in the chains people
write, a Runnable that turns retrieved ``Document``s into id-carrying content blocks, a FAISS
retriever and a ready RAG chain ``{question} -> {answer, sources}``.

Documents reach :class:`ChatLazyAttention` in any of three ways:

- **found in the prompt** (no wiring): LCEL with ``format_docs``
  (``{"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | model``),
  ``RunnableWithMessageHistory``, any retriever. A callback handler that the model installs for
  the whole process (``langchain_callbacks``) records what every retriever returns; the model
  finds those documents, and the ones registered with its engine, in the formatted prompt and
  places each from its cached K/V, computing the template's text around them;
- **content blocks**: a text block with an ``id`` and ``extras={"document": True}`` (make them
  with :func:`document_block`); the message's other text is the question;
- the ``documents=`` call argument (LangChain ``Document``s, ``lazyattn_rag.Document``s, or the
  ids of documents registered with the engine).

The last two use the engine's own RAG prompt. Formatted text with no known document in it is
completed in the model's chat template with no reuse (``prompt_match["reason"]`` says why).

Empty retrieval: the question is answered through the RAG prompt with no documents (no
exception); ``sources`` is empty and the stats list no documents. :func:`rag_chain` passes
``documents=[]`` for this; do the same when calling the model on an empty retrieval yourself.

Example::

    from lazyattn_rag.integrations.langchain import ChatLazyAttention
    model = ChatLazyAttention(max_tokens=128)                 # offline SmolLM2, shared engine
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | model
    print(chain.invoke("What does the else clause of a for loop do?").response_metadata["lazyattn"])
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough
from pydantic import ConfigDict, Field, PrivateAttr

from lazyattn_rag.types.documents import Document, content_id
from lazyattn_rag.types.errors import UnknownDocumentError
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
from lazyattn_rag.integrations import langchain_callbacks
from lazyattn_rag.integrations.call_options import WrapperSettings, call_sampling, with_sampling
from lazyattn_rag.integrations.langchain_structured import structured_runnable
from lazyattn_rag.engine.planning.prompt_match import Candidate
from lazyattn_rag.integrations.requests import EngineRequest, PromptMatcher, deserves_warning, rag_request
from lazyattn_rag.llm import LazyAttention
from lazyattn_rag.types.outputs import StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams

METADATA_KEY = "lazyattn"
_CALL_KEYWORDS = ("documents", "model")  # ChatLazyAttention's own call keywords, besides the sampling fields
logger = logging.getLogger("lazyattn_rag.integrations")

__all__ = ["ChatLazyAttention", "FaissRetriever", "document_block", "documents_to_messages", "rag_chain",
           "to_engine_document"]

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "chat": "user", "tool": "user"}


def to_engine_document(doc: LCDocument | Document) -> Document:
    """A LangChain ``Document`` as an engine document: its ``id`` (or a hash of its text when it
    has none) and its ``page_content``."""
    if isinstance(doc, Document):
        return doc
    return Document(doc.id or content_id(doc.page_content), doc.page_content, dict(doc.metadata))


def document_block(doc: LCDocument | Document) -> dict:
    """An id-carrying text content block for ``doc``:
    ``{"type": "text", "text": ..., "id": ..., "extras": {"document": True}}``."""
    d = to_engine_document(doc)
    return {"type": "text", "text": d.text, "id": d.id, "extras": {"document": True}}


def _is_document_block(block: Any) -> bool:
    return (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("id"), str)
            and bool((block.get("extras") or {}).get("document")))


def _split_message(message: BaseMessage) -> tuple[list[Document], str]:
    """(documents in the message's content blocks, the rest of its text)."""
    if isinstance(message.content, str):
        return [], message.content
    docs, texts = [], []
    for block in message.content:
        if _is_document_block(block):
            docs.append(Document(block["id"], block["text"]))
        elif isinstance(block, str):
            texts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            texts.append(block.get("text", ""))
    return docs, "\n".join(t for t in texts if t)


def _role(message: BaseMessage) -> str:
    return _ROLES.get(message.type, "user")


def call_documents(engine: LazyAttention, documents: Sequence[LCDocument | Document | str],
                   namespace: str = "") -> list[Document]:
    """The ``documents=`` call argument as engine documents: LangChain ``Document`` objects and
    ``lazyattn_rag.Document`` objects as they are (:func:`to_engine_document`), a ``str`` as the id of
    a document registered with ``engine`` in ``namespace`` (its registered text, looked up once
    per call for all such ids).

    Raises:
        UnknownDocumentError: a ``str`` id that is not registered (named).
        TypeError: an entry of another type (named, with its position).
    """
    for i, d in enumerate(documents):
        if not isinstance(d, (str, LCDocument, Document)):
            raise TypeError(f"documents= takes LangChain Documents, lazyattn_rag.Documents or registered ids "
                            f"(str); entry {i} is a {type(d).__name__}")
    ids = [d for d in documents if isinstance(d, str)]
    texts = engine.document_texts(ids, namespace) if ids else {}
    missing = [i for i in ids if i not in texts]
    if missing:
        raise UnknownDocumentError(f"documents= names ids not registered{' in namespace ' + repr(namespace) if namespace else ''}: "
                                   f"{', '.join(map(repr, dict.fromkeys(missing)))} (register them with add_documents, "
                                   f"or pass Documents with their texts)")
    return [Document(d, texts[d]) if isinstance(d, str) else to_engine_document(d) for d in documents]


def build_request(engine: LazyAttention, messages: Sequence[BaseMessage],
                  documents: Sequence[LCDocument | Document | str] | None = None,
                  matcher: PromptMatcher | None = None, retrieved: Sequence[Candidate] = (),
                  namespace: str = "") -> EngineRequest:
    """The engine request for chat ``messages`` (see the module docstring for the rules).

    Args:
        engine: the engine.
        messages: the chat messages.
        documents: the ``documents=`` call argument (``None``: not given; see :func:`call_documents`).
        matcher: finds documents in formatted text (default: a new one over ``engine``).
        retrieved: documents the chain's retrievers returned for this call.
        namespace: where ``str`` ids in ``documents`` are registered.
    Raises:
        ValueError: no messages.
        UnknownDocumentError, TypeError: as :func:`call_documents`.
    """
    if not messages:
        raise ValueError("ChatLazyAttention needs at least one message")
    split = [(_role(m), *_split_message(m)) for m in messages]
    docs = [d for _, ds, _ in split for d in ds] + call_documents(engine, documents or (), namespace)
    if not docs and documents is None:
        return (matcher or PromptMatcher(engine)).request([(role, text) for role, _, text in split], retrieved)
    turns = [(role, text) for role, _, text in split if text.strip()]
    multi = sum(role != "system" for role, _ in turns) > 1
    question = "\n\n".join(f"{role}: {text}" if multi else text for role, text in turns)
    # One document given twice (in a message's blocks and in documents=, or repeated) is placed
    # once; the same id with another text is an error (rag_request).
    return rag_request(question, list({(d.id, d.text): d for d in docs}.values()))


class ChatLazyAttention(BaseChatModel, WrapperSettings):
    """A LangChain chat model over a :class:`~lazyattn_rag.llm.LazyAttention` engine.

    Constructible from settings (``ChatLazyAttention(model=..., temperature=..., max_tokens=...)``:
    the engine is :meth:`LazyAttention.shared` for that configuration, built on first use) or
    around an engine (``ChatLazyAttention(engine=llm)``).

    Documents reach the engine by id (document blocks, ``documents=``) or are found in formatted
    text: those the chain's retrievers returned in the same run (any retriever, see
    ``langchain_callbacks``) and those registered with the engine. A RAG-looking prompt that
    places none logs one warning per model naming why.

    Every result message carries ``usage_metadata`` (``input_token_details.cache_read`` = prompt
    tokens served from the KV cache) and ``response_metadata["lazyattn"] = {"doc_ids", "stats",
    "prompt_match"?, "finish_reason"}``. Per call, ``stop`` and any :class:`SamplingParams`
    field (``max_tokens``, ``temperature``...) or a whole ``sampling=`` override the defaults,
    ``model=`` runs the call on that model's shared engine (loaded on first use); other
    keywords raise ``TypeError`` naming the accepted ones. ``with_structured_output`` enforces
    its schema while sampling (``langchain_structured``); tool calling is not supported
    (``bind_tools`` raises ``NotImplementedError`` saying so).

    Args:
        engine: a ready engine (else one is built from the settings).
        sampling: default sampling as one :class:`SamplingParams` (else the settings' fields).
        **settings: the fields of :class:`~lazyattn_rag.integrations.call_options.WrapperSettings`
            (``model``, ``context_window``, ``temperature``, ``max_tokens``, ``top_p``, ``stop``,
            ``sampling_kwargs``, ``engine_kwargs``) and the framework's own.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    _matchers: dict[int, PromptMatcher] = PrivateAttr(default_factory=dict)
    _warned: bool = PrivateAttr(default=False)

    def __init__(self, engine: LazyAttention | None = None, sampling: SamplingParams | None = None, **kwargs: Any):
        super().__init__(**with_sampling(sampling, kwargs))
        self._use_settings(engine)
        langchain_callbacks.install()

    @property
    def _llm_type(self) -> str:
        return "lazyattn-rag"

    @property
    def _model_name(self) -> str:
        return self.model or "SmolLM2-135M-Instruct"

    def _engine_for(self, model: str | None) -> LazyAttention:
        """The engine of a call: this model's, or for a per-call ``model=`` override the process's
        shared engine of that model (same other settings), loaded on first use."""
        if model is None or model == self.model:
            return self.engine
        return LazyAttention.shared(self.engine_settings(model))

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self._model_name, **dataclasses.asdict(self.sampling)}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        sampling = call_sampling(self.sampling, kwargs, "ChatLazyAttention", _CALL_KEYWORDS, stop)
        name = kwargs.get("model") or self._model_name
        params = LangSmithParams(ls_provider="lazyattn-rag", ls_model_name=name, ls_model_type="chat",
                                 ls_temperature=sampling.temperature, ls_max_tokens=sampling.max_tokens)
        if sampling.stop:
            params["ls_stop"] = list(sampling.stop)
        return params

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` under the engine's own tokenizer (no special tokens added). The
        shared tokenizer is only read here: turning its special-token parsing off would write to
        it while the engine thread uses it."""
        return list(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable:
        raise NotImplementedError("ChatLazyAttention does not support tool calling: it answers from documents "
                                  "placed by id or found in the prompt (see lazyattn_rag.integrations.langchain)")

    def with_structured_output(self, schema: Any = None, *, method: str = "json_schema", include_raw: bool = False,
                               strict: bool | None = None, **kwargs: Any) -> Runnable:
        """This model answering in ``schema`` (a Pydantic class, ``TypedDict`` or JSON schema
        dict), enforced as a token mask while sampling (``langchain_structured``); ``method``
        ``json_schema`` (default), ``function_calling`` (the same mask) or ``json_mode``;
        ``include_raw`` as LangChain's own models; ``kwargs`` go to the model's calls, as
        ``ChatOpenAI`` passes them (sampling fields: ``max_tokens=200``...; any other is a
        ``TypeError`` when the model is called).

        Raises:
            ValueError: an unknown ``method``.
        """
        return structured_runnable(self, schema, method, include_raw, strict, kwargs)

    def _prepare(self, messages, stop, kwargs, run_manager) -> tuple[EngineRequest, SamplingParams, LazyAttention]:
        sampling = call_sampling(self.sampling, kwargs, "ChatLazyAttention", _CALL_KEYWORDS, stop)
        engine = self._engine_for(kwargs.get("model"))
        self._matchers = {k: m for k, m in self._matchers.items() if not m.llm.loop.stopped}
        matcher = self._matchers.setdefault(id(engine), PromptMatcher(engine, self.namespace))
        retrieved = langchain_callbacks.retrieved_candidates(run_manager.run_id if run_manager else None)
        request = build_request(engine, messages, kwargs.get("documents"), matcher, retrieved, self.namespace)
        nested = run_manager is not None and run_manager.parent_run_id is not None
        self._warn_once(request, messages, bool(retrieved), nested)
        return request, sampling, engine

    def _warn_once(self, request: EngineRequest, messages: Sequence[BaseMessage], retrieved: bool,
                   nested: bool) -> None:
        texts = [_split_message(m)[1] for m in messages]
        if self._warned or not deserves_warning(request.match, texts, retrieved, nested):
            return
        self._warned = True
        logger.warning("lazyattn-rag: this prompt reuses no cached document: %s. Retrieve through a LangChain "
                       "retriever in the same chain (its documents are found in the prompt), pass documents "
                       "by id (document_block, documents=), or register them with the engine "
                       "(lazyattn_rag.integrations.langchain_store.FaissVectorStore(..., engine=...), or "
                       "engine.add_documents). Said once per model; each call's reason is in "
                       "response_metadata['lazyattn']['prompt_match'].", request.match.reason)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        chunks = list(self._stream(messages, stop, run_manager, **kwargs))
        return _result(chunks)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return _result([c async for c in self._astream(messages, stop, run_manager, **kwargs)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        request, sampling, engine = self._prepare(messages, stop, kwargs, run_manager)
        for delta in request.stream(engine, sampling, self.namespace, self.remedies):
            chunk = self._chunk(request, delta, kwargs.get("model"))
            if chunk is not None:
                if run_manager and delta.text:
                    run_manager.on_llm_new_token(delta.text, chunk=chunk)
                yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        request, sampling, engine = await asyncio.to_thread(self._prepare, messages, stop, kwargs, run_manager)
        async for delta in request.astream(engine, sampling, self.namespace, self.remedies):
            chunk = self._chunk(request, delta, kwargs.get("model"))
            if chunk is not None:
                if run_manager and delta.text:
                    await run_manager.on_llm_new_token(delta.text, chunk=chunk)
                yield chunk

    def _chunk(self, request: EngineRequest, delta: StreamDelta, model: str | None) -> ChatGenerationChunk | None:
        if not delta.finished:
            return ChatGenerationChunk(message=AIMessageChunk(content=delta.text)) if delta.text else None
        s = delta.stats
        usage = {"input_tokens": s.num_prompt_tokens, "output_tokens": s.num_output_tokens,
                 "total_tokens": s.num_prompt_tokens + s.num_output_tokens,
                 "input_token_details": {"cache_read": s.num_cached_tokens}}
        meta = {"model_name": model or self._model_name, "finish_reason": delta.finish_reason,
                METADATA_KEY: request.report}
        message = AIMessageChunk(content=delta.text, usage_metadata=usage, response_metadata=meta,
                                 chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": delta.finish_reason})


def _result(chunks: list[ChatGenerationChunk]) -> ChatResult:
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    m = total.message
    message = AIMessage(content=m.content, usage_metadata=m.usage_metadata, response_metadata=m.response_metadata)
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=total.generation_info)])


class FaissRetriever(BaseRetriever):
    """A LangChain retriever over a :class:`FaissDocumentStore`.

    Returned ``Document``s carry the store's stable id as ``id`` and the cosine similarity as
    ``metadata["score"]``; at most ``k`` (fewer when the store holds fewer).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    store: FaissDocumentStore = Field(description="The document store.")
    k: int = Field(default=4, ge=1, description="Documents per query.")

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[LCDocument]:
        return [LCDocument(page_content=d.text, metadata={**d.metadata, "score": score}, id=d.id)
                for d, score in self.store.search(query, self.k)]

    async def _aget_relevant_documents(self, query: str, *, run_manager: Any) -> list[LCDocument]:
        return await asyncio.to_thread(self._get_relevant_documents, query, run_manager=run_manager)


def _question_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("question"), str):
        return value["question"]
    raise TypeError(f'expected a question string or {{"question": str}}, got {type(value).__name__}')


def _messages(value: dict) -> list[BaseMessage]:
    docs = value.get("documents", value.get("sources")) or ()
    blocks = [document_block(d) for d in docs]
    return [HumanMessage(content=[*blocks, {"type": "text", "text": _question_of(value)}])]


documents_to_messages: Runnable = RunnableLambda(_messages, name="documents_to_messages")
"""``{"question": str, "documents": [Document]}`` (or ``"sources"``) -> ``[HumanMessage]`` with
one id-carrying block per document (in order) and the question as the last text block."""


def rag_chain(retriever: BaseRetriever, model: ChatLazyAttention) -> Runnable:
    """A RAG chain: ``str`` or ``{"question": str}`` -> ``{"answer": str, "sources": [Document]}``.

    The retrieved documents reach the model as id-carrying blocks, so their cached K/V is reused.
    ``chain.stream(...)`` yields ``{"sources": [...]}`` first, then ``{"answer": piece}`` pieces.
    """
    question = RunnableLambda(_question_of, name="question")
    retrieve = RunnableParallel(question=question, sources=question | retriever)
    # documents=[] adds none but keeps the RAG prompt when retrieval comes back empty
    answer = documents_to_messages | model.bind(documents=[]) | StrOutputParser()
    return (retrieve | RunnablePassthrough.assign(answer=answer)).pick(["answer", "sources"]).with_config(
        run_name="lazyattn_rag_chain")
