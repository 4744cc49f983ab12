"""Reuse in the idioms people write, with no special wiring, on the real default model.

Each test builds a fresh engine over the shared SmolLM2 weights, runs the idiom as its
documentation shows it, and asks a second question that retrieves the same documents. On the
second query every placed document is served from the cache and the engine computes only the
text after the first document (the framework's template around the question and the chat
template's closing): the prompt's head is cached like a prefix, documents by content. The
id path computes the engine's own tail instead; the difference is the framework's template
(``TEMPLATE_TOKENS``, documented in docs/integrations.md).
"""

import asyncio
import functools
import random

import pytest
from llama_index.core import Document as LIDocument
from llama_index.core import VectorStoreIndex

from lazyattn_rag import CacheConfig, EngineConfig
from lazyattn_rag.integrations.embeddings import default_embedding_model_path
from lazyattn_rag.llm import LazyAttention
from tests.integrations_kit import PlanSpy, bow_llamaindex_embedding

FACTS = {
    "eiffel": "The Eiffel Tower is a wrought-iron lattice tower in Paris. It was completed in 1889 for the "
              "World's Fair and is 330 metres tall.",
    "fuji": "Mount Fuji is the highest mountain in Japan at 3,776 metres. It is an active stratovolcano on the "
            "island of Honshu.",
    "wall": "The Great Wall of China is a series of fortifications built across northern China over many "
            "centuries to guard against invasions.",
    "nile": "The Nile is a major river in northeastern Africa. It flows north for about 6,650 kilometres into "
            "the Mediterranean Sea.",
}
QUESTIONS = ("When was the Eiffel Tower completed?", "How tall is the Eiffel Tower?")
SAMPLING = dict(max_tokens=4, temperature=0.0)


@pytest.fixture
def engine(smollm2):
    """A fresh engine (empty registry and cache) over the session's SmolLM2 weights."""
    config = EngineConfig(device="cpu", attention_backend="torch", cache=CacheConfig(num_blocks=512))
    llm = LazyAttention.from_model(smollm2.model, smollm2.tokenizer, config, name="SmolLM2-135M-Instruct",
                                   weights_sha256=smollm2.fingerprint.weights_sha256)
    yield llm
    llm.shutdown()


@functools.cache
def li_embedding():
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(default_embedding_model_path()), device="cpu")


@functools.cache
def lc_embeddings():
    from langchain_huggingface import HuggingFaceEmbeddings

    return HuggingFaceEmbeddings(model_name=str(default_embedding_model_path()),
                                 model_kwargs={"device": "cpu", "local_files_only": True},
                                 encode_kwargs={"normalize_embeddings": True})


def li_index() -> VectorStoreIndex:
    docs = [LIDocument(text=t, id_=k) for k, t in FACTS.items()]
    return VectorStoreIndex.from_documents(docs, embed_model=li_embedding())


def assert_reused(spy: PlanSpy, since: int, stats: dict | None = None) -> int:
    """The calls of one query (``spy.calls[since:]``): documents placed before are served from the
    cache (at least one), cached = head + those documents, computed = the text after the first
    document plus documents placed for the first time. Returns the last call's computed tokens
    besides new documents (a call without documents computes its whole prompt)."""
    earlier = {d for c in spy.calls[:since] for d in c["doc_ids"]}
    hits = 0
    for call in spy.calls[since:]:
        plan, s = call["plan"], call["stats"]
        placed = call["doc_ids"]
        if not placed:  # a call with no document (condense_plus_context rewrites the question first)
            assert s.num_computed_tokens == plan.num_prompt_tokens
            continue
        assert s.docs_hit == [d for d in placed if d in earlier]
        assert s.docs_missed == [d for d in placed if d not in earlier]
        new_tokens = sum(len(c.token_ids) for c in plan.chunks if c.doc_id in s.docs_missed)
        # exact-prefix blocks of the tail, cached by an earlier call with the same context
        head = sum(len(c.token_ids) for c in plan.chunks if c.doc_id is None)
        tail_hits = s.num_exact_prefix_tokens - head
        assert tail_hits % 16 == 0 and 0 <= tail_hits < len(plan.query_token_ids)
        assert s.num_cached_tokens == plan.num_cached_prompt_tokens - new_tokens + tail_hits
        text_tokens = plan.num_text_tokens + len(plan.query_token_ids)
        assert s.num_computed_tokens == text_tokens + new_tokens - tail_hits
        earlier |= set(placed)
        hits += len(s.docs_hit)
    assert hits > 0
    if stats is not None:  # what the response's metadata reports is what the engine did
        assert stats["docs_hit"] == s.docs_hit and stats["num_computed_tokens"] == s.num_computed_tokens
    return text_tokens


def id_path_computed(engine, question: str) -> int:
    return len(engine.engine.planner.template.tail_token_ids(question))


@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize", "simple_summarize"])
def test_llamaindex_as_query_engine_reuses_documents_in_every_response_mode(engine, mode):
    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

    spy = PlanSpy(engine)
    llm = LazyAttentionLLM(engine, **SAMPLING)
    query_engine = li_index().as_query_engine(llm=llm, response_mode=mode, similarity_top_k=2)
    first = query_engine.query(QUESTIONS[0])
    assert first.metadata["lazyattn"]["stats"]["docs_missed"]
    since = len(spy.calls)
    second = query_engine.query(QUESTIONS[1])
    meta = second.metadata["lazyattn"]
    computed = assert_reused(spy, since, meta["calls"][-1]["stats"])
    assert meta["num_llm_calls"] == (2 if mode == "refine" else 1)
    assert 0 < computed - id_path_computed(engine, QUESTIONS[1]) <= TEMPLATE_TOKENS[mode]


def test_llamaindex_streaming_and_aquery_reuse_documents(engine):
    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

    spy = PlanSpy(engine)
    llm = LazyAttentionLLM(engine, **SAMPLING)
    index = li_index()
    streaming = index.as_query_engine(llm=llm, streaming=True, similarity_top_k=2)
    text = "".join(streaming.query(QUESTIONS[0]).response_gen)
    since = len(spy.calls)
    second = streaming.query(QUESTIONS[1])
    assert "".join(second.response_gen) and text
    computed = assert_reused(spy, since, second.metadata["lazyattn"]["stats"])  # filled once the stream ended
    assert 0 < computed - id_path_computed(engine, QUESTIONS[1]) <= TEMPLATE_TOKENS["compact"]

    async_engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    since = len(spy.calls)
    response = asyncio.run(async_engine.aquery(QUESTIONS[0]))
    assert_reused(spy, since, response.metadata["lazyattn"]["stats"])


@pytest.mark.parametrize("chat_mode", ["context", "condense_plus_context"])
def test_llamaindex_chat_engines_reuse_documents(engine, chat_mode):
    from llama_index.core.memory import ChatMemoryBuffer

    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

    spy = PlanSpy(engine)
    llm = LazyAttentionLLM(engine, **SAMPLING)
    chat = li_index().as_chat_engine(chat_mode=chat_mode, llm=llm, similarity_top_k=2,
                                     memory=ChatMemoryBuffer.from_defaults(token_limit=4000))
    chat.chat(QUESTIONS[0])
    since = len(spy.calls)
    second = chat.chat(QUESTIONS[1])
    computed = assert_reused(spy, since, second.metadata["lazyattn"]["calls"][-1]["stats"])
    assert 0 < computed - id_path_computed(engine, QUESTIONS[1]) <= TEMPLATE_TOKENS[chat_mode]


def test_llamaindex_retriever_query_engine_with_a_postprocessor(engine):
    from llama_index.core.postprocessor import SimilarityPostprocessor
    from llama_index.core.query_engine import RetrieverQueryEngine

    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

    spy = PlanSpy(engine)
    llm = LazyAttentionLLM(engine, **SAMPLING)
    retriever = li_index().as_retriever(similarity_top_k=3)
    query_engine = RetrieverQueryEngine.from_args(retriever, llm=llm,
                                                  node_postprocessors=[SimilarityPostprocessor(similarity_cutoff=0.2)])
    query_engine.query(QUESTIONS[0])
    since = len(spy.calls)
    second = query_engine.query(QUESTIONS[1])
    assert_reused(spy, since, second.metadata["lazyattn"]["stats"])


RAG_PROMPT = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
              "to answer the question.\n\nContext:\n{context}\n\nQuestion: {question}\nAnswer:")


def format_docs(docs) -> str:
    return "\n\n".join(d.page_content for d in docs)


def lcel_chain(retriever, model):
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    prompt = ChatPromptTemplate.from_template(RAG_PROMPT)
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | model


def test_langchain_lcel_with_format_docs_over_a_retriever_the_project_did_not_build(engine):
    from langchain_core.vectorstores import InMemoryVectorStore

    from lazyattn_rag.integrations.langchain import ChatLazyAttention

    spy = PlanSpy(engine)
    store = InMemoryVectorStore(lc_embeddings())
    store.add_texts(list(FACTS.values()), ids=list(FACTS))
    chain = lcel_chain(store.as_retriever(search_kwargs={"k": 2}), ChatLazyAttention(engine=engine, **SAMPLING))
    chain.invoke(QUESTIONS[0])
    since = len(spy.calls)
    message = chain.invoke(QUESTIONS[1])
    computed = assert_reused(spy, since, message.response_metadata["lazyattn"]["stats"])
    assert 0 < computed - id_path_computed(engine, QUESTIONS[1]) <= TEMPLATE_TOKENS["lcel"]
    assert message.usage_metadata["input_token_details"]["cache_read"] > computed


def test_langchain_lcel_with_format_docs_over_the_project_store(engine):
    from lazyattn_rag import Document
    from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
    from lazyattn_rag.integrations.langchain import ChatLazyAttention, FaissRetriever
    from tests.integrations_kit import embedder

    spy = PlanSpy(engine)
    store = FaissDocumentStore(embedder(), engine=engine)
    store.upsert([Document(k, t) for k, t in FACTS.items()])
    assert all(engine.has_document(k) for k in FACTS)  # adding to the store registered them
    chain = lcel_chain(FaissRetriever(store=store, k=2), ChatLazyAttention(engine=engine, **SAMPLING))
    asyncio.run(chain.ainvoke(QUESTIONS[0]))
    since = len(spy.calls)
    message = chain.invoke(QUESTIONS[1])
    assert_reused(spy, since, message.response_metadata["lazyattn"]["stats"])


def test_langchain_runnable_with_message_history(engine):
    from langchain_core.chat_history import InMemoryChatMessageHistory
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.runnables.history import RunnableWithMessageHistory
    from langchain_core.vectorstores import InMemoryVectorStore

    from lazyattn_rag.integrations.langchain import ChatLazyAttention

    spy = PlanSpy(engine)
    store = InMemoryVectorStore(lc_embeddings())
    store.add_texts(list(FACTS.values()), ids=list(FACTS))
    retriever = store.as_retriever(search_kwargs={"k": 2})
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer from this context:\n\n{context}"), MessagesPlaceholder("history"), ("human", "{question}")])
    chain = (RunnablePassthrough.assign(context=(lambda x: x["question"]) | retriever | format_docs) | prompt
             | ChatLazyAttention(engine=engine, **SAMPLING))
    histories: dict = {}
    with_history = RunnableWithMessageHistory(
        chain, lambda sid: histories.setdefault(sid, InMemoryChatMessageHistory()),
        input_messages_key="question", history_messages_key="history")
    config = {"configurable": {"session_id": "s1"}}
    with_history.invoke({"question": QUESTIONS[0]}, config=config)
    since = len(spy.calls)
    message = with_history.invoke({"question": QUESTIONS[1]}, config=config)
    assert len(histories["s1"].messages) == 4
    assert_reused(spy, since, message.response_metadata["lazyattn"]["stats"])


@pytest.mark.parametrize("mode", ["simple_summarize", "tree_summarize"])
def test_llamaindex_fits_full_windows_to_the_engine_with_its_tokenizer(smollm2, mode, monkeypatch):
    """LlamaIndex sizes prompts with ``Settings.tokenizer`` (tiktoken unless set). SmolLM2 splits
    digits one per token, ~1.5x tiktoken's count on numeric text, so a window LlamaIndex fills
    overflows the engine: the error says to set ``Settings.tokenizer = llm.tokenizer``, and with
    it set the prompts fit (planned, not run: ~8k tokens of prefill on the CPU)."""
    import llama_index.core
    from llama_index.core import Settings

    from lazyattn_rag.types.errors import PromptTooLongError
    from llama_index.core import Document, VectorStoreIndex

    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

    llm = LazyAttentionLLM(smollm2, max_tokens=4)
    rng = random.Random(0)

    def report(i):
        return f"Quarterly report {i}.\n" + "\n".join(
            f"Item {j}: revenue {rng.randint(100000, 999999)} EUR, cost {rng.randint(10000, 99999)} EUR, "
            f"margin {rng.randint(10, 99)}.{rng.randint(0, 9)}%" for j in range(300))

    index = VectorStoreIndex.from_documents([Document(text=report(i)) for i in range(6)],
                                            embed_model=bow_llamaindex_embedding())
    engine = index.as_query_engine(llm=llm, similarity_top_k=10, response_mode=mode)
    with pytest.raises(PromptTooLongError, match=r"Settings.tokenizer = llm.tokenizer"):
        engine.query("What was the revenue of item 7?")
    planned = []

    def plan_only(plan, params, sink, warm_only=False):  # refuses the plan it records: planned, not run
        planned.append(plan.num_prompt_tokens)
        raise _Planned()

    monkeypatch.setattr(smollm2.engine, "submit", plan_only)
    monkeypatch.setattr(llama_index.core, "global_tokenizer", llama_index.core.global_tokenizer)  # restored after
    Settings.tokenizer = llm.tokenizer
    engine = index.as_query_engine(llm=llm, similarity_top_k=10, response_mode=mode)
    with pytest.raises(_Planned):
        engine.query("What was the revenue of item 7?")
    monkeypatch.undo()
    assert planned and max(planned) < smollm2.max_model_len


class _Planned(Exception):
    pass


# Tokens of each framework's template that a request computes besides what the id path computes
# for the same question (its "Question: ... " tail of 16 tokens here): the text after the first
# document, measured on SmolLM2's tokenizer with llama-index-core 0.14.25 / langchain-core 1.8
# (compact 20, refine 13, tree_summarize 22, simple_summarize 22, context 28, condense_plus_context
# 59 with one turn of history, LCEL 3), plus 4 for template edits between framework versions.
# docs/integrations.md has the table.
TEMPLATE_TOKENS = {"compact": 24, "refine": 17, "tree_summarize": 26, "simple_summarize": 26, "context": 32,
                   "condense_plus_context": 63, "lcel": 7}
