"""Plain prompt text split into passages at the boundaries RAG templates produce (issue 36).

A RAG application that talks to an OpenAI-compatible server pastes its retrieved texts into the
message: LangChain's ``format_docs`` joins them with blank lines, LlamaIndex puts them between
``---------------------`` rules (with ``key: value`` metadata headers and a blank line before
each text), other templates write ``Context: ...``, ``Sources:`` or ``<document>`` tags. The
splitter cuts a message's text into pieces at exactly those places, deterministically, so a
text pasted whole into two prompts yields the same piece (the same characters) in both, at
whatever position it sits:

* **blank lines** end a piece;
* **separator lines** (``-----``, ``=====``, ``***``, ``###``, ``~~~`` rules of three or more,
  a tag alone on its line such as ``<document>`` or ``</context>``, a short label alone on its
  line such as ``Sources:`` or ``Document 2:``) are pieces of their own, except that a rule
  directly followed by a short piece that closes the context (fewer than
  ``HEADER_ATTACH_CHARS``, with a separator, a label or the end after it: a template's own
  sentence, not a retrieved passage) begins that piece, as LlamaIndex's closing rule begins its
  "Given the context information..." line;
* **labels** that open a RAG section (``Context:``, ``Documents:``, ``Question:``,
  ``Query:``, ``Answer:``...) at the start of a line start a new piece, and are cut from the
  text that follows them on the same line (``Context: <first passage>``);
* **a line that introduces the context**, in a message's opening (no text piece before it), ends
  its piece, so that the first document on the next line is a piece of its own: it ends with a
  colon, names the context and an instruction (``Answer the question based only on the following
  context:``, LangChain's LCEL example); the opening is a separator then (never a passage: it may
  hold the user's question). A retrieved text's own lead-in ("gather the following documents:")
  names no instruction, and one after the opening is never cut;
* **fenced code** (between ````` or ``~~~`` fences, closed by a line of the same character, at
  least as many, as CommonMark closes them) is never cut: the fence and what it holds stay in one
  piece, blank lines included.

Pieces are stripped of surrounding whitespace; their spans index the original text.
:func:`passage_key` names a piece by namespace and content for the sightings history.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import xxhash

HEADER_ATTACH_CHARS = 160
_FENCE_OPEN = re.compile(r"[ \t]*(`{3,}(?=[^`]*$)|~{3,})")  # CommonMark: no backtick in a backtick fence's info
_RULE = re.compile(r"[ \t]*([-=*_#~+])\1{2,}[ \t]*\r?\n?")
_TAG = re.compile(r"[ \t]*</?[A-Za-z][\w:.-]*(?:\s[^<>\n]*)?>[ \t]*\r?\n?")
_LONE_LABEL = re.compile(r"[ \t]*[A-Za-z][\w .#-]{0,38}:[ \t]*\r?\n?")
# the words that open a template's context section (Context:, Documents:, Retrieved passages: ...)
CONTEXT_WORDS = (r"context(?:s| information)?|documents?|passages?|sources?|references?|excerpts?|snippets?"
                 r"|retrieved(?: context| documents?| passages?| information)?|background(?: information)?"
                 r"|knowledge(?: base)?")
# a line that introduces the context (_introduces_context): at most INTRO_MAX_CHARS characters
INTRO_MAX_CHARS = 200
_CONTEXT_WORD = re.compile(rf"\b(?:{CONTEXT_WORDS})\b", re.IGNORECASE)
_INSTRUCTION_WORD = re.compile(r"\b(?:answer|question|query|respond|reply|use|using|based)\b", re.IGNORECASE)
_LABEL = re.compile(
    rf"[ \t]*(?:{CONTEXT_WORDS}|question|query|answer|helpful answer|final answer|input|user|assistant)[ \t]*:[ \t]*",
    re.IGNORECASE)


@dataclass(frozen=True)
class Piece:
    """A piece of a message's text.

    Attributes:
        start, end: its span in the text (surrounding whitespace excluded).
        text: ``text[start:end]``.
        separator: a separator line, a label alone or an opening that introduces the context (never
            a passage).
    """

    start: int
    end: int
    text: str
    separator: bool = False


def is_plain_label(text: str) -> bool:
    """Whether ``text`` (a separator piece) is a label alone on its line that opens no RAG section
    (``Return JSON:``, ``Output format:``; not ``Context:`` or ``Question:``)."""
    return bool(_LONE_LABEL.fullmatch(text)) and not _LABEL.match(text)


def split_passages(text: str) -> list[Piece]:
    """``text`` cut into pieces at the boundaries of the module docstring, in order.

    Example::

        >>> [p.text for p in split_passages("Context: A text.\\n\\nB text.\\n---\\nQuestion: why?")]
        ['Context:', 'A text.', 'B text.', '---', 'Question:', 'why?']
    """
    pieces: list[Piece] = []
    start = None  # where the open piece began (None: none is open)
    end = 0  # where its last non-blank line ended
    fence = None  # the open fence's marker, e.g. "```" or "~~~~"
    seps = 0  # pieces[:seps] are all separators (the opening so far)
    pos = 0
    for line in text.splitlines(keepends=True):
        line_start, pos = pos, pos + len(line)
        opening = _FENCE_OPEN.match(line) if fence is None else None
        if fence is not None or opening:
            if opening:
                fence = opening.group(1)
            elif _closes(line, fence):
                fence = None
            start, end = (line_start if start is None else start), pos
            continue
        if not line.strip():
            _close(pieces, text, start, end)
            start = None
            continue
        if _RULE.fullmatch(line) or _TAG.fullmatch(line) or _LONE_LABEL.fullmatch(line):
            _close(pieces, text, start, end)
            _close(pieces, text, line_start, pos, separator=True)
            start = None
            continue
        label = _LABEL.match(line)
        if label:
            _close(pieces, text, start, end)
            _close(pieces, text, line_start, line_start + label.end(), separator=True)
            start, end = line_start + label.end(), pos
            continue
        start, end = (line_start if start is None else start), pos
        if _introduces_context(line):
            while seps < len(pieces) and pieces[seps].separator:  # each piece looked at once
                seps += 1
            if seps == len(pieces):  # the message's opening: the context begins on the next line
                _close(pieces, text, start, end, separator=True)  # the template's opening: never a passage
                start = None
    _close(pieces, text, start, end)
    return _attach_headers(pieces, text)


def _introduces_context(line: str) -> bool:
    """Whether ``line`` introduces the context: it ends with a colon, is at most
    ``INTRO_MAX_CHARS`` characters, and names the context and an instruction."""
    stripped = line.strip()
    return (stripped.endswith(":") and len(stripped) <= INTRO_MAX_CHARS and bool(_CONTEXT_WORD.search(stripped))
            and bool(_INSTRUCTION_WORD.search(stripped)))


def _closes(line: str, fence: str) -> bool:
    """Whether ``line`` closes a fence opened with ``fence``: the same character, at least as
    many, nothing else on the line."""
    stripped = line.strip()
    return len(stripped) >= len(fence) and set(stripped) == {fence[0]}


def _close(pieces: list[Piece], text: str, start: int | None, end: int, separator: bool = False) -> None:
    """Append ``text[start:end]`` stripped, if anything is left of it."""
    if start is None:
        return
    chunk = text[start:end]
    lead = len(chunk) - len(chunk.lstrip())
    stripped = chunk.strip()
    if stripped:
        pieces.append(Piece(start + lead, start + lead + len(stripped), stripped, separator))


def _attach_headers(pieces: list[Piece], text: str) -> list[Piece]:
    """A rule directly followed (on the next line) by a short piece that closes the context (a
    separator, a label or the end follows it) begins that piece: the template's closing sentence."""
    out: list[Piece] = []
    for i, piece in enumerate(pieces):
        prev = out[-1] if out else None
        closing = i + 1 == len(pieces) or pieces[i + 1].separator
        if (prev is not None and prev.separator and _RULE.fullmatch(prev.text) and not piece.separator and closing
                and len(piece.text) < HEADER_ATTACH_CHARS and text[prev.end:piece.start].count("\n") <= 1):
            out[-1] = Piece(prev.start, piece.end, text[prev.start:piece.end])
        else:
            out.append(piece)
    return out


def passage_key(namespace: str, text: str) -> str:
    """A piece's name in the sightings history: 32 hex digits of XXH3-128 over its namespace and text."""
    return xxhash.xxh3_128_hexdigest(f"{namespace}\x00{text}".encode())


class PassageHistory:
    """Sightings of passages in earlier requests, bounded (least recently seen forgotten first).

    Args:
        max_entries: passages remembered.
    """

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._seen: OrderedDict[str, int] = OrderedDict()  # key -> requests it occurred in

    def __len__(self) -> int:
        return len(self._seen)

    def observe(self, keys: Iterable[str]) -> dict[str, int]:
        """Record one request's passages (each counted once, however often it occurs in it).
        Returns in how many earlier requests each key occurred (0 when new)."""
        before: dict[str, int] = {}
        for key in dict.fromkeys(keys):
            count = self._seen.pop(key, 0)
            before[key] = count
            self._seen[key] = count + 1
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return before


class PlainPrefixes:
    """Where plain layouts (a prompt computed whole, its exact-prefix blocks cached) have been:
    a digest of every message-content prefix that ends at a piece of theirs, bounded (least
    recently recorded forgotten first).

    A plain prompt reads cached K/V in place only as far as an earlier plain layout had the same
    tokens, hence the same messages up to there. So when no plain layout recorded here had the
    same content up to the end of a piece (its digest, :func:`piece_digests`, is not ``in`` here),
    a new plain prompt's cached prefix ends before that piece does: that says how far
    ``PassageLearner`` tokenizes a plain prompt to count the blocks it would read in place.
    Blocks cached by a plain prompt not recorded here (a raw completion, a forgotten digest) reach
    that cut, and the learner then plans the plain prompt whole: a missing digest costs a
    tokenization, never a wrong choice.

    Args:
        max_entries: digests remembered.
    """

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._digests: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._digests)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._digests

    def record(self, namespace: str, contents: list[tuple[str, list[str]]]) -> None:
        """Record the prefixes of a plain layout's messages (``(role, text parts)`` each) that
        end at one of their pieces (:func:`split_passages`)."""
        for _, digest in piece_digests(namespace, contents):
            self._digests.pop(digest, None)
            self._digests[digest] = None
        while len(self._digests) > self.max_entries:
            self._digests.popitem(last=False)



def piece_digests(namespace: str, contents: list[tuple[str, list[str]]]
                  ) -> Iterator[tuple[tuple[int, int, Piece], bytes]]:
    """``((message, part, piece), digest)`` for every piece of ``contents`` (``(role, text parts)``
    per message) that is not a separator, in order: XXH3-128 of ``namespace`` and the content up
    to the piece's end (roles and part and message boundaries marked), in one pass."""
    state = xxhash.xxh3_128()
    state.update(f"{namespace}\x00".encode())
    for m_index, (role, parts) in enumerate(contents):
        state.update(f"{role}\x1e".encode())
        for p_index, part in enumerate(parts):
            pos = 0
            for piece in split_passages(part):
                if piece.separator:
                    continue
                state.update(part[pos:piece.end].encode())
                pos = piece.end
                yield (m_index, p_index, piece), state.copy().digest()
            state.update(part[pos:].encode() + b"\x1f")
        state.update(b"\x1d")
