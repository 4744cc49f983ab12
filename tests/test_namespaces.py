"""Namespaces through both framework wrappers (issue 17, item 5): a wrapper's ``namespace=`` keeps
its documents, and their cached K/V, apart from every other tenant's, on the id path and on the
formatted-prompt path, even for identical ids and text."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document as LCDocument
from langchain_core.messages import HumanMessage

from lazyattn_rag import Document
from lazyattn_rag.integrations.langchain import ChatLazyAttention
from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM
from tests.integrations_kit import GREEDY, tiny_engine
from tests.tiny import words

TEXT = words(40, start=60)


@pytest.fixture
def engine():
    llm = tiny_engine()
    yield llm
    llm.close()


def langchain_stats(model: ChatLazyAttention, **kwargs) -> dict:
    doc = LCDocument(page_content=TEXT, id="doc")
    return model.invoke([HumanMessage("w5 w6")], documents=[doc], **kwargs).response_metadata["lazyattn"]["stats"]


def test_langchain_tenants_never_share_a_document(engine):
    a, b = ChatLazyAttention(engine, GREEDY, namespace="a"), ChatLazyAttention(engine, GREEDY, namespace="b")
    assert langchain_stats(a)["docs_missed"] == ["doc"]
    assert langchain_stats(b)["docs_missed"] == ["doc"]  # same id, same text: computed again for b
    assert langchain_stats(a)["docs_hit"] == ["doc"] and langchain_stats(b)["docs_hit"] == ["doc"]
    assert engine.has_document("doc", "a") and engine.has_document("doc", "b") and not engine.has_document("doc")
    assert engine.stats()["num_cached_chunks"] == 4  # the anchor, the prompt head, one chunk per tenant


def test_llamaindex_tenants_never_share_a_document(engine):
    a, b = LazyAttentionLLM(engine, GREEDY, namespace="a"), LazyAttentionLLM(engine, GREEDY, namespace="b")
    stats = [list(llm.stream_rag("w5 w6", [Document("doc", TEXT)]))[-1].stats for llm in (a, b, a)]
    assert [s.docs_missed for s in stats] == [["doc"], ["doc"], []] and stats[2].docs_hit == ["doc"]
    assert engine.document_ids("a") == engine.document_ids("b") == ["doc"] and engine.document_ids() == []


def test_the_prompt_matcher_finds_only_its_own_tenants_documents(engine):
    """A formatted prompt holding a document's text: the tenant that registered it places it from
    the cache; another tenant's wrapper finds nothing to reuse (the text is its own tokens)."""
    engine.add_document("doc", TEXT, namespace="a")
    prompt = f"Context information is below.\n{TEXT}\nGiven the context information, answer: w5 w6"
    owner = ChatLazyAttention(engine, GREEDY, namespace="a").invoke(prompt).response_metadata["lazyattn"]
    other = ChatLazyAttention(engine, GREEDY, namespace="b").invoke(prompt).response_metadata["lazyattn"]
    assert owner["doc_ids"] == ["doc"] and other["doc_ids"] == []


def test_a_malformed_namespace_is_refused_by_the_wrapper():
    with pytest.raises(ValueError, match="namespace"):
        ChatLazyAttention(namespace="has spaces")
    with pytest.raises(ValueError, match="namespace"):
        LazyAttentionLLM(namespace="x" * 129)
