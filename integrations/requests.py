"""Turn what a framework hands over into one engine request (shared by LlamaIndex and LangChain).

Three shapes reach the engine:

- **documents + question** (the RAG paths): documents are registered (or updated) under their
  ids and placed by id; their cached K/V is reused. Zero documents is allowed: the question is
  answered through the same RAG prompt with no documents (the documented empty-retrieval
  behaviour on every path).
- **formatted text in which registered documents occur** (the plain-prompt fallback, see
  :mod:`~lazyattn_rag.integrations.prompt_match`): the found documents are placed by id and the
  rest of the text becomes the question.
- **formatted text with no registered document in it**: a plain completion of the text in the
  model's chat template, with no reuse.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lazyattn_rag.documents import Document
from lazyattn_rag.integrations.prompt_match import PromptMatch, match_documents, registered_texts
from lazyattn_rag.outputs import StreamDelta

if TYPE_CHECKING:
    from lazyattn_rag.llm import LazyAttention
    from lazyattn_rag.sampling import SamplingParams


@dataclass
class EngineRequest:
    """One request, ready to stream.

    Attributes:
        question: the question text (RAG shape); empty for a plain prompt.
        documents: documents placed in the prompt, in order (registered when the request runs).
        plain_prompt: token ids of a plain prompt (no reuse), or ``None`` for the RAG shape.
        match: the fallback's report when the request came from formatted text, else ``None``.
    """

    question: str = ""
    documents: list[Document] = field(default_factory=list)
    plain_prompt: list[int] | None = None
    match: PromptMatch | None = None

    @property
    def doc_ids(self) -> list[str]:
        return [d.id for d in self.documents]

    def stream(self, llm: "LazyAttention", sampling: "SamplingParams") -> Iterator[StreamDelta]:
        """Run on ``llm``. Errors of :meth:`LazyAttention.stream` are raised before the first delta."""
        if self.plain_prompt is not None:
            return llm.stream_prompt(self.plain_prompt, sampling)
        return llm.stream(self.question, documents=self.documents, sampling=sampling)

    def astream(self, llm: "LazyAttention", sampling: "SamplingParams") -> AsyncIterator[StreamDelta]:
        """Async :meth:`stream` through :class:`~lazyattn_rag.async_llm.AsyncLazyAttention`: the
        event loop is never blocked, and leaving the stream early aborts the request. Errors
        raise on the first ``__anext__``."""
        from lazyattn_rag.async_llm import AsyncLazyAttention

        allm = AsyncLazyAttention(llm)
        if self.plain_prompt is not None:
            return allm.stream_prompt(self.plain_prompt, sampling)
        return allm.stream(self.question, documents=self.documents, sampling=sampling)

    def extra(self) -> dict:
        """JSON-able facts about the request for response metadata (ids, fallback match)."""
        out: dict = {"doc_ids": self.doc_ids}
        if self.match is not None:
            out["prompt_match"] = self.match.as_dict()
        return out


def rag_request(question: str, documents: Sequence[Document]) -> EngineRequest:
    """Documents (by id) and a question.

    Whitespace-only documents carry nothing to attend to and are left out (a retriever can
    return an empty node). The same id twice with the same text is kept twice (placed twice);
    the same id with two different texts is ambiguous.

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
    return EngineRequest(question=question, documents=kept)


def text_request(llm: "LazyAttention", messages: Sequence[tuple[str, str]]) -> EngineRequest:
    """Formatted chat messages ``(role, text)``: registered documents inside are reused by id.

    Roles are ``system``, ``user``, ``assistant``. With no registered document found (or
    nothing left besides documents) the messages become a plain chat-template prompt.
    """
    texts = registered_texts(llm)
    found = [match_documents(text, texts) for _, text in messages]
    doc_ids = list(dict.fromkeys(d for m in found for d in m.doc_ids))
    match = PromptMatch(tuple(doc_ids), "", sum(m.matched_chars for m in found), sum(m.prompt_chars for m in found))
    turns = [(role, m.rest) for (role, _), m in zip(messages, found) if m.rest]
    if doc_ids and turns:
        multi = sum(role != "system" for role, _ in turns) > 1
        question = "\n\n".join(f"{role}: {rest}" if multi else rest for role, rest in turns)
        match = PromptMatch(match.doc_ids, question, match.matched_chars, match.prompt_chars)
        return EngineRequest(question, [Document(d, texts[d]) for d in doc_ids], None, match)
    # A plain prompt places nothing: report no match, even if the text was nothing but documents.
    nothing = PromptMatch((), "", 0, match.prompt_chars)
    return EngineRequest(plain_prompt=chat_prompt_ids(llm.tokenizer, messages), match=nothing)


def chat_prompt_ids(tokenizer, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template, ready for the answer.

    Without a chat template: ``role: text`` lines followed by ``assistant:`` (BOS first if any).
    """
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in messages],
                                                 tokenize=False, add_generation_prompt=True)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    rendered = "\n".join(f"{r}: {t}" for r, t in messages) + "\nassistant:"
    return list(tokenizer(rendered)["input_ids"])
