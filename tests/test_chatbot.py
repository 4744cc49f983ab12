"""The FAISS chatbot end to end with the real default model (SmolLM2-135M) on a tiny --docs folder,
and multi-byte (CJK, emoji) streaming through both frameworks."""

import asyncio
import io
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

    pieces = list(llm.stream_rag(question, [doc]))
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


def test_cli_chat_reports_a_missing_docs_path():
    result = CliRunner().invoke(app, ["chat", "--docs", "/nonexistent/lazyattn-docs", "--question", "hi"])
    assert result.exit_code == 2
    assert "does not exist" in result.output
