"""What goes in and out of a :class:`~lazyattn_rag.integrations.faiss_store.FaissDocumentStore`'s
index: vectors checked and normalized on the way in, swapped all or none, and the files a store is
saved in (the FAISS index, the documents as JSON lines and a small JSON header naming the format,
the embedder, the dimension and the next FAISS id; a save writes every file in full before any
replaces an earlier one)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

INDEX_FILE, DOCS_FILE, META_FILE = "index.faiss", "documents.jsonl", "meta.json"
FORMAT = 1


class EmbeddingDimensionError(ValueError):
    """Vectors (or a saved index) whose dimension differs from the store's; the message names
    both dimensions and both embedders."""


def unit_vectors(raw: Any, rows: int, dim: int | None, index_embedder: str | None, source: str | None,
                 what: str) -> np.ndarray:
    """``raw`` as float32 ``[rows, dim]`` unit rows, checked against the index's dimension ``dim``
    (``None``: no index yet) and named in errors as ``what`` from ``source`` (the embedding model;
    ``index_embedder``: the index's)."""
    try:
        vectors = np.array(raw, dtype=np.float32)
    except (TypeError, ValueError) as e:  # ragged rows: vectors of different lengths
        raise EmbeddingDimensionError(f"{what}{_from(source)}: not one [n, dim] array of numbers "
                                      f"(vectors of different lengths?): {e}") from None
    if vectors.ndim == 1 and rows == 1:
        vectors = vectors.reshape(1, -1)
    if vectors.ndim != 2 or vectors.shape[0] != rows:
        raise ValueError(f"{what}{_from(source)}: expected {rows} vectors, got an array of "
                         f"shape {tuple(vectors.shape)}")
    if vectors.shape[1] < 1:
        raise EmbeddingDimensionError(f"{what}{_from(source)}: 0 dimensions")
    if dim is not None and vectors.shape[1] != dim:
        raise EmbeddingDimensionError(
            f"{what}{_from(source)}: {vectors.shape[1]} dimensions, but this index holds "
            f"{dim}-dimensional vectors from {_named(index_embedder)}; embed with the model the "
            "index was built with, or build a new index")
    if not np.isfinite(vectors).all():
        raise ValueError(f"{what}{_from(source)}: NaN or infinite values")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.ascontiguousarray(vectors / np.where(norms > 0, norms, 1.0))


def swap_vectors(index: Any, vectors: np.ndarray | None, new_ids: list[int], old_ids: list[int]) -> None:
    """Add ``vectors`` under ``new_ids``, then remove the vectors ``old_ids``; if either step
    raises, the index is left as it was (the new vectors are taken out again)."""
    if new_ids:
        index.add_with_ids(vectors, np.asarray(new_ids, dtype=np.int64))
    try:
        if old_ids:
            index.remove_ids(np.asarray(old_ids, dtype=np.int64))
    except BaseException:
        if new_ids:
            index.remove_ids(np.asarray(new_ids, dtype=np.int64))
        raise


def _named(name: str | None) -> str:
    return repr(name) if name else "an unnamed embedding model"


def _from(name: str | None) -> str:
    return f" from {name!r}" if name else ""


def write_store(out: Path, index: Any, rows: Iterable[dict], meta: dict) -> Path:
    """Write ``index`` (a FAISS index), ``rows`` (one JSON object per document) and ``meta`` (with
    ``"format"`` added) under ``out``, replacing what a previous save left only once all three
    are written."""
    import faiss

    out.mkdir(parents=True, exist_ok=True)
    parts = {name: out / f".{name}.{os.getpid()}.tmp" for name in (INDEX_FILE, DOCS_FILE, META_FILE)}
    try:
        faiss.write_index(index, str(parts[INDEX_FILE]))
        with open(parts[DOCS_FILE], "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        parts[META_FILE].write_text(json.dumps({"format": FORMAT, **meta}))
    except BaseException:
        for tmp in parts.values():
            tmp.unlink(missing_ok=True)
        raise
    for name, tmp in parts.items():
        os.replace(tmp, out / name)
    return out


def read_meta(src: Path, embedder_name: str | None, embedder_dim: int | None) -> dict:
    """The header of a saved store, checked against the embedder that will query it (``None``:
    not known).

    Raises:
        FileNotFoundError: no header.
        ValueError: another format or embedder; :class:`EmbeddingDimensionError` when only the
            dimension differs.
    """
    meta = json.loads((src / META_FILE).read_text())
    saved = f"{meta.get('embedder')!r} (dim {meta.get('dim')}, format {meta.get('format')})"
    if meta.get("format") != FORMAT:
        raise ValueError(f"index in {src} has format {meta.get('format')}; this version reads {FORMAT}")
    if embedder_name is not None and meta.get("embedder") is not None and meta["embedder"] != embedder_name:
        raise ValueError(f"index in {src} was built with {saved}; this embedder is {embedder_name!r}")
    if embedder_dim is not None and meta.get("dim") != embedder_dim:
        raise EmbeddingDimensionError(f"index in {src} was built with {saved}; this embedder {embedder_name!r} "
                                      f"gives {embedder_dim}-dimensional vectors")
    return meta


def read_index(src: Path) -> Any:
    """The saved FAISS index."""
    import faiss

    return faiss.read_index(str(src / INDEX_FILE))


def read_rows(src: Path) -> Iterator[dict]:
    """The saved documents, one JSON object each (``id``, ``int_id``, ``text``, ``metadata``)."""
    with open(src / DOCS_FILE, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)
