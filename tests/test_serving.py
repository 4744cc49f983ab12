"""Continuous batching, concurrency, memory pressure, preemption, soak and bad input in flight."""

import asyncio
import functools
import random
import time

import pytest

from lazyattn_rag import (
    AsyncLazyAttention,
    CacheConfig,
    DocumentTooLongError,
    EmptyInputError,
    PromptTooLongError,
    SamplingParams,
    SchedulerConfig,
    UnknownDocumentError,
)
from tests.observe import StepLog, assert_no_leak, fail_first_call
from tests.oracle import oracle_generate
from tests.tiny import words

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def make_llm(make_llm):
    """Block counts in these tests assume no anchor (an anchor keeps one entry pinned for good)."""
    return functools.partial(make_llm, anchor="none", max_num_batched_tokens=512)


def sequences_per_step(steps: StepLog) -> list[int]:
    """Sequences of each step's forward pass: one per chunk piece and one per compute job (no
    request here has text segments, which would add sequences)."""
    return [len(out.chunk_prefills) + len(out.computes) for out in steps.outputs]


@pytest.mark.parametrize("anchor", ["none", "bos"])
def test_32_concurrent_async_requests_equal_sequential_outputs(make_llm, anchor):
    hf, llm = make_llm(anchor=anchor)
    for i in range(8):
        llm.add_document(f"d{i}", words(9 + 5 * i, start=11 * i))
    rng = random.Random(0)
    requests = []
    for i in range(32):
        ids = rng.sample([f"d{j}" for j in range(8)], k=rng.randint(1, 4))
        if i % 5 == 0:
            ids.append(ids[0])  # a document twice in one prompt
        requests.append((words(rng.randint(1, 4), start=100 + i), ids))
    sequential = [llm.generate(q, ids, sampling=GREEDY).token_ids for q, ids in requests]
    for i in range(8):  # start cold again so the concurrent run also shares encodes
        llm.remove_document(f"d{i}")
        llm.add_document(f"d{i}", words(9 + 5 * i, start=11 * i))
    steps = StepLog(llm)
    allm = AsyncLazyAttention(llm)

    async def run_all():
        return await asyncio.gather(*(allm.generate(q, ids, sampling=GREEDY) for q, ids in requests))

    concurrent = asyncio.run(run_all())
    assert [c.token_ids for c in concurrent] == sequential
    assert max(sequences_per_step(steps)) > 8  # requests really shared steps
    # 8 documents + the head (+ the anchor), each encoded once
    assert llm.stats()["num_cached_chunks"] == 9 + (anchor != "none")
    if anchor != "none":  # the oracle below encodes documents alone
        return
    q, ids = requests[3]
    plan = llm.plan(q, ids)
    tokens, _ = oracle_generate(hf, [([], list(c.token_ids), c.global_start) for c in plan.chunks],
                                list(plan.query_token_ids), GREEDY.max_tokens)
    assert sequential[3] == tokens
    assert_no_leak(llm)


def test_same_unseen_document_in_one_step_is_encoded_once(make_llm):
    hf, llm = make_llm()
    llm.add_document("shared", words(40))
    steps = StepLog(llm)
    allm = AsyncLazyAttention(llm)

    async def run():
        return await asyncio.gather(*(allm.generate(f"w{i}", ["shared"], sampling=GREEDY) for i in range(6)))

    outs = asyncio.run(run())
    key = llm.engine.documents["shared"].key
    encodes = [e.key for out in steps.outputs for e in out.chunk_prefills]
    assert encodes.count(key) == 1
    assert sum(o.stats.docs_missed == ["shared"] for o in outs) == 1
    assert_no_leak(llm)


def test_oldest_request_survives_memory_pressure_and_preempted_ones_recompute_correctly(make_llm):
    hf, llm = make_llm(num_blocks=14, max_num_batched_tokens=64)
    for i in range(6):
        llm.add_document(f"d{i}", words(30, start=7 * i))  # 2 blocks each
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    solo = {i: llm.generate("w1 w2", [f"d{i}"], sampling=long).token_ids for i in range(6)}
    streams = [llm.stream("w1 w2", [f"d{i}"], sampling=long) for i in range(6)]  # all queued at once
    finals = [list(s) for s in streams]
    for i, deltas in enumerate(finals):
        assert [d.token_id for d in deltas if d.token_id is not None] == solo[i]
    assert finals[0][-1].stats.num_preemptions == 0
    assert llm.stats()["num_preemptions"] > 0  # 6 x (2 + 3) blocks cannot all fit in 14
    assert_no_leak(llm)


def test_waiting_request_whose_document_was_evicted_reencodes_it(make_llm):
    hf, llm = make_llm(num_blocks=8, max_num_seqs=1)
    llm.add_document("victim", words(20, start=3))
    for i in range(2):
        llm.add_document(f"big{i}", words(40, start=50 + i))
    llm.warm(["victim"])
    solo = llm.generate("w9", ["victim"], sampling=GREEDY).token_ids
    first = llm.stream("w8", ["big0", "big1"], sampling=GREEDY)  # needs 6 blocks: evicts victim
    waiting = llm.stream("w9", ["victim"], sampling=GREEDY)  # queued behind (max_num_seqs=1)
    assert list(first)[-1].stats.docs_missed == ["big0", "big1"]
    deltas = list(waiting)
    assert deltas[-1].stats.docs_missed == ["victim"]
    assert [d.token_id for d in deltas if d.token_id is not None] == solo
    assert llm.stats()["num_evictions"] >= 1
    assert_no_leak(llm)


def test_soak_1000_queries_under_small_budget(make_llm):
    import resource

    hf, llm = make_llm(num_blocks=40, max_num_batched_tokens=256, eviction_policy="lfu")
    docs = [f"doc{i}" for i in range(30)]
    rng = random.Random(1)
    for i, d in enumerate(docs):
        llm.add_document(d, words(rng.randint(8, 30), start=i * 5))
    weights = [1 / (i + 1) ** 1.1 for i in range(len(docs))]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    rss, hit_ratios = [], []
    for wave in range(20):
        before = llm.stats()
        streams = [llm.stream("w1 w2", rng.choices(docs, weights, k=3), sampling=params) for _ in range(50)]
        for s in streams:
            assert list(s)[-1].finished
        after = llm.stats()
        looked = after["num_prompt_tokens"] - before["num_prompt_tokens"]
        hit_ratios.append((after["num_cached_prompt_tokens"] - before["num_cached_prompt_tokens"]) / looked)
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    stats = llm.stats()
    assert stats["num_requests_finished"] >= 1000
    print(f"soak token hit ratio per wave: {[round(h, 2) for h in hit_ratios]}; doc hit ratio "
          f"{stats['doc_hit_ratio']:.3f}; evictions {stats['num_evictions']}")
    steady = hit_ratios[5:]
    assert min(steady) > 0.75 and max(steady) - min(steady) < 0.1  # measured 0.85-0.89
    assert stats["num_evictions"] > 0
    assert (rss[-1] - rss[4]) < 64 * 1024  # KiB: no growth beyond noise after warm-up
    assert_no_leak(llm)


def test_bad_input_and_cancellation_leave_other_requests_correct(make_llm):
    hf, llm = make_llm(model_config=dict(max_position_embeddings=256))
    llm.add_document("ok", words(20))
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    solo = llm.generate("w1", ["ok"], sampling=long).token_ids
    running = llm.stream("w1", ["ok"], sampling=long)
    cancelled = llm.stream("w2", ["ok"], sampling=long)
    with pytest.raises(UnknownDocumentError, match="'nope'"):
        llm.stream("w1", ["ok", "nope"])
    with pytest.raises(DocumentTooLongError, match="'long'"):
        llm.add_document("long", words(400))
    for i in range(5):
        llm.add_document(f"f{i}", words(60, start=i))
    with pytest.raises(PromptTooLongError, match="context limit is 256"):
        llm.stream("w1", [f"f{i}" for i in range(5)])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    got = []
    for d in cancelled:
        got.append(d)
        if len(got) == 2:
            break
    cancelled.close()  # cancel mid-decode
    deltas = list(running)
    assert [d.token_id for d in deltas if d.token_id is not None] == solo
    assert llm.stats()["num_requests_aborted"] == 1
    assert_no_leak(llm)


def test_async_cancellation_frees_blocks(make_llm):
    hf, llm = make_llm()
    llm.add_document("ok", words(20))
    allm = AsyncLazyAttention(llm)

    async def run():
        streaming = asyncio.Event()

        async def consume():
            n = 0
            async for _ in allm.stream("w1", ["ok"], sampling=SamplingParams(max_tokens=4000, ignore_eos=True)):
                n += 1
                if n == 3:
                    streaming.set()  # cancelled mid-stream, whatever the machine's speed
                await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        await streaming.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await allm.generate("w1", ["ok"], sampling=GREEDY)

    out = asyncio.run(run())
    assert out.finish_reason == "length"
    assert_no_leak(llm)


def test_prometheus_metrics_match_stats(make_llm):
    from prometheus_client import CollectorRegistry, generate_latest

    from lazyattn_rag.metrics import register_metrics

    hf, llm = make_llm()
    llm.add_document("a", words(20))
    llm.generate("w1", ["a"], sampling=GREEDY)
    before = time.time()
    out = llm.generate("w2", ["a"], sampling=GREEDY)
    assert before <= out.stats.arrival_time <= time.time()  # wall clock, as vLLM's RequestMetrics
    registry = CollectorRegistry()
    register_metrics(llm, registry)
    text = generate_latest(registry).decode()
    stats = llm.stats()
    model = f'{{model_name="{llm.model_name}"}}'
    assert f"lazyattn_requests_finished_total{model} 2.0" in text
    assert f"lazyattn_doc_hit_ratio{model} {stats['doc_hit_ratio']}" in text and stats["doc_hit_ratio"] == 0.5
    assert f"lazyattn_cached_prompt_tokens_total{model} {float(stats['num_cached_prompt_tokens'])}" in text
    assert stats["num_cached_prompt_tokens"] == out.stats.num_cached_tokens  # the first request hit nothing
    assert out.stats.queue_ms is not None and out.stats.tpot_ms is not None
    # each finished request once in each latency histogram, in the bucket of its own time
    assert f"lazyattn_time_to_first_token_seconds_count{model} 2.0" in text
    ttft = stats["latency"]["ttft"]
    bound = next(b for b in ttft["buckets_s"] if out.stats.ttft_ms / 1e3 <= b)
    assert ttft["counts"][ttft["buckets_s"].index(bound)] >= 1
    assert stats["latency"]["e2e"]["count"] == 2 and stats["latency"]["e2e"]["sum_s"] >= out.stats.e2e_ms / 1e3


def test_stats_say_where_the_time_before_the_engine_took_a_request_went(make_llm, monkeypatch):
    """A plain chat prompt is planned in a planning thread: its planning time and the wait for
    the engine thread (busy here with a 150 ms command) are stamped on its stats; a request
    planned on the engine thread has no planning stamps, only its wait."""
    hf, llm = make_llm()
    llm.add_document("a", words(20))
    engine = llm.client.loop.engine
    plan_plain_chat = engine.plan_plain_chat

    def slow_plan(*args, **kwargs):
        time.sleep(0.1)
        return plan_plain_chat(*args, **kwargs)

    monkeypatch.setattr(engine, "plan_plain_chat", slow_plan)
    llm.client.loop.post(time.sleep, 0.15)  # the engine thread is busy for 150 ms from now
    plain = llm.chat([("user", words(30))], sampling=GREEDY).stats
    assert plain.planning_ms >= 100 and 0 <= plain.planning_queue_ms < 100
    assert 0 < plain.submission_wait_ms <= 150  # the command's last 50 ms or less, after 100 ms of planning
    llm.client.loop.post(time.sleep, 0.15)
    by_id = llm.generate("w1", ["a"], sampling=GREEDY).stats
    assert by_id.planning_ms is None and by_id.planning_queue_ms is None
    assert 100 <= by_id.submission_wait_ms <= 150 + 100
    # every answer of n > 1 carries its request's stamps; requests planned on the engine thread
    # (by id with n > 1, messages placing a document) have no planning times however they queue
    three = llm.chat([("user", words(30))], sampling=SamplingParams(max_tokens=4, ignore_eos=True, n=3))
    assert [a.stats.planning_ms >= 100 for a in [three, *three.alternatives]] == [True] * 3
    two = llm.generate("w1", ["a"], sampling=SamplingParams(max_tokens=4, ignore_eos=True, n=2))
    placed = llm.chat([{"role": "user", "content": [{"type": "document", "id": "a"}, {"type": "text", "text": "w1"}]}],
                      sampling=GREEDY)
    for stats in (two.stats, two.alternatives[0].stats, placed.stats):
        assert stats.planning_ms is None and stats.planning_queue_ms is None and stats.submission_wait_ms >= 0


def test_async_submissions_wait_in_no_worker_thread(make_llm):
    """AsyncLazyAttention awaits its submissions as futures: with an event loop whose default
    executor refuses every job, a plain chat (planned in a planning thread) and a request by id
    (planned on the engine thread) still answer as the sync API does, and the errors of either
    path (a plain prompt over the context limit; an unknown id) raise at the first ``anext``."""
    from concurrent.futures import ThreadPoolExecutor

    class Refusing(ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            raise AssertionError("a submission waited in a worker thread")

    hf, llm = make_llm()
    llm.add_document("a", words(20))
    plain_messages = [("user", words(30))]
    expected = (llm.chat(plain_messages, sampling=GREEDY).token_ids,
                llm.generate("w1", ["a"], sampling=GREEDY).token_ids)
    allm = AsyncLazyAttention(llm)

    async def run():
        asyncio.get_running_loop().set_default_executor(Refusing())
        answers = await asyncio.gather(allm.chat(plain_messages, sampling=GREEDY),
                                       allm.generate("w1", ["a"], sampling=GREEDY))
        with pytest.raises(PromptTooLongError):
            await allm.chat([("user", words(4100))], sampling=GREEDY)  # max_model_len 4,080
        with pytest.raises(UnknownDocumentError, match="'nope'"):
            await allm.generate("w1", ["nope"], sampling=GREEDY)
        return tuple(a.token_ids for a in answers)

    assert asyncio.run(run()) == expected
    assert_no_leak(llm)


def test_submit_soon_after_shutdown_fails_its_future_for_every_kind_of_request(make_llm):
    """The error of a submission after shutdown comes in the future, never raised by the call:
    plain chat, by id, and with a constraint to compile (whose pool is shut down too)."""
    from lazyattn_rag.client import chat_request, question_request
    from lazyattn_rag.types.sampling_params import StructuredOutputParams

    hf, llm = make_llm()
    client = llm.client
    llm.shutdown()
    constrained = SamplingParams(max_tokens=4, structured_output=StructuredOutputParams(regex="[0-9]+"))
    for make in (chat_request([("user", "w1")], [], GREEDY), question_request("w1", [], [], GREEDY),
                 chat_request([("user", "w1")], [], constrained)):
        future = client.submit_soon(make, lambda item: None)  # raises nothing itself
        with pytest.raises(RuntimeError, match="shut ?down"):  # the engine loop's, or a thread pool's
            future.result(timeout=10)


def test_rebinding_old_text_while_a_request_reads_it_revives_the_entry(make_llm):
    hf, llm = make_llm(num_blocks=64)
    text = words(40, start=9)
    llm.add_document("A", text)
    solo = llm.generate("w1", ["A"], sampling=SamplingParams(max_tokens=30, ignore_eos=True)).token_ids
    stream = llm.stream("w1", ["A"], sampling=SamplingParams(max_tokens=30, ignore_eos=True))
    first = next(stream)
    llm.remove_document("A")  # the running request keeps the (now dead) entry pinned
    llm.add_document("A", text)  # same text again: the pinned entry serves again
    again = llm.generate("w1", ["A"], sampling=SamplingParams(max_tokens=30, ignore_eos=True))
    assert again.stats.docs_hit == ["A"] and again.token_ids == solo
    assert [first.token_id] + [d.token_id for d in stream if d.token_id is not None] == solo
    assert_no_leak(llm)


def test_sampling_failure_fails_only_that_request(make_llm, monkeypatch):
    hf, llm = make_llm()
    llm.add_document("a", words(10))
    engine = llm.engine

    def broken(logits, params, generator):
        raise RuntimeError("sampler exploded")

    monkeypatch.setattr("lazyattn_rag.engine.output.output_processor.sample", broken)
    bad = llm.stream("w1", ["a"], sampling=SamplingParams(max_tokens=4, temperature=1.0, seed=1))
    good = llm.generate("w2", ["a"], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(RuntimeError, match="sampler exploded"):
        list(bad)
    monkeypatch.undo()
    assert good.finish_reason == "length" and len(good.token_ids) == 4
    assert not engine.outputs.requests
    assert_no_leak(llm)


def test_shutdown_fails_requests_in_flight(make_llm):
    hf, llm = make_llm()
    llm.add_document("a", words(10))
    stream = llm.stream("w1", ["a"], sampling=SamplingParams(max_tokens=100, ignore_eos=True))
    next(stream)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        list(stream)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.add_document("b", words(3))


def test_input_validation_is_atomic_and_specific(make_llm):
    hf, llm = make_llm()
    with pytest.raises(ValueError, match="not the string"):
        llm.generate("w1", "abc")
    with pytest.raises(EmptyInputError, match="'b' is empty"):
        llm.add_documents([("a", words(5)), ("b", "  ")])
    assert not llm.has_document("a")  # all or none
    out = llm.generate("w1", documents=[("t1", words(4))], sampling=GREEDY)  # tuples accepted inline
    assert out.stats.docs_missed == ["t1"]
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 210\)"):
        llm.complete([5, 10**9])
    with pytest.raises(ValueError, match="token ids"):
        llm.complete([5.7])
    for bad in (dict(seed=2**70), dict(seed=1.5), dict(ignore_eos="no"), dict(stop=None),
                dict(temperature="0.5"), dict(stop_token_ids=["5"])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    for bad in (dict(num_blocks=2.5), dict(block_size=True), dict(block_size=16.0)):
        with pytest.raises(ValueError):
            CacheConfig(**bad)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=1.5)
    tiny_temperature = llm.generate("w1", ["t1"], sampling=SamplingParams(max_tokens=4, temperature=1e-45,
                                                                          ignore_eos=True))
    assert tiny_temperature.token_ids == llm.generate("w1", ["t1"], sampling=GREEDY).token_ids[:4]
    assert_no_leak(llm)


def test_unread_or_dropped_streams_are_cancelled(make_llm):
    import gc

    hf, llm = make_llm()
    llm.add_document("a", words(10))
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    stream = llm.stream("w1", ["a"], sampling=long)
    stream.close()  # never iterated: still cancelled
    dropped = llm.stream("w2", ["a"], sampling=long)
    del dropped
    gc.collect()
    with llm.stream("w3", ["a"], sampling=long) as s:
        next(s)
    assert_no_leak(llm)
    assert llm.stats()["num_requests_aborted"] == 3


def _drain(engine, llm):
    llm.loop.call(lambda: None)
    while engine.has_unfinished():
        llm.loop.call(lambda: None)


def test_a_failing_forward_fails_its_requests_and_drops_their_pending_encodes(make_llm, monkeypatch):
    hf, llm = make_llm()
    llm.add_document("a", words(20))
    solo = llm.generate("w1", ["a"], sampling=GREEDY).token_ids
    llm.remove_document("a")
    llm.add_document("a", words(20))  # cold again
    calls = fail_first_call(monkeypatch, llm.engine.runner, "execute", "device fault")
    engine, sinks = llm.engine, [[], []]
    # both queued before the engine steps: one encodes "a", the other waits on its pending entry
    llm.loop.call(lambda: [engine.submit(engine.planner.plan("w1", ["a"]), GREEDY, sink.append) for sink in sinks])
    _drain(engine, llm)
    assert calls[0] >= 1
    for sink in sinks:
        assert len(sink) == 1 and isinstance(sink[0], RuntimeError) and "device fault" in str(sink[0])
    assert llm.engine.cache.lookup(llm.engine.documents["a"].key, touch=False) is None
    assert_no_leak(llm)
    assert llm.generate("w1", ["a"], sampling=GREEDY).token_ids == solo


def test_a_failed_encode_step_that_the_query_prefill_could_not_join_fails_that_request_alone(make_llm, monkeypatch):
    """A 40-token document over a 32-token step budget is encoded alone in its step, so the
    request's prefill cannot join it. When that step's forward pass fails, the request fails
    (it must not run later over blocks that went back to the pool), and a request that was never
    in that step finishes as if alone. Found by an adversarial pass: the request had been moved
    to running without a prefill, escaped the failure, and streamed tokens over freed blocks."""
    hf, llm = make_llm(max_num_batched_tokens=32)
    llm.add_document("a", words(40))
    llm.add_document("b", words(20, start=100))
    long = SamplingParams(max_tokens=12, ignore_eos=True)
    solo_b = llm.generate("w2", ["b"], sampling=long).token_ids
    llm.remove_document("b")
    llm.add_document("b", words(20, start=100))  # cold again
    fail_first_call(monkeypatch, llm.engine.runner, "execute", "device fault")
    engine, sink_a, sink_b = llm.engine, [], []
    llm.loop.call(lambda: (engine.submit(engine.planner.plan("w1", ["a"]), GREEDY, sink_a.append),
                           engine.submit(engine.planner.plan("w2", ["b"]), long, sink_b.append)))
    _drain(engine, llm)
    assert len(sink_a) == 1 and isinstance(sink_a[0], RuntimeError) and "device fault" in str(sink_a[0])
    assert not any(isinstance(d, BaseException) for d in sink_b)
    assert [d.token_id for d in sink_b if d.token_id is not None] == solo_b
    assert_no_leak(llm)


def test_a_failed_copy_fails_its_request_and_leaves_the_cache_clean(make_llm, monkeypatch):
    """block_attention: the copy of "a" to a new offset raises. Its request fails alone, the
    copy's pending entry and its source pin are dropped, and the same request then succeeds.
    (The copy used to run outside the step's failure handling: a pending entry with no holder
    was left behind and the next request over that document waited forever.)"""
    _, llm = make_llm(num_blocks=64, mode="block_attention")
    llm.add_documents([("a", words(20)), ("b", words(10, start=50))])
    llm.generate("w1", ["a"], sampling=GREEDY)
    fail_first_call(monkeypatch, llm.engine.runner, "copy_rotated", "copy fault")
    with pytest.raises(RuntimeError, match="copy fault"):
        llm.generate("w1", ["b", "a"], sampling=GREEDY)
    assert_no_leak(llm)
    again = llm.generate("w1", ["b", "a"], sampling=GREEDY)
    assert again.stats.docs_hit == [] and sorted(again.stats.docs_missed) == ["a", "b"]  # "a" copied again
    assert_no_leak(llm)
    llm.shutdown()


def test_a_request_waiting_for_room_counts_its_cached_documents_once(make_llm):
    """LFU frequency is one hit per admission, not one per step spent waiting for room."""
    hf, llm = make_llm(num_blocks=12)
    llm.add_document("h", words(16, start=50))  # 1 block
    llm.add_document("big", words(100, start=0))  # 7 blocks
    llm.warm(["h"])
    engine = llm.engine

    def scenario():
        key = engine.documents["h"].key
        before = engine.cache.policy._freq[key]
        engine.submit(engine.planner.plan("w1", ["big"]), SamplingParams(max_tokens=40, ignore_eos=True), lambda d: None)
        engine.step()
        waiting = engine.submit(engine.planner.plan(words(40, start=150), ["h"]), GREEDY, lambda d: None)
        num_waited = 0
        while waiting.status.value == "waiting":
            engine.step()
            num_waited += 1
        while engine.has_unfinished():
            engine.step()
        return before, engine.cache.policy._freq[key], num_waited, waiting.stats.docs_hit

    before, after, num_waited, hits = llm.loop.call(scenario)
    assert num_waited > 5  # it really waited for room
    assert (after, hits) == (before + 1, ["h"])
    assert_no_leak(llm)


def test_the_runner_keeps_block_tables_only_for_running_requests(make_llm):
    """Each request's packed context is kept by the runner while it runs and dropped once the
    scheduler reports it released (with the next step): sequential requests never pile up."""
    hf, llm = make_llm()
    llm.add_documents([("a", words(12)), ("b", words(20, start=40))])
    counts = []
    for i in range(6):
        llm.generate(f"w{i}", ["a", "b"][: 1 + i % 2], sampling=GREEDY)
        counts.append(llm.loop.call(lambda: llm.engine.runner.inputs.num_tables))
    assert counts == [1] * 6  # the request that just finished, until the next step
    llm.generate("w9", [], sampling=GREEDY)
    assert llm.loop.call(lambda: llm.engine.runner.inputs.num_tables) == 1
    assert_no_leak(llm)


def test_a_raising_step_listener_is_removed_and_costs_no_request(make_llm, caplog):
    """Found by an adversarial review: a diagnostic hook that raised failed every request in
    flight (and every later one, as it stayed registered)."""
    hf, llm = make_llm()
    llm.add_document("a", words(10))
    calls = []

    def broken(step):
        calls.append(step.output)
        if len(calls) == 3:
            raise ValueError("diagnostic listener bug")

    llm.add_step_listener(broken)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    with caplog.at_level("ERROR", logger="lazyattn_rag.engine.engine"):
        streams = [llm.stream(f"w{i}", ["a"], sampling=sampling) for i in range(2)]
        outputs = [[d.token_id for d in s if d.token_id is not None] for s in streams]
    assert [len(o) for o in outputs] == [12, 12] and len(calls) == 3  # removed after raising
    assert "diagnostic listener bug" in caplog.text and llm.stats()["num_requests_failed"] == 0
    assert outputs[0] == llm.generate("w0", ["a"], sampling=sampling).token_ids
    assert_no_leak(llm)


def test_calling_back_from_a_step_listener_raises_instead_of_answering_none(make_llm):
    """A listener runs inside the step: reading the engine through the public class there cannot
    be answered (it used to return None); removing the listener from inside itself works."""
    hf, llm = make_llm()
    llm.add_document("a", words(10))
    seen = []

    def listener(step):
        try:
            seen.append(llm.has_document("a"))
        except RuntimeError as error:
            seen.append(str(error))
        remove()

    remove = llm.add_step_listener(listener)
    llm.generate("w1", ["a"], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(seen) == 1 and "from inside a step" in seen[0]  # called once: it removed itself
    remove()  # idempotent
    assert llm.has_document("a")
    assert_no_leak(llm)
