"""The FAISS chatbot end to end with the real default model (SmolLM2-135M) on a tiny --docs folder,
and multi-byte (CJK, emoji) streaming through both frameworks."""

import asyncio
import io
import warnings
from pathlib import Path

import pytest


from langchain_core.messages import HumanMessage
from typer.testing import CliRunner

from lazyattn_rag import CacheConfig, Document, EngineConfig, SamplingParams
from lazyattn_rag.cli import app
from lazyattn_rag.integrations.chatbot import ChatOptions, run_chat
from lazyattn_rag.integrations.langchain import ChatLazyAttention, document_block
from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM, LazyAttentionSynthesizer

DOCS = {
    "zembla.md": "# Zembla\n\nZembla is a small northern kingdom. The capital city of Zembla is Onhava, a port on "
                 "the western coast.\nIts rivers freeze every winter.\n",
    "bread.txt": "Sourdough bread rises because wild yeast and lactic acid bacteria ferment the dough for hours.\n",
    "facts.jsonl": '{"id": "moon", "text": "The Moon orbits the Earth once every 27.3 days."}\n',
}
MOON = "How long does the Moon take to orbit the Earth?"


@pytest.fixture(scope="module")
def engine():
    from lazyattn_rag.llm import LazyAttention

    return LazyAttention(EngineConfig(device="cpu", attention_backend="torch", cache=CacheConfig(num_blocks=256)))


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


@pytest.mark.slow
def test_chatbot_answers_from_the_docs_then_reuses_cached_chunks(engine, docs_dir, tmp_path):
    out, log = io.StringIO(), io.StringIO()
    options = ChatOptions(questions=("What is the capital city of Zembla?", MOON), docs=docs_dir, top_k=2,
                          index_dir=tmp_path / "index")
    first, second = run_chat(options, out=out, log=log, engine=engine)
    assert first["docs_missed"] == ["zembla.md#0", "moon#0"] and first["docs_hit"] == []
    assert second["docs_hit"] == ["moon#0"]  # retrieved again, now first in the prompt: served from cache
    assert second["docs_missed"] == ["bread.txt#0"]
    text = out.getvalue()
    moon_answer = text.split(f"Q: {MOON}\nA: ")[1].split("\n   source")[0]
    assert "27.3" in moon_answer  # answered correctly from the document
    assert "source moon#0" in text and "docs hit" in text and "TTFT" in text
    assert "Embedding 3 chunks" in log.getvalue() and (tmp_path / "index" / "index.faiss").is_file()

    # second start: the saved index is reloaded; interactive mode reads questions until "exit"
    out2, log2 = io.StringIO(), io.StringIO()
    again = run_chat(ChatOptions(docs=docs_dir, top_k=2, index_dir=tmp_path / "index"), out=out2, log=log2,
                     stdin=io.StringIO(MOON + "\nexit\n"), engine=engine)
    assert "Loaded the FAISS index (3 chunks)" in log2.getvalue()
    assert len(again) == 1 and again[0]["docs_hit"] == ["moon#0", "bread.txt#0"] and again[0]["docs_missed"] == []
    assert "27.3" in out2.getvalue()


@pytest.mark.slow
def test_cjk_and_emoji_stream_without_replacement_characters(engine):
    doc = Document("sushi", "寿司 🍣 は日本の料理です。東京の人は寿司が大好きです 🍣🍜。")
    question = "What emoji is in the document?"
    sampling = SamplingParams(max_tokens=14)
    llm = LazyAttentionLLM(engine, sampling)
    full = engine.generate(question, documents=[doc], sampling=sampling).text
    assert "🍣" in full  # the answer itself carries multi-byte characters split over several tokens

    pieces = list(engine.stream(question, documents=[doc], sampling=sampling))
    assert "".join(p.text for p in pieces) == full
    assert sum(p.text == "" and p.token_id is not None for p in pieces) >= 1  # a character was held back

    from llama_index.core.schema import NodeWithScore, TextNode

    nodes = [NodeWithScore(node=TextNode(id_=doc.id, text=doc.text), score=1.0)]
    li_pieces = list(LazyAttentionSynthesizer(llm, streaming=True).synthesize(question, nodes).response_gen)
    model = ChatLazyAttention(engine=engine, sampling=sampling)
    messages = [HumanMessage([document_block(doc), {"type": "text", "text": question}])]
    lc_pieces = [c.content for c in model.stream(messages)]

    async def run():
        return [c.content async for c in model.astream(messages)]

    lc_async = asyncio.run(run())
    for stream in (li_pieces, lc_pieces, lc_async):
        assert len(stream) >= 2 and "".join(stream) == full
        assert all("\ufffd" not in p for p in stream)


def test_an_index_saved_before_the_llamaindex_vector_store_loads_offline(docs_dir, tmp_path, monkeypatch):
    """The chatbot used to save a FaissDocumentStore built with SentenceEmbedder; such an index is
    found under the same fingerprint and loads with no network, and retrieval gives its scores."""
    import socket

    from llama_index.core import VectorStoreIndex

    from lazyattn_rag.integrations.chatbot import corpus_fingerprint, load_or_build_store
    from lazyattn_rag.integrations.corpus import SPECIAL_TOKENS, chunk_sources, embedder_token_counter, folder_sources
    from lazyattn_rag.integrations.embeddings import llamaindex_embedding
    from lazyattn_rag.integrations.faiss_store import FaissDocumentStore
    from tests.integrations_kit import embedder

    sources, e = folder_sources(docs_dir), embedder()
    before = FaissDocumentStore(e)
    before.upsert(chunk_sources(sources, embedder_token_counter(e.tokenizer), e.max_seq_length - SPECIAL_TOKENS))
    before.save(tmp_path / "index")

    def no_network(*args, **kwargs):
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    embed_model = llamaindex_embedding()
    assert corpus_fingerprint(sources, embed_model, 16) == "05c8cd22bde4e04d"  # what the previous chatbot named it
    log = io.StringIO()
    store = load_or_build_store(sources, embed_model, tmp_path / "index", 16, rebuild=False, log=log)
    assert "Loaded the FAISS index (3 chunks)" in log.getvalue()
    [hit] = VectorStoreIndex.from_vector_store(store, embed_model=embed_model).as_retriever(similarity_top_k=1) \
        .retrieve(MOON)
    [(doc, score)] = before.search(MOON, 1)
    assert hit.node.node_id == doc.id == "moon#0" and hit.node.get_content() == doc.text
    assert hit.score == pytest.approx(score, abs=1e-5)


def test_the_chatbot_chunks_below_the_embedder_limit_so_no_text_is_cut(tmp_path):
    """The chatbot's ingestion splits a long text into chunks of at most 256 MiniLM tokens ([CLS]
    and [SEP] included) before embedding: nothing warns of truncation, and a fact at the end of
    the text is found. The same text embedded whole is cut, and the embed model says so."""
    from lazyattn_rag.integrations.chatbot import load_or_build_store
    from lazyattn_rag.integrations.corpus import Source
    from lazyattn_rag.integrations.embeddings import (
        EmbeddingTruncationWarning,
        embedding_tokenizer,
        llamaindex_embedding,
    )

    text = ("Cats purr when they are content. " + " ".join(f"Note {i} says the weather was mild that day."
                                                           for i in range(60))
            + " The treasure is buried under the old oak tree.")
    embed_model, tokenizer = llamaindex_embedding(), embedding_tokenizer()
    n = len(tokenizer(text)["input_ids"])
    assert n > 2 * embed_model.max_length and embed_model.max_length == 256
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmbeddingTruncationWarning)  # a cut chunk fails the test
        store = load_or_build_store([Source("notes", text, {})], embed_model, tmp_path / "index", 16,
                                    rebuild=True, log=io.StringIO())
    chunks = store.client.documents()
    assert len(chunks) >= 3 and [d.id for d in chunks] == [f"notes#{i}" for i in range(len(chunks))]
    assert max(len(tokenizer(d.text)["input_ids"]) for d in chunks) <= 256
    [(top, _)] = store.client.search_vector(embed_model.get_query_embedding("Where is the treasure buried?"), 1)
    assert top.id == chunks[-1].id and top.text.endswith("The treasure is buried under the old oak tree.")
    with pytest.warns(EmbeddingTruncationWarning, match=f"has {n}: only its first 256 are embedded"):
        embed_model.get_text_embedding(text)


def test_cli_chat_reports_a_missing_docs_path():
    result = CliRunner().invoke(app, ["chat", "--docs", "/nonexistent/lazyattn-docs", "--question", "hi"])
    assert result.exit_code == 2
    assert "does not exist" in result.output
