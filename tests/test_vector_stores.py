"""The FAISS store as the frameworks' own types (a LlamaIndex vector store, a LangChain VectorStore),
with the frameworks' embedding classes over the offline MiniLM: round trips, the attached engine kept
in step, wrong-dimension errors."""

import functools

import numpy as np
import pytest
from langchain_core.documents import Document as LCDocument
from llama_index.core import Document as LIDocument
from llama_index.core import StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.core.schema import MetadataMode
from llama_index.core.vector_stores import MetadataFilter, MetadataFilters

from lazyattn_rag import Document
from lazyattn_rag.integrations.embeddings import (
    default_embedding_model_path,
    langchain_embeddings,
    llamaindex_embedding,
)
from lazyattn_rag.integrations.faiss_store import EmbeddingDimensionError, FaissDocumentStore
from lazyattn_rag.integrations.langchain import ChatLazyAttention, rag_chain
from lazyattn_rag.integrations.langchain_store import FaissVectorStore as LCFaissVectorStore
from lazyattn_rag.integrations.llamaindex_store import FaissVectorStore as LIFaissVectorStore
from tests.integrations_kit import CORPUS, GREEDY, StreamSpy, corpus_documents, embedder, tiny_engine

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
