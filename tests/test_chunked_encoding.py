"""Chunked encoding: a cold document larger than a step's token budget is encoded in pieces
across steps, so it neither waits for the running batch to drain nor blocks requests behind it
(issue 14, item 5). The reference for the K/V is the same request with the whole chunk encoded
in one step (a budget larger than the chunk)."""

import queue
import time

import pytest

from lazyattn_rag import SamplingParams
from tests.observe import fail_first_call
from tests.tiny import words

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture
def new_llm(make_llm, tiny_model):
    """``new_llm(budget=2048, num_blocks=512, anchor="bos")``: an engine over the session's tiny model."""
    def new(budget=2048, num_blocks=512, anchor="bos"):
        return make_llm(model=tiny_model[1], max_num_batched_tokens=budget, num_blocks=num_blocks, anchor=anchor)[1]

    return new


def test_cold_documents_over_the_budget_start_within_a_few_steps_of_a_long_decode(new_llm):
    """The issue's case: A decodes 300 tokens; B needs 2,100 tokens of encoding (three cold
    700-token documents) against a 2,048-token budget; C is small over a cached document. Both
    started computing only after A's 300 decode steps; now B's encoding starts in the first
    step after they arrive and takes two, and both prefill in the second."""
    llm = new_llm()
    engine = llm.engine
    try:
        for i in range(3):
            llm.add_document(f"cold{i}", words(699, 50 * i))  # 699 words + separator = 700 tokens
        llm.add_document("hot", words(30, 7))
        llm.warm(["hot"])
        steps: list[tuple[int, object]] = []
        llm.add_step_listener(lambda step: steps.append((engine.counters.num_steps, step.output)))  # on the engine thread
        a = llm.stream(words(3, 120), sampling=SamplingParams(max_tokens=300, ignore_eos=True))
        next(iter(a))  # A is decoding
        sinks = {"b": queue.SimpleQueue(), "c": queue.SimpleQueue()}
        plan_b = llm.plan(words(3, 130), ["cold0", "cold1", "cold2"])
        plan_c = llm.plan(words(3, 140), ["hot"])

        def submit_both():
            return (engine.counters.num_steps, engine.submit(plan_b, GREEDY, sinks["b"].put),
                    engine.submit(plan_c, GREEDY, sinks["c"].put))

        arrival, b, c = llm.loop.call(submit_both)
        assert len(list(a)) == 300  # A ran to its end meanwhile
        for q in sinks.values():
            while not getattr(item := q.get(timeout=60), "finished", False):
                assert not isinstance(item, BaseException), item
        cold_keys = {ch.key for ch in plan_b.chunks if ch.doc_id}
        b_encode_steps = sorted({n for n, out in steps for e in out.chunk_prefills if e.key in cold_keys})
        first_compute = {r: min(n for n, out in steps for j in out.computes if j.request is r) for r in (b, c)}
        assert b_encode_steps == [arrival + 1, arrival + 2]  # 2,100 tokens in two pieces under 2,048
        # B's prefill joins its last encode step, and C (admitted behind B, with the budget of
        # the first step spent) joins it too
        assert first_compute[b] == first_compute[c] == arrival + 2
        assert all(out.num_batched_tokens <= 2048 for _, out in steps)
        engine.cache.check_integrity()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("anchor", ["none", "bos"])
def test_a_chunk_encoded_in_pieces_matches_the_oracle(new_llm, tiny_model, anchor):
    """Budget 16: a 69-token document is encoded in five pieces, each attending the pieces before
    it and the anchor; the answer equals the transformers oracle's (the document encoded alone,
    placed at its offset) and the whole-chunk encode's."""
    from tests.oracle import plan_oracle

    hf, _ = tiny_model
    question, doc = words(3, 120), words(69, 3)
    tokens = {}
    for budget in (16, 4096):
        llm = new_llm(budget=budget, anchor=anchor)
        try:
            llm.add_document("d", doc)
            plan = llm.plan(question, ["d"])
            pieces = []
            llm.add_step_listener(  # noqa: B023 - called before the loop moves on
                lambda step: pieces.extend(len(e.token_ids) for e in step.output.chunk_prefills if e.key == plan.chunks[-1].key))
            sampling = SamplingParams(max_tokens=8, ignore_eos=True)
            tokens[budget] = llm.generate(question, ["d"], sampling=sampling).token_ids
            assert pieces == ([13, 16, 16, 16, 8] if budget == 16 else [69])  # the head's 3 tokens share step 1
            expected, _ = plan_oracle(hf, plan, list(llm.engine.planner.anchor_ids), 8)
            again = llm.generate(question, ["d"], sampling=sampling)
            assert again.stats.docs_hit == ["d"] and again.token_ids == tokens[budget]
        finally:
            llm.shutdown()
        assert tokens[budget] == expected
    assert tokens[16] == tokens[4096]


def _after_first_piece(llm, key, action):
    """Run ``action(engine)`` on the engine thread right after the step that encoded the first
    piece of chunk ``key`` (between that step and the next)."""
    engine, done = llm.engine, []

    def listener(step):
        if not done and any(e.key == key and not e.final for e in step.output.chunk_prefills):
            done.append(True)
            action(engine)

    llm.add_step_listener(listener)
    return done


def _assert_clean(llm):
    cache = llm.engine.cache
    llm.loop.call(cache.check_integrity)
    encoding, pins = llm.loop.call(lambda: (llm.engine.scheduler.chunk_tasks,
                                            [e.pin_count for e in cache.entries() if e.pin_count]))
    assert encoding == [] and pins == [1] * (llm.engine.planner.anchor_key is not None)  # only the anchor's pin is left


@pytest.mark.parametrize("remove_document", [False, True])
def test_the_requester_leaving_mid_encode(new_llm, remove_document):
    """The only request waiting for a chunk is aborted after its first piece: the encoding goes
    on and the chunk is cached (the next request hits it); if its document was removed too,
    the encoding stops and its blocks go back to the pool."""
    llm = new_llm(budget=16)
    try:
        llm.add_document("d", words(69, 3))
        key = llm.plan(words(3, 120), ["d"]).chunks[-1].key
        stream = llm.stream(words(3, 120), ["d"], sampling=GREEDY)

        def leave(engine):
            engine.abort(stream.request_id)
            if remove_document:
                engine.documents.remove("d")

        done = _after_first_piece(llm, key, leave)
        assert list(stream)[-1].finish_reason == "abort" and done
        while llm.loop.call(llm.engine.has_unfinished):  # the loop finishes (or drops) the encoding
            time.sleep(0.01)
        cached = llm.loop.call(lambda: llm.engine.cache.lookup(key, touch=False) is not None)
        assert cached is not remove_document
        _assert_clean(llm)
        if not remove_document:
            assert llm.generate(words(3, 120), ["d"], sampling=GREEDY).stats.docs_hit == ["d"]
    finally:
        llm.shutdown()


def test_a_step_failing_mid_encode_fails_its_requests_and_drops_the_chunk(new_llm, monkeypatch):
    llm = new_llm(budget=16)
    try:
        llm.add_document("d", words(69, 3))
        key = llm.plan(words(3, 120), ["d"]).chunks[-1].key

        def break_next_step(engine):  # the next forward pass raises, the ones after it run
            fail_first_call(monkeypatch, engine.runner, "execute", "device lost")

        _after_first_piece(llm, key, break_next_step)
        with pytest.raises(RuntimeError, match="device lost"):
            llm.generate(words(3, 120), ["d"], sampling=GREEDY)
        _assert_clean(llm)
        assert llm.loop.call(lambda: llm.engine.cache.lookup(key, touch=False)) is None
        out = llm.generate(words(3, 120), ["d"], sampling=GREEDY)  # encoded again from the start
        assert out.stats.docs_missed == ["d"] and len(out.token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()
