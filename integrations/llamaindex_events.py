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

import threading
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from llama_index.core.schema import MetadataMode, NodeWithScore
from llama_index_instrumentation.span import active_span_id

from lazyattn_rag.integrations.prompt_match import Candidate
from lazyattn_rag.integrations.retrieval_log import RetrievalLog
from lazyattn_rag.integrations.reuse_report import CallReport, ReuseSummary

METADATA_KEY = "lazyattn"
_LOG = RetrievalLog()
_REPORTS: dict[str, list[CallReport]] = {}
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
        _attach(id_, result)
        _LOG.end(id_)
        return None

    def prepare_to_drop_span(self, id_: str, bound_args: Any, instance: Any = None, err: Any = None,
                             **kwargs: Any) -> None:
        with _REPORTS_LOCK:
            _REPORTS.pop(id_, None)
        _LOG.end(id_)
        return None


class _RetrievalEvents(BaseEventHandler):
    @classmethod
    def class_name(cls) -> str:
        return "LazyAttentionRetrievalEvents"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            add_retrieved(event.nodes, event.span_id)


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


def retrieved_candidates(span_id: str | None = None) -> list[Candidate]:
    """Nodes retrieved so far in the query that ``span_id`` (default: the active span) belongs to."""
    return _LOG.documents(current_span() if span_id is None else span_id)


def add_retrieved(nodes: list[Any], span_id: str | None = None) -> None:
    """Record ``nodes`` as retrieved in the query ``span_id`` (default: the active span) belongs to."""
    _LOG.add(current_span() if span_id is None else span_id, [c for n in nodes for c in node_candidates(n)])


def record_call(report: CallReport, span_id: str | None = None) -> None:
    """File a call's report under its span and every ancestor (their responses will carry it)."""
    node = current_span() if span_id is None else span_id
    with _REPORTS_LOCK:  # (the log takes its own lock inside; it never takes this one)
        for ancestor in _LOG.ancestors(node):
            _REPORTS.setdefault(ancestor, []).append(report)


def _attach(span_id: str, result: Any) -> None:
    with _REPORTS_LOCK:
        calls = _REPORTS.pop(span_id, None)
    if not calls or result is None or not hasattr(result, "source_nodes"):
        return
    metadata = getattr(result, "metadata", None)
    if metadata is None:
        metadata = {}
        try:
            result.metadata = metadata
        except (AttributeError, TypeError):  # a response type that takes no metadata
            return
    metadata[METADATA_KEY] = ReuseSummary(calls)
