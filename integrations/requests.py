"""Turn what a framework hands over into one engine request (shared by LlamaIndex and LangChain).

Two shapes reach the engine:

- **documents + question** (the id paths: ``LazyAttentionSynthesizer``, LangChain document
  blocks and ``documents=``): documents are registered (or updated) under their ids and placed
  by id in the engine's RAG prompt. Zero documents is allowed: the question is answered through
  the same prompt with no documents (the documented empty-retrieval behaviour on every path).
- **formatted chat messages** (the idioms people write: ``index.as_query_engine()``, chat
  engines, LCEL with ``format_docs``): :class:`PromptMatcher` finds the documents inside the
  text (those registered with the engine, and those the framework retrieved in the same query)
  and the messages go to :meth:`LazyAttention.stream_chat` as text around document
  references: each document is placed from its cached K/V, the template's text is computed as
  the request's own tokens. With no document found the messages are a plain chat prompt, and
  the report's ``reason`` says why.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lazyattn_rag.types.documents import Document
from lazyattn_rag.engine.planning.prompt_match import (
    Candidate,
    DocumentMatcher,
    PromptMatch,
    resolve,
    split_message,
)
from lazyattn_rag.integrations.reuse_report import CallReport
from lazyattn_rag.types.messages import Message, rag_messages
from lazyattn_rag.types.outputs import StreamDelta

if TYPE_CHECKING:
    from lazyattn_rag.types.config import PromptConfig, RequestRemedies
    from lazyattn_rag.llm import LazyAttention
    from lazyattn_rag.types.sampling_params import SamplingParams

_RAG_WORDS = re.compile(r"\b(context|documents?|passages?|sources?|retrieved)\b", re.IGNORECASE)
RAG_PROMPT_MIN_CHARS = 300


@dataclass
class EngineRequest:
    """One request, ready to stream.

    Attributes:
        question: the question text (documents + question shape).
        documents: placed in order (documents + question shape), or registered before the
            messages are planned (chat shape: the retrieved documents the matcher found).
        messages: the chat shape's messages (text and document references), else ``None``.
        match: the matcher's report for formatted text, else ``None``.
        report: what the call reports in response metadata (filled in when it finishes).
    """

    question: str = ""
    documents: list[Document] = field(default_factory=list)
    messages: list[Message] | None = None
    match: PromptMatch | None = None
    report: CallReport = field(init=False)

    def __post_init__(self):
        self.report = CallReport(self.doc_ids, self.match.as_dict() if self.match is not None else None)

    @property
    def doc_ids(self) -> list[str]:
        """Documents placed, in prompt order."""
        if self.messages is not None:
            return [d for m in self.messages for d in m.document_ids()]
        return [d.id for d in self.documents]

    def stream(self, llm: "LazyAttention", sampling: "SamplingParams", namespace: str = "",
               remedies: "RequestRemedies | None" = None) -> Iterator[StreamDelta]:
        """Run on ``llm``, the documents in ``namespace``, with the answer-fidelity ``remedies``
        (``None``: the engine's). Errors of :meth:`LazyAttention.stream` are raised before the
        first delta."""
        if self.messages is not None:
            deltas = llm.stream_chat(self.messages, self.documents, sampling, namespace, remedies=remedies)
        else:
            deltas = llm.stream(self.question, documents=self.documents, sampling=sampling, namespace=namespace,
                                remedies=remedies)
        return self._reported(deltas)

    def astream(self, llm: "LazyAttention", sampling: "SamplingParams", namespace: str = "",
                remedies: "RequestRemedies | None" = None) -> AsyncIterator[StreamDelta]:
        """Async :meth:`stream` through :class:`~lazyattn_rag.async_llm.AsyncLazyAttention`: the
        event loop is never blocked, and leaving the stream early aborts the request. Errors
        raise on the first ``__anext__``."""
        allm = llm.aio()
        if self.messages is not None:
            return self._areported(allm.stream_chat(self.messages, self.documents, sampling, namespace,
                                                    remedies=remedies))
        return self._areported(allm.stream(self.question, documents=self.documents, sampling=sampling,
                                           namespace=namespace, remedies=remedies))

    def _reported(self, deltas: Iterator[StreamDelta]) -> Iterator[StreamDelta]:
        try:
            for d in deltas:
                if d.finished:
                    self.report.finish(d)
                yield d
        finally:  # leaving early cancels the request
            close = getattr(deltas, "close", None)
            if close is not None:
                close()

    async def _areported(self, deltas: AsyncIterator[StreamDelta]) -> AsyncIterator[StreamDelta]:
        try:
            async for d in deltas:
                if d.finished:
                    self.report.finish(d)
                yield d
        finally:
            await deltas.aclose()


def rag_request(question: str, documents: Sequence[Document], preamble: Sequence[tuple[str, str]] = (),
                prompt: "PromptConfig | None" = None) -> EngineRequest:
    """Documents (by id) and a question, in the engine's RAG prompt.

    Whitespace-only documents carry nothing to attend to and are left out (a retriever can
    return an empty node). The same id twice with the same text is kept twice (placed twice);
    the same id with two different texts is ambiguous.

    Args:
        question: the question.
        documents: placed by id, in order.
        preamble: chat turns ``(role, text)`` before the RAG turn (a system prompt, a history);
            with any, the request is the engine's RAG turn (``prompt``'s instruction, the
            documents, its question prefix and the question) after them, as chat messages.
        prompt: the engine's :class:`~lazyattn_rag.types.config.PromptConfig` (needed with a preamble).
    Raises:
        ValueError: one id with two different texts (the id is named).
    """
    seen: dict[str, str] = {}
    kept = []
    for d in documents:
        if not isinstance(d.text, str) or not d.text.strip():
            continue
        if seen.setdefault(d.id, d.text) != d.text:
            raise ValueError(f"document id {d.id!r} is given twice with different texts in one request")
        kept.append(d)
    if not preamble:
        return EngineRequest(question=question, documents=kept)
    return EngineRequest(documents=kept, messages=rag_messages(question, [d.id for d in kept], preamble, prompt))


def looks_like_rag(text: str) -> bool:
    """A long prompt that speaks of context, documents, passages or sources (warning heuristic)."""
    return len(text) >= RAG_PROMPT_MIN_CHARS and _RAG_WORDS.search(text) is not None


def deserves_warning(match: PromptMatch | None, texts: Sequence[str], retrieved: bool, nested: bool) -> bool:
    """Whether a call that placed no document should say so (once per LLM object).

    Yes when its query retrieved documents and none is in the prompt, or one occurs only in
    part. Otherwise only for a prompt that looks like RAG (:func:`looks_like_rag`) and either no
    document is known at all, or the call is the user's own (not a step inside a framework's
    query, such as a chat engine rewriting the question before it retrieves anything).

    Args:
        match: the call's :class:`PromptMatch` (``None``: an id path, nothing to say).
        texts: the messages' texts.
        retrieved: a retriever ran in the call's query (LlamaIndex span, LangChain run).
        nested: the call runs inside a framework query or chain rather than on its own.
    """
    if match is None or match.doc_ids:
        return False
    if retrieved or match.partial_ids:
        return True
    if not any(looks_like_rag(t) for t in texts):
        return False
    return match.num_registered == 0 or not nested


class PromptMatcher:
    """Finds documents in formatted chat messages for one engine.

    The engine's registered documents are indexed once per change of its registry
    (``LazyAttention.documents_version``); a query's retrieved documents are indexed per call.

    Args:
        llm: the engine.
        namespace: the namespace whose registered documents are looked for.
    """

    def __init__(self, llm: "LazyAttention", namespace: str = ""):
        self.llm, self.namespace = llm, namespace
        self._version = -1
        self._texts: dict[str, str] = {}
        self._registered = DocumentMatcher(())

    def registered(self) -> tuple[DocumentMatcher, dict[str, str]]:
        """The matcher over the engine's registered documents, and their texts by id."""
        version = self.llm.documents_version
        if version != self._version:
            texts = self.llm.document_texts(namespace=self.namespace)
            self._registered = DocumentMatcher(Candidate(d, t) for d, t in texts.items())
            self._texts, self._version = texts, version
        return self._registered, self._texts

    def request(self, messages: Sequence[tuple[str, str]], retrieved: Sequence[Candidate] = ()) -> EngineRequest:
        """The chat request for formatted ``messages`` ``(role, text)``.

        Against a ``lazyattn serve`` server (a remote engine) the messages go as plain text: the
        server finds its registered documents in them and learns the passages that recur
        (``lazyattn_rag/serve/payload.py``), so the client makes no call of its own per query and
        never downloads the registry.

        Args:
            messages: roles ``system``, ``user`` or ``assistant``.
            retrieved: documents the framework retrieved in this query (registered when found).
        """
        if getattr(self.llm, "is_remote", False):
            return EngineRequest(messages=[Message(role, text) for role, text in messages])
        registered, texts = self.registered()
        own = [_own_id(c, texts) for c in retrieved]
        fresh = DocumentMatcher(own)
        parts, placed, partial, escaped, matched_chars = [], {}, set(), 0, 0
        for role, text in messages:
            occ_a, partial_a = registered.occurrences(text)
            occ_b, partial_b = fresh.occurrences(text)
            found = resolve(occ_a + occ_b)
            partial |= partial_a | partial_b
            escaped += sum(m[3] for m in found)
            matched_chars += sum(m[1] - m[0] for m in found)
            placed.update({m[2].doc_id: m[2] for m in found})
            parts.append(Message(role, tuple(split_message(text, found))))
        doc_ids = tuple(d for m in parts for d in m.document_ids())
        prompt_chars = sum(len(t) for _, t in messages)
        partial -= set(placed)
        match = PromptMatch(doc_ids, matched_chars, prompt_chars, tuple(sorted(partial)), escaped,
                            registered.num_candidates + fresh.num_candidates, registered.num_candidates,
                            "" if doc_ids else _reason(texts, own, partial))
        inline = [Document(c.doc_id, c.text) for c in placed.values() if texts.get(c.doc_id) != c.text]
        return EngineRequest(documents=inline, messages=parts, match=match)


def _own_id(candidate: Candidate, texts: dict[str, str]) -> Candidate:
    """A retrieved document under its own id, or ``<id>@<hash>`` when the engine holds another
    text under that id (never overwrite a registered document with a rendering of it)."""
    if texts.get(candidate.doc_id, candidate.text) == candidate.text:
        return candidate
    digest = hashlib.sha256(candidate.text.encode()).hexdigest()[:12]
    return Candidate(f"{candidate.doc_id}@{digest}", candidate.text)


def _reason(texts: dict[str, str], retrieved: list[Candidate], partial: set[str]) -> str:
    if not texts and not retrieved:
        return ("no documents are known: none is registered with the engine and no retriever ran in this "
                "query through LlamaIndex or LangChain")
    if partial:
        return (f"documents {sorted(partial)} occur only in part (cut to fit the context window, or edited): "
                "they are computed as text, not reused")
    known = len(texts) + len(retrieved)
    return (f"none of the {known} known documents occurs in the prompt: the prompt's text differs from the "
            "registered or retrieved text")
