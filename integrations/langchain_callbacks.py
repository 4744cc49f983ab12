"""LangChain callbacks: learn the documents every retriever returns, with no user wiring.

:func:`install` registers one callback handler as a LangChain *configure hook* (the mechanism
LangChain's own tracers use), so it joins every run's callback manager in the process: any
retriever (the project's, ``InMemoryVectorStore().as_retriever()``, a community store...) in
any chain (LCEL with ``format_docs``, ``RunnableWithMessageHistory``, ...). The handler keeps
each run's parent and, on ``on_retriever_end``, the returned documents under the root run of
the chain; :class:`ChatLazyAttention` looks them up by its own run id and finds them in its
prompt. :class:`ChatLazyAttention` calls :func:`install` when constructed.
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tracers.context import register_configure_hook

from lazyattn_rag.types.documents import content_id
from lazyattn_rag.engine.planning.prompt_match import Candidate
from lazyattn_rag.integrations.retrieval_log import RetrievalLog

_LOG = RetrievalLog()
_INSTALL_LOCK = threading.Lock()
_HOOK: ContextVar[BaseCallbackHandler | None] | None = None  # its default is the handler, once installed


def document_candidate(doc: Any) -> Candidate:
    """A LangChain ``Document`` as a candidate: its ``id`` (or a hash of its text) and ``page_content``."""
    return Candidate(getattr(doc, "id", None) or content_id(doc.page_content), doc.page_content)


class RetrievalCallbackHandler(BaseCallbackHandler):
    """Keeps the run tree and the documents each chain's retrievers returned (see the module)."""

    run_inline = True  # called in order, on the caller's thread, before the model runs
    raise_error = False

    def _start(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        _LOG.start(str(run_id), str(parent_run_id) if parent_run_id else None)

    def _end(self, *args: Any, run_id: UUID, **kwargs: Any) -> None:
        _LOG.end(str(run_id))

    def on_chain_start(self, serialized, inputs, *, run_id, parent_run_id=None, **kwargs) -> None:
        self._start(run_id, parent_run_id)

    def on_retriever_start(self, serialized, query, *, run_id, parent_run_id=None, **kwargs) -> None:
        self._start(run_id, parent_run_id)

    def on_chat_model_start(self, serialized, messages, *, run_id, parent_run_id=None, **kwargs) -> None:
        self._start(run_id, parent_run_id)

    def on_llm_start(self, serialized, prompts, *, run_id, parent_run_id=None, **kwargs) -> None:
        self._start(run_id, parent_run_id)

    def on_tool_start(self, serialized, input_str, *, run_id, parent_run_id=None, **kwargs) -> None:
        self._start(run_id, parent_run_id)

    def on_retriever_end(self, documents, *, run_id, parent_run_id=None, **kwargs) -> None:
        _LOG.add(str(run_id), [document_candidate(d) for d in documents])
        _LOG.end(str(run_id))

    on_chain_end = on_chain_error = on_retriever_error = _end
    on_llm_end = on_llm_error = on_tool_end = on_tool_error = _end


def install() -> None:
    """Register the handler for every LangChain run in this process (idempotent, thread-safe)."""
    global _HOOK
    with _INSTALL_LOCK:
        if _HOOK is None:
            _HOOK = ContextVar("lazyattn_rag_retrievals", default=RetrievalCallbackHandler())
            register_configure_hook(_HOOK, inheritable=True)


def retrieved_candidates(run_id: UUID | str | None) -> list[Candidate]:
    """Documents retrieved so far in the chain run ``run_id`` belongs to (none for ``None``)."""
    return _LOG.documents(str(run_id)) if run_id is not None else []
