"""LangChain integration: a chat model that reuses documents' cached K/V by id, a Runnable that
turns retrieved ``Document``s into id-carrying content blocks, a FAISS retriever and a ready RAG
chain ``{question} -> {answer, sources}``.

Documents reach :class:`ChatLazyAttention` in either of two ways:

- **content blocks**: a text block with an ``id`` and ``extras={"document": True}`` (make them
  with :func:`document_block`); the message's other text is the question;
- the ``documents=`` call argument (LangChain ``Document``s or ``lazyattn_rag.Document``s).

Messages with neither (and no ``documents=`` argument) go through the plain-prompt fallback:
registered documents found in the text are reused by id, otherwise the messages are completed
in the model's chat template.

Empty retrieval: the question is answered through the RAG prompt with no documents (no
exception); ``sources`` is empty and the stats list no documents. :func:`rag_chain` passes
``documents=[]`` for this; do the same when calling the model on an empty retrieval yourself.

Example::

    from lazyattn_rag.integrations.langchain import ChatLazyAttention, FaissRetriever, rag_chain
    chain = rag_chain(FaissRetriever(store=store, k=3), ChatLazyAttention(engine=llm))
    out = chain.invoke({"question": "What does the else clause of a for loop do?"})
    print(out["answer"], [d.id for d in out["sources"]])
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document as LCDocument
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough
from pydantic import ConfigDict, Field

from lazyattn_rag.documents import Document
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
from lazyattn_rag.integrations.requests import EngineRequest, rag_request, text_request
from lazyattn_rag.llm import LazyAttention
from lazyattn_rag.outputs import StreamDelta
from lazyattn_rag.sampling import SamplingParams

METADATA_KEY = "lazyattn"

__all__ = ["ChatLazyAttention", "FaissRetriever", "document_block", "documents_to_messages", "rag_chain",
           "to_engine_document"]

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "chat": "user", "tool": "user"}


def to_engine_document(doc: LCDocument | Document) -> Document:
    """A LangChain ``Document`` as an engine document: its ``id`` (or a hash of its text when it
    has none) and its ``page_content``."""
    if isinstance(doc, Document):
        return doc
    doc_id = doc.id or "sha256:" + hashlib.sha256(doc.page_content.encode()).hexdigest()[:32]
    return Document(doc_id, doc.page_content, dict(doc.metadata))


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


def build_request(engine: LazyAttention, messages: Sequence[BaseMessage],
                  documents: Sequence[LCDocument | Document] | None = None) -> EngineRequest:
    """The engine request for chat ``messages`` (see the module docstring for the rules).

    Raises:
        ValueError: no messages.
    """
    if not messages:
        raise ValueError("ChatLazyAttention needs at least one message")
    split = [(_role(m), *_split_message(m)) for m in messages]
    docs = [d for _, ds, _ in split for d in ds] + [to_engine_document(d) for d in documents or ()]
    if not docs and documents is None:
        return text_request(engine, [(role, text) for role, _, text in split])
    turns = [(role, text) for role, _, text in split if text.strip()]
    multi = sum(role != "system" for role, _ in turns) > 1
    question = "\n\n".join(f"{role}: {text}" if multi else text for role, text in turns)
    # One document given twice (in a message's blocks and in documents=, or repeated) is placed
    # once; the same id with another text is an error (rag_request).
    return rag_request(question, list({(d.id, d.text): d for d in docs}.values()))


class ChatLazyAttention(BaseChatModel):
    """A LangChain chat model over a :class:`~lazyattn_rag.llm.LazyAttention` engine.

    Every result message carries ``usage_metadata`` (``input_token_details.cache_read`` = prompt
    tokens served from the KV cache) and ``response_metadata["lazyattn"] = {"doc_ids", "stats",
    "prompt_match"?}`` with the request's :class:`~lazyattn_rag.outputs.RequestStats`.
    Async calls stream through :class:`~lazyattn_rag.async_llm.AsyncLazyAttention` and never block
    the event loop; concurrent requests share the engine's batches.

    Args:
        engine: the :class:`LazyAttention` to run on.
        sampling: default :class:`SamplingParams`; ``stop`` from LangChain is added to its stop
            strings and a ``sampling=`` call argument replaces it.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    engine: LazyAttention = Field(description="The engine the model runs on.")
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Default sampling parameters.")

    @property
    def _llm_type(self) -> str:
        return "lazyattn-rag"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.engine.model_name, **dataclasses.asdict(self.sampling)}

    def _prepare(self, messages, stop, kwargs) -> tuple[EngineRequest, SamplingParams]:
        sampling = kwargs.get("sampling") or self.sampling
        if stop:
            sampling = dataclasses.replace(sampling, stop=tuple(sampling.stop) + tuple(stop))
        return build_request(self.engine, messages, kwargs.get("documents")), sampling

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        chunks = list(self._stream(messages, stop, run_manager, **kwargs))
        return _result(chunks)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return _result([c async for c in self._astream(messages, stop, run_manager, **kwargs)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        request, sampling = self._prepare(messages, stop, kwargs)
        for delta in request.stream(self.engine, sampling):
            chunk = self._chunk(request, delta)
            if chunk is not None:
                if run_manager and delta.text:
                    run_manager.on_llm_new_token(delta.text, chunk=chunk)
                yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        request, sampling = await asyncio.to_thread(self._prepare, messages, stop, kwargs)
        async for delta in request.astream(self.engine, sampling):
            chunk = self._chunk(request, delta)
            if chunk is not None:
                if run_manager and delta.text:
                    await run_manager.on_llm_new_token(delta.text, chunk=chunk)
                yield chunk

    def _chunk(self, request: EngineRequest, delta: StreamDelta) -> ChatGenerationChunk | None:
        if not delta.finished:
            return ChatGenerationChunk(message=AIMessageChunk(content=delta.text)) if delta.text else None
        s = delta.stats
        usage = {"input_tokens": s.num_prompt_tokens, "output_tokens": s.num_output_tokens,
                 "total_tokens": s.num_prompt_tokens + s.num_output_tokens,
                 "input_token_details": {"cache_read": s.num_cached_tokens}}
        meta = {"model_name": self.engine.model_name, "finish_reason": delta.finish_reason,
                METADATA_KEY: {**request.extra(), "stats": s.as_dict()}}
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
