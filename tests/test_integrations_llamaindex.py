"""LlamaIndex integration on a tiny random model over a small FAISS index."""

import asyncio

import pytest


from llama_index.core import VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.chat_engine import ContextChatEngine
from llama_index.core.memory import ChatMemoryBuffer
from llama_index.core.query_engine import RetrieverQueryEngine

from lazyattn_rag import Document, RequestRemedies, SamplingParams
from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
from lazyattn_rag.integrations.llamaindex import (FaissRetriever, KVCacheWarmer, LazyAttentionLLM,
                                                  LazyAttentionSynthesizer, as_query_engine)
from lazyattn_rag.integrations.llamaindex_store import FaissVectorStore as LIFaissVectorStore
from tests.integrations_kit import (GREEDY, bow_llamaindex_embedding, embedder, engine, loop_ticks_during,  # noqa: F401
                                   spy, store)
from tests.tiny import words


@pytest.fixture(scope="module")
def llm(engine):
    return LazyAttentionLLM(engine, GREEDY)


def test_query_engine_passes_node_ids_and_second_query_hits_at_new_offset(llm, engine, spy, store):
    qe = as_query_engine(store, llm, similarity_top_k=2)
    first = qe.query("Why do cats purr?")
    ids1 = [n.node.node_id for n in first.source_nodes]
    assert ids1 == [d.id for d, _ in store.search("Why do cats purr?", 2)]
    assert ids1 == ["cats", "dogs"]
    assert spy.last["doc_ids"] == ids1  # the engine got the node ids, in retrieval order
    assert spy.last["stats"].docs_missed == ids1 and spy.last["stats"].docs_hit == []
    assert first.response == engine.generate("Why do cats purr?", ids1, sampling=GREEDY).text
    offsets1 = spy.calls[-2]["offsets"]

    second = qe.query("Why do dogs bark at strangers?")
    ids2 = [n.node.node_id for n in second.source_nodes]
    assert ids2 == ["dogs", "cats"]
    stats = second.metadata["lazyattn"]["stats"]
    assert stats["docs_hit"] == ["dogs", "cats"] and stats["docs_missed"] == []
    assert stats["num_computed_tokens"] < stats["num_cached_tokens"]
    for doc_id in ids2:  # both reused, each at a different position than before
        assert spy.last["offsets"][doc_id] != offsets1[doc_id]
    assert second.response == engine.generate("Why do dogs bark at strangers?", ids2, sampling=GREEDY).text


def test_streaming_sync_and_async_equal_the_non_streamed_answer(llm, store):
    question = "Where do rivers flow?"
    expected = as_query_engine(store, llm, 2).query(question).response
    streamed = as_query_engine(store, llm, 2, streaming=True).query(question)
    pieces = list(streamed.response_gen)
    assert len(pieces) >= 2 and "".join(pieces) == expected
    assert streamed.metadata["lazyattn"]["stats"]["docs_hit"] == [n.node.node_id for n in streamed.source_nodes]

    async def run():
        r = await as_query_engine(store, llm, 2, streaming=True).aquery(question)
        return [p async for p in r.async_response_gen()]

    apieces = asyncio.run(run())
    assert len(apieces) >= 2 and "".join(apieces) == expected


def test_llm_complete_and_chat_stream_sync_and_async(llm):
    prompt = "Question : " + words(6, 7)
    full = llm.complete(prompt)
    chunks = list(llm.stream_complete(prompt))
    assert len(chunks) >= 2 and "".join(c.delta for c in chunks) == full.text == chunks[-1].text
    assert full.additional_kwargs["lazyattn"]["stats"]["num_output_tokens"] == GREEDY.max_tokens
    messages = [ChatMessage(role="user", content=prompt)]
    chat = llm.chat(messages)

    async def run():
        a = await llm.acomplete(prompt)
        ac = [c.delta async for c in await llm.astream_complete(prompt)]
        ch = await llm.achat(messages)
        ach = [c.delta async for c in await llm.astream_chat(messages)]
        return a, ac, ch, ach

    a, ac, ch, ach = asyncio.run(run())
    assert a.text == full.text and "".join(ac) == full.text and len(ac) >= 2
    assert ch.message.content == chat.message.content == "".join(ach) and len(ach) >= 2
    assert "".join(c.delta for c in llm.stream_chat(messages)) == chat.message.content


def test_async_stream_does_not_block_the_event_loop(llm):
    async def consume():
        gen = await llm.astream_complete("Question : " + words(5), sampling=SamplingParams(max_tokens=48, ignore_eos=True))
        return len([c async for c in gen])

    ticks, count = loop_ticks_during(consume)
    assert count >= 48 and ticks >= 5  # the loop kept running while the engine generated


def test_empty_retrieval_answers_without_documents_on_the_id_path(llm, engine, spy):
    empty = FaissDocumentStore(embedder(), engine=engine)
    question = "Why do cats purr?"
    expected = engine.generate(question, [], sampling=GREEDY).text
    r = as_query_engine(empty, llm, 3).query(question)
    assert r.response == expected and r.source_nodes == []
    assert spy.last["doc_ids"] == [] and spy.last["stats"].docs_hit == [] == spy.last["stats"].docs_missed
    s = as_query_engine(empty, llm, 3, streaming=True).query(question)
    assert "".join(s.response_gen) == expected and s.source_nodes == []

    async def run():
        a = await as_query_engine(empty, llm, 3).aquery(question)
        return a.response

    assert asyncio.run(run()) == expected


def test_empty_retrieval_on_each_path_the_docs_name(llm, engine, spy):
    """docs/integrations.md, "Empty retrieval": LazyAttentionSynthesizer answers from the LLM with no
    documents wherever it is the synthesizer; LlamaIndex's own synthesizers (``index.as_query_engine()``,
    ``RetrieverQueryEngine.from_args`` without one, the context chat engines) return "Empty Response"
    without calling any LLM."""
    index = VectorStoreIndex.from_vector_store(LIFaissVectorStore(engine=engine), embed_model=bow_llamaindex_embedding())
    question = "Why do cats purr?"
    expected = engine.generate(question, [], sampling=GREEDY).text
    calls = len(spy.calls)

    for mode in ("compact", "refine", "tree_summarize", "simple_summarize", "accumulate"):
        assert index.as_query_engine(llm=llm, response_mode=mode).query(question).response == "Empty Response"
    assert "".join(index.as_query_engine(llm=llm, streaming=True).query(question).response_gen) == "Empty Response"
    assert asyncio.run(index.as_query_engine(llm=llm).aquery(question)).response == "Empty Response"
    assert RetrieverQueryEngine.from_args(index.as_retriever(), llm=llm).query(question).response == "Empty Response"
    for mode in ("context", "condense_plus_context"):
        assert index.as_chat_engine(chat_mode=mode, llm=llm).chat(question).response == "Empty Response"
    assert len(spy.calls) == calls  # the LLM was never called

    synthesizer = LazyAttentionSynthesizer(llm)
    for query_engine in (as_query_engine(index, llm),
                         index.as_query_engine(llm=llm, response_synthesizer=synthesizer),
                         RetrieverQueryEngine.from_args(index.as_retriever(), llm=llm, response_synthesizer=synthesizer)):
        r = query_engine.query(question)
        assert r.response == expected and r.source_nodes == [] and spy.last["doc_ids"] == []
    assert len(spy.calls) == calls + 3  # one LLM call each


def test_top_k_larger_than_the_index_returns_only_real_documents(store):
    nodes = FaissRetriever(store, similarity_top_k=10).retrieve("Why do cats purr?")
    ids = [n.node.node_id for n in nodes]
    assert sorted(ids) == sorted(["cats", "dogs", "rivers", "stars"])
    scores = [n.score for n in nodes]
    assert scores == sorted(scores, reverse=True) and all(-1.0 <= s <= 1.0 for s in scores)


def test_update_changes_retrieved_text_answer_and_kv_then_delete_removes_both(llm, engine, spy, store):
    qe = as_query_engine(store, llm, 1)
    question = "Why do cats purr?"
    before = qe.query(question)
    new_text = "Cats purr when they are content and relaxed. " + words(24, 150)
    store.upsert([Document("cats", new_text)])
    after = qe.query(question)
    assert after.source_nodes[0].node.get_content() == new_text
    assert spy.last["stats"].docs_missed == ["cats"]  # re-encoded: the old K/V is not served
    assert after.response != before.response
    assert after.response == engine.generate(question, ["cats"], sampling=GREEDY).text
    cached = engine.info()["num_cached_chunks"]

    store.delete(["cats"])
    assert "cats" not in store and not engine.has_document("cats")
    assert engine.info()["num_cached_chunks"] == cached - 1
    assert "cats" not in [n.node.node_id for n in FaissRetriever(store, 10).retrieve(question)]


def test_context_chat_engine_reuses_cached_chunks_through_the_prompt_fallback(llm, spy, store):
    retriever = FaissRetriever(store, similarity_top_k=2)
    # an in-process memory (the default Memory runs an async SQLite store through its own loops)
    chat_engine = ContextChatEngine.from_defaults(retriever=retriever, llm=llm,
                                                  memory=ChatMemoryBuffer.from_defaults(token_limit=4000),
                                                  node_postprocessors=[KVCacheWarmer(llm=llm)])
    response = chat_engine.chat("Why do cats purr?")
    ids = [n.node.node_id for n in response.source_nodes]
    assert ids == ["cats", "dogs"]
    assert spy.last["doc_ids"] == ids
    assert spy.last["stats"].docs_hit == ids and spy.last["stats"].docs_missed == []  # warmed, then matched
    assert spy.last["stats"].num_cached_tokens > spy.last["stats"].num_computed_tokens


def test_fallback_reports_the_matched_share_of_the_prompt(llm, engine, store):
    engine.add_document("rivers", store.get("rivers").text)
    prompt = "Context: " + store.get("rivers").text + " Question : w1 w2"
    out = llm.complete(prompt)
    match = out.additional_kwargs["lazyattn"]["prompt_match"]
    assert match["doc_ids"] == ["rivers"]
    assert match["matched_chars"] == len(store.get("rivers").text) and match["prompt_chars"] == len(prompt)
    assert out.additional_kwargs["lazyattn"]["stats"]["docs_hit"] + out.additional_kwargs["lazyattn"]["stats"][
        "docs_missed"] == ["rivers"]
    plain = llm.complete("Question : w1 w2 w3 w4")
    assert plain.additional_kwargs["lazyattn"]["prompt_match"]["doc_ids"] == []
    assert plain.additional_kwargs["lazyattn"]["stats"]["num_cached_tokens"] == 0  # a plain full prefill
    assert "reason" in plain.additional_kwargs["lazyattn"]["prompt_match"]
    only_doc = llm.complete(store.get("rivers").text)  # nothing but a document: placed, the template follows
    assert only_doc.additional_kwargs["lazyattn"]["doc_ids"] == ["rivers"]
    assert only_doc.additional_kwargs["lazyattn"]["stats"]["docs_hit"] == ["rivers"]


def test_synthesizer_metadata_lists_the_documents_it_placed(llm):
    from llama_index.core.schema import NodeWithScore, TextNode

    nodes = [NodeWithScore(node=TextNode(id_="blank", text="  \n "), score=1.0),
             NodeWithScore(node=TextNode(id_="kept", text=words(12, 3)), score=0.9)]
    response = LazyAttentionSynthesizer(llm).synthesize("w1 w2", nodes)
    meta = response.metadata["lazyattn"]
    assert meta["doc_ids"] == ["kept"] == meta["stats"]["docs_hit"] + meta["stats"]["docs_missed"]


def test_warmer_encodes_once(llm, engine, store):
    nodes = FaissRetriever(store, similarity_top_k=2).retrieve("Where do rivers flow?")
    warmer = KVCacheWarmer(llm=llm)
    ids = [n.node.node_id for n in nodes]
    first = warmer.warm(nodes)
    assert set(first) <= set(ids) and engine.warm(ids) == []
    assert warmer.postprocess_nodes(nodes) == nodes
    from llama_index.core.schema import TextNode

    with pytest.raises(ValueError, match="'twice'"):
        warmer.warm([TextNode(id_="twice", text=words(5)), TextNode(id_="twice", text=words(6))])
    assert not engine.has_document("twice")


def test_bad_arguments_raise_clear_errors(llm, store):
    with pytest.raises(TypeError, match="as_query_engine needs"):
        as_query_engine(42, llm)
    with pytest.raises(ValueError, match="similarity_top_k"):
        FaissRetriever(store, similarity_top_k=0)
    with pytest.raises(TypeError, match="needs a LazyAttentionLLM"):
        LazyAttentionSynthesizer(object())


def test_concurrent_async_queries_each_get_their_own_documents(llm, engine, store):
    questions = ["Why do cats purr?", "Where do rivers flow?", "Why do stars shine?"]
    qe = as_query_engine(store, llm, 2)
    sequential = [qe.query(q) for q in questions]

    async def run():
        return await asyncio.gather(*(qe.aquery(q) for q in questions))

    concurrent = asyncio.run(run())
    for seq, con in zip(sequential, concurrent):
        ids = [n.node.node_id for n in con.source_nodes]
        assert ids == [n.node.node_id for n in seq.source_nodes]
        assert con.metadata["lazyattn"]["stats"]["docs_hit"] == ids  # all cached by the sequential pass
        assert con.response == seq.response


def test_default_query_engine_reuses_cached_chunks_through_the_prompt_fallback(llm, spy, store):
    from llama_index.core.query_engine import RetrieverQueryEngine

    qe = RetrieverQueryEngine.from_args(FaissRetriever(store, similarity_top_k=2), llm=llm,
                                        node_postprocessors=[KVCacheWarmer(llm=llm)])
    response = qe.query("Where do rivers flow?")
    ids = [n.node.node_id for n in response.source_nodes]
    assert spy.last["doc_ids"] == ids and len(ids) == 2
    assert spy.last["stats"].docs_hit == ids and spy.last["stats"].docs_missed == []
    texts = [p for m in spy.last["messages"] for p in m.parts() if isinstance(p, str)]
    assert any("Where do rivers flow?" in t for t in texts)  # LlamaIndex's own template around the documents


def test_repacked_nodes_are_placed_whole_or_computed_as_text_never_mixed():
    """A small context window makes compact mode split the joined node texts across two calls:
    a node cut in two is reported as partial and computed as text; whole ones are placed."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import TextNode

    from tests.integrations_kit import PlanSpy, tiny_engine

    engine = tiny_engine(max_model_len=1000)
    spy = PlanSpy(engine)
    llm = LazyAttentionLLM(engine, SamplingParams(max_tokens=2, ignore_eos=True))
    texts = {f"n{i}": words(100, 30 * i) for i in range(6)}  # ~1,200 tiktoken tokens: more than one window
    nodes = [TextNode(id_=k, text=t) for k, t in texts.items()]
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    # the synthesizer sized for this LLM explicitly: llama-index-core before 0.14.24 sized the
    # factory's prompts for Settings' LLM, whatever llm= was given
    from llama_index.core.indices.prompt_helper import PromptHelper
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.response_synthesizers import get_response_synthesizer

    synthesizer = get_response_synthesizer(llm=llm, response_mode="compact",
                                           prompt_helper=PromptHelper.from_llm_metadata(llm.metadata))
    query_engine = RetrieverQueryEngine(index.as_retriever(similarity_top_k=6), synthesizer)
    response = query_engine.query("w1 w2")
    calls = response.metadata["lazyattn"]["calls"]
    assert len(calls) >= 2  # LlamaIndex repacked the nodes into several prompts
    partial = {d for c in calls for d in c["prompt_match"].get("partial_ids", [])}
    assert partial  # a node cut at a prompt boundary
    for call in spy.calls:
        for chunk in call["plan"].chunks:
            if chunk.doc_id is not None:  # a placed node is its whole registered text
                assert engine.engine.documents[chunk.doc_id].token_ids == chunk.token_ids
    for c in calls:
        assert not set(c["doc_ids"]) & set(c["prompt_match"].get("partial_ids", []))
    engine.shutdown()


def test_nodes_with_metadata_headers_are_found_as_the_llm_sees_them(llm, engine):
    """MetadataMode.LLM puts "key: value" lines before the text: the node's id covers both."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import TextNode

    node = TextNode(id_="with-meta", text=words(30, 11), metadata={"file_name": "w5.txt", "secret": "x"},
                    excluded_llm_metadata_keys=["secret"])
    index = VectorStoreIndex([node], embed_model=MockEmbedding(embed_dim=8))
    chat = index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=1)
    response = chat.chat("w1 w2")
    meta = response.metadata["lazyattn"]
    assert meta["doc_ids"] == ["with-meta"]
    assert engine.engine.documents["with-meta"].text.startswith("file_name: w5.txt")
    streamed = chat.stream_chat("w3 w4")
    assert "".join(streamed.response_gen) is not None
    assert streamed.metadata["lazyattn"]["doc_ids"] == ["with-meta"]
    engine.remove_document("with-meta")


def test_as_query_engine_over_the_llamaindex_vector_store_places_node_ids(llm, engine, spy):
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.schema import TextNode

    from lazyattn_rag.integrations.embeddings import llamaindex_embedding
    from lazyattn_rag.integrations.llamaindex_store import FaissVectorStore

    store = FaissVectorStore(engine=engine)
    nodes = [TextNode(id_="vs-cats", text="Cats purr when content. " + words(20, 5), metadata={"kind": "pet"}),
             TextNode(id_="vs-stars", text="Stars shine by fusion. " + words(20, 90))]
    VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store),
                     embed_model=llamaindex_embedding())
    response = as_query_engine(store, llm, similarity_top_k=1).query("Why do cats purr?")
    assert [n.node.node_id for n in response.source_nodes] == ["vs-cats"]
    assert response.source_nodes[0].node.metadata == {"kind": "pet"}  # the node that was added, whole
    assert spy.last["doc_ids"] == ["vs-cats"]
    for node in nodes:
        engine.remove_document(node.node_id)


def test_the_llm_asks_its_remedy_per_request(engine, store):
    """``LazyAttentionLLM(..., recompute_chunk_head_tokens=4)``: the id path recomputes each
    document's first 4 tokens, as the engine does when asked directly (issue 41)."""
    head4 = LazyAttentionLLM(engine, GREEDY, recompute_chunk_head_tokens=4)
    docs = [store.get(i) for i in ("cats", "dogs")]
    deltas = list(head4.stream_rag("Why do cats purr?", docs))
    stats = deltas[-1].stats
    assert stats.remedy == "chunk_head_recompute" and stats.num_recomputed_tokens == 8
    direct = engine.generate("Why do cats purr?", ["cats", "dogs"], sampling=GREEDY,
                             remedies=RequestRemedies(recompute_chunk_head_tokens=4))
    assert "".join(d.text for d in deltas) == direct.text
