"""Demo corpora as chunked :class:`~lazyattn_rag.types.documents.Document` lists.

Sources: Python's language reference (``pydoc_data.topics``, shipped with CPython), or a
user's folder of text files (``TEXT_SUFFIXES``: ``.txt``, ``.md``, ``.markdown``, ``.rst``) or
JSONL files (one ``{"text": ..., "id": ...}`` object a line). Chunks are cut by LlamaIndex's
``SentenceSplitter`` (paragraphs, then sentences) counting tokens with the *embedder's*
tokenizer, so every chunk is embedded whole (all-MiniLM-L6-v2 truncates at 256 tokens). Chunk
ids are stable: ``<source id>#<index>``.

Needs the ``llamaindex`` extra (``llama-index-core``).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from lazyattn_rag.types.documents import Document, NotUTF8Error, read_text_file

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
JSONL_SUFFIXES = (".jsonl",)
# [CLS] and [SEP] take two of a BERT-style embedder's max_seq_length tokens
SPECIAL_TOKENS = 2


@dataclass(frozen=True)
class Source:
    """One unchunked text: ``id`` (stable), ``text``, ``metadata`` (copied to its chunks)."""

    id: str
    text: str
    metadata: dict


def pydoc_sources() -> list[Source]:
    """Python's language reference: one :class:`Source` per ``pydoc_data.topics`` topic (~80).

    Ids are ``pydoc:<topic>``; metadata ``{"source": "pydoc", "topic": <topic>}``.
    """
    from pydoc_data.topics import topics

    return [Source(f"pydoc:{name}", text, {"source": "pydoc", "topic": name})
            for name, text in sorted(topics.items()) if text.strip()]


def folder_sources(path: str | Path, on_skip: Callable[[Path, str], None] | None = None) -> list[Source]:
    """Texts from ``path``: a text file (``TEXT_SUFFIXES``), a ``.jsonl`` file, or a folder of them.

    In a folder, files are read recursively in sorted order; ids are paths relative to it. A
    JSONL line is an object with a ``"text"`` string and optionally an ``"id"`` (default:
    ``<file>:<line number>``); its other keys become metadata. A file that is not UTF-8 is
    skipped: ``on_skip(file, reason)`` is called for it (default: a warning naming it).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no supported file under ``path``; no text in them (every file empty or
            skipped; the skipped ones are named); a JSONL line that is not an object with a
            string ``"text"`` (file and line are named).
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"--docs path {str(root)!r} does not exist")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    files = [f for f in files if f.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES]
    if not files:
        raise ValueError(f"no {'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files under {str(root)!r}")
    base = root.parent if root.is_file() else root
    out: list[Source] = []
    skipped: list[Path] = []
    for f in files:
        rel = f.relative_to(base).as_posix()
        try:
            content = read_text_file(f)
        except NotUTF8Error as e:
            skipped.append(f)
            reason = e.reason
            if on_skip is None:
                warnings.warn(f"skipped {f}: {reason}", stacklevel=2)
            else:
                on_skip(f, reason)
            continue
        if f.suffix.lower() in JSONL_SUFFIXES:
            out += _jsonl_sources(content, rel)
        elif content.strip():
            out.append(Source(rel, content, {"source": rel}))
    if not out:
        why = (f"{len(skipped)} of {len(files)} files are not UTF-8 text ({', '.join(map(str, skipped[:3]))}"
               f"{', ...' if len(skipped) > 3 else ''}): convert them, e.g. iconv -f latin1 -t utf-8"
               if skipped else "no file holds any text")
        raise ValueError(f"no text under {str(root)!r}: {why}")
    return out


def _jsonl_sources(content: str, rel: str) -> list[Source]:
    out = []
    for n, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{rel} line {n}: not valid JSON ({e.msg})") from e
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f'{rel} line {n}: expected an object with a string "text" field')
        if row["text"].strip():
            meta = {k: v for k, v in row.items() if k not in ("id", "text")}
            out.append(Source(str(row.get("id", f"{rel}:{n}")), row["text"], {"source": rel, **meta}))
    return out


def chunk_sources(sources: Iterable[Source], count_tokens: Callable[[str], int], max_tokens: int,
                  overlap: int = 16) -> list[Document]:
    """Split sources into chunks of at most ``max_tokens`` tokens as counted by ``count_tokens``.

    Args:
        sources: texts to split.
        count_tokens: token count of a string (the embedder's tokenizer, no special tokens).
        max_tokens: chunk budget (the embedder's ``max_seq_length`` minus its special tokens).
        overlap: tokens shared by consecutive chunks of one source.
    Returns:
        Documents with ids ``<source id>#<index>`` and the source's metadata plus ``"chunk"``.
    Raises:
        ValueError: ``max_tokens`` < 16 or ``overlap`` not in ``[0, max_tokens)``.

    A chunk the splitter cannot bring under ``max_tokens`` (one unbreakable word) is kept and
    flagged with ``metadata["truncated"] = True`` and a warning: the embedder sees only its start.
    """
    if max_tokens < 16:
        raise ValueError(f"max_tokens must be >= 16, got {max_tokens}")
    if not 0 <= overlap < max_tokens:
        raise ValueError(f"overlap must be in [0, max_tokens), got {overlap}")
    from llama_index.core.node_parser import SentenceSplitter

    splitter = SentenceSplitter(chunk_size=max_tokens, chunk_overlap=overlap, paragraph_separator="\n\n",
                                tokenizer=lambda s: range(count_tokens(s)))
    docs, truncated = [], 0
    for src in sources:
        for i, text in enumerate(t for t in splitter.split_text(src.text) if t.strip()):
            meta = {**src.metadata, "chunk": i}
            if count_tokens(text) > max_tokens:
                meta["truncated"] = True
                truncated += 1
            docs.append(Document(f"{src.id}#{i}", text, meta))
    if truncated:
        warnings.warn(f"{truncated} chunks exceed {max_tokens} embedder tokens; only their start is embedded",
                      stacklevel=2)
    return docs


def embedder_token_counter(tokenizer) -> Callable[[str], int]:
    """``count_tokens`` for a transformers tokenizer (special tokens excluded)."""
    return lambda text: len(tokenizer(text, add_special_tokens=False, truncation=False, verbose=False)["input_ids"])
