"""Chat messages whose content places registered documents by id (value types).

A framework's formatted prompt is text around documents: an instruction, the documents, the
question, a chat history. :meth:`LazyAttention.stream_chat` takes it as messages whose content
is a sequence of text pieces and :class:`DocumentRef` s, so each document is placed from its
cached, position-agnostic K/V while the text around it is computed as the request's own
tokens (see :meth:`lazyattn_rag.engine.engine.LLMEngine.plan_messages`).

Example::

    messages = [Message("system", "You answer from the context."),
                Message("user", ("Context:\\n", DocumentRef("eiffel"), DocumentRef("fuji"),
                                 "Question: When was the tower completed?"))]
    out = llm.chat(messages)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lazyattn_rag.types.config import PromptConfig

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class DocumentRef:
    """A registered document placed in a message.

    It renders as the document's chunk (its text stripped, then the engine's
    ``PromptConfig.document_separator``); whitespace right after it in the message is dropped,
    the separator stands for it.

    Attributes:
        id: the document id (registered with ``add_document`` or passed in ``documents=``).
        matched: a matcher found the document's text in the prompt (``lazyattn serve``, the
            framework wrappers) rather than the caller naming it; reported in
            ``RequestStats.doc_sources``, not compared.
    """

    id: str
    matched: bool = field(default=False, compare=False)


MessagePart = str | DocumentRef


@dataclass(frozen=True)
class Message:
    """One chat turn.

    Attributes:
        role: ``"system"``, ``"user"`` or ``"assistant"``.
        content: text, or a sequence of text pieces and :class:`DocumentRef` s in order.
    """

    role: str
    content: str | tuple[MessagePart, ...]

    def parts(self) -> tuple[MessagePart, ...]:
        return (self.content,) if isinstance(self.content, str) else tuple(self.content)

    def document_ids(self) -> list[str]:
        return [p.id for p in self.parts() if isinstance(p, DocumentRef)]


def as_message(value: Message | Mapping[str, Any] | tuple[str, Any]) -> Message:
    """A :class:`Message` from itself, ``(role, content)`` or an OpenAI-style dict.

    Dict content may be a string or a list of parts: strings, ``{"type": "text", "text": ...}``
    and ``{"type": "document", "id": ...}``.

    Raises:
        ValueError: an unknown role, or a part of another kind (named).
    """
    if isinstance(value, Message):
        message = value
    elif isinstance(value, Mapping):
        message = Message(value.get("role"), _parts(value.get("content")))
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        message = Message(value[0], _parts(value[1]))
    else:
        raise ValueError(f"a message must be a Message, a (role, content) pair or a dict, got {value!r}")
    if message.role not in ROLES:
        raise ValueError(f"message role must be one of {ROLES}, got {message.role!r}")
    for part in message.parts():
        if not isinstance(part, (str, DocumentRef)):
            raise ValueError(f"message content parts must be text or DocumentRef, got {part!r}")
    return message


def _parts(content: Any) -> str | tuple[MessagePart, ...]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")
    parts: list[MessagePart] = []
    for part in content:
        if isinstance(part, (str, DocumentRef)):
            parts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        elif isinstance(part, Mapping) and part.get("type") == "document" and isinstance(part.get("id"), str):
            parts.append(DocumentRef(part["id"], matched=part.get("matched") is True))
        else:
            raise ValueError(f"unsupported message content part {part!r}: use text or "
                             '{"type": "document", "id": ...}')
    return tuple(parts)


def rag_messages(question: str, doc_ids: Sequence[str], preamble: Sequence[tuple[str, str]],
                 prompt: "PromptConfig") -> list[Message]:
    """Chat turns ``preamble`` (``(role, text)``: a system prompt, a history), then the engine's
    RAG turn: ``prompt``'s instruction, the documents by id, its question prefix and ``question``
    (what :meth:`LazyAttention.stream` builds, after earlier turns)."""
    turn = (prompt.instruction, *(DocumentRef(d) for d in doc_ids), prompt.question_prefix + question.strip())
    return [Message(role, text) for role, text in preamble] + [Message("user", turn)]
