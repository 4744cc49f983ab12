"""Documents as the retrieval side hands them over: a stable id and the text."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Document:
    """A retrievable document.

    Attributes:
        id: stable id (a LlamaIndex node id, a LangChain ``Document.id``, a file path...). The
            cache maps it to the K/V of its current text; new text under the same id is re-encoded.
        text: the document's text, as it should appear in the prompt.
        metadata: free-form metadata (not part of the prompt or the cache key).
    """

    id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def content_id(text: str) -> str:
    """An id for a document that has none (a framework's text chunk, an id-less LangChain
    ``Document``): ``sha256:`` and the first 32 hex digits of its text's hash, so equal texts
    share one id and one cached K/V."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]
