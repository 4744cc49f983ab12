"""Hybrid retrieval for the chatbot: BM25 and embeddings, fused by reciprocal rank (issue 38.3).

Embedding similarity alone ranks a chunk by what it is about, so a question naming a rare
term ("Who founded the Zorvath Lighthouse Society?") may retrieve the chunks that repeat the
name and miss the one that answers; BM25 ranks by the words themselves. The two rankings are
fused by reciprocal rank (RRF: each chunk scores ``sum 1 / (60 + rank)`` over the rankings,
Cormack et al., SIGIR 2009) with LlamaIndex's own parts: ``BM25Retriever``
(``llama-index-retrievers-bm25``, on ``bm25s``, English stemming and stopwords) and
``QueryFusionRetriever`` in ``reciprocal_rerank`` mode with the question alone (no generated
queries, so no LLM call). Each ranking contributes ``candidates`` chunks. Node ids are the
chunks' document ids, as the vector store's, so the engine places the cached chunks.

``benchmarks/retrieval_quality.py`` measures recall@k and answers right, vector against hybrid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lazyattn_rag.integrations.llamaindex_store import node_from_document
from lazyattn_rag.types.documents import Document

RETRIEVAL_MODES = ("hybrid", "vector")


def chat_retriever(index: Any, documents: Sequence[Document], top_k: int, mode: str = "hybrid",
                   llm: Any = None, candidates: int | None = None):
    """The chatbot's retriever over ``index`` (a LlamaIndex ``VectorStoreIndex``) whose chunks
    are ``documents``.

    Args:
        top_k: chunks returned per question.
        mode: ``"hybrid"`` (BM25 and the index's embeddings, fused by reciprocal rank) or
            ``"vector"`` (the index's embeddings alone).
        llm: a LlamaIndex LLM for ``QueryFusionRetriever``, which asks it nothing with one query
            (default: LlamaIndex's ``MockLLM``, so that its default, OpenAI, is never resolved).
        candidates: chunks each ranking contributes to the fusion (default ``2 * top_k``).
    Raises:
        ValueError: an unknown ``mode``, or ``top_k`` < 1.
    """
    if mode not in RETRIEVAL_MODES:
        raise ValueError(f"retrieval must be one of {', '.join(RETRIEVAL_MODES)}, got {mode!r}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if mode == "vector" or not documents:
        return index.as_retriever(similarity_top_k=top_k)
    from llama_index.core.llms.mock import MockLLM
    from llama_index.core.retrievers import QueryFusionRetriever
    from llama_index.retrievers.bm25 import BM25Retriever

    n = min(candidates or 2 * top_k, len(documents))
    bm25 = BM25Retriever.from_defaults(nodes=[node_from_document(d) for d in documents], similarity_top_k=n)
    return QueryFusionRetriever([index.as_retriever(similarity_top_k=n), bm25], llm=llm or MockLLM(),
                                similarity_top_k=top_k,
                                num_queries=1, mode="reciprocal_rerank", use_async=False)
