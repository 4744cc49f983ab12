"""Edge cases of the framework integrations found by an adversarial pass (tiny engine, no real
model): each test was a reproducer of a defect, now fixed."""

from __future__ import annotations

import asyncio
import datetime
import gc

import pytest

from lazyattn_rag import SamplingParams
from tests.integrations_kit import PlanSpy, bow_langchain_embeddings, bow_llamaindex_embedding, tiny_engine
from tests.tiny import save_model_dir, words


@pytest.fixture(scope="module")
def engine():
    e = tiny_engine(num_blocks=1024, max_model_len=1200)
    yield e
    e.shutdown()


def _index(n=12):
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode

    nodes = [TextNode(id_=f"doc{i}", text=words(30, (i * 5) % 200)) for i in range(n)]
    return VectorStoreIndex(nodes, embed_model=bow_llamaindex_embedding())


# --- 1. memory: _REPORTS grows by one entry per streamed chat-engine turn -----------------------
@pytest.mark.parametrize("mode", ["context", "condense_plus_context"])
def test_streaming_chat_engine_turns_leave_nothing_behind_in_the_report_table(engine, mode):
    """A chat engine's streamed reply calls the LLM in LlamaIndex's writer thread, under a span whose
    parent (the chat engine's ``stream_chat`` span) has already ended. ``record_call`` files the
    report under that ended parent too (``RetrievalLog.ancestors`` includes a parent that is no
    longer open), and nothing ever pops it: ``llamaindex_events._REPORTS`` grows without bound."""
    from llama_index.core.memory import ChatMemoryBuffer

    from lazyattn_rag.integrations import llamaindex_events as ev
    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

    llm = LazyAttentionLLM(engine, SamplingParams(max_tokens=2, ignore_eos=True))
    chat = _index().as_chat_engine(chat_mode=mode, llm=llm, similarity_top_k=2,
                                   memory=ChatMemoryBuffer.from_defaults(token_limit=300))
    before = len(ev._REPORTS)

    async def turns():
        for i in range(5):
            s = await chat.astream_chat(words(3, i))
            async for _ in s.async_response_gen():
                pass

    asyncio.run(turns())
    gc.collect()
    assert len(ev._REPORTS) == before, f"{len(ev._REPORTS) - before} report entries leaked after 5 turns"


# --- 2. partial_ids: overlapping chunks and shared metadata headers ---------------------------------
def test_partial_ids_are_not_every_node_that_shares_a_metadata_header(engine):
    """MetadataMode.LLM puts ``file_path: ...`` first in every node of a file; the matcher indexes
    candidates by their first 32 normalized characters and reports a candidate as "partial" when that
    opening occurs anywhere. With a path of 30+ characters every other node of the file is reported as
    cut/edited in every call (and, when nothing is placed, the warning blames truncation)."""
    from lazyattn_rag.engine.planning.prompt_match import Candidate, DocumentMatcher

    header = "file_path: /home/alice/projects/handbook/chapter1.txt\n\n"
    cands = [Candidate(f"n{i}", header + words(30, 7 * i)) for i in range(50)]
    prompt = "Context:\n" + cands[3].text + "\n\n" + cands[9].text + "\nQuestion: w1?"
    occurrences, partial = DocumentMatcher(cands).occurrences(prompt)
    assert sorted({m[2].doc_id for m in occurrences}) == ["n3", "n9"]
    assert partial == set(), f"{len(partial)} whole, unplaced nodes reported as partial"


def test_overlapping_chunks_are_not_reported_as_partial():
    """Splitters overlap consecutive chunks (LlamaIndex's SentenceSplitter, LangChain's
    RecursiveCharacterTextSplitter): chunk k+1 opens with chunk k's tail. Placing chunk k must
    not report chunk k+1 as "cut to fit the context window, or edited"."""
    from lazyattn_rag.engine.planning.prompt_match import Candidate, DocumentMatcher

    a = Candidate("a", words(40, 0))
    b = Candidate("b", words(40, 30))  # starts with a's last 10 words
    occurrences, partial = DocumentMatcher([a, b]).occurrences("Context: " + a.text + " Question: w1")
    assert [m[2].doc_id for m in occurrences] == ["a"]
    assert partial == set()


# --- 3. LlamaIndex id path drops the LLM's system_prompt ------------------------------------------
def test_id_path_keeps_the_llms_system_prompt(engine):
    """``LazyAttentionLLM(system_prompt=...)``: LlamaIndex's own synthesizer path
    (``index.as_query_engine(llm=llm)``) puts it in the prompt; the id path
    (``as_query_engine(index, llm)`` / ``LazyAttentionSynthesizer``) silently drops it:
    ``LazyAttentionLLM._request`` keeps only the last message's content as the question."""
    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM, as_query_engine

    spy = PlanSpy(engine)
    marker = "w150 w151 w152 w153 w154 w155"
    llm = LazyAttentionLLM(engine, SamplingParams(max_tokens=2, ignore_eos=True), system_prompt=marker)
    index = _index(4)
    w150 = engine.tokenizer.convert_tokens_to_ids("w150")
    index.as_query_engine(llm=llm, similarity_top_k=1).query("w1 w2")
    assert w150 in spy.last["plan"].token_ids()  # LlamaIndex's own synthesizer: kept
    as_query_engine(index, llm, 1).query("w1 w2")
    assert w150 in spy.last["plan"].token_ids(), "the id path dropped LazyAttentionLLM.system_prompt"


# --- 5. persistence: a failing save destroys the previous good save ----------------------------------
def test_metadata_that_cannot_be_saved_is_refused_at_add_and_a_failed_save_keeps_the_last_one(tmp_path):
    """Metadata JSON cannot encode (a ``date``, as some LangChain loaders produce) is refused when
    added, naming the document; a save that fails part-way (metadata changed in place afterwards)
    leaves the previous save loadable: every file is written in full before any is replaced."""
    from lazyattn_rag.integrations.langchain_store import FaissVectorStore

    store = FaissVectorStore.from_texts(["w1 w2 w3 w4", "w5 w6 w7"], bow_langchain_embeddings(), ids=["a", "b"])
    store.save_local(tmp_path)
    with pytest.raises(ValueError, match="document 'c' has metadata that cannot be saved as JSON"):
        store.add_texts(["w8 w9"], metadatas=[{"when": datetime.date(2024, 1, 1)}], ids=["c"])
    assert len(store.store) == 2
    store.add_texts(["w8 w9"], ids=["c"])
    store.store.get("a").metadata["when"] = datetime.date(2024, 1, 1)  # changed after it was added
    with pytest.raises(TypeError):
        store.save_local(tmp_path)
    loaded = FaissVectorStore.load_local(tmp_path, bow_langchain_embeddings())
    assert sorted(d.id for d in loaded.store.documents()) == ["a", "b"]
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temporary files left


# --- 6. wrappers built from settings keep a shut-down shared engine ----------------------------------
def test_settings_built_wrappers_follow_the_shared_engine_after_shutdown(tmp_path):
    """``LazyAttention.shared``: "shutdown of a shared engine removes it, and the next call builds a
    new one". New wrappers get the new engine; wrappers built before keep the stopped one forever
    (``RuntimeError: the engine loop is shut down`` on every call), and no longer share with new ones."""
    from langchain_core.messages import HumanMessage

    from lazyattn_rag.integrations.langchain import ChatLazyAttention
    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

    model = str(save_model_dir(tmp_path / "tiny"))
    kw = {"device": "cpu", "attention_backend": "torch", "cache": {"num_blocks": 64}}
    chat = ChatLazyAttention(model=model, max_tokens=2, engine_kwargs=kw)
    llm = LazyAttentionLLM(model=model, max_tokens=2, engine_kwargs=kw)
    chat.invoke([HumanMessage("w1 w2")])
    assert chat.engine is llm.engine
    chat.engine.shutdown()
    fresh = ChatLazyAttention(model=model, max_tokens=2, engine_kwargs=kw)
    fresh.invoke([HumanMessage("w1 w2")])
    try:
        chat.invoke([HumanMessage("w1 w2")])
        llm.complete("w1 w2")
        assert chat.engine is fresh.engine is llm.engine
    finally:
        fresh.engine.shutdown()


# --- 7. a prompt with an out-of-range \U escape makes every call fail --------------------------------
@pytest.mark.parametrize("text", [r"What does \UFFFFFFFF mean in the log?", r"open C:\U12345678\notes.txt please"])
def test_escape_sequences_outside_unicode_do_not_break_the_call(engine, text):
    """``prompt_match._view(unescape=True)`` decodes ``\\U`` + 8 hex digits with ``chr(int(...))``
    unguarded: above U+10FFFF it raises (OverflowError / ValueError) and the whole LLM call fails,
    on both frameworks, whenever any document is registered. The text comes from the user's
    question or from a retrieved document (hex dumps, paths, code)."""
    from langchain_core.messages import HumanMessage

    from lazyattn_rag.integrations.langchain import ChatLazyAttention
    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM
    from lazyattn_rag.engine.planning.prompt_match import Candidate, DocumentMatcher

    DocumentMatcher([Candidate("d", words(20, 3))]).occurrences(text)  # raises today
    engine.add_document("registered", words(20, 3))
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    ChatLazyAttention(engine=engine, sampling=sampling).invoke([HumanMessage(text)])
    LazyAttentionLLM(engine, sampling).complete(text)
