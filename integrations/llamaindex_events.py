"""LlamaIndex instrumentation: learn retrieved nodes and report reuse with no user wiring.

:func:`install` adds one span handler and one event handler to LlamaIndex's root dispatcher
(once per process; :class:`LazyAttentionLLM` calls it when constructed). Then:

* every ``RetrievalEndEvent`` (any retriever, any index, inside ``query``/``chat``/``retrieve``)
  records its nodes, as the LLM is shown them (``MetadataMode.LLM``) and as plain text, under
  the root span of the query, where the LLM's prompt matcher finds them
  (:func:`retrieved_candidates`);
* every call's :class:`~lazyattn_rag.integrations.reuse_report.CallReport` is filed under the
  spans it runs in (:func:`record_call`), and when a span returns a response (``Response``,
  ``StreamingResponse``, ``AgentChatResponse``...) its ``metadata["lazyattn"]`` becomes the
  :class:`~lazyattn_rag.integrations.reuse_report.ReuseSummary` of the calls below it.

Nothing else changes: events and spans still reach every other handler.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Any

from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from llama_index.core.schema import MetadataMode, NodeWithScore
from llama_index_instrumentation.span import active_span_id

from lazyattn_rag.engine.planning.prompt_match import Candidate
from lazyattn_rag.integrations.retrieval_log import RetrievalLog
from lazyattn_rag.integrations.reuse_report import CallReport, ReuseSummary

METADATA_KEY = "lazyattn"
logger = logging.getLogger("lazyattn_rag.integrations")
_LOG = RetrievalLog()
_REPORTS: dict[str, list[CallReport]] = {}  # span id -> calls made below it
_STREAMS: dict[str, "_Deferred"] = {}  # span id -> a streaming response returned below it
_REPORTS_LOCK = threading.Lock()
_INSTALLED = threading.Event()
_INSTALL_LOCK = threading.Lock()


def node_candidates(node: Any) -> list[Candidate]:
    """A node as the LLM sees it (``MetadataMode.LLM``; id = ``node_id``) and, when that differs,
    as plain text (id ``<node_id>#text``)."""
    node = node.node if isinstance(node, NodeWithScore) else node
    shown = node.get_content(metadata_mode=MetadataMode.LLM)
    out = [Candidate(node.node_id, shown)]
    plain = node.get_content(metadata_mode=MetadataMode.NONE)
    if plain.strip() != shown.strip():
        out.append(Candidate(node.node_id + "#text", plain))
    return out


class _SpanTree(BaseSpanHandler[Any]):
    """Records each span's parent, and attaches reuse summaries to the responses spans return."""

    @classmethod
    def class_name(cls) -> str:
        return "LazyAttentionSpanTree"

    def new_span(self, id_: str, bound_args: Any, instance: Any = None, parent_span_id: str | None = None,
                 tags: Any = None, **kwargs: Any) -> None:
        _LOG.start(id_, parent_span_id)
        return None  # nothing kept in the base class's open-span tables

    def prepare_to_exit_span(self, id_: str, bound_args: Any, instance: Any = None, result: Any = None,
                             **kwargs: Any) -> None:
        try:
            _attach(id_, result)
        except Exception:  # LlamaIndex swallows handler errors silently: say it
            logger.exception("lazyattn-rag: attaching reuse metadata to %s failed", id_)
        _LOG.end(id_)
        return None

    def prepare_to_drop_span(self, id_: str, bound_args: Any, instance: Any = None, err: Any = None,
                             **kwargs: Any) -> None:
        with _REPORTS_LOCK:
            _REPORTS.pop(id_, None)
            _STREAMS.pop(id_, None)
        _LOG.end(id_)
        return None


class _RetrievalEvents(BaseEventHandler):
    @classmethod
    def class_name(cls) -> str:
        return "LazyAttentionRetrievalEvents"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            try:
                add_retrieved(event.nodes, event.span_id)
            except Exception:  # LlamaIndex swallows handler errors silently: say it
                logger.exception("lazyattn-rag: recording retrieved nodes failed")


def install() -> None:
    """Add the handlers to LlamaIndex's root dispatcher (idempotent, thread-safe)."""
    if _INSTALLED.is_set():
        return
    with _INSTALL_LOCK:
        if not _INSTALLED.is_set():
            root = get_dispatcher()
            root.add_span_handler(_SpanTree())
            root.add_event_handler(_RetrievalEvents())
            _INSTALLED.set()


def current_span() -> str | None:
    return active_span_id.get()


@dataclass
class _Deferred:
    """A streaming response's query, for LLM calls its generator makes after the query's spans ended."""

    candidates: list[Candidate]
    summary: ReuseSummary


_DEFERRED: contextvars.ContextVar[_Deferred | None] = contextvars.ContextVar("lazyattn_deferred", default=None)


def retrieved_candidates(span_id: str | None = None) -> list[Candidate]:
    """Nodes retrieved so far in the query that ``span_id`` (default: the active span) belongs to,
    or, inside a streaming response's generator, in the query that returned it."""
    found = _LOG.documents(current_span() if span_id is None else span_id)
    deferred = _DEFERRED.get()
    return found + deferred.candidates if deferred is not None else found


def in_framework_query(own_prefix: str, span_id: str | None = None) -> bool:
    """Whether the span (default: the active one) runs inside a LlamaIndex operation other than
    the LLM's own calls, whose span ids start with ``own_prefix`` (e.g. ``"LazyAttentionLLM."``)."""
    node = current_span() if span_id is None else span_id
    return any(not a.startswith(own_prefix) for a in _LOG.ancestors(node))


def add_retrieved(nodes: list[Any], span_id: str | None = None) -> None:
    """Record ``nodes`` as retrieved in the query ``span_id`` (default: the active span) belongs to."""
    _LOG.add(current_span() if span_id is None else span_id, [c for n in nodes for c in node_candidates(n)])


def record_call(report: CallReport, span_id: str | None = None) -> None:
    """File a call's report under its span and every ancestor (their responses will carry it)."""
    node = current_span() if span_id is None else span_id
    with _REPORTS_LOCK:  # (the log takes its own lock inside; it never takes this one)
        for ancestor in _LOG.ancestors(node):
            _REPORTS.setdefault(ancestor, []).append(report)
    deferred = _DEFERRED.get()
    if deferred is not None:
        deferred.summary.add([report])


def _attach(span_id: str, result: Any) -> None:
    """A span returned ``result``: give a response its reuse summary; a streaming one also
    carries its query's documents into its generator (LlamaIndex's synthesizers may call the
    LLM only when the stream is read, after the query's spans ended), and the responses that
    enclosing spans return (a chat engine's stream) share its summary."""
    with _REPORTS_LOCK:
        calls = _REPORTS.pop(span_id, None) or []
        inherited = _STREAMS.pop(span_id, None)
    if result is None or not hasattr(result, "source_nodes"):
        return
    deferred = getattr(result, "_lazyattn_deferred", None) or inherited
    if deferred is None and _is_stream(result):
        deferred = _Deferred([], ReuseSummary())
        _wrap_stream(result, deferred)
    if deferred is not None:
        deferred.candidates[:] = _LOG.documents(span_id) or deferred.candidates
        deferred.summary.add(calls)
        summary = deferred.summary
        with _REPORTS_LOCK:
            for ancestor in _LOG.ancestors(span_id)[1:]:
                _STREAMS.setdefault(ancestor, deferred)
    elif calls:
        summary = ReuseSummary(calls)
    else:
        return
    metadata = getattr(result, "metadata", None)
    if metadata is None:
        metadata = {}
        try:
            result.metadata = metadata
        except (AttributeError, TypeError):  # a response type that takes no metadata
            return
    metadata[METADATA_KEY] = summary


def _is_stream(result: Any) -> bool:
    """A query engine's streaming response with a generator not yet wrapped."""
    if not isinstance(result, (StreamingResponse, AsyncStreamingResponse)):
        return False
    return inspect.isgenerator(result.response_gen) or inspect.isasyncgen(result.response_gen)


def _wrap_stream(result: Any, deferred: _Deferred) -> None:
    gen = result.response_gen
    result.response_gen = _async_in(gen, deferred) if inspect.isasyncgen(gen) else _sync_in(gen, deferred)
    result._lazyattn_deferred = deferred


def _sync_in(gen, deferred: _Deferred):
    """``gen``'s items, each produced with ``deferred`` as the current query."""
    try:
        while True:
            token = _DEFERRED.set(deferred)
            try:
                item = next(gen)
            except StopIteration:
                return
            finally:
                _DEFERRED.reset(token)
            yield item
    finally:
        gen.close()


async def _async_in(gen, deferred: _Deferred):
    try:
        while True:
            token = _DEFERRED.set(deferred)
            try:
                item = await gen.__anext__()
            except StopAsyncIteration:
                return
            finally:
                _DEFERRED.reset(token)
            yield item
    finally:
        await gen.aclose()
