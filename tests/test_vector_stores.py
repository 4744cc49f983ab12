"""The FAISS store as the frameworks' own types (a LlamaIndex vector store, a LangChain VectorStore),
with the frameworks' embedding classes over the offline MiniLM: round trips, the attached engine kept
in step, wrong-dimension errors."""

import functools
import pickle
import warnings

import numpy as np
import pytest
from langchain_core.documents import Document as LCDocument
from llama_index.core import Document as LIDocument
from llama_index.core import StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.core.schema import MetadataMode
from llama_index.core.vector_stores import MetadataFilter, MetadataFilters

from lazyattn_rag import Document, DocumentTooLongError
from lazyattn_rag.integrations.embeddings import (
    EmbeddingTruncationWarning,
    default_embedding_model_path,
    langchain_embeddings,
    llamaindex_embedding,
)
from lazyattn_rag.integrations.faiss_store import EmbeddingDimensionError, FaissDocumentStore
from lazyattn_rag.integrations.langchain import ChatLazyAttention, rag_chain
from lazyattn_rag.integrations.langchain_store import FaissVectorStore as LCFaissVectorStore
from lazyattn_rag.integrations.llamaindex_store import FaissVectorStore as LIFaissVectorStore
from tests.integrations_kit import (
    CORPUS,
    GREEDY,
    StreamSpy,
    bow_langchain_embeddings,
    bow_llamaindex_embedding,
    bow_vector,
    corpus_documents,
    embedder,
    tiny_engine,
)
from tests.tiny import words

CATS = "Why do cats purr?"


@functools.cache
def li_embed():
    return llamaindex_embedding()


@functools.cache
def lc_embed():
    return langchain_embeddings()


@functools.cache
def truncated_embeddings():
    """The same MiniLM cut to its first 128 dimensions (sentence-transformers' truncate_dim): a
    real embedder whose vectors do not fit a 384-dimensional index."""
    from langchain_huggingface import HuggingFaceEmbeddings
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    path = str(default_embedding_model_path())
    li = HuggingFaceEmbedding(model_name=path, device="cpu", local_files_only=True, truncate_dim=128)
    lc = HuggingFaceEmbeddings(model_name=path, model_kwargs={"device": "cpu", "local_files_only": True,
                                                              "truncate_dim": 128})
    return li, lc


def reference_ranking(query: str, texts: dict[str, str]) -> list[tuple[str, float]]:
    """Independent reference: brute-force cosine similarity over SentenceEmbedder's vectors."""
    e = embedder()
    ids = list(texts)
    scores = e.encode([texts[i] for i in ids]) @ e.encode([query])[0]
    return sorted(zip(ids, scores.tolist()), key=lambda p: -p[1])


def test_embedding_helpers_match_the_sentence_embedder():
    texts = [CORPUS["cats"], CORPUS["rivers"]]
    ref = embedder().encode(texts)
    li = np.asarray(li_embed().get_text_embedding_batch(texts))
    lc = np.asarray(lc_embed().embed_documents(texts))
    assert li.shape == lc.shape == (2, 384)
    assert np.allclose(li, ref, atol=1e-5) and np.allclose(lc, ref, atol=1e-5)
    assert np.allclose(np.linalg.norm(lc, axis=1), 1.0, atol=1e-5)
    assert np.allclose(lc_embed().embed_query(CATS), embedder().encode([CATS])[0], atol=1e-5)
    with pytest.raises(FileNotFoundError, match="no local embedding model folder"):
        langchain_embeddings("sentence-transformers/all-MiniLM-L6-v2")  # a hub name: refused, not fetched


def test_every_embedder_embeds_from_many_threads_at_once():
    """A fast tokenizer resets truncation on its shared Rust object per call: unserialized, two
    threads in one model raise 'RuntimeError: Already borrowed' (seen in CI under concurrent
    LlamaIndex aquery). Each embedder gives, from 8 threads at once, the vectors it gives alone."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [words(n, start=n) for n in (3, 40, 7, 60, 15, 50, 2, 70)]  # under the 256-token limit
    ref = embedder().encode(texts)
    calls = {
        "store": lambda i: embedder().encode([texts[i]])[0],
        "llamaindex": lambda i: li_embed().get_text_embedding(texts[i]),
        "langchain": lambda i: lc_embed().embed_query(texts[i]),
    }
    for name, call in calls.items():
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(call, [i % len(texts) for i in range(64)]))
        for i, vec in enumerate(got):
            assert np.allclose(vec, ref[i % len(texts)], atol=1e-5), (name, i)


# --- LlamaIndex -----------------------------------------------------------------------------------
def test_llamaindex_vector_store_registers_nodes_round_trips_and_deletes(tmp_path):
    engine = tiny_engine()
    vector_store = LIFaissVectorStore(engine=engine, embed_model_name="all-MiniLM-L6-v2")
    docs = [LIDocument(id_=k, text=v, metadata={"topic": k}) for k, v in CORPUS.items()]
    storage = StorageContext.from_defaults(vector_store=vector_store)
    index = VectorStoreIndex.from_documents(docs, storage_context=storage, embed_model=li_embed())

    hits = index.as_retriever(similarity_top_k=10).retrieve(CATS)
    ref = reference_ranking(CATS, {k: f"topic: {k}\n\n{v}" for k, v in CORPUS.items()})  # what the embedder saw
    assert [n.node.ref_doc_id for n in hits] == [k for k, _ in ref]
    assert np.allclose([n.score for n in hits], [s for _, s in ref], atol=1e-5)
    top = hits[0].node
    assert top.text == CORPUS["cats"] and top.metadata == {"topic": "cats"}  # the node that was added
    texts = engine.document_texts()
    for n in hits:  # every node registered under its node id, with the text an LLM is shown
        assert texts[n.node.node_id] == n.node.get_content(metadata_mode=MetadataMode.LLM)
        assert texts[n.node.node_id].startswith(f"topic: {n.node.ref_doc_id}")

    only_rivers = MetadataFilters(filters=[MetadataFilter(key="topic", value="rivers")])
    assert [n.node.ref_doc_id for n in index.as_retriever(similarity_top_k=3, filters=only_rivers).retrieve(CATS)] \
        == ["rivers"]

    storage.persist(str(tmp_path / "storage"))
    index.delete_ref_doc("cats")
    assert not engine.has_document(top.node_id)
    assert "cats" not in [n.node.ref_doc_id for n in index.as_retriever(similarity_top_k=10).retrieve(CATS)]

    engine2 = tiny_engine()
    reloaded = LIFaissVectorStore.from_persist_dir(tmp_path / "storage", engine=engine2)
    assert sorted(engine2.document_ids()) == sorted(n.node.node_id for n in hits)
    index2 = load_index_from_storage(StorageContext.from_defaults(persist_dir=str(tmp_path / "storage"),
                                                                  vector_store=reloaded), embed_model=li_embed())
    again = index2.as_retriever(similarity_top_k=10).retrieve(CATS)
    assert [(n.node.node_id, round(n.score, 5)) for n in again] == [(n.node.node_id, round(n.score, 5)) for n in hits]
    assert again[0].node.text == CORPUS["cats"] and again[0].node.ref_doc_id == "cats"
    reloaded.clear()
    assert engine2.document_ids() == [] and reloaded.get_nodes() == []


def test_llamaindex_vector_store_over_a_core_store_and_its_refusals():
    store = FaissDocumentStore(embedder())
    store.upsert(corpus_documents())
    vector_store = LIFaissVectorStore(store)
    nodes = vector_store.get_nodes(["dogs", "stars", "nope"])
    assert [(n.node_id, n.text) for n in nodes] == [("dogs", CORPUS["dogs"]), ("stars", CORPUS["stars"])]
    index = VectorStoreIndex.from_vector_store(vector_store, embed_model=li_embed())
    assert [n.node.node_id for n in index.as_retriever(similarity_top_k=2).retrieve(CATS)] == \
        [k for k, _ in reference_ranking(CATS, CORPUS)[:2]]
    with pytest.raises(ValueError, match="has no embedding"):
        vector_store.add([LIDocument(id_="x", text="no vector")])
    with pytest.raises(ValueError, match="needs node_ids or filters"):
        vector_store.delete_nodes()
    vector_store.delete_nodes(["dogs", "nope"])
    assert "dogs" not in store and len(store) == 3


# --- LangChain ------------------------------------------------------------------------------------
def test_langchain_vector_store_registers_texts_round_trips_and_deletes(tmp_path):
    engine = tiny_engine()
    store = LCFaissVectorStore.from_documents([LCDocument(id=k, page_content=v, metadata={"topic": k})
                                               for k, v in CORPUS.items()], lc_embed(), engine=engine)
    hits = store.similarity_search_with_score(CATS, k=10)
    ref = reference_ranking(CATS, CORPUS)
    assert [(d.id, d.page_content, d.metadata) for d, _ in hits] == [(k, CORPUS[k], {"topic": k}) for k, _ in ref]
    assert np.allclose([s for _, s in hits], [s for _, s in ref], atol=1e-5)
    assert engine.document_texts() == CORPUS
    assert [d.id for d in store.similarity_search(CATS, k=3, filter={"topic": "stars"})] == ["stars"]

    new = "Volcanoes erupt when magma pressure rises."
    assert store.add_texts([new], [{"topic": "volcano"}], ids=["rivers"]) == ["rivers"]  # upsert, same id
    assert engine.document_texts()["rivers"] == new
    [(top, score)] = store.similarity_search_with_score("Why do volcanoes erupt?", k=1)
    assert top.id == "rivers" and score == pytest.approx(reference_ranking("Why do volcanoes erupt?",
                                                                           {"r": new})[0][1], abs=1e-5)
    [fresh] = store.add_texts(["Comets grow tails near the sun."])
    assert engine.has_document(fresh) and len(fresh) == 36  # a UUID

    spy = StreamSpy(engine)
    out = rag_chain(store.as_retriever(search_kwargs={"k": 2}), ChatLazyAttention(engine=engine, sampling=GREEDY)) \
        .invoke(CATS)
    assert [d.id for d in out["sources"]] == spy.last["doc_ids"] == [d.id for d in store.similarity_search(CATS, 2)]
    assert spy.last["doc_ids"][0] == "cats"

    assert store.delete(["nope"]) is True  # LangChain's contract: deleting what is not there is no error
    assert engine.has_document("cats")
    store.delete(["cats", "nope"])
    assert not engine.has_document("cats") and store.get_by_ids(["cats", "dogs"])[0].id == "dogs"
    assert "cats" not in [d.id for d in store.similarity_search(CATS, k=10)]

    store.save_local(tmp_path / "lc")
    engine2 = tiny_engine()
    loaded = LCFaissVectorStore.load_local(tmp_path / "lc", lc_embed(), engine=engine2)
    assert sorted(engine2.document_ids()) == sorted(["dogs", "rivers", "stars", fresh])
    assert [(d.id, round(s, 5)) for d, s in loaded.similarity_search_with_score(CATS, k=4)] == \
        [(d.id, round(s, 5)) for d, s in store.similarity_search_with_score(CATS, k=4)]
    loaded.delete()
    assert engine2.document_ids() == [] and loaded.similarity_search(CATS) == []


# --- wrong dimensions -----------------------------------------------------------------------------
def test_wrong_dimension_is_a_clear_error_on_every_path(tmp_path):
    li_128, lc_128 = truncated_embeddings()
    assert len(lc_128.embed_query(CATS)) == 128  # a real embedder of another dimension
    message = r"128 dimensions, but this index holds 384-dimensional vectors from 'all-MiniLM-L6-v2'"
    engine = tiny_engine()
    core = FaissDocumentStore(embedder(), engine=engine)
    core.upsert(corpus_documents())
    before = engine.document_ids()

    # core store: vectors on add, a query vector
    with pytest.raises(EmbeddingDimensionError, match=message):
        core.upsert([Document("new", "New text.")], vectors=np.ones((1, 128)))
    with pytest.raises(EmbeddingDimensionError, match=message):
        core.search_vector(lc_128.embed_query(CATS), 2)

    # LangChain: the embeddings named on add and on query; nothing changes
    lc_store = LCFaissVectorStore(lc_128, store=core)
    with pytest.raises(EmbeddingDimensionError, match=message) as err:
        lc_store.add_texts(["Comets grow tails near the sun."], ids=["comets"])
    assert str(err.value).startswith("the embeddings from 'all-MiniLM-L6-v2': 128")  # the adding model
    with pytest.raises(EmbeddingDimensionError, match=message):
        lc_store.similarity_search(CATS)
    with pytest.raises(EmbeddingDimensionError, match=message):
        lc_store.as_retriever().invoke(CATS)

    # LlamaIndex: insert through an index whose embed model is the 128-dim one, and query
    index = VectorStoreIndex.from_vector_store(LIFaissVectorStore(core), embed_model=li_128)
    with pytest.raises(EmbeddingDimensionError, match=message):
        index.insert(LIDocument(id_="comets", text="Comets grow tails near the sun."))
    with pytest.raises(EmbeddingDimensionError, match=message):
        index.as_retriever().retrieve(CATS)

    assert engine.document_ids() == before and len(core) == 4 and core.index.ntotal == 4

    # a fresh store takes the first vectors' dimension and holds every later batch to it
    fresh = LCFaissVectorStore(lc_128)
    fresh.add_texts([CORPUS["cats"]], ids=["cats"])
    with pytest.raises(EmbeddingDimensionError, match="384 dimensions, but this index holds 128-dimensional"):
        LCFaissVectorStore(lc_embed(), store=fresh.store).add_texts(["Dogs bark."])
    core.save(tmp_path / "idx")
    with pytest.raises(ValueError, match="built with 'all-MiniLM-L6-v2'"):
        FaissDocumentStore.load(tmp_path / "idx", embedder_name="other-model")


# --- a change the engine refuses leaves store and engine as they were ----------------------------
A, B, C, TOO_LONG = words(10, 0), words(10, 20), words(8, 60), words(80, 100)  # the engine's context: 64


def refuse_removing(engine, monkeypatch, refused: str) -> None:
    """``engine.remove_document(refused)`` fails as a shut-down engine's does; other ids go."""
    remove = engine.remove_document

    def remove_document(doc_id):
        if doc_id == refused:
            raise RuntimeError("the engine loop is shut down")
        remove(doc_id)

    monkeypatch.setattr(engine, "remove_document", remove_document)


def li_node(node_id: str, text: str):
    from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode

    return TextNode(id_=node_id, text=text, embedding=bow_vector(text),
                    relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id="source")})


def test_llamaindex_vector_store_adds_and_deletes_all_or_none(tmp_path, monkeypatch):
    from llama_index.core.vector_stores.types import VectorStoreQuery

    engine = tiny_engine(max_model_len=64)
    vector_store = LIFaissVectorStore(engine=engine, embed_model_name="bow")
    vector_store.add([li_node("a", A), li_node("b", B)])

    def assert_holds_a_and_b(where):
        assert [(n.node_id, n.text) for n in vector_store.get_nodes()] == [("a", A), ("b", B)]
        assert vector_store.client.index.ntotal == 2 and engine.document_texts() == {"a": A, "b": B}
        for node_id, text in (("a", A), ("b", B)):
            hit = vector_store.query(VectorStoreQuery(query_embedding=bow_vector(text), similarity_top_k=1))
            assert hit.ids == [node_id] and hit.similarities[0] == pytest.approx(1.0, abs=1e-6)
        vector_store.persist(str(tmp_path / where))
        loaded = LIFaissVectorStore.from_persist_path(tmp_path / where)
        assert [(n.node_id, n.text) for n in loaded.get_nodes()] == [("a", A), ("b", B)]

    with pytest.raises(DocumentTooLongError, match="'a' has 80 tokens"):
        vector_store.add([li_node("a", TOO_LONG)])
    assert_holds_a_and_b("single")
    with pytest.raises(DocumentTooLongError, match="'a' has 80 tokens"):
        vector_store.add([li_node("b", C), li_node("c", C), li_node("a", TOO_LONG)])
    assert_holds_a_and_b("batch")

    refuse_removing(engine, monkeypatch, "b")
    for delete in (lambda: vector_store.delete_nodes(["a", "b"]), lambda: vector_store.delete("source"),
                   vector_store.clear):
        with pytest.raises(RuntimeError, match="shut down"):
            delete()
        assert_holds_a_and_b("delete")


def test_llamaindex_update_ref_doc_deletes_before_it_inserts():
    """LlamaIndex's ``update_ref_doc`` (and ``refresh_ref_docs``) is two calls to the vector store,
    delete then add: when the engine refuses the new text, the old nodes are already gone (as
    docs/integrations.md says); store and engine still agree with each other."""
    engine = tiny_engine(max_model_len=64)
    vector_store = LIFaissVectorStore(engine=engine, embed_model_name="bow")
    index = VectorStoreIndex.from_vector_store(vector_store, embed_model=bow_llamaindex_embedding())
    index.insert_nodes([li_node("a", A)])
    with pytest.raises(DocumentTooLongError):
        index.update_ref_doc(LIDocument(id_="source", text=TOO_LONG))
    assert vector_store.get_nodes() == [] and vector_store.client.index.ntotal == 0
    assert engine.document_ids() == []


def test_langchain_vector_store_adds_and_deletes_all_or_none(tmp_path, monkeypatch):
    engine = tiny_engine(max_model_len=64)
    store = LCFaissVectorStore.from_texts([A, B], bow_langchain_embeddings(), ids=["a", "b"], engine=engine)

    def assert_holds_a_and_b(where):
        assert [(d.id, d.page_content) for d in store.get_by_ids(["a", "b", "c"])] == [("a", A), ("b", B)]
        assert store.store.index.ntotal == 2 and engine.document_texts() == {"a": A, "b": B}
        for doc_id, text in (("a", A), ("b", B)):
            [(top, score)] = store.similarity_search_with_score(text, k=1)
            assert top.id == doc_id and score == pytest.approx(1.0, abs=1e-6)
        store.save_local(tmp_path / where)
        loaded = LCFaissVectorStore.load_local(tmp_path / where, bow_langchain_embeddings())
        assert [d.id for d in loaded.get_by_ids(["a", "b", "c"])] == ["a", "b"]

    with pytest.raises(DocumentTooLongError, match="'a' has 80 tokens"):
        store.add_texts([TOO_LONG], ids=["a"])
    assert_holds_a_and_b("single")
    with pytest.raises(DocumentTooLongError, match="'a' has 80 tokens"):
        store.add_documents([LCDocument(id="b", page_content=C), LCDocument(id="c", page_content=C),
                             LCDocument(id="a", page_content=TOO_LONG)])
    assert_holds_a_and_b("batch")

    refuse_removing(engine, monkeypatch, "b")
    for delete in (lambda: store.delete(["a", "b"]), store.delete):
        with pytest.raises(RuntimeError, match="shut down"):
            delete()
        assert_holds_a_and_b("delete")


# --- embedding truncation is visible --------------------------------------------------------------
LONG = ("Cats purr when they are content. " + "Their whiskers sense the air around them. " * 40
        + "The treasure is buried under the old oak tree.")


def truncation_messages(record) -> list[str]:
    return [str(w.message) for w in record if w.category is EmbeddingTruncationWarning]


def test_the_embedding_helpers_warn_for_every_text_they_cut():
    n = len(embedder().tokenizer(LONG)["input_ids"])  # with [CLS] and [SEP], as the model counts
    assert n > embedder().max_seq_length == 256
    said = f"all-MiniLM-L6-v2 reads at most 256 tokens but the text 'Cats purr when they are content. Their whiskers ...' " \
           f"has {n}: only its first 256 are embedded"

    # LlamaIndex: VectorStoreIndex over the FAISS vector store, documents taken as nodes
    with pytest.warns(EmbeddingTruncationWarning) as record:
        VectorStoreIndex.from_documents([LIDocument(id_="long", text=LONG), LIDocument(id_="cats", text=CORPUS["cats"])],
                                        storage_context=StorageContext.from_defaults(vector_store=LIFaissVectorStore()),
                                        embed_model=li_embed(), transformations=[])
    assert [m[:len(said)] for m in truncation_messages(record)] == [said]

    # LangChain: the FAISS VectorStore and the embeddings themselves
    with pytest.warns(EmbeddingTruncationWarning) as record:
        LCFaissVectorStore.from_texts([CORPUS["cats"], LONG], lc_embed(), ids=["cats", "long"])
    assert [m[:len(said)] for m in truncation_messages(record)] == [said]
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmbeddingTruncationWarning)
        li_embed().get_text_embedding_batch([CORPUS["cats"], CORPUS["dogs"]])  # texts that fit: no warning
        lc_embed().embed_documents([CORPUS["cats"]])

    # the helpers' classes are the frameworks' (subclasses), pickled by reference like them
    from langchain_huggingface import HuggingFaceEmbeddings
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    assert isinstance(li_embed(), HuggingFaceEmbedding) and isinstance(lc_embed(), HuggingFaceEmbeddings)
    assert li_embed().class_name() == "HuggingFaceEmbedding"
    for cls in (type(li_embed()), type(lc_embed())):
        assert pickle.loads(pickle.dumps(cls)) is cls
