"""LangChain integration on a tiny random model over a small FAISS index."""

import asyncio
import dataclasses

import pytest


from langchain_core.documents import Document as LCDocument
from langchain_core.messages import HumanMessage, SystemMessage

from lazyattn_rag import Document, RequestRemedies, SamplingParams, UnknownDocumentError
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
from lazyattn_rag.integrations.langchain import (ChatLazyAttention, FaissRetriever, document_block,
                                                 documents_to_messages, rag_chain)
from tests.integrations_kit import GREEDY, embedder, engine, loop_ticks_during, spy, store  # noqa: F401
from tests.tiny import words


@pytest.fixture(scope="module")
def model(engine):
    return ChatLazyAttention(engine=engine, sampling=GREEDY)


def test_chain_passes_document_ids_and_second_query_hits_at_new_offset(model, engine, spy, store):
    chain = rag_chain(FaissRetriever(store=store, k=2), model)
    first = chain.invoke({"question": "Why do cats purr?"})
    ids1 = [d.id for d in first["sources"]]
    assert ids1 == ["cats", "dogs"] == [d.id for d, _ in store.search("Why do cats purr?", 2)]
    assert spy.last["doc_ids"] == ids1 and spy.last["stats"].docs_missed == ids1
    assert first["answer"] == engine.generate("Why do cats purr?", ids1, sampling=GREEDY).text
    offsets1 = spy.calls[-2]["offsets"]

    second = chain.invoke("Why do dogs bark at strangers?")
    ids2 = [d.id for d in second["sources"]]
    assert ids2 == ["dogs", "cats"]
    assert spy.last["doc_ids"] == ids2
    assert spy.last["stats"].docs_hit == ids2 and spy.last["stats"].docs_missed == []
    for doc_id in ids2:
        assert spy.last["offsets"][doc_id] != offsets1[doc_id]
    assert second["answer"] == engine.generate("Why do dogs bark at strangers?", ids2, sampling=GREEDY).text


def test_documents_from_blocks_and_from_the_call_argument_are_equivalent(model, engine, spy, store):
    docs = [LCDocument(page_content=store.get(i).text, id=i) for i in ("rivers", "stars")]
    [message] = documents_to_messages.invoke({"question": "Where do rivers flow?", "documents": docs})
    assert message.content[0] == document_block(docs[0]) and message.content[-1]["text"] == "Where do rivers flow?"
    by_blocks = model.invoke([message])
    assert spy.last["doc_ids"] == ["rivers", "stars"] and spy.last["question"] == "Where do rivers flow?"
    by_argument = model.invoke([HumanMessage("Where do rivers flow?")], documents=docs)
    assert spy.last["doc_ids"] == ["rivers", "stars"]
    assert by_blocks.content == by_argument.content == engine.generate("Where do rivers flow?", ["rivers", "stars"],
                                                                       sampling=GREEDY).text
    meta = by_argument.response_metadata["lazyattn"]
    assert meta["doc_ids"] == ["rivers", "stars"] and meta["stats"]["docs_hit"] == ["rivers", "stars"]
    usage = by_argument.usage_metadata
    assert usage["input_tokens"] == meta["stats"]["num_prompt_tokens"]
    assert usage["output_tokens"] == GREEDY.max_tokens
    assert usage["input_token_details"]["cache_read"] == meta["stats"]["num_cached_tokens"] > 0


def test_streaming_sync_and_async_equal_the_non_streamed_answer(model, store):
    messages = [HumanMessage([document_block(store.get("stars")), {"type": "text", "text": "Why do stars shine?"}])]
    full = model.invoke(messages).content
    chunks = [c.content for c in model.stream(messages)]
    assert len([c for c in chunks if c]) >= 2 and "".join(chunks) == full
    chain = rag_chain(FaissRetriever(store=store, k=2), model)
    chain_full = chain.invoke("Why do stars shine?")["answer"]
    pieces = [p["answer"] for p in chain.stream("Why do stars shine?") if "answer" in p]
    assert len(pieces) >= 2 and "".join(pieces) == chain_full

    async def run():
        a = [c.content async for c in model.astream(messages)]
        g = await model.ainvoke(messages)
        c = [p["answer"] async for p in chain.astream("Why do stars shine?") if "answer" in p]
        return a, g.content, c

    a, g, c = asyncio.run(run())
    assert len([x for x in a if x]) >= 2 and "".join(a) == g == full
    assert len(c) >= 2 and "".join(c) == chain_full


def test_async_stream_does_not_block_the_event_loop(model):
    long = model.bind(sampling=SamplingParams(max_tokens=48, ignore_eos=True))

    async def consume():
        return len([c async for c in long.astream([HumanMessage("Question : " + words(5))])])

    ticks, n = loop_ticks_during(consume)
    assert n >= 48 and ticks >= 5  # the loop kept running while the engine generated


def test_leaving_an_async_stream_early_frees_the_request(model, engine):
    long = model.bind(sampling=SamplingParams(max_tokens=64, ignore_eos=True))
    free = engine.info()["num_free_blocks"]

    async def run():
        got = []
        async for chunk in long.astream([HumanMessage("Question : " + words(9, 3))]):
            got.append(chunk.content)
            if len(got) == 2:
                break
        return got, await model.ainvoke([HumanMessage("Question : " + words(4))])

    got, after = asyncio.run(run())
    assert len(got) == 2 and after.response_metadata["lazyattn"]["stats"]["num_output_tokens"] == GREEDY.max_tokens
    assert engine.info()["num_free_blocks"] == free  # the abandoned request's blocks came back


def test_empty_retrieval_answers_without_documents(model, engine, spy):
    empty = FaissDocumentStore(embedder(), engine=engine)
    out = rag_chain(FaissRetriever(store=empty, k=3), model).invoke("Why do cats purr?")
    assert out["sources"] == []
    assert out["answer"] == engine.generate("Why do cats purr?", [], sampling=GREEDY).text
    assert spy.last["doc_ids"] == [] and spy.last["stats"].docs_hit == [] == spy.last["stats"].docs_missed
    explicit = model.invoke([HumanMessage("Why do cats purr?")], documents=[])
    assert explicit.content == out["answer"]


def test_retriever_top_k_larger_than_the_index_and_update_delete(model, engine, spy, store):
    retriever = FaissRetriever(store=store, k=10)
    docs = retriever.invoke("Why do cats purr?")
    assert sorted(d.id for d in docs) == ["cats", "dogs", "rivers", "stars"]
    assert all(isinstance(d.metadata["score"], float) for d in docs)

    chain = rag_chain(FaissRetriever(store=store, k=1), model)
    before = chain.invoke("Why do stars shine?")
    new_text = "Stars shine because nuclear fusion burns in their cores. " + words(26, 10)
    store.upsert([Document("stars", new_text)])
    after = chain.invoke("Why do stars shine?")
    assert after["sources"][0].page_content == new_text
    assert spy.last["stats"].docs_missed == ["stars"]
    assert after["answer"] != before["answer"]
    store.delete(["stars"])
    assert not engine.has_document("stars")
    assert "stars" not in [d.id for d in retriever.invoke("Why do stars shine?")]


def test_documents_by_registered_id_equal_documents_with_their_texts(model, engine, store):
    engine.add_documents([Document(i, store.get(i).text) for i in ("rivers", "stars")])
    docs = [LCDocument(page_content=store.get(i).text, id=i) for i in ("rivers", "stars")]
    by_text = model.invoke([HumanMessage("Where do rivers flow?")], documents=docs)
    by_id = model.invoke([HumanMessage("Where do rivers flow?")], documents=["rivers", "stars"])
    assert by_id.response_metadata["lazyattn"]["doc_ids"] == ["rivers", "stars"]
    assert by_id.content == by_text.content
    with pytest.raises(UnknownDocumentError, match="not registered: 'nope', 'gone' "):
        model.invoke("Where do rivers flow?", documents=["rivers", "nope", "gone", "nope"])
    with pytest.raises(TypeError, match="entry 1 is a int"):
        model.invoke("Where do rivers flow?", documents=["rivers", 7])


def test_messages_without_documents_use_the_fallback(model, engine, store):
    engine.add_document("dogs", store.get("dogs").text)
    msg = model.invoke([SystemMessage("Context: " + store.get("dogs").text), HumanMessage("Question : w3 w4")])
    meta = msg.response_metadata["lazyattn"]
    assert meta["prompt_match"]["doc_ids"] == ["dogs"] and meta["stats"]["docs_hit"] + meta["stats"][
        "docs_missed"] == ["dogs"]


def test_bad_input_raises_clear_errors(model):
    with pytest.raises(ValueError, match="at least one message"):
        model.invoke([])
    with pytest.raises(TypeError, match="question string"):
        rag_chain(FaissRetriever(store=FaissDocumentStore(embedder()), k=1), model).invoke(42)


def test_a_wrapper_asks_its_remedy_per_request_on_the_shared_engine(model, engine, store):
    """``recompute_chunk_head_tokens=4`` on the wrapper: every call asks the engine for chunk-head
    recompute (issue 41), on the same engine a plain wrapper uses, and answers as the engine does
    when asked directly; the wrapper's remedy fields are exactly :class:`RequestRemedies`'."""
    docs = [LCDocument(page_content=store.get(i).text, id=i) for i in ("rivers", "stars")]
    question = [HumanMessage("Where do rivers flow?")]
    plain = model.invoke(question, documents=docs).response_metadata["lazyattn"]["stats"]
    head4 = ChatLazyAttention(engine=engine, sampling=GREEDY, recompute_chunk_head_tokens=4)
    out = head4.invoke(question, documents=docs)
    stats = out.response_metadata["lazyattn"]["stats"]
    assert plain["remedy"] is None and plain["num_recomputed_tokens"] == 0
    assert stats["remedy"] == "chunk_head_recompute" and stats["num_recomputed_tokens"] == 8
    direct = engine.generate("Where do rivers flow?", ["rivers", "stars"], sampling=GREEDY,
                             remedies=RequestRemedies(recompute_chunk_head_tokens=4))
    assert out.content == direct.text
    assert {f.name for f in dataclasses.fields(RequestRemedies)} <= set(ChatLazyAttention.model_fields)
    with pytest.raises(ValueError, match="choose one remedy"):
        ChatLazyAttention(engine=engine, sampling=GREEDY, recompute_chunk_head_tokens=4,
                          recompute_selective_ratio=0.1).invoke(question, documents=docs)
