"""Hybrid retrieval of the chatbot (issue 38.3): BM25 and embeddings fused by reciprocal rank find
a chunk that holds the question's rare exact term where embedding similarity ranks chunks about
its topic first; the node ids are the chunks' ids, so the engine places its cached chunks; a bad
mode is refused."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.retrievers.bm25")

from lazyattn_rag.integrations.hybrid_retrieval import chat_retriever  # noqa: E402
from lazyattn_rag.types.documents import Document  # noqa: E402

DOCS = [
    Document("pump", "The cooling pump of the engine room moves sea water through the condenser; its seals are "
                     "changed every spring and its bearings greased weekly."),
    Document("valve", "The main steam valve of the engine room is opened slowly by hand; its packing is checked "
                      "before each voyage and its wheel painted red."),
    Document("boiler", "The boiler of the engine room is fired with coal; its tubes are cleaned every month and "
                       "its water level read from a glass gauge."),
    Document("k7741", "Item K-7741: second drawer, left workbench."),
    Document("grayling", "The silver grayling is a fish of cold seas, eaten fried in butter with sorrel."),
]


@pytest.fixture(scope="module")
def index():
    from llama_index.core import VectorStoreIndex

    from lazyattn_rag.integrations.embeddings import llamaindex_embedding
    from lazyattn_rag.integrations.llamaindex_store import node_from_document

    embed = llamaindex_embedding()
    return VectorStoreIndex([node_from_document(d) for d in DOCS], embed_model=embed)


def ids(retriever, question: str) -> list[str]:
    return [n.node.node_id for n in retriever.retrieve(question)]


def test_hybrid_finds_a_rare_exact_term_that_embeddings_rank_low(index):
    """A part number means little to the embedder, which ranks the engine-room texts first; BM25
    matches it exactly, and the fused top 2 has it."""
    question = "In the engine room, where do the crew find K-7741 when the cooling pump's seals fail?"
    vector = ids(chat_retriever(index, DOCS, 2, "vector"), question)
    hybrid = ids(chat_retriever(index, DOCS, 2, "hybrid"), question)
    assert "k7741" not in vector and len(vector) == 2
    assert "k7741" in hybrid and len(hybrid) == 2 and set(hybrid) <= {d.id for d in DOCS}


def test_an_unknown_mode_or_top_k_is_refused(index):
    with pytest.raises(ValueError, match="retrieval must be one of hybrid, vector"):
        chat_retriever(index, DOCS, 2, "bm25")
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        chat_retriever(index, DOCS, 0)
