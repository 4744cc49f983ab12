"""The plain-prompt fallback: find registered documents inside an already formatted prompt.

Callers such as LlamaIndex's ``ContextChatEngine`` hand the LLM one formatted string with the
retrieved texts pasted in. Each registered document whose text occurs verbatim in the prompt is
cut out and passed to the engine by id (its cached K/V is reused); what remains of the prompt
becomes the request's question text, after the documents. The report says how much of the
prompt was matched, so a caller can see when the fallback found nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lazyattn_rag.llm import LazyAttention


@dataclass(frozen=True)
class PromptMatch:
    """Registered documents found in a prompt.

    Attributes:
        doc_ids: matched document ids, in the order they appear in the prompt.
        rest: the prompt with the matched texts removed (stripped).
        matched_chars: characters of the prompt covered by matched documents.
        prompt_chars: characters of the prompt.
    """

    doc_ids: tuple[str, ...]
    rest: str
    matched_chars: int
    prompt_chars: int

    @property
    def fraction(self) -> float:
        """Share of the prompt's characters served by cached documents (0 for an empty prompt)."""
        return self.matched_chars / self.prompt_chars if self.prompt_chars else 0.0

    def as_dict(self) -> dict:
        return {"doc_ids": list(self.doc_ids), "matched_chars": self.matched_chars,
                "prompt_chars": self.prompt_chars, "fraction": round(self.fraction, 4)}


def registered_texts(llm: "LazyAttention") -> dict[str, str]:
    """Document id -> registered text of every document the engine knows."""
    return llm.document_texts()


def match_documents(prompt: str, texts: dict[str, str], min_chars: int = 32) -> PromptMatch:
    """Find non-overlapping verbatim occurrences of ``texts`` in ``prompt``.

    Args:
        prompt: the formatted prompt.
        texts: document id -> text (compared stripped of surrounding whitespace).
        min_chars: shorter texts are ignored (they match by accident too easily).
    Returns:
        :class:`PromptMatch`; longer documents win where two occurrences overlap.
    """
    found: list[tuple[int, int, str]] = []
    for doc_id, text in texts.items():
        needle = text.strip()
        if len(needle) < min_chars:
            continue
        start = prompt.find(needle)
        if start != -1:
            found.append((start, start + len(needle), doc_id))
    taken: list[tuple[int, int, str]] = []
    for start, end, doc_id in sorted(found, key=lambda f: (f[0] - f[1], f[0])):  # longest first
        if all(end <= s or start >= e for s, e, _ in taken):
            taken.append((start, end, doc_id))
    taken.sort()
    pieces, pos = [], 0
    for start, end, _ in taken:
        pieces.append(prompt[pos:start])
        pos = end
    pieces.append(prompt[pos:])
    return PromptMatch(tuple(d for _, _, d in taken), "".join(pieces).strip(),
                       sum(e - s for s, e, _ in taken), len(prompt))
