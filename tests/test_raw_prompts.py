"""Raw prompts (``LazyAttention.stream_prompt``/``complete``; the server's ``/v1/completions``): text in
the caller's own template, computed whole, or text and document parts placing cached chunks, against
the transformers oracle."""

import functools

import pytest

from lazyattn_rag import Document, SamplingParams
from lazyattn_rag.types.errors import EmptyInputError, UnknownDocumentError
from lazyattn_rag.types.messages import DocumentRef
from tests.oracle import full_prefill_generate, plan_oracle
from tests.tiny import words

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def make_llm(make_llm):
    return functools.partial(make_llm, anchor="none")


def parts():
    """A raw RAG prompt: instruction, document a, a line, document b, the question."""
    return ["w100 w101 Context : ", DocumentRef("a"), "w150 w151 ", DocumentRef("b"), "Question : w5 w6 Answer :"]


def register(llm):
    llm.add_document("a", words(17, start=3))
    llm.add_document("b", words(33, start=40))


def test_a_raw_prompt_places_documents_from_their_chunks_as_the_oracle_computes_it(make_llm):
    hf, llm = make_llm()
    register(llm)
    plan = llm.engine.planner.plan_raw(parts())
    head = llm.tokenizer("w100 w101 Context :")["input_ids"]  # BOS where the tokenizer adds one, as a raw prompt
    assert [c.doc_id for c in plan.chunks] == [None, "a", "b"] and plan.chunks[0].token_ids == tuple(head)
    assert [list(t.token_ids) for t in plan.texts] == [llm.tokenizer("w150 w151", add_special_tokens=False)["input_ids"]]
    assert list(plan.query_token_ids) == llm.tokenizer("Question : w5 w6 Answer :", add_special_tokens=False)[
        "input_ids"]
    out = llm.complete(parts(), GREEDY)
    tokens, _ = plan_oracle(hf, plan, list(llm.engine.planner.anchor_ids), GREEDY.max_tokens)
    assert out.token_ids == tokens and out.stats.docs_missed == ["a", "b"]
    again = llm.complete(parts(), GREEDY)
    assert again.token_ids == tokens and again.stats.docs_hit == ["a", "b"]
    assert again.stats.num_computed_tokens == plan.num_text_tokens + len(plan.query_token_ids)
    llm.engine.cache.check_integrity()


def test_a_raw_prompt_without_documents_is_the_tokenizers_prompt_with_its_prefix_cached(make_llm):
    hf, llm = make_llm(prefix_caching=True)
    text = "w1 w2 " + words(40, start=10)
    assert llm.engine.planner.plan_raw([text]).query_token_ids == llm.engine.planner.plan_prompt(text).query_token_ids
    ids = llm.tokenizer(text)["input_ids"]
    first = llm.complete([text], GREEDY)
    assert first.token_ids == full_prefill_generate(hf, ids, GREEDY.max_tokens)[0]
    again = llm.complete(text, GREEDY, namespace="")
    assert again.token_ids == first.token_ids and again.stats.num_cached_tokens > 0
    other = llm.complete(text, GREEDY, namespace="team-b")  # another tenant's prefixes are not shared
    assert other.token_ids == first.token_ids and other.stats.num_cached_tokens == 0


def test_inline_documents_register_with_the_request_and_bad_parts_are_named(make_llm):
    _, llm = make_llm()
    out = llm.complete(["w9 ", DocumentRef("x"), "w8"], GREEDY, documents=[Document("x", words(12, start=9))],
                       namespace="ns")
    assert out.stats.docs_missed == ["x"] and llm.has_document("x", "ns") and not llm.has_document("x")
    with pytest.raises(UnknownDocumentError, match="'y'"):
        llm.complete(["w9 ", DocumentRef("y"), "w8"], GREEDY)
    with pytest.raises(ValueError, match="token ids must be integers"):  # neither parts nor token ids
        llm.complete(["w9 ", 3], GREEDY)
    with pytest.raises(EmptyInputError, match="ends with a document"):
        llm.complete(["w9 ", DocumentRef("x")], GREEDY, namespace="ns")
    llm.engine.cache.check_integrity()
