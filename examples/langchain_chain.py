"""A LangChain RAG chain with ChatLazyAttention and a FAISS retriever (offline).

    python examples/langchain_chain.py

The chain maps ``{"question": ...}`` to ``{"answer", "sources"}``; retrieved documents reach the
model as id-carrying content blocks, so a document retrieved again costs no prefill.
"""

from lazyattn_rag import Document, SamplingParams
from lazyattn_rag.integrations.embeddings import SentenceEmbedder
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
from lazyattn_rag.integrations.langchain import ChatLazyAttention, FaissRetriever, rag_chain
from lazyattn_rag.llm import LazyAttention

DOCUMENTS = [
    Document("moon", "The Moon orbits the Earth once every 27.3 days."),
    Document("mars", "Mars has two small moons, Phobos and Deimos."),
    Document("bread", "Sourdough bread rises because wild yeast and bacteria ferment the dough."),
    Document("tea", "Green tea is made from leaves that are not oxidized."),
]


def main() -> None:
    engine = LazyAttention()  # the offline default SmolLM2-135M-Instruct
    store = FaissDocumentStore(SentenceEmbedder(), engine=engine)
    store.upsert(DOCUMENTS)
    model = ChatLazyAttention(engine=engine, sampling=SamplingParams(max_tokens=40))
    chain = rag_chain(FaissRetriever(store=store, k=2), model)

    for question in ("How long does the Moon take to orbit the Earth?", "What are the names of the moons of Mars?"):
        print(f"Q: {question}\nA: ", end="", flush=True)
        sources = []
        for part in chain.stream({"question": question}):  # {"sources": [...]}, then {"answer": piece}...
            sources = part.get("sources", sources)
            print(part.get("answer", ""), end="", flush=True)
        print(f"\n   sources: {[d.id for d in sources]}")
    # the model's own message carries the cache stats
    message = model.invoke("What are the names of the moons of Mars?", documents=[store.get("mars"), store.get("moon")])
    print("stats:", {k: message.response_metadata["lazyattn"]["stats"][k] for k in ("docs_hit", "docs_missed")})
    print("usage:", message.usage_metadata)


if __name__ == "__main__":
    main()
