"""A LangChain LCEL RAG chain as LangChain's tutorials write it, with ChatLazyAttention (offline).

    python examples/langchain_chain.py

``{"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | model``
over LangChain's ``InMemoryVectorStore``: nothing is wired for reuse. The model learns what the
retriever returned through LangChain's callbacks, finds those documents in the formatted
prompt and serves them from its KV cache; each message's ``response_metadata["lazyattn"]`` and
``usage_metadata`` say what was reused.
"""

from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from lazyattn_rag.integrations.embeddings import langchain_embeddings
from lazyattn_rag.integrations.langchain import ChatLazyAttention

TEXTS = {
    "moon": "The Moon orbits the Earth once every 27.3 days, and always shows the same face to it.",
    "mars": "Mars has two small moons, Phobos and Deimos, both probably captured asteroids.",
    "bread": "Sourdough bread rises because wild yeast and lactic acid bacteria ferment the dough.",
    "tea": "Green tea is made from leaves that are steamed or pan-fired so that they are not oxidized.",
}
PROMPT = ChatPromptTemplate.from_template(
    "Answer the question using only this context.\n\nContext:\n{context}\n\nQuestion: {question}")


def format_docs(docs) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


def main() -> None:
    store = InMemoryVectorStore(langchain_embeddings())  # all-MiniLM-L6-v2, offline
    store.add_texts(list(TEXTS.values()), ids=list(TEXTS))
    model = ChatLazyAttention(max_tokens=40)  # the offline SmolLM2-135M, one shared engine
    chain = {"context": store.as_retriever(search_kwargs={"k": 2}) | format_docs,
             "question": RunnablePassthrough()} | PROMPT | model

    for question in ("How long does the Moon take to orbit the Earth?", "Which moons does Mars have?",
                     "How many days does the Moon take to orbit the Earth?"):
        message = chain.invoke(question)
        s = message.response_metadata["lazyattn"]["stats"]
        print(f"Q: {question}\nA: {message.content.strip()}")
        print(f"   [docs hit {s['docs_hit']}, missed {s['docs_missed']} | prompt {s['num_prompt_tokens']} tokens: "
              f"{message.usage_metadata['input_token_details']['cache_read']} cached, {s['num_computed_tokens']} "
              f"computed]\n")


if __name__ == "__main__":
    main()
