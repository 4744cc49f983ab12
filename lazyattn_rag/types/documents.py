"""Documents as the retrieval side hands them over: a stable id and the text."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
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


class NotUTF8Error(ValueError):
    """A document file that is not UTF-8 text; ``reason`` says where (``not UTF-8 text (byte 0xe9
    at offset 3)``), for messages that name the file their own way."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path} is {reason}")
        self.path, self.reason = path, reason


def read_text_file(path: Path) -> str:
    """A document file's text.

    Raises:
        NotUTF8Error: the bytes are not UTF-8 (the first bad byte and its offset are named).
        OSError: the file cannot be read.
    """
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotUTF8Error(path, f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from e


@dataclass(frozen=True)
class RemovedDocument:
    """What deleting a document removed (``LazyAttention.remove_document``,
    ``DELETE /v1/documents/{id}``).

    Attributes:
        id, namespace: the document.
        num_kv_blocks: KV-pool blocks its chunk held that were freed now.
        num_in_use: its cached chunks still read by running requests: they finish with the text
            they started with, and the blocks are freed when they do (never stored again).
        tiers: the storage tiers (``"host"``, ``"disk"``, ``"redis"``) its chunk was deleted from.
        shared: another registered document has the very same text (and namespace), so the
            K/V was kept for it; only the id was removed.
    """

    id: str
    namespace: str = ""
    num_kv_blocks: int = 0
    num_in_use: int = 0
    tiers: tuple[str, ...] = ()
    shared: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "namespace": self.namespace, "num_kv_blocks": self.num_kv_blocks,
                "num_in_use": self.num_in_use, "tiers": list(self.tiers), "shared": self.shared}
