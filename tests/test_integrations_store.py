"""FAISS document store, corpus loading and chunking, the prompt-match fallback."""

import json
import warnings

import numpy as np
import pytest


from lazyattn_rag import Document, DocumentTooLongError, UnknownDocumentError
from lazyattn_rag.integrations.corpus import (SPECIAL_TOKENS, Source, chunk_sources, embedder_token_counter,
                                              folder_sources, pydoc_sources)
from lazyattn_rag.integrations.embeddings import EmbeddingTruncationWarning
from lazyattn_rag.integrations.faiss_store import EmbeddingDimensionError, FaissDocumentStore
from tests.integrations_kit import CORPUS, bow_vector, corpus_documents, embedder, tiny_engine
from tests.tiny import words


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
    from lazyattn_rag.types.documents import Document
    from lazyattn_rag.integrations.requests import rag_request

    req = rag_request("q", [Document("a", "text a"), Document("e", "  \n"), Document("a", "text a")])
    assert [d.id for d in req.documents] == ["a", "a"]
    with pytest.raises(ValueError, match="'a' is given twice with different texts"):
        rag_request("q", [Document("a", "text a"), Document("a", "other")])


# --- a change the engine (or the index) refuses leaves store and engine as they were -------------
def small_store():
    """A store of two short documents kept in step with an engine whose context is 64 tokens."""
    engine = tiny_engine(max_model_len=64)
    store = FaissDocumentStore(engine=engine, dim=64, embedder_name="bow")
    docs = [Document("a", words(10, 0)), Document("b", words(10, 20))]
    store.upsert(docs, vectors=[bow_vector(d.text) for d in docs])
    return store, engine, docs


def assert_holds(store, engine, docs, tmp_path):
    """``store`` and its engine hold exactly ``docs``: contents, index size, retrieval of each by its
    own vector (cosine 1), the engine's texts, and a save/load round trip."""
    texts = {d.id: d.text for d in docs}
    assert store.documents() == docs and store.index.ntotal == len(docs)
    for d in docs:
        [(top, score)] = store.search_vector(bow_vector(d.text), 1)
        assert top == d and score == pytest.approx(1.0, abs=1e-6)
    assert engine.document_texts() == texts
    loaded = FaissDocumentStore.load(store.save(tmp_path / "saved"))
    assert loaded.documents() == docs and loaded.index.ntotal == len(docs)
    assert [d.id for d, _ in loaded.search_vector(bow_vector(docs[0].text), 1)] == [docs[0].id]


def test_an_upsert_the_engine_refuses_changes_nothing_single_and_batch(tmp_path):
    store, engine, docs = small_store()
    too_long = Document("a", words(80, 100))  # 80 tokens: over the 64-token context
    with pytest.raises(DocumentTooLongError, match="'a' has 80 tokens"):
        store.upsert([too_long], vectors=[bow_vector(too_long.text)])
    assert_holds(store, engine, docs, tmp_path / "single")
    batch = [Document("b", words(12, 40)), Document("c", words(8, 60)), too_long]  # update, new, refused
    with pytest.raises(DocumentTooLongError, match="'a' has 80 tokens"):
        store.upsert(batch, vectors=[bow_vector(d.text) for d in batch])
    assert_holds(store, engine, docs, tmp_path / "batch")


class FailingIndex:
    """The store's FAISS index with ``add_with_ids`` failing (as when memory runs out)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add_with_ids(self, vectors, ids):
        raise MemoryError("no room for the vectors")


def test_an_index_failure_after_the_engine_accepted_puts_the_engine_back(tmp_path, monkeypatch):
    store, engine, docs = small_store()
    monkeypatch.setattr(store, "index", FailingIndex(store.index))
    batch = [Document("a", words(12, 40)), Document("c", words(8, 60))]  # an update and a new document
    with pytest.raises(MemoryError):
        store.upsert(batch, vectors=[bow_vector(d.text) for d in batch])
    monkeypatch.undo()
    assert_holds(store, engine, docs, tmp_path)  # the engine's "a" is the old text again, "c" unregistered
    assert store.upsert(batch, vectors=[bow_vector(d.text) for d in batch]) == ["a", "c"]  # and it works after
    assert_holds(store, engine, [batch[0], docs[1], batch[1]], tmp_path / "after")


def test_a_delete_the_engine_refuses_part_way_changes_nothing(tmp_path, monkeypatch):
    store, engine, docs = small_store()
    remove = engine.remove_document

    def refuse_b(doc_id):
        if doc_id == "b":
            raise RuntimeError("the engine loop is shut down")
        remove(doc_id)

    monkeypatch.setattr(engine, "remove_document", refuse_b)
    with pytest.raises(RuntimeError, match="shut down"):
        store.delete(["a", "b"])  # "a" left the engine before "b" was refused: it is registered again
    assert_holds(store, engine, docs, tmp_path)
    monkeypatch.undo()
    store.delete(["a", "b"])
    assert store.documents() == [] and store.index.ntotal == 0 and engine.document_ids() == []


def test_a_shut_down_engine_refuses_a_delete_and_the_store_keeps_the_documents(tmp_path):
    store, engine, docs = small_store()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        store.delete(["a"])
    assert store.documents() == docs and store.index.ntotal == 2
    assert [d.id for d, _ in store.search_vector(bow_vector(docs[0].text), 1)] == ["a"]
    assert FaissDocumentStore.load(store.save(tmp_path / "saved")).documents() == docs


# --- embedding truncation is visible -----------------------------------------------------------
def test_the_store_warns_once_per_document_its_embedder_cuts():
    e = embedder()
    long_text = "Cats purr when they are content. " + "Their whiskers sense the air around them. " * 40 \
        + "The treasure is buried under the old oak tree."
    n = len(e.tokenizer(long_text)["input_ids"])  # with [CLS] and [SEP], as the model counts
    assert n > e.max_seq_length == 256
    store = FaissDocumentStore(e)
    with pytest.warns(EmbeddingTruncationWarning) as record:
        store.upsert([Document("short", CORPUS["dogs"]), Document("long", long_text)])
    messages = [str(w.message) for w in record if w.category is EmbeddingTruncationWarning]
    assert len(messages) == 1
    assert messages[0].startswith(f"all-MiniLM-L6-v2 reads at most 256 tokens but document 'long' has {n}: "
                                  "only its first 256 are embedded")
    assert store.get("long").text == long_text  # still added: a warning, not an error
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmbeddingTruncationWarning)
        assert store.upsert([Document("long", long_text)]) == []  # unchanged: not embedded again, no warning
        store.upsert([Document("fits", CORPUS["cats"])])  # a text that fits: no warning
