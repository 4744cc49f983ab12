"""Cache modes compared by the serving benchmark: lazy, block_attention, prefix, full.

``lazy`` runs with ``anchor="none"`` here, the setting in which it computes the same function as
``block_attention`` (which encodes documents alone, as Block-Attention does)."""

import functools

import pytest

from lazyattn_rag import SamplingParams
from tests.oracle import oracle_generate
from tests.tiny import tiny_llm, words

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
REQUESTS = [("w1 w2", ["a", "b", "c"]), ("w3", ["c", "a"]), ("w1 w2", ["a", "b", "c"]), ("w4", ["b", "c", "a"])]


@pytest.fixture
def make_llm(make_llm):
    """A tiny-model engine with no anchor; ``mode`` and ``num_blocks`` given by each test."""
    return functools.partial(make_llm, anchor="none")


def run_mode(tiny_model, mode, num_blocks=256):
    hf, ours = tiny_model
    llm = tiny_llm(ours, mode=mode, num_blocks=num_blocks, anchor="none")
    for name, n, start in (("a", 21, 0), ("b", 16, 40), ("c", 35, 80)):
        llm.add_document(name, words(n, start=start))
    outs = [llm.generate(q, ids, sampling=GREEDY) for q, ids in REQUESTS]
    llm.engine.cache.check_integrity()
    return hf, llm, outs


@pytest.fixture(scope="module")
def results(tiny_model):
    modes = {mode: run_mode(tiny_model, mode) for mode in ("lazy", "block_attention", "prefix", "full")}
    yield modes
    for _, llm, _ in modes.values():
        llm.shutdown()


def test_lazy_and_block_attention_compute_the_same_function(results):
    hf, llm, lazy = results["lazy"]
    _, _, block = results["block_attention"]
    assert [o.token_ids for o in lazy] == [o.token_ids for o in block]
    plan = llm.plan(*REQUESTS[1])
    tokens, _ = oracle_generate(hf, [([], list(c.token_ids), c.global_start) for c in plan.chunks],
                                list(plan.query_token_ids), GREEDY.max_tokens)
    assert lazy[1].token_ids == tokens


def test_prefix_and_full_compute_the_same_function(results):
    _, _, prefix = results["prefix"]
    _, _, full = results["full"]
    assert [o.token_ids for o in prefix] == [o.token_ids for o in full]


def test_prefix_mode_reuses_only_exact_prefixes(results):
    _, llm, prefix = results["prefix"]
    assert prefix[0].stats.num_cached_tokens == 0
    assert prefix[2].stats.num_cached_tokens >= prefix[2].stats.num_prompt_tokens - 16  # same prompt again
    assert prefix[1].stats.num_cached_tokens < 16  # "c" first: only the head's full blocks could match
    _, _, full = results["full"]
    assert all(o.stats.num_cached_tokens == 0 for o in full)


def test_block_attention_keeps_one_copy_per_offset_and_copies_on_new_offsets(results):
    _, llm, block = results["block_attention"]
    _, lazy_llm, lazy = results["lazy"]
    assert block[0].stats.docs_missed == ["a", "b", "c"]
    assert block[1].stats.docs_missed == ["c", "a"]  # new offsets: copies
    assert block[2].stats.docs_hit == ["a", "b", "c"]  # same offsets as the first request
    copies = llm.stats()["num_cached_chunks"] - 1
    assert copies == 3 + 2 + 3  # every (document, offset) pair seen
    assert lazy_llm.stats()["num_cached_chunks"] - 1 == 3  # one copy per document
    assert block[1].stats.num_computed_tokens == len(llm.plan(*REQUESTS[1]).query_token_ids)  # copied, not encoded


NUM_PRESSURE_BLOCKS = 26  # 16 tokens each: room for about two requests of three documents


@pytest.mark.parametrize("mode", ["lazy", "block_attention", "prefix", "full"])
def test_every_mode_runs_concurrent_requests_under_memory_pressure(make_llm, mode):
    """A budget of a few requests' blocks, many requests in flight, documents at shifting offsets:
    every request completes with its sequential output and the cache invariants hold after each
    step (a regression test: prefix mode once counted blocks still held by running requests as
    evictable room, block_attention pinned copy sources after checking room)."""
    import asyncio
    import random

    from lazyattn_rag import AsyncLazyAttention

    _, llm = make_llm(mode=mode, num_blocks=NUM_PRESSURE_BLOCKS, max_num_batched_tokens=128, max_num_seqs=8)
    for i in range(10):
        llm.add_document(f"d{i}", words(20 + 5 * i, start=17 * i))
    rng = random.Random(5)
    requests = [(words(2, start=120 + i), rng.sample([f"d{j}" for j in range(10)], k=3)) for i in range(16)]
    sequential = [llm.generate(q, ids, sampling=GREEDY).token_ids for q, ids in requests]
    llm.add_step_listener(lambda step: llm.engine.cache.check_integrity())  # on the engine thread
    allm = AsyncLazyAttention(llm)

    async def run_all():
        return await asyncio.gather(*(allm.generate(q, ids, sampling=GREEDY) for q, ids in requests))

    assert [c.token_ids for c in asyncio.run(run_all())] == sequential
    stats = llm.stats()
    assert stats["num_requests_failed"] == 0 and stats["num_evictions"] + stats["num_preemptions"] > 0  # real pressure
    assert stats["num_blocks_free"] + stats["num_blocks_cached"] == NUM_PRESSURE_BLOCKS  # nothing leaked
    llm.shutdown()


def test_full_mode_admits_a_request_only_when_its_prompt_fits(make_llm):
    """Eight concurrent full-mode prompts of 128 tokens (8 blocks; 9 with their 4 outputs) in 20
    blocks: two run at a time and the others wait. Admitting a request without room for its own
    prefill would preempt it (or a running one) at once, step after step (33 preemptions here
    before the admission check counted the private prompt)."""
    import asyncio

    from lazyattn_rag import AsyncLazyAttention

    _, llm = make_llm(mode="full", num_blocks=20, max_num_batched_tokens=128, max_num_seqs=8)
    for i in range(3):
        llm.add_document(f"d{i}", words(40, start=17 * i))
    requests = [(words(2, start=120 + i), ["d0", "d1", "d2"]) for i in range(8)]
    assert llm.plan(*requests[0]).num_prompt_tokens == 128
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sequential = [llm.generate(q, ids, sampling=params).token_ids for q, ids in requests]
    allm = AsyncLazyAttention(llm)

    async def run_all():
        return await asyncio.gather(*(allm.generate(q, ids, sampling=params) for q, ids in requests))

    outs = asyncio.run(run_all())
    assert [o.token_ids for o in outs] == sequential
    assert [o.stats.num_preemptions for o in outs] == [0] * 8
    assert llm.stats()["num_preemptions"] == 0
    llm.shutdown()


def test_block_attention_falls_back_to_encoding_when_room_needs_the_copy_source(make_llm):
    """Request 2 places "a" at a new offset (its copy at the old offset is the source) and needs a
    new "c": the room for both exists only by evicting that source, so "a" is encoded instead
    of copied, and the request succeeds (it once failed: the source was pinned after the room
    check had counted it as evictable)."""
    block_size, max_tokens = 16, GREEDY.max_tokens
    blocks = lambda n: -(-n // block_size)  # noqa: E731

    def engine(mode, num_blocks):
        _, llm = make_llm(mode=mode, num_blocks=num_blocks, block_size=block_size, eviction_policy="lru")
        llm.add_documents([("a", words(40, start=3)), ("b", words(20, start=60)), ("c", words(40, start=90))])
        return llm

    lazy = engine("lazy", 256)
    plan = lazy.plan("w7", ["a", "c"])
    request_blocks = sum(blocks(len(c.token_ids)) for c in plan.chunks) + blocks(len(plan.query_token_ids) + max_tokens)
    llm = engine("block_attention", request_blocks + 1)
    llm.generate("w7", ["b", "a"], sampling=GREEDY)  # caches "b" and "a" (after "b"); frees the rest
    out = llm.generate("w7", ["a", "c"], sampling=GREEDY)
    assert out.token_ids == lazy.generate("w7", ["a", "c"], sampling=GREEDY).token_ids
    assert out.stats.docs_missed == ["a", "c"]
    stats = llm.stats()
    assert stats["num_requests_failed"] == 0 and stats["num_evictions"] == 2  # "b" and the old copy of "a"
    llm.engine.cache.check_integrity()
