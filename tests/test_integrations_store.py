"""FAISS document store, corpus loading and chunking, the prompt-match fallback."""

import json

import numpy as np
import pytest


from lazyattn_rag import Document, UnknownDocumentError
from lazyattn_rag.integrations.corpus import (
    SPECIAL_TOKENS,
    Source,
    chunk_sources,
    embedder_token_counter,
    folder_sources,
    pydoc_sources,
)
from lazyattn_rag.integrations.faiss_store import EmbeddingDimensionError, FaissDocumentStore
from tests.integrations_kit import CORPUS, corpus_documents, embedder, tiny_engine


@pytest.fixture
def store():
    s = FaissDocumentStore(embedder())
    s.upsert(corpus_documents())
    return s


def cosine_ranking(query: str, texts: dict[str, str]) -> list[tuple[str, float]]:
    """Independent reference: brute-force cosine similarity with numpy."""
    e = embedder()
    ids = list(texts)
    docs = e.encode([texts[i] for i in ids])
    q = e.encode([query])[0]
    scores = docs @ q / (np.linalg.norm(docs, axis=1) * np.linalg.norm(q))
    return sorted(zip(ids, scores.tolist()), key=lambda p: -p[1])


def test_search_matches_brute_force_cosine_and_never_pads(store):
    ref = cosine_ranking("Why do cats purr?", CORPUS)
    hits = store.search("Why do cats purr?", 10)  # more than the store holds
    assert [d.id for d, _ in hits] == [i for i, _ in ref]
    assert np.allclose([s for _, s in hits], [s for _, s in ref], atol=1e-5)
    assert [d.text for d, _ in hits] == [CORPUS[i] for i, _ in ref]
    assert FaissDocumentStore(embedder()).search("anything", 3) == []


def test_update_reembeds_under_the_same_id_and_delete_removes(store):
    assert store.upsert(corpus_documents()) == []  # unchanged: nothing re-embedded
    new = "Volcanoes erupt when magma pressure rises."
    assert store.upsert([Document("rivers", new)]) == ["rivers"]
    assert len(store) == 4 and store.index.ntotal == 4
    top, score = store.search("Why do volcanoes erupt?", 1)[0]
    assert top.id == "rivers" and top.text == new
    assert score == pytest.approx(cosine_ranking("Why do volcanoes erupt?", {"rivers": new})[0][1], abs=1e-5)
    with pytest.raises(UnknownDocumentError, match="'nope'"):
        store.delete(["cats", "nope"])
    assert "cats" in store and store.index.ntotal == 4  # nothing removed on error
    store.delete(["cats"])
    assert "cats" not in store and store.index.ntotal == 3
    assert "cats" not in [d.id for d, _ in store.search("Why do cats purr?", 10)]


def test_save_and_load_round_trip(store, tmp_path):
    store.delete(["dogs"])
    store.upsert([Document("comets", "Comets grow tails near the sun.", {"kind": "space"})])
    store.save(tmp_path / "idx")
    loaded = FaissDocumentStore.load(tmp_path / "idx", embedder())
    assert loaded.documents() == store.documents()
    assert loaded.get("comets").metadata == {"kind": "space"}
    for q in ("Why do cats purr?", "What grows near the sun?"):
        ranked = [(d.id, round(s, 5)) for d, s in store.search(q, 4)]
        assert [(d.id, round(s, 5)) for d, s in loaded.search(q, 4)] == ranked
    loaded.upsert([Document("new", "A fresh document after reload.")])  # ids keep counting past the old ones
    assert len({loaded._int_ids[d] for d in ("cats", "rivers", "stars", "comets", "new")}) == 5
    meta = json.loads((tmp_path / "idx" / "meta.json").read_text())
    (tmp_path / "idx" / "meta.json").write_text(json.dumps({**meta, "embedder": "other-model"}))
    with pytest.raises(ValueError, match="other-model"):
        FaissDocumentStore.load(tmp_path / "idx", embedder())


def test_bad_input(store):
    with pytest.raises(ValueError, match="k must be"):
        store.search("cats", 0)
    with pytest.raises(ValueError, match="query is empty"):
        store.search("  ", 2)
    with pytest.raises(ValueError, match="twice"):
        store.upsert([Document("a", "one text"), Document("a", "another text")])
    with pytest.raises(ValueError, match="empty text"):
        store.upsert([Document("a", " ")])
    with pytest.raises(UnknownDocumentError):
        store.get("missing")


def test_store_fed_with_vectors_takes_their_dimension_and_keeps_an_engine_in_step(tmp_path):
    docs = corpus_documents()
    vectors = embedder().encode([d.text for d in docs]) * 3.0  # not unit length: normalized on the way in
    store = FaissDocumentStore(embedder_name="all-MiniLM-L6-v2")
    assert store.dim is None and store.search_vector(np.ones(5), 2) == []  # nothing added yet
    with pytest.raises(ValueError, match="no embedder"):
        store.upsert(docs)
    with pytest.raises(ValueError, match="expected 4 vectors"):
        store.upsert(docs, vectors=vectors[:3])
    assert store.dim is None and len(store) == 0  # a refused batch sets nothing
    assert store.upsert(docs, vectors=vectors) == list(CORPUS)
    assert store.dim == 384
    query = embedder().encode(["Why do cats purr?"])[0]
    hits = store.search_vector(query, 4)
    ref = cosine_ranking("Why do cats purr?", CORPUS)
    assert [d.id for d, _ in hits] == [i for i, _ in ref]
    assert np.allclose([s for _, s in hits], [s for _, s in ref], atol=1e-5)
    assert [d.id for d, _ in store.search_vector(query, 4, accept=lambda d: d.id != "cats")] == [i for i, _ in ref[1:]]
    with pytest.raises(ValueError, match="has no embedder"):
        store.search("Why do cats purr?", 2)
    with pytest.raises(EmbeddingDimensionError, match="the query embedding: 3 dimensions, but this index holds "
                                                       "384-dimensional vectors from 'all-MiniLM-L6-v2'"):
        store.search_vector([1.0, 0.0, 0.0], 2)

    engine = tiny_engine()
    store.attach_engine(engine)  # what the store already holds is registered now
    assert engine.document_texts() == CORPUS
    store.upsert([Document("comets", "Comets grow tails near the sun.")], vectors=vectors[:1])
    store.delete(["cats"])
    assert engine.has_document("comets") and not engine.has_document("cats")
    store.save(tmp_path / "idx")
    loaded = FaissDocumentStore.load(tmp_path / "idx")  # no embedder: the saved name and dimension
    assert (loaded.dim, loaded.embedder_name, len(loaded)) == (384, "all-MiniLM-L6-v2", 4)
    with pytest.raises(ValueError, match="nothing to save"):
        FaissDocumentStore().save(tmp_path / "empty")


def test_pydoc_chunks_fit_the_embedder_and_cover_their_topics():
    e = embedder()
    sources = [s for s in pydoc_sources() if s.metadata["topic"] in ("for", "break", "lambda", "with")]
    assert len(pydoc_sources()) >= 70
    docs = chunk_sources(sources, embedder_token_counter(e.tokenizer), e.max_seq_length - SPECIAL_TOKENS)
    assert len({d.id for d in docs}) == len(docs)
    for d in docs:
        assert len(e.tokenizer(d.text)["input_ids"]) <= e.max_seq_length  # with [CLS] and [SEP]
        assert not d.metadata.get("truncated")
    for s in sources:
        mine = [d for d in docs if d.id.startswith(s.id + "#")]
        assert [d.id for d in mine] == [f"{s.id}#{i}" for i in range(len(mine))]
        assert all(d.text in s.text for d in mine)
        words = set(s.text.split())
        assert words == set(w for d in mine for w in d.text.split())  # every word lands in some chunk


def test_chunk_sources_validates_its_budget():
    with pytest.raises(ValueError, match="max_tokens"):
        chunk_sources([Source("a", "text", {})], len, 8)
    with pytest.raises(ValueError, match="overlap"):
        chunk_sources([Source("a", "text", {})], len, 32, overlap=32)


def test_folder_sources_reads_text_markdown_and_jsonl(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.md").write_text("# Title\n\nMarkdown body.")
    (tmp_path / "sub" / "b.txt").write_text("Plain text.")
    (tmp_path / "skip.py").write_text("print('not a document')")
    (tmp_path / "c.jsonl").write_text('{"id": "x1", "text": "First row.", "lang": "en"}\n\n{"text": "Second row."}\n')
    got = {s.id: (s.text, s.metadata) for s in folder_sources(tmp_path)}
    assert got == {"a.md": ("# Title\n\nMarkdown body.", {"source": "a.md"}),
                   "sub/b.txt": ("Plain text.", {"source": "sub/b.txt"}),
                   "x1": ("First row.", {"source": "c.jsonl", "lang": "en"}),
                   "c.jsonl:3": ("Second row.", {"source": "c.jsonl"})}
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n["not", "an", "object"]\n')
    with pytest.raises(ValueError, match="bad.jsonl line 2"):
        folder_sources(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        folder_sources(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt"):
        folder_sources(tmp_path / "empty")


def test_rag_request_drops_empty_documents_and_rejects_conflicting_texts():
    from lazyattn_rag.documents import Document
    from lazyattn_rag.integrations.requests import rag_request

    req = rag_request("q", [Document("a", "text a"), Document("e", "  \n"), Document("a", "text a")])
    assert [d.id for d in req.documents] == ["a", "a"]
    with pytest.raises(ValueError, match="'a' is given twice with different texts"):
        rag_request("q", [Document("a", "text a"), Document("a", "other")])
