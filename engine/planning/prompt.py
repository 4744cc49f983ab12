"""The prompt template: the head, document and tail segments a plan is made of, tokenized.

The layout of a plan is in ``engine/planning/prompt_plan.py``. The head is the chat template's opening (system turn, start of the user turn) plus the
instruction; each document is its text plus a separator; the tail is the question and the
template's closing (end of the user turn, start of the assistant turn). Segments are
tokenized separately and concatenated as token ids; the joined string is never
re-tokenized, so a boundary tokenizes the same way on a cache hit as on a miss.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lazyattn_rag.engine.planning.token_ids import TokenEncoder
from lazyattn_rag.types.config import PromptConfig
from lazyattn_rag.types.messages import DocumentRef, Message

_SENTINEL = "\u2063LAZYATTN_CONTENT\u2063"
_SYSTEM_SENTINEL = "\u2063LAZYATTN_SYSTEM\u2063"


@dataclass(frozen=True)
class PromptText:
    """Prompt text between documents: runs of chat-template markup and of literal text.

    Markup is the template's own text (turn markers, BOS written by the template): the text
    of a special token in it becomes that token's id. Literal text is everything a user,
    a document or a framework wrote: it never yields a special-token id, whatever it contains
    (a document quoting ``<|im_end|>`` keeps those characters as ordinary text).

    Attributes:
        runs: ``(text, is_markup)`` pairs in order, none empty.
    """

    runs: tuple[tuple[str, bool], ...]

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.runs)


def _positions(ids: list[int], values: set[int]) -> list[int]:
    """The indices in ``ids`` of every occurrence of each of ``values``, found by ``list.index``
    (C loops; the values are few: the special tokens a prompt contains)."""
    found = []
    for value in values:
        i = ids.index(value)
        while True:
            found.append(i)
            try:
                i = ids.index(value, i + 1)
            except ValueError:
                break
    return found


class PromptTemplate:
    """Renders the head, document and tail segments from a tokenizer's chat template.

    Tokenization rule: template markup is parsed for special tokens; user text (documents,
    questions, message content, the configured instruction and prefixes) is tokenized
    literally (special-token parsing off), so no text a user controls can open or close a
    turn. Without a chat template, a tokenizer that prepends BOS (base Llama, Mistral) gets it
    exactly once, at position 0, in every prompt's head.

    Args:
        tokenizer: a transformers tokenizer; its chat template (if any) frames the user turn.
        config: :class:`PromptConfig`.
    """

    def __init__(self, tokenizer: Any, config: PromptConfig):
        self.tokenizer = tokenizer
        # Private copies of the Rust backend (engine/planning/token_ids.py): the literal one's
        # ``encode_special_tokens`` stays on, the parsing one's off; neither is written again, so
        # planning threads read them while other threads use the shared tokenizer, and neither
        # gives up the GIL mid-plan.
        self.parsing, self.literal = TokenEncoder.pair(tokenizer)
        # a raw prompt is tokenized as the tokenizer's own call does by default, which reads
        # special-token text as text where the tokenizer is configured so
        self.raw = self.literal if getattr(tokenizer, "split_special_tokens", False) else self.parsing
        self.config = config
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self._special = _special_tokens(tokenizer)
        self._special_ids = {tokenizer.convert_tokens_to_ids(t) for t in self._special}
        self._unk_id, self._unk_text = tokenizer.unk_token_id, tokenizer.unk_token
        self._leading_special_ids: list[int] | None = None
        self.opening_runs, self.closing = self._split_template()
        self.opening = "".join(text for text, _ in self.opening_runs)

    def _split_template(self) -> tuple[tuple[tuple[str, bool], ...], str]:
        """The template's opening as runs (the configured system prompt literal, the rest
        markup) and its closing (markup), around the user content."""
        if not self.has_chat_template:
            return (), "\nAnswer:"
        system = self.config.system_prompt
        messages = [] if system is None else [{"role": "system", "content": _SYSTEM_SENTINEL}]
        messages.append({"role": "user", "content": _SENTINEL})
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if rendered.count(_SENTINEL) != 1:
            raise ValueError("the chat template does not render the user content exactly once")
        opening, closing = rendered.split(_SENTINEL)
        if system is None:
            return _nonempty([(opening, True)]), closing
        if opening.count(_SYSTEM_SENTINEL) != 1:
            raise ValueError("the chat template does not render the system prompt exactly once")
        before, after = opening.split(_SYSTEM_SENTINEL)
        return _nonempty([(before, True), (system, False), (after, True)]), closing

    # --- tokenizing ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of literal ``text``: no special tokens added, none parsed from the text."""
        if not text:
            return []
        return self.literal.ids(text)

    def encode_runs(self, runs: Sequence[tuple[str, bool]]) -> list[int]:
        """Token ids of ``(text, is_markup)`` runs, as the tokenizer would give for their joined
        text with special tokens recognized inside markup runs only.

        The joined text is tokenized whole, special tokens parsed (exactly what the tokenizer
        gives for the rendered template), and kept if every special token in it lies inside a
        markup run. Otherwise (user text that spells a special token, or a slow tokenizer
        without offsets) the joined text is split at the special tokens found in markup (their
        ``lstrip`` / ``rstrip`` whitespace rules applied) and each piece between them is
        tokenized literally, so user text never produces a special-token id.
        """
        text = "".join(t for t, _ in runs)
        markup, pos = [], 0  # character spans of the markup runs in ``text``
        for run, is_markup in runs:
            if is_markup:
                markup.append((pos, pos + len(run)))
            pos += len(run)
        joint = self._joint_ids(text, markup)
        if joint is not None:
            return joint
        ids: list[int] = []
        cursor = 0
        for match in self._special_matches(text, markup):
            token = self._special[match.group(0)]
            before = text[cursor:match.start()]
            ids += self.encode(before.rstrip() if token.lstrip else before)
            ids.append(self.tokenizer.convert_tokens_to_ids(token.content))
            cursor = match.end()
            if token.rstrip:
                cursor += len(text[cursor:]) - len(text[cursor:].lstrip())
        return ids + self.encode(text[cursor:])

    def _joint_ids(self, text: str, markup: list[tuple[int, int]]) -> list[int] | None:
        """The tokenizer's ids for ``text`` with special tokens parsed, if each special token
        comes from within a markup span; ``None`` if one does not (or offsets are unavailable)."""
        if not text:
            return []
        try:
            ids, offsets = self.parsing.ids_and_offsets(text)
        except (NotImplementedError, ValueError, TypeError):  # slow tokenizers have no offsets
            return None
        present = self._special_ids.intersection(ids)  # in C: a pasted 17k-character prompt's 2.6k ids
        for i in _positions(ids, present):  # visited in Python only where a special id lies
            token, (start, end) = ids[i], offsets[i]
            piece = text[start:end]  # without the whitespace an lstrip/rstrip token absorbs
            if token == self._unk_id and piece.strip() != self._unk_text:
                continue  # a word-level tokenizer's unknown word, not the unknown token's text spelled out
            start, end = start + len(piece) - len(piece.lstrip()), end - len(piece) + len(piece.rstrip())
            if not any(a <= start and end <= b for a, b in markup):
                return None
        return ids

    def _special_matches(self, text: str, markup: list[tuple[int, int]]) -> list[re.Match]:
        if not self._special or not markup:
            return []
        pattern = "|".join(re.escape(t) for t in sorted(self._special, key=len, reverse=True))
        return [m for m in re.finditer(pattern, text)
                if any(a <= m.start() and m.end() <= b for a, b in markup)]

    def leading_special_ids(self) -> list[int]:
        """Ids the tokenizer adds before any text (e.g. BOS) when there is no chat template to
        write them; empty with a chat template (the template writes its own BOS, if any).
        Worked out once (every plan asks)."""
        if self._leading_special_ids is None:
            self._leading_special_ids = self._probe_leading_special_ids()
        return list(self._leading_special_ids)

    @functools.cached_property
    def tokenizer_leading_ids(self) -> tuple[int, ...]:
        """Ids the tokenizer adds before any text (e.g. BOS), chat template or not: what a raw
        prompt (``/v1/completions``) starts with. Worked out once."""
        probe = "a"
        plain = list(self.tokenizer(probe, add_special_tokens=False)["input_ids"])
        full = list(self.tokenizer(probe, add_special_tokens=True)["input_ids"])
        return next((tuple(full[:i]) for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain),
                    ())

    def _probe_leading_special_ids(self) -> list[int]:
        return [] if self.has_chat_template else list(self.tokenizer_leading_ids)

    # --- the RAG prompt's segments -----------------------------------------------------------
    def head_text(self) -> str:
        return self.opening + self.config.instruction

    def document_text(self, text: str) -> str:
        return text.strip() + self.config.document_separator

    def tail_text(self, question: str) -> str:
        return self.config.question_prefix + question.strip() + self.closing

    def head_token_ids(self) -> list[int]:
        """BOS (where the tokenizer adds one and no template writes it), the template's opening
        (markup, with the configured system prompt literal), then the instruction (literal)."""
        return self.leading_special_ids() + self.encode_runs(
            _nonempty([*self.opening_runs, (self.config.instruction, False)]))

    def document_token_ids(self, text: str) -> list[int]:
        """A document's chunk: its text and the separator, literal."""
        return self.encode(self.document_text(text))

    def tail_token_ids(self, question: str) -> list[int]:
        """The question prefix and the question (literal), then the template's closing (markup)."""
        return self.encode_runs(_nonempty([(self.config.question_prefix + question.strip(), False),
                                           (self.closing, True)]))

    # --- chat messages with placed documents ---------------------------------------------------
    def render_messages(self, messages: list[Message]) -> list[PromptText | DocumentRef]:
        """Messages in the chat template, as text and :class:`DocumentRef` s in prompt order.

        The template's markup (turn markers, the assistant opening) becomes markup runs around
        each message's parts, whose text is literal; adjacent text is merged into one
        :class:`PromptText`, whitespace right after a document reference is dropped (the
        document's chunk ends with the separator), and so are spaces and tabs right before one
        (``"Context: "``: the document's stripped text starts its chunk). Without a chat template: ``role: content``
        lines, then ``assistant:``.

        Raises:
            ValueError: the chat template does not render every message's content exactly once.
        """
        markup = self._markup(messages)
        pieces: list[tuple[str, bool] | DocumentRef] = []
        for before, message in zip(markup, messages):
            pieces.append((before, True))
            pieces.extend(p if isinstance(p, DocumentRef) else (p, False) for p in message.parts())
        pieces.append((markup[-1], True))
        return _merge_text(pieces)

    def render_raw(self, parts: Sequence[str | DocumentRef]) -> list[PromptText | DocumentRef]:
        """A raw prompt (the caller's own template, as ``/v1/completions`` takes it) as text and
        :class:`DocumentRef` s in order: its text is markup (special-token text in it becomes
        the token, as the tokenizer parses a raw prompt), whitespace around a document handled
        as in :meth:`render_messages`."""
        return _merge_text([p if isinstance(p, DocumentRef) else (p, True) for p in parts if p != ""])

    def _markup(self, messages: list[Message]) -> list[str]:
        """The template text before each message's content, and after the last (``len + 1`` pieces)."""
        if not self.has_chat_template:
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


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    """Special added tokens by their text (``AddedToken`` objects carry the strip rules)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {t.content: t for t in decoder.values() if getattr(t, "special", False) and t.content}


def _nonempty(runs: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    return [(t, m) for t, m in runs if t]


def _merge_text(pieces: list[tuple[str, bool] | DocumentRef]) -> list[PromptText | DocumentRef]:
    merged: list[PromptText | DocumentRef] = []
    runs: list[tuple[str, bool]] = []
    after_document = False
    for piece in pieces:
        if isinstance(piece, DocumentRef):
            if runs and not runs[-1][1]:  # spaces that end a label ("Context: ") before a document: its text starts it
                runs[-1] = (runs[-1][0].rstrip(" \t"), False)
                runs = runs if runs[-1][0] else runs[:-1]
            if runs:
                merged.append(PromptText(tuple(runs)))
                runs = []
            merged.append(piece)
            after_document = True
            continue
        text, is_markup = piece
        if after_document:
            text = text.lstrip()
        if not text:
            continue
        after_document = False
        if runs and runs[-1][1] == is_markup:
            runs[-1] = (runs[-1][0] + text, is_markup)
        else:
            runs.append((text, is_markup))
    if runs:
        merged.append(PromptText(tuple(runs)))
    return merged
