"""Documents removed or changed while requests that planned them are queued, acquiring or running.

A request keeps reading the content it was planned with (cache keys are content hashes, so a
dead entry still holds exactly that content); other requests never notice; nothing leaks.
Found by an adversarial pass over the engine; each test failed before its fix.
"""

import functools

import pytest

from lazyattn_rag import PromptConfig, SamplingParams, UnknownDocumentError
from tests.tiny import words

LONG = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture
def make_llm(make_llm):
    return functools.partial(make_llm, anchor="none", max_num_seqs=8, max_num_batched_tokens=512)


def tokens(sink) -> list[int]:
    errors = [x for x in sink if isinstance(x, BaseException)]
    assert not errors, errors
    return [d.token_id for d in sink if d.token_id is not None]


def assert_clean(llm):
    def check():
        engine = llm.engine
        engine.cache.check_integrity()
        assert not engine.has_unfinished() and not engine.outputs.requests
        held = [e for e in engine.cache.entries() if e.pin_count and e.key != engine.planner.anchor_key]
        assert not held, held
        pool = engine.cache.pool
        assert pool.num_free + engine.cache.num_cached_blocks == pool.num_blocks

    llm.loop.call(check)


@pytest.mark.parametrize("mode", ["lazy", "block_attention"])
@pytest.mark.parametrize("change", ["remove", "new_text"])
def test_document_changed_between_its_encode_and_the_prefill(make_llm, mode, change):
    """A 20-token step budget fits the encode of "A" but not the query prefill that would
    otherwise join it in the same step, so the prefill runs a step later."""
    _, llm = make_llm(mode=mode, max_num_batched_tokens=20)
    llm.add_document("A", words(20, start=3))
    expected = llm.generate("w1", ["A"], sampling=LONG).token_ids
    llm.remove_document("A")
    llm.add_document("A", words(20, start=3))  # cold again
    engine, sink = llm.engine, []

    def scenario():
        request = engine.submit(engine.planner.plan("w1", ["A"]), LONG, sink.append)
        engine.step()  # encodes "A"; the request's prefill did not fit this step, so it waits for the next
        assert request.status.value == "acquired"
        if change == "remove":
            engine.documents.remove("A")
        else:
            engine.documents.add([("A", words(20, start=50))])
        while engine.has_unfinished():
            engine.step()

    llm.loop.call(scenario)
    assert tokens(sink) == expected  # read the content it was planned with
    assert_clean(llm)


def test_queued_request_over_a_removed_document_reads_the_entry_others_still_hold(make_llm):
    _, llm = make_llm(max_num_seqs=2)
    llm.add_document("A", words(20, start=3))
    expected = llm.generate("w1", ["A"], sampling=LONG).token_ids
    running = llm.stream("w1", ["A"], sampling=LONG)
    short = llm.stream("w1", ["A"], sampling=SamplingParams(max_tokens=2, ignore_eos=True))
    next(running)
    queued = llm.stream("w1", ["A"], sampling=LONG)  # waits: two requests already hold resources
    llm.remove_document("A")
    assert [d.token_id for d in queued if d.token_id is not None] == expected
    assert len([d for d in short if d.token_id is not None]) == 2
    assert len([d for d in running if d.token_id is not None]) == len(expected) - 1
    assert_clean(llm)
    assert llm.stats()["num_cached_chunks"] == 1  # only the head: the removed document's entry is gone


def test_a_failed_acquisition_never_drops_another_requests_pending_encode(make_llm):
    _, llm = make_llm()
    llm.add_document("A", words(20, start=3))
    llm.add_document("B", words(25, start=60))
    engine, sinks = llm.engine, {name: [] for name in ("R0", "R1", "R2")}
    expected_r1 = llm.generate("w3", ["B"], sampling=LONG).token_ids
    llm.remove_document("B")
    llm.add_document("B", words(25, start=60))  # cold again

    def scenario():
        engine.submit(engine.planner.plan("w1", ["A"]), LONG, sinks["R0"].append)
        engine.step()
        engine.step()  # R0 running, pins "A"
        plan2 = engine.planner.plan("w2", ["B", "A"])  # planned before "A" is removed
        engine.documents.remove("A")  # "A" is dead, still held by R0
        engine.submit(engine.planner.plan("w3", ["B"]), LONG, sinks["R1"].append)  # R1 encodes "B"
        engine.submit(plan2, LONG, sinks["R2"].append)  # R2 pins R1's pending "B" and reads dead "A"
        while engine.has_unfinished():
            engine.step()

    llm.loop.call(scenario)
    assert tokens(sinks["R1"]) == expected_r1
    assert len(tokens(sinks["R0"])) == len(tokens(sinks["R2"])) == LONG.max_tokens
    assert_clean(llm)


def test_fail_all_reaches_every_request_even_if_releasing_one_raises(make_llm, monkeypatch):
    _, llm = make_llm()
    llm.add_document("A", words(20, start=3))
    engine, sinks = llm.engine, [[], []]
    remove = engine.scheduler.remove

    def scenario():
        for sink in sinks:
            engine.submit(engine.planner.plan("w1", ["A"]), LONG, sink.append)
        engine.step()
        first = next(iter(engine.outputs.requests.values()))

        def remove_failing_first(request):  # releasing the first request raises
            if request is first:
                raise KeyError("no-such-key")
            remove(request)

        monkeypatch.setattr(engine.scheduler, "remove", remove_failing_first)
        engine.fail_all(RuntimeError("boom"))

    llm.loop.call(scenario)
    assert all(isinstance(sink[-1], RuntimeError) for sink in sinks)


def test_a_document_with_the_prompt_heads_tokens_is_a_separate_entry(make_llm):
    _, llm = make_llm()  # anchor "none": documents and the head are encoded alike
    head_text = " ".join(llm.engine.tokenizer.convert_ids_to_tokens(list(llm.engine.planner.head_ids)))
    llm.add_document("X", head_text)
    assert llm.engine.documents["X"].token_ids == llm.engine.planner.head_ids
    assert llm.engine.documents["X"].key != llm.engine.planner.head_key
    llm.add_document("B", words(20, start=60))
    running = llm.stream("w1", ["B", "X"], sampling=LONG)
    next(running)
    llm.remove_document("X")  # must not touch the head's entry
    assert len(llm.generate("w2", ["B"], sampling=LONG).token_ids) == LONG.max_tokens
    assert len([d for d in running if d.token_id is not None]) == LONG.max_tokens - 1
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["lazy", "block_attention", "prefix", "full"])
def test_an_empty_prompt_head_is_left_out_of_the_plan(make_llm, mode):
    prompt = PromptConfig(instruction="", document_separator=" ", question_prefix="Question : ")
    _, llm = make_llm(mode=mode, anchor="bos", prompt=prompt)
    assert llm.engine.planner.head_ids == ()
    llm.add_document("a", words(10, start=5))
    first = llm.generate("w1", ["a"], sampling=LONG)
    again = llm.generate("w1", ["a"], sampling=LONG)
    assert first.token_ids == again.token_ids and len(first.token_ids) == LONG.max_tokens
    if mode == "lazy":
        assert again.stats.docs_hit == ["a"]
    assert_clean(llm)


def test_the_head_as_anchor_is_one_entry(make_llm):
    _, llm = make_llm(anchor="head")
    assert llm.engine.planner.anchor_key == llm.engine.planner.head_key
    llm.add_document("a", words(10, start=5))
    llm.generate("w1", ["a"], sampling=LONG)
    assert llm.stats()["num_cached_chunks"] == 2  # the head (= the anchor) and "a"


def test_a_failed_call_leaves_inline_documents_as_they_were(make_llm):
    _, llm = make_llm()
    llm.add_document("b", words(10, start=30))
    old_key = llm.engine.documents["b"].key
    with pytest.raises(UnknownDocumentError, match="nope"):
        llm.generate("w1", ["nope"], documents=[("d", words(8)), ("b", words(9, start=70))], sampling=LONG)
    assert not llm.has_document("d")
    assert llm.engine.documents["b"].key == old_key and llm.engine.cache.num_document_refs(old_key) == 1
    assert len(llm.generate("w1", ["b"], sampling=LONG).token_ids) == LONG.max_tokens
    assert_clean(llm)
