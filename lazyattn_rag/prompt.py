"""The RAG prompt plan: head, document chunks and query as separately tokenized segments.

::

    global pos: 0 ..... P | g1 ...... g1+L1 | g2 ...... g2+L2 | ... | gq ..... gq+Lq | generated
    segments:   [ head   ][ chunk doc A      ][ chunk doc B      ]     [ query tail    ][ decode ...
    delta:        0        g1 - l             g2 - l                   0                0

The head is the chat template's opening (system turn, start of the user turn) plus the
instruction; each document is its text plus a separator; the tail is the question and the
template's closing (end of the user turn, start of the assistant turn). Segments are
tokenized separately and concatenated as token ids; the joined string is never
re-tokenized, so a boundary tokenizes the same way on a cache hit as on a miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lazyattn_rag.config import PromptConfig
from lazyattn_rag.messages import DocumentRef, Message, MessagePart

_SENTINEL = "\u2063LAZYATTN_CONTENT\u2063"


@dataclass(frozen=True)
class ChunkSegment:
    """A cached chunk placed in a request.

    Attributes:
        key: the chunk's cache key.
        token_ids: its tokens.
        local_start: ``l``, the position its first token was encoded at.
        global_start: ``g``, where it sits in this request.
        doc_id: the document id, or ``None`` for the head.
        source_key: for a position-aware copy (``block_attention`` mode), the document's
            position-agnostic key; copies of one source can be made from each other.
    """

    key: str
    token_ids: tuple[int, ...]
    local_start: int
    global_start: int
    doc_id: str | None
    source_key: str | None = None

    @property
    def delta(self) -> int:
        """RoPE offset of this placement (``g - l``)."""
        return self.global_start - self.local_start


@dataclass(frozen=True)
class TextSegment:
    """Request-private prompt tokens placed between cached chunks.

    A framework's template text between two documents (a header, a separator that is not
    whitespace) is computed by the request like its query tail: its tokens are written rotated
    at their global positions (``delta = 0``) and attend to everything before them (the chunks
    and text segments earlier in the prompt). Documents placed after it do not attend to it
    (each was encoded alone).

    Attributes:
        token_ids: its tokens (non-empty).
        global_start: position of its first token in the request.
    """

    token_ids: tuple[int, ...]
    global_start: int


@dataclass(frozen=True)
class PromptPlan:
    """One request's prompt: cached chunks (head first), private text segments between them,
    then the new query tokens.

    Attributes:
        chunks: head and documents in prompt order.
        query_token_ids: the tail (question and template closing), computed per request.
        prefix_block_keys: ``prefix`` mode only: the chained hash of every full block of
            ``query_token_ids`` (exact-prefix reuse, as vLLM's automatic prefix caching).
        texts: private text segments between chunks, in prompt order. Chunks and texts tile
            positions ``0 .. tail_start - 1`` without gaps; the tail follows.
    """

    chunks: tuple[ChunkSegment, ...]
    query_token_ids: tuple[int, ...]
    prefix_block_keys: tuple[str, ...] = ()
    texts: tuple[TextSegment, ...] = ()

    @property
    def num_cached_prompt_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def num_text_tokens(self) -> int:
        """Tokens of the private text segments (computed per request, before the tail)."""
        return sum(len(t.token_ids) for t in self.texts)

    @property
    def tail_start(self) -> int:
        """Global position of the first query-tail token."""
        return self.num_cached_prompt_tokens + self.num_text_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.tail_start + len(self.query_token_ids)

    def segments(self) -> list[ChunkSegment | TextSegment]:
        """Chunks and text segments in prompt order (the tail excluded)."""
        return sorted([*self.chunks, *self.texts], key=lambda s: s.global_start)

    def token_ids(self) -> list[int]:
        """The whole prompt as one id list (what a full prefill would see)."""
        ids = [t for s in self.segments() for t in s.token_ids]
        return ids + list(self.query_token_ids)


class PromptTemplate:
    """Renders the head, document and tail segments from a tokenizer's chat template.

    Args:
        tokenizer: a transformers tokenizer; its chat template (if any) frames the user turn.
        config: :class:`PromptConfig`.
    """

    def __init__(self, tokenizer: Any, config: PromptConfig):
        self.tokenizer = tokenizer
        self.config = config
        self.opening, self.closing = self._split_template()

    def _split_template(self) -> tuple[str, str]:
        if not getattr(self.tokenizer, "chat_template", None):
            return "", "\nAnswer:"
        messages = []
        if self.config.system_prompt is not None:
            messages.append({"role": "system", "content": self.config.system_prompt})
        messages.append({"role": "user", "content": _SENTINEL})
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if rendered.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not render the user content exactly once")
        opening, closing = rendered.split(_SENTINEL)
        return opening, closing

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def head_text(self) -> str:
        return self.opening + self.config.instruction

    def document_text(self, text: str) -> str:
        return text.strip() + self.config.document_separator

    def tail_text(self, question: str) -> str:
        return self.config.question_prefix + question.strip() + self.closing

    def head_token_ids(self) -> list[int]:
        return self.encode(self.head_text())

    def document_token_ids(self, text: str) -> list[int]:
        return self.encode(self.document_text(text))

    def tail_token_ids(self, question: str) -> list[int]:
        return self.encode(self.tail_text(question))

    # --- chat messages with placed documents ---------------------------------------------------
    def leading_special_ids(self) -> list[int]:
        """Ids the tokenizer adds before any text (e.g. BOS) when there is no chat template to write them."""
        if getattr(self.tokenizer, "chat_template", None):
            return []
        return list(self.tokenizer("", add_special_tokens=True)["input_ids"])

    def render_messages(self, messages: list[Message]) -> list[MessagePart]:
        """Messages in the chat template, as text runs and :class:`DocumentRef` s in prompt order.

        The template's markup (turn markers, the assistant opening) becomes text around each
        message's parts; adjacent text is merged, and whitespace right after a document
        reference is dropped (the document's chunk ends with the separator). Without a chat
        template: ``role: content`` lines, then ``assistant:``.

        Raises:
            ValueError: the chat template does not render every message's content exactly once.
        """
        markup = self._markup(messages)
        pieces: list[MessagePart] = []
        for before, message in zip(markup, messages):
            pieces.append(before)
            pieces.extend(message.parts())
        pieces.append(markup[-1])
        return _merge_text(pieces)

    def _markup(self, messages: list[Message]) -> list[str]:
        """The template text before each message's content, and after the last (``len + 1`` pieces)."""
        if not getattr(self.tokenizer, "chat_template", None):
            return [("\n" if i else "") + f"{m.role}: " for i, m in enumerate(messages)] + ["\nassistant:"]
        marks = [f"\u2063LAZYATTN_MESSAGE_{i}\u2063" for i in range(len(messages))]
        rendered = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": mark} for m, mark in zip(messages, marks)],
            tokenize=False, add_generation_prompt=True)
        out = []
        for i, mark in enumerate(marks):
            if rendered.count(mark) != 1:
                raise ValueError(f"the chat template does not render message {i} ({messages[i].role}) exactly once")
            before, rendered = rendered.split(mark)
            out.append(before)
        return out + [rendered]


def _merge_text(pieces: list[MessagePart]) -> list[MessagePart]:
    merged: list[MessagePart] = []
    for piece in pieces:
        if isinstance(piece, str):
            if merged and isinstance(merged[-1], DocumentRef):
                piece = piece.lstrip()
            if not piece:
                continue
            if merged and isinstance(merged[-1], str):
                merged[-1] += piece
                continue
        merged.append(piece)
    return merged
