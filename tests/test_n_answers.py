"""Several answers from one prompt (``SamplingParams.n``, issue 40): the prompt is computed once and
forked after its first token (``engine/scheduling/forks.py``); each answer must equal the same
request sampled alone (its own seed ``seed + i``), which is the reference here."""

import dataclasses

import pytest

from lazyattn_rag import SamplingParams, StructuredOutputParams
from tests.observe import assert_no_leak
from tests.tiny import words

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture
def llm(make_llm):
    _, llm = make_llm()
    for i in range(3):
        llm.add_document(f"d{i}", words(21 + 8 * i, start=10 + 17 * i))  # prompts end inside blocks and on them
    return llm


def alone(llm, question, doc_ids, params, i):
    """Answer ``i`` of ``params`` as a request of its own."""
    seed = None if params.seed is None else params.seed + i
    return llm.generate(question, doc_ids, sampling=dataclasses.replace(params, n=1, seed=seed))


@pytest.mark.parametrize("question", ["w1", "w1 w2 w3", words(16, start=200)])
def test_each_answer_equals_that_answer_sampled_alone(llm, question):
    params = SamplingParams(max_tokens=12, ignore_eos=True, n=4, temperature=1.0, seed=7)
    out = llm.generate(question, ["d2", "d0"], sampling=params)
    answers = [out, *out.alternatives]
    assert [a.token_ids for a in answers] == [alone(llm, question, ["d2", "d0"], params, i).token_ids
                                             for i in range(4)]
    assert len({tuple(a.token_ids) for a in answers}) == 4  # four seeds, four samples
    greedy = llm.generate(question, ["d1"], sampling=dataclasses.replace(GREEDY, n=3))
    assert [a.token_ids for a in greedy.alternatives] == [greedy.token_ids] * 2
    assert greedy.token_ids == llm.generate(question, ["d1"], sampling=GREEDY).token_ids
    assert_no_leak(llm)


def test_the_prompt_is_computed_once(llm):
    llm.generate("w5", ["d0", "d1"], sampling=GREEDY)  # the documents are cached from here on
    before = llm.stats()["num_computed_prompt_tokens"]
    one = llm.generate("w6 w7", ["d1", "d0"], sampling=GREEDY)
    after_one = llm.stats()["num_computed_prompt_tokens"]
    three = llm.generate("w6 w8", ["d1", "d0"], sampling=dataclasses.replace(GREEDY, n=3))
    assert llm.stats()["num_computed_prompt_tokens"] - after_one == after_one - before == one.stats.num_computed_tokens
    assert [a.stats.num_computed_tokens for a in three.alternatives] == [0, 0]
    assert all(a.stats.num_cached_tokens == a.stats.num_prompt_tokens for a in three.alternatives)
    assert all(a.stats.docs_hit == ["d1", "d0"] for a in three.alternatives)
    stats = llm.stats()  # the three answers are one request, its prompt counted once
    assert stats["num_requests_finished"] == 3 and stats["latency"]["ttft"]["count"] == 3
    assert stats["num_output_tokens"] == sum(len(a.token_ids) for a in [three, *three.alternatives]) + 2 * 12
    assert_no_leak(llm)


def test_chat_messages_and_one_token_answers(llm):
    messages = [{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w9"},
                {"role": "user", "content": "w5"}]
    params = SamplingParams(max_tokens=6, ignore_eos=True, n=3, temperature=1.0, seed=11)
    out = llm.chat(messages, sampling=params)
    for i, answer in enumerate([out, *out.alternatives]):
        single = llm.chat(messages, sampling=dataclasses.replace(params, n=1, seed=11 + i))
        assert answer.token_ids == single.token_ids
    short = llm.generate("w1", ["d0"], sampling=SamplingParams(max_tokens=1, n=3, temperature=1.0, seed=1))
    assert [len(a.token_ids) for a in [short, *short.alternatives]] == [1, 1, 1]
    assert_no_leak(llm)


def test_a_stream_tags_answers_and_closing_it_frees_them_all(llm):
    params = dataclasses.replace(GREEDY, n=3, max_tokens=30)
    deltas = list(llm.stream("w1", ["d0"], sampling=params))
    assert sorted(d.index for d in deltas if d.finished) == [0, 1, 2]
    assert {d.index for d in deltas} == {0, 1, 2}
    stream = llm.stream("w2", ["d1"], sampling=params)
    next(stream)
    stream.close()
    assert_no_leak(llm)


def test_forks_under_preemption_and_with_selective_recompute_match_alone(make_llm):
    _, llm = make_llm(num_blocks=14)  # four answers of 40 tokens do not fit at once: some are preempted
    llm.add_document("d", words(30, start=40))
    params = SamplingParams(max_tokens=40, ignore_eos=True, n=4, temperature=1.0, seed=3)
    out = llm.generate("w1 w2", ["d"], sampling=params)
    assert llm.stats()["num_preemptions"] > 0
    assert [a.token_ids for a in [out, *out.alternatives]] == [alone(llm, "w1 w2", ["d"], params, i).token_ids
                                                              for i in range(4)]
    assert_no_leak(llm)
    _, selective = make_llm(recompute_selective_ratio=0.2)  # the selected tokens' blocks are the request's own:
    selective.add_document("d", words(30, start=40))  # its other answers compute the prompt themselves
    out = selective.generate("w1", ["d"], sampling=dataclasses.replace(params, max_tokens=8))
    assert [a.token_ids for a in [out, *out.alternatives]] == [
        alone(selective, "w1", ["d"], dataclasses.replace(params, max_tokens=8), i).token_ids for i in range(4)]
    assert_no_leak(selective)


def test_n_is_checked_and_the_wrappers_do_not_take_it():
    from lazyattn_rag.integrations.call_options import SAMPLING_FIELDS
    from lazyattn_rag.types.wire import sampling_to_body

    for bad in (0, 129, 2.0, True):
        with pytest.raises(ValueError, match="n must be an integer in"):
            SamplingParams(n=bad)
    assert "n" not in SAMPLING_FIELDS
    with pytest.raises(ValueError, match="n=2: this client asks for one answer"):
        sampling_to_body(SamplingParams(n=2))


def test_structured_answers_fork_with_their_own_matchers(smollm2):
    params = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=2,
                            structured_output=StructuredOutputParams(choice=["red", "green", "blue"]))
    out = smollm2.chat([{"role": "user", "content": "Name a colour."}], sampling=params)
    assert all(a.text in ("red", "green", "blue") and a.finish_reason == "stop" for a in [out, *out.alternatives])
