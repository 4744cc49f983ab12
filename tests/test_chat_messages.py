"""Chat messages that place documents by id: text between documents is computed by the request.

The reference is the transformers oracle (``tests/oracle.py``): documents encoded alone and
rotated to their offsets, the head and every text segment run by the HF model after everything
before them.
"""

import functools

import pytest

from lazyattn_rag import (
    Document,
    DocumentRef,
    EmptyInputError,
    Message,
    PromptTooLongError,
    SamplingParams,
    UnknownDocumentError,
)
from lazyattn_rag.engine.planning.prompt_plan import TextSegment
from tests.observe import StepLog
from tests.oracle import full_prefill_generate, plan_oracle
from tests.tiny import words

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def make_llm(make_llm):
    return functools.partial(make_llm, anchor="none")


def rag_messages(texts=("w150 w151", "w152 " + words(20, 160), "w185 w186")):
    """A system turn, then a user turn: text, doc a, text, doc b, text, doc a again, the question."""
    return [Message("system", "w100 w101 w102"),
            Message("user", (texts[0] + " ", DocumentRef("a"), texts[1] + " ", DocumentRef("b"),
                             texts[2] + " ", DocumentRef("a"), "Question : w5 w6"))]


def register(llm):
    llm.add_document("a", words(17, start=3))
    llm.add_document("b", words(33, start=40))


@pytest.mark.parametrize("anchor", ["none", "bos", "head"])
def test_text_between_documents_matches_the_oracle(make_llm, anchor):
    hf, llm = make_llm(anchor=anchor)
    register(llm)
    messages = rag_messages()
    plan = llm.plan_chat(messages)
    assert [c.doc_id for c in plan.chunks] == [None, "a", "b", "a"]
    assert [len(t.token_ids) for t in plan.texts] == [21, 2]
    assert all(isinstance(t, TextSegment) for t in plan.texts)
    head = llm.tokenizer("system: w100 w101 w102\nuser: w150 w151")["input_ids"]
    assert plan.chunks[0].delta == 0 and plan.chunks[0].token_ids == tuple(head)
    steps = StepLog(llm, logits=True)
    out = llm.chat(messages, sampling=GREEDY)
    tokens, first = plan_oracle(hf, plan, list(llm.engine.planner.anchor_ids), GREEDY.max_tokens)
    assert out.token_ids == tokens
    assert (steps.logits[-GREEDY.max_tokens][-1] - first).abs().max().item() <= 1e-4
    assert out.stats.num_cached_tokens == 17  # everything was cold; "a" is encoded once for both places
    again = llm.chat(messages, sampling=GREEDY)
    assert again.token_ids == tokens
    assert again.stats.docs_hit == ["a", "b", "a"]
    assert again.stats.num_computed_tokens == plan.num_text_tokens + len(plan.query_token_ids)
    llm.engine.cache.check_integrity()


@pytest.mark.parametrize("budget", [7, 16, 33])
def test_text_segments_split_across_steps_and_block_boundaries(make_llm, budget):
    """Private text of 1, 16, 17 and 40 tokens, prefilled in pieces of ``budget`` tokens a step."""
    hf, llm = make_llm(anchor="bos", max_num_batched_tokens=budget)
    register(llm)
    for i, n in enumerate((1, 16, 17, 40)):
        messages = rag_messages(("w150", words(n, start=100 + i), "w185"))
        plan = llm.plan_chat(messages)
        assert len(plan.texts[0].token_ids) == n
        out = llm.chat(messages, sampling=GREEDY)
        tokens, _ = plan_oracle(hf, plan, list(llm.engine.planner.anchor_ids), GREEDY.max_tokens)
        assert out.token_ids == tokens, n
    llm.engine.cache.check_integrity()


def test_full_mode_runs_the_same_prompt_as_a_full_prefill(make_llm):
    hf, llm = make_llm(mode="full")
    register(llm)
    plan = llm.plan_chat(rag_messages())
    assert plan.chunks == () and plan.texts == ()
    out = llm.chat(rag_messages(), sampling=GREEDY)
    tokens, _ = full_prefill_generate(hf, list(plan.query_token_ids), GREEDY.max_tokens)
    assert out.token_ids == tokens


def test_block_attention_mode_keeps_text_segments(make_llm):
    hf, llm = make_llm(mode="block_attention")
    register(llm)
    plan = llm.plan_chat(rag_messages())
    assert [len(t.token_ids) for t in plan.texts] == [21, 2]
    out = llm.chat(rag_messages(), sampling=GREEDY)
    tokens, _ = plan_oracle(hf, plan, [], GREEDY.max_tokens)  # positioned copies: encoded at their offsets
    assert out.token_ids == tokens


def test_messages_without_documents_are_a_plain_prompt_and_inline_documents_register(make_llm):
    from lazyattn_rag import Document

    hf, llm = make_llm()
    plain = llm.plan_chat([("user", "w1 w2 w3")])
    assert plain.chunks == () and list(plain.query_token_ids) == llm.tokenizer("user: w1 w2 w3 \nassistant:")[
        "input_ids"]
    out = llm.chat([{"role": "user", "content": ["w9 ", {"type": "document", "id": "x"}, "w8"]}],
                   documents=[Document("x", words(12, start=9))], sampling=GREEDY)
    assert out.stats.docs_missed == ["x"] and llm.has_document("x")


def test_preempted_request_with_text_segments_recomputes_the_same_answer(make_llm):
    hf, llm = make_llm(anchor="none", num_blocks=28)  # 6 blocks of chunks, 4 a request at admission, 5 to finish
    register(llm)
    alone = llm.chat(rag_messages(), sampling=SamplingParams(max_tokens=20, ignore_eos=True))
    streams = [llm.stream_chat(rag_messages(), sampling=SamplingParams(max_tokens=20, ignore_eos=True))
               for _ in range(6)]
    outs = [[d.token_id for d in s if d.token_id is not None] for s in streams]
    assert all(o == alone.token_ids for o in outs)
    assert llm.stats()["num_preemptions"] > 0
    llm.engine.cache.check_integrity()


def test_bad_messages_get_specific_errors_and_leave_the_cache_clean(make_llm):
    hf, llm = make_llm(anchor="none", model_config=dict(max_position_embeddings=128))
    register(llm)
    with pytest.raises(UnknownDocumentError, match="'nope'"):
        llm.chat([("user", ("w1 ", DocumentRef("nope"), "w2"))])
    with pytest.raises(ValueError, match="role must be one of"):
        llm.chat([("robot", "w1")])
    with pytest.raises(ValueError, match="unsupported message content part"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    with pytest.raises(EmptyInputError, match="no messages"):
        llm.chat([])
    with pytest.raises(PromptTooLongError, match="context limit is 128"):
        llm.chat([("user", (DocumentRef("b"), words(60), DocumentRef("b"), DocumentRef("a"), "w1"))])
    cache = llm.engine.cache
    cache.check_integrity()
    assert all(e.pin_count == 0 for e in cache.entries() if e.key != llm.engine.planner.anchor_key)


def test_a_refused_inline_update_keeps_the_registered_documents_cached_kv(make_llm):
    """``stream_chat(messages, documents=[Document("x", new_text)])`` whose plan is refused
    (here: too long) restores "x"'s registration ("all or none"), but the temporary rebinding
    already marked the old entry dead and dropped it: the next request misses "x" and re-encodes
    it. A failed call should change nothing, K/V included."""
    hf, llm = make_llm(anchor="none", num_blocks=64, model_config=dict(max_position_embeddings=200))
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.add_document("x", words(20, 0))
    first = llm.chat([("user", ("w1 ", DocumentRef("x"), "w2"))], sampling=sp)
    assert first.stats.docs_missed == ["x"]
    with pytest.raises(PromptTooLongError):
        llm.chat([("user", ("w1 ", DocumentRef("x"), words(190), "w2"))],
                 documents=[Document("x", words(20, 50))], sampling=sp)
    assert llm.engine.documents["x"].text == words(20, 0)  # registration restored
    again = llm.chat([("user", ("w1 ", DocumentRef("x"), "w2"))], sampling=sp)
    assert again.stats.docs_hit == ["x"], "the refused call dropped x's cached K/V"
