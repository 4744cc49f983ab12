"""Find known documents inside a formatted prompt, however the framework reformatted them.

Frameworks hand the LLM one formatted string with the retrieved texts pasted in. The matcher
finds every occurrence of every candidate document (a registered document, or a node the
framework retrieved in the same query) and splits the prompt into text pieces and
:class:`~lazyattn_rag.types.messages.DocumentRef` s, so the engine places each document from its
cached K/V and computes the text around it as the request's own tokens.

What it is robust to (each seen in LlamaIndex or LangChain prompts):

* **whitespace**: runs of whitespace compare equal to one space, so re-joined newlines and
  re-indented text match (the document's registered text is what gets placed);
* **escaped text**: LlamaIndex's ``simple_summarize`` pastes the Python ``repr`` of its text
  list (``['...\\n...']``); escape sequences are decoded before matching, and the separator
  between two escaped documents (``\\n``) is dropped like whitespace;
* **metadata headers** (``MetadataMode.LLM``): candidates carry the text as the framework
  shows it to an LLM (see the adapters), so a header is part of the document;
* **repeated documents**: every occurrence is placed;
* **truncation** (a framework cut a document to fit its context window): a document is
  matched whole or not at all, never partly; one of which at least half occurs as an opening
  without the rest is reported in :attr:`PromptMatch.partial_ids` and stays text (a shared
  metadata header or a splitter's chunk overlap is not enough);
* **word boundaries**: a document never matches inside a longer word of the prompt.

Texts shorter than ``MIN_CHARS`` characters are never matched (they occur by accident).
"""

from __future__ import annotations

import bisect
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lazyattn_rag.types.messages import DocumentRef, MessagePart

MIN_CHARS = 32
PARTIAL_FRACTION = 0.5  # a document counts as cut when at least this share of it occurs as an opening
_KEY_CHARS = MIN_CHARS  # candidates are indexed by their first normalized characters
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[nrtabfv0'\"\\])")
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b", "f": "\f", "v": "\v", "0": "\0",
           "'": "'", '"': '"', "\\": "\\"}


@dataclass(frozen=True)
class Candidate:
    """A document that may occur in prompts.

    Attributes:
        doc_id: the id it is placed (and registered) under.
        text: its text, as it should appear in the prompt.
    """

    doc_id: str
    text: str


@dataclass(frozen=True)
class PromptMatch:
    """What the matcher found in a request's messages.

    Attributes:
        doc_ids: matched document ids in prompt order (a document found twice is listed twice).
        matched_chars: prompt characters covered by matched documents.
        prompt_chars: characters of the prompt (all messages).
        partial_ids: candidates whose opening occurs but not the whole text (truncated or edited
            by the framework): computed as text, not reused.
        num_escaped: matches found only after decoding escape sequences.
        num_candidates: how many documents were looked for.
        num_registered: how many of them the engine had registered (the rest were retrieved).
        reason: why nothing was placed (empty when something was).
    """

    doc_ids: tuple[str, ...] = ()
    matched_chars: int = 0
    prompt_chars: int = 0
    partial_ids: tuple[str, ...] = ()
    num_escaped: int = 0
    num_candidates: int = 0
    num_registered: int = 0
    reason: str = ""

    @property
    def fraction(self) -> float:
        """Share of the prompt's characters served by cached documents (0 for an empty prompt)."""
        return self.matched_chars / self.prompt_chars if self.prompt_chars else 0.0

    def as_dict(self) -> dict:
        out = {"doc_ids": list(self.doc_ids), "matched_chars": self.matched_chars,
               "prompt_chars": self.prompt_chars, "fraction": round(self.fraction, 4),
               "num_candidates": self.num_candidates}
        if self.partial_ids:
            out["partial_ids"] = list(self.partial_ids)
        if self.num_escaped:
            out["num_escaped"] = self.num_escaped
        if self.reason:
            out["reason"] = self.reason
        return out


class _View:
    """A normalized view of a text: every whitespace run is one space, and (``unescape``) escape
    sequences are decoded; ``span(i)`` is the raw character span ``chars[i]`` came from.

    Without escapes (the common case) the view is one regex substitution, and only whitespace
    runs longer than one character (which shift the offsets) are remembered: the server matches
    every plain prompt against every registered text, so building the view must not loop over
    the characters in Python. With escapes it is kept as runs: ``(raw start, raw end, copied)``
    at each normalized start (a stretch copied as it is, a folded whitespace run, or one escape
    sequence decoded to one character).
    """

    def __init__(self, text: str, unescape: bool):
        self._escaped = unescape
        if not unescape:  # str.split and re's \s take the same characters for whitespace
            self.chars = (" " * text[:1].isspace()) + " ".join(text.split()) + (" " * (text[-1:].isspace()
                                                                                      and not text.isspace()))
            self._starts, self._runs, self._shifts = [], [], []  # runs of 2+ whitespace characters
            shift = 0
            for m in _LONG_WHITESPACE.finditer(text):
                self._starts.append(m.start() - shift)
                self._runs.append((m.start(), m.end(), False))
                shift += m.end() - m.start() - 1
                self._shifts.append(shift)
            return
        self._build_escaped(text)

    def _build_escaped(self, text: str) -> None:
        raw_pieces: list[tuple[int, int, str]] = []  # (raw start, raw end, normalized text)
        pos = 0
        for m in _ESCAPE.finditer(text):
            code = m.group(1)
            char = _SIMPLE.get(code) or (chr(int(code[1:], 16)) if int(code[1:], 16) <= sys.maxunicode else None)
            if char is None:  # e.g. "\UFFFFFFFF" in a path or a hex dump: no escape, left as it is
                continue
            raw_pieces.append((pos, m.start(), text[pos:m.start()]))
            raw_pieces.append((m.start(), m.end(), char))
            pos = m.end()
        raw_pieces.append((pos, len(text), text[pos:]))
        self._starts, self._runs = [], []
        out: list[str] = []
        n = 0
        for raw_start, raw_end, piece in raw_pieces:
            escaped = raw_end - raw_start != len(piece)  # one escape sequence -> one character
            for m in _TOKENS.finditer(piece):
                chunk = m.group(0)
                start, end = (raw_start, raw_end) if escaped else (raw_start + m.start(), raw_start + m.end())
                if chunk.isspace():
                    if out and out[-1] == " ":  # adjacent whitespace (across an escape) folds into one
                        prev_start, _, _ = self._runs[-1]
                        self._runs[-1] = (prev_start, end, False)
                        continue
                    chunk = " "
                self._starts.append(n)
                self._runs.append((start, end, not escaped and chunk != " "))
                out.append(chunk)
                n += len(chunk)
        self.chars = "".join(out)

    def span(self, i: int) -> tuple[int, int]:
        """The raw ``(start, end)`` of normalized character ``i``."""
        k = bisect.bisect_right(self._starts, i) - 1
        if not self._escaped:
            if k >= 0 and self._starts[k] == i:
                return self._runs[k][:2]
            raw = i + (self._shifts[k] if k >= 0 else 0)
            return raw, raw + 1
        start, end, copied = self._runs[k]
        if copied:
            offset = start + i - self._starts[k]
            return offset, offset + 1
        return start, end


_TOKENS = re.compile(r"\s+|\S+")
_LONG_WHITESPACE = re.compile(r"\s{2,}")


def _view(text: str, unescape: bool) -> _View:
    return _View(text, unescape)


def normalize(text: str) -> str:
    """Whitespace runs as one space, stripped: the form documents are compared in."""
    return " ".join(text.split())


class DocumentMatcher:
    """Candidates indexed for repeated matching; :meth:`add` and :meth:`remove` keep the index
    current as documents change (the server keeps one per namespace).

    Args:
        candidates: documents to look for; shorter than ``MIN_CHARS`` (normalized) are skipped,
            and of two with the same normalized text the first is matched (the other takes
            over when the first is removed).
    """

    def __init__(self, candidates: Iterable[Candidate] = ()):
        self._by_key: dict[str, list[str]] = {}  # first normalized chars -> normalized texts
        self._by_norm: dict[str, list[Candidate]] = {}  # normalized text -> candidates with it, first matched
        self._norm_of: dict[str, str] = {}  # doc id -> its normalized text
        self._automaton = None  # Aho-Corasick over the keys, rebuilt on the first scan after a change
        for c in candidates:
            if c.doc_id not in self._norm_of:
                self.add(c)

    @property
    def num_candidates(self) -> int:
        """Distinct texts matched (a candidate whose text another one has is not counted)."""
        return len(self._by_norm)

    def add(self, candidate: Candidate) -> None:
        """Look for ``candidate`` from now on (replacing an earlier text under its id)."""
        self.remove(candidate.doc_id)
        norm = normalize(candidate.text)
        if len(norm) < MIN_CHARS:
            return
        self._norm_of[candidate.doc_id] = norm
        same = self._by_norm.setdefault(norm, [])
        if not same:
            self._by_key.setdefault(norm[:_KEY_CHARS], []).append(norm)
            self._automaton = None
        same.append(candidate)

    def remove(self, doc_id: str) -> None:
        """Stop looking for ``doc_id`` (a no-op for an unknown id)."""
        norm = self._norm_of.pop(doc_id, None)
        if norm is None:
            return
        same = self._by_norm[norm]
        same[:] = [c for c in same if c.doc_id != doc_id]
        if same:
            return
        del self._by_norm[norm]
        bucket = self._by_key[norm[:_KEY_CHARS]]
        bucket.remove(norm)
        if not bucket:
            del self._by_key[norm[:_KEY_CHARS]]
            self._automaton = None

    def _scan(self, view: _View) -> tuple[list[tuple[int, int, Candidate]], set[str]]:
        """Raw spans of full matches (whole words at both ends), and ids of candidates found only
        in part: a long opening (``PARTIAL_FRACTION`` of the text, at least ``2 * MIN_CHARS``
        characters) without the rest. The keys (every candidate's first ``_KEY_CHARS``
        normalized characters) are found in one Aho-Corasick pass (``pyahocorasick``, in C); an
        occurrence inside a word is skipped (a document never starts inside one)."""
        found, partial = [], set()
        chars = view.chars
        for last, key in self._keys().iter(chars):
            i = last - _KEY_CHARS + 1
            if _inside_token(chars, i):
                continue
            for norm in self._by_key[key]:
                c = self._by_norm[norm][0]
                end = i + len(norm)
                if chars.startswith(norm, i):
                    if _inside_token(chars, end):
                        continue  # the prompt's word or number goes on: not this document's end
                    found.append((view.span(i)[0], view.span(end - 1)[1], c))
                elif _common_prefix(chars, i, norm) >= max(2 * MIN_CHARS, PARTIAL_FRACTION * len(norm)):
                    partial.add(c.doc_id)
        return found, partial

    def _keys(self):
        if self._automaton is None:
            import ahocorasick

            self._automaton = ahocorasick.Automaton()
            for key in self._by_key:
                self._automaton.add_word(key, key)
            self._automaton.make_automaton()
        return self._automaton

    def occurrences(self, text: str) -> tuple[list[tuple[int, int, Candidate, bool]], set[str]]:
        """Every occurrence ``(start, end, candidate, escaped)`` in ``text`` (raw character spans,
        possibly overlapping; see :func:`resolve`), and the ids of candidates found only in part
        (their opening occurs, their whole text nowhere)."""
        if not self._by_key or len(text) < MIN_CHARS:
            return [], set()
        plain, partial = self._scan(_view(text, unescape=False))
        matches = [(s, e, c, False) for s, e, c in plain]
        if "\\" in text:
            escaped, esc_partial = self._scan(_view(text, unescape=True))
            known = {(s, e) for s, e, _ in plain}
            matches += [(s, e, c, True) for s, e, c in escaped if (s, e) not in known]
            partial |= esc_partial
        return matches, partial - {m[2].doc_id for m in matches}



def _inside_token(chars: str, k: int) -> bool:
    """Whether the boundary before ``chars[k]`` lies inside a word (letters or digits on both
    sides) or inside a number (``104.7``, ``3,500``: a ``.`` or ``,`` between digits, on either
    side of the boundary): a document found there would be cut out of the prompt's own token."""
    if k <= 0 or k >= len(chars):
        return False
    before, after = chars[k - 1], chars[k]
    if before.isalnum() and after.isalnum():
        return True
    digit = lambda j: 0 <= j < len(chars) and chars[j].isdigit()  # noqa: E731
    return ((before in ".," and digit(k - 2) and after.isdigit())
            or (after in ".," and before.isdigit() and digit(k + 1)))


def _common_prefix(chars: str, start: int, norm: str) -> int:
    """Length of the common prefix of ``chars[start:]`` and ``norm``."""
    n = min(len(norm), len(chars) - start)
    lo, hi = _KEY_CHARS, n  # the key matched; binary search on slice equality (C speed)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chars[start:start + mid] == norm[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def resolve(matches: Iterable[tuple[int, int, Candidate, bool]]) -> list[tuple[int, int, Candidate, bool]]:
    """Non-overlapping matches in text order; where two overlap the longer wins (then the earlier)."""
    taken: list[tuple[int, int, Candidate, bool]] = []
    for m in sorted(matches, key=lambda m: (m[0] - m[1], m[0])):
        if all(m[1] <= t[0] or m[0] >= t[1] for t in taken):
            taken.append(m)
    return sorted(taken, key=lambda m: m[0])


def split_message(text: str, matches: Sequence[tuple[int, int, Candidate, bool]]) -> list[MessagePart]:
    """``text`` as text pieces and document references at the (resolved) matched spans.

    Text between two documents that is only whitespace (or escaped whitespace, such as ``\\n``
    between two documents of a ``repr``) is dropped: each document's chunk ends with the
    separator.
    """
    parts: list[MessagePart] = []
    pos = 0
    for start, end, candidate, _ in matches:
        gap = text[pos:start]
        after_document = bool(parts) and isinstance(parts[-1], DocumentRef)
        if gap and not (after_document and not _view(gap, unescape=True).chars.strip()):
            parts.append(gap)
        parts.append(DocumentRef(candidate.doc_id, matched=True))
        pos = end
    if text[pos:] or not parts:
        parts.append(text[pos:])
    return parts
