"""Callers that go away at awkward moments cost only their own request (found by an adversarial pass).

* An asyncio caller cancelled while its submission waits behind a long step: the request that
  the submission still makes is aborted, not left generating for nobody.
* A consumer whose sink raises (its event loop closed): only that request is dropped; the step and
  every other request go on.
"""

import asyncio
import threading

import pytest

from lazyattn_rag import AsyncLazyAttention, SamplingParams
from tests.tiny import words

LONG = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture
def llm(make_llm):
    """A tiny engine (no anchor, 128 blocks) with document "a" registered."""
    _, llm = make_llm(anchor="none", num_blocks=128)
    llm.add_document("a", words(16, start=4))
    return llm


def assert_idle_and_clean(llm):
    def check():
        engine = llm.engine
        engine.cache.check_integrity()
        assert not engine.outputs.requests and not engine.has_unfinished()
        assert engine.cache.pool.num_free + engine.cache.num_cached_blocks == engine.cache.pool.num_blocks

    llm.loop.call(check)


def test_cancelled_while_submitting_aborts_the_request_it_makes(llm):
    allm = AsyncLazyAttention(llm)
    gate = threading.Event()
    llm.loop.post(gate.wait, 30)  # holds the engine thread: the submission queues behind it

    async def main():
        task = asyncio.create_task(allm.generate("w1", ["a"], sampling=LONG))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        gate.set()
        for _ in range(50):  # the abort is queued right after the submission lands
            await asyncio.sleep(0.02)
            if not await asyncio.to_thread(lambda: llm.loop.call(lambda: bool(llm.engine.outputs.requests))):
                break

    asyncio.run(main())
    assert llm.stats()["num_requests_aborted"] == 1
    assert llm.stats()["num_output_tokens"] == 0  # nothing was generated for nobody
    assert_idle_and_clean(llm)


def test_a_raising_sink_drops_only_its_own_request(llm):
    expected = llm.generate("w1", ["a"], sampling=LONG).token_ids
    engine, good = llm.engine, []

    def closed_loop_sink(item):
        raise RuntimeError("Event loop is closed")

    def scenario():
        engine.submit(engine.planner.plan("w1", ["a"]), LONG, closed_loop_sink)
        engine.submit(engine.planner.plan("w1", ["a"]), LONG, good.append)
        while engine.has_unfinished():
            engine.step()

    llm.loop.call(scenario)
    assert [d.token_id for d in good if d.token_id is not None] == expected
    assert llm.stats()["num_requests_aborted"] == 1
    assert_idle_and_clean(llm)


def test_leaving_an_async_stream_after_shutdown_is_quiet(llm):
    allm = AsyncLazyAttention(llm)

    async def main():
        stream = allm.stream("w1", ["a"], sampling=LONG)
        first = await stream.__anext__()
        llm.shutdown()
        await stream.aclose()  # its abort finds the engine gone: nothing to do, nothing raised
        return first

    assert asyncio.run(main()).token_id is not None
