"""The scheduler on its own: a real chunk cache and block pool, hand-made requests, no model, no runner.

Each test plays the engine's part by hand: ``schedule()``, then (as if the forward pass ran)
``update_from_output`` and one sampled token per sampling compute job, ``remove`` when a request
ends. Expected block ids follow from the pool's FIFO free list: blocks ``0 .. n-1`` in order at
first, then each freed block at the back in the order it was freed. Blocks hold 4 tokens.
"""

import zlib

from lazyattn_rag.engine.kv.block_pool import BlockPool
from lazyattn_rag.engine.kv.block_table import BlockEntry, block_table_entries
from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.counters import EngineCounters
from lazyattn_rag.engine.kv.eviction import LRUPolicy
from lazyattn_rag.engine.planning.prompt_plan import ChunkSegment, PrefixKeys, PromptPlan
from lazyattn_rag.engine.scheduling.request import Request, RequestStatus
from lazyattn_rag.engine.scheduling.scheduler import Scheduler
from lazyattn_rag.engine.scheduling.scheduler_output import ChunkPrefillJob, ComputeJob, HeadSeedJob
from lazyattn_rag.types.errors import CacheCapacityError
from lazyattn_rag.types.outputs import RequestStats
from lazyattn_rag.types.sampling_params import SamplingParams

BS = 4  # tokens per block
SAMPLED = 7  # the token every sampling compute job "samples"


def scheduler(num_blocks: int, budget: int = 64, max_num_seqs: int = 8, prefill_with_encodes: bool = True,
              anchor_tokens: int = 0, retained: tuple[str, ...] = ()) -> Scheduler:
    """A scheduler over a fresh pool of ``num_blocks``; with ``anchor_tokens``, an anchor chunk
    ("anchor") encoded into the first blocks and pinned for good, as the engine does at start;
    its cache retains the chunk keys ``retained`` (as registered documents' keys are)."""
    cache = ChunkCache(BlockPool(num_blocks), BS, LRUPolicy())
    for key in retained:
        cache.retain_key(key)
    context = []
    if anchor_tokens:
        blocks = cache.allocate(-(-anchor_tokens // BS))
        entry = cache.insert_pending("anchor", blocks, anchor_tokens, 0, token_ids=tuple(range(anchor_tokens)))
        cache.mark_ready("anchor")
        context = block_table_entries(entry.block_ids, anchor_tokens, 0, BS)
    return Scheduler(cache, budget, max_num_seqs, context, "anchor" if anchor_tokens else None,
                     prefill_with_encodes, EngineCounters())


def tokens_of(key: str, n: int) -> tuple[int, ...]:
    """A chunk's tokens: a function of its key (a hit compares them with the entry's)."""
    base = 1000 + zlib.crc32(key.encode()) % 1000 * 100
    return tuple(range(base, base + n))


def plan(*chunks: tuple, tail: int, local_start: int = 0) -> PromptPlan:
    """Chunks ``(key, num_tokens, doc_id)`` back to back from position 0 (a document chunk encoded
    at ``local_start``, the head at 0), then a query tail of ``tail`` tokens."""
    segments, g = [], 0
    for key, n, doc_id in chunks:
        segments.append(ChunkSegment(key, tokens_of(key, n), 0 if doc_id is None else local_start, g, doc_id))
        g += n
    return PromptPlan(tuple(segments), tuple(range(500, 500 + tail)))


def request(rid: str, p: PromptPlan, arrival: float, warm_only: bool = False) -> Request:
    """A request as ``LLMEngine.submit`` makes it (its tail counted as computed from the start)."""
    stats = RequestStats(rid, num_prompt_tokens=p.num_prompt_tokens)
    stats.num_computed_tokens = len(p.query_token_ids) + p.num_text_tokens
    return Request(rid, p, SamplingParams(max_tokens=16), stats, arrival_time=arrival, warm_only=warm_only)


def served_and_left(sched: Scheduler, p: PromptPlan) -> None:
    """A request ``r1`` of plan ``p`` admitted, run for one step and removed (its chunks stay
    cached, unpinned; its own blocks go to the back of the free list)."""
    r1 = request("r1", p, 1.0)
    sched.add(r1)
    ran(sched, sched.schedule())
    sched.remove(r1)


def ran(sched: Scheduler, out) -> None:
    """What the engine does once a step's forward pass ran: the scheduler's update, then one
    sampled token for each compute job that samples."""
    sched.update_from_output(out)
    for compute in out.computes:
        if compute.sample:
            compute.request.output_ids.append(SAMPLED)


def job(key: str, n: int, blocks: list[int], context=(), start: int = 0, length: int | None = None,
        local_start: int = 0) -> ChunkPrefillJob:
    """The expected piece ``start .. start + length`` of chunk ``key`` (``n`` tokens in all)."""
    length = n - start if length is None else length
    return ChunkPrefillJob(key, tokens_of(key, n)[start:start + length], local_start, blocks, list(context), start,
                           start + length == n)


# --- admission: misses started, hits pinned ---------------------------------------------------------
def test_a_cold_request_gets_fifo_blocks_and_its_prefill_joins_the_encodes():
    s = scheduler(16, retained=("A", "B"))
    cache = s.cache
    r = request("r", plan(("H", 5, None), ("A", 6, "a"), ("B", 4, "b"), tail=3), 1.0)
    s.add(r)

    out = s.schedule()
    # chunks in prompt order, then the request's own prompt block: H 0-1, A 2-3, B 4, private 5
    assert out.chunk_prefills == [job("H", 5, [0, 1]), job("A", 6, [2, 3]), job("B", 4, [4])]
    assert out.computes == [ComputeJob(r, 0, 3, True)]
    assert (out.copies, out.failed, out.warmed, out.released_ids) == ([], [], [], [])
    assert out.num_batched_tokens == 5 + 6 + 4 + 3
    assert r.status is RequestStatus.RUNNING and s.running == [r] and not s.waiting and not s.acquired
    assert cache.pins_of("r") == ["H", "A", "B"] and r.private_blocks == [5]
    # each chunk at its offset: delta = global start - local start
    assert r.context_entries == [BlockEntry(0, 0, 4), BlockEntry(1, 0, 1), BlockEntry(2, 5, 4), BlockEntry(3, 5, 2),
                                 BlockEntry(4, 11, 4)]
    assert r.context_len == 15
    # pending entries: pinned by the encoder and by the request
    assert [(e.key, e.ready, e.pin_count) for e in cache.entries()] == [("H", False, 2), ("A", False, 2),
                                                                         ("B", False, 2)]
    assert r.stats.docs_missed == ["a", "b"] and r.stats.docs_hit == []
    assert r.stats.num_computed_tokens == 3 + 15
    assert cache.pool.free_block_ids() == list(range(6, 16))
    cache.check_integrity()

    ran(s, out)  # the chunks are written: readable, the encoder lets go; the tail counts as computed
    assert [(e.key, e.ready, e.pin_count) for e in cache.entries()] == [("H", True, 1), ("A", True, 1),
                                                                         ("B", True, 1)]
    assert r.num_computed == 3
    cache.check_integrity()

    out = s.schedule()  # decode: the 4th private token still fits block 5
    assert out.chunk_prefills == [] and out.computes == [ComputeJob(r, 3, 1, True)]
    assert r.private_blocks == [5]
    ran(s, out)
    out = s.schedule()  # the 5th needs a block: the next free one
    assert out.computes == [ComputeJob(r, 4, 1, True)] and r.private_blocks == [5, 6]
    ran(s, out)
    assert r.num_computed == 5
    cache.check_integrity()

    s.remove(r)  # finished: private blocks back at the end of the free list, pins dropped, chunks kept
    assert cache.pool.free_block_ids() == list(range(7, 16)) + [5, 6]
    assert [(e.key, e.pin_count) for e in cache.entries()] == [("H", 0), ("A", 0), ("B", 0)]
    assert cache.num_evictable_blocks == 5
    out = s.schedule()
    assert out.is_empty and out.released_ids == ["r"] and not s.has_unfinished()
    cache.check_integrity()


def test_a_chunk_two_requests_need_in_one_step_is_prefilled_once():
    s = scheduler(16, retained=("A",))
    cache = s.cache
    r1 = request("r1", plan(("A", 6, "a"), tail=3), 1.0)
    r2 = request("r2", plan(("A", 6, "a"), tail=2), 2.0)
    s.add(r1)
    s.add(r2)

    out = s.schedule()
    # r1 starts A (blocks 0-1) and takes block 2; r2 pins the pending entry and takes block 3
    assert out.chunk_prefills == [job("A", 6, [0, 1])]
    assert out.computes == [ComputeJob(r1, 0, 3, True), ComputeJob(r2, 0, 2, True)]
    assert r1.private_blocks == [2] and r2.private_blocks == [3]
    assert r1.context_entries == r2.context_entries == [BlockEntry(0, 0, 4), BlockEntry(1, 0, 2)]
    assert cache.lookup("A", touch=False).pin_count == 3  # the encoder and both requests
    assert r1.prefilled_keys == {"A"} and r2.prefilled_keys == set()
    assert (r1.stats.docs_missed, r1.stats.docs_hit) == (["a"], [])
    assert (r2.stats.docs_missed, r2.stats.docs_hit) == ([], ["a"])
    assert r1.stats.num_computed_tokens == 3 + 6 and r2.stats.num_computed_tokens == 2
    cache.check_integrity()

    ran(s, out)
    entry = cache.lookup("A", touch=False)
    assert entry.ready and entry.pin_count == 2
    assert (r1.num_computed, r2.num_computed) == (3, 2)
    cache.check_integrity()


def test_a_cached_chunk_is_pinned_and_only_the_miss_is_prefilled():
    s = scheduler(8, retained=("A", "B"))
    cache = s.cache
    served_and_left(s, plan(("A", 6, "a"), tail=3))  # A in blocks 0-1, r1's tail in block 2: free 3 4 5 6 7 2

    r2 = request("r2", plan(("A", 6, "a"), ("B", 4, "b"), tail=3), 2.0)
    s.add(r2)
    out = s.schedule()
    assert out.chunk_prefills == [job("B", 4, [3])]
    assert out.computes == [ComputeJob(r2, 0, 3, True)]
    assert out.released_ids == ["r1"]
    assert r2.private_blocks == [4] and cache.pins_of("r2") == ["A", "B"]
    assert r2.context_entries == [BlockEntry(0, 0, 4), BlockEntry(1, 0, 2), BlockEntry(3, 6, 4)]
    assert cache.lookup("A", touch=False).pin_count == 1 and cache.lookup("B", touch=False).pin_count == 2
    assert (r2.stats.docs_hit, r2.stats.docs_missed) == (["a"], ["b"])
    assert r2.stats.num_computed_tokens == 3 + 4
    assert cache.pool.free_block_ids() == [5, 6, 7, 2]
    cache.check_integrity()


def test_a_miss_evicts_an_unpinned_chunk_and_reuses_its_blocks():
    s = scheduler(5, retained=("A", "B"))
    cache = s.cache
    served_and_left(s, plan(("A", 8, "a"), tail=3))  # A 0-1, private 2: free 3 4 2; A (0-1) evictable

    r2 = request("r2", plan(("B", 12, "b"), tail=3), 2.0)  # B needs 3 blocks and its tail 1: 4 > 3 free
    s.add(r2)
    out = s.schedule()
    # B takes the three free blocks; its tail's block comes from evicting A (0, 1 freed in that order)
    assert out.chunk_prefills == [job("B", 12, [3, 4, 2])]
    assert out.computes == [ComputeJob(r2, 0, 3, True)]
    assert r2.private_blocks == [0]
    assert cache.lookup("A") is None and cache.num_evictions == 1
    assert cache.pool.free_block_ids() == [1]
    cache.check_integrity()


def test_a_request_without_room_waits_then_is_admitted_once_blocks_free():
    s = scheduler(6, retained=("A", "B"))
    cache = s.cache
    r1 = request("r1", plan(("A", 8, "a"), tail=4), 1.0)
    r2 = request("r2", plan(("B", 8, "b"), tail=5), 2.0)  # B 2 blocks + its tail 2: 4, fits the cache alone
    s.add(r1)
    s.add(r2)

    out = s.schedule()  # r1: A 0-1, private 2; r2 needs 4 with 3 free and nothing evictable: it waits
    assert out.chunk_prefills == [job("A", 8, [0, 1])]
    assert out.computes == [ComputeJob(r1, 0, 4, True)]
    assert list(s.waiting) == [r2] and r2.status is RequestStatus.WAITING
    assert cache.pins_of("r2") == [] and r2.private_blocks == [] and cache.lookup("B") is None  # took nothing
    assert cache.pool.free_block_ids() == [3, 4, 5]
    cache.check_integrity()

    ran(s, out)
    out = s.schedule()  # r1's 5th token takes block 3; r2 still finds 2 free and waits again
    assert out.computes == [ComputeJob(r1, 4, 1, True)] and r1.private_blocks == [2, 3]
    assert out.chunk_prefills == [] and list(s.waiting) == [r2]
    assert out.released_ids == []  # a request that waits held nothing the runner keeps: not reported
    ran(s, out)
    cache.check_integrity()

    s.remove(r1)  # frees 2, 3 after 4, 5; A stays cached, unpinned
    out = s.schedule()
    assert out.released_ids == ["r1"]
    assert out.chunk_prefills == [job("B", 8, [4, 5])]
    assert out.computes == [ComputeJob(r2, 0, 5, True)]
    assert r2.private_blocks == [2, 3] and r2.status is RequestStatus.RUNNING and not s.waiting
    assert cache.lookup("A", touch=False) is not None and cache.num_evictions == 0  # free blocks sufficed
    assert cache.pool.free_block_ids() == []
    cache.check_integrity()


def test_at_most_max_num_seqs_requests_hold_blocks():
    s = scheduler(16, max_num_seqs=2)
    r1, r2, r3 = (request(f"r{i}", plan(tail=4), float(i)) for i in (1, 2, 3))
    for r in (r1, r2, r3):
        s.add(r)

    out = s.schedule()
    assert out.computes == [ComputeJob(r1, 0, 4, True), ComputeJob(r2, 0, 4, True)]
    assert (r1.private_blocks, r2.private_blocks) == ([0], [1])
    assert list(s.waiting) == [r3] and r3.status is RequestStatus.WAITING
    ran(s, out)

    s.remove(r1)  # free: 2 .. 15, 0
    out = s.schedule()  # r2 decodes into a new block first, then r3 is admitted
    assert out.released_ids == ["r1"]
    assert out.computes == [ComputeJob(r2, 4, 1, True), ComputeJob(r3, 0, 4, True)]
    assert (r2.private_blocks, r3.private_blocks) == ([1, 2], [3])
    s.cache.check_integrity()


def test_a_request_that_could_never_fit_fails_alone_at_admission():
    s = scheduler(4, retained=("A",))
    big = request("big", plan(("A", 12, "a"), tail=4), 1.0)  # A 3 blocks + tail and next token 2: 5 > 4
    small = request("small", plan(tail=4), 2.0)
    s.add(big)
    s.add(small)

    out = s.schedule()
    [(failed, error)] = out.failed
    assert failed is big and isinstance(error, CacheCapacityError)
    assert str(error) == "request needs 5 KV blocks (16 prompt tokens) but the cache has 4 blocks of 4 tokens"
    assert out.chunk_prefills == [] and out.computes == [ComputeJob(small, 0, 4, True)]
    assert small.private_blocks == [0] and big.private_blocks == [] and s.cache.num_entries == 0
    s.cache.check_integrity()


def test_a_warm_up_finishes_once_its_chunks_are_written_without_a_compute():
    s = scheduler(8, retained=("A",))
    warm = request("warm", plan(("A", 6, "a"), tail=0), 1.0, warm_only=True)
    s.add(warm)

    out = s.schedule()
    assert out.chunk_prefills == [job("A", 6, [0, 1])] and out.computes == [] and out.warmed == []
    assert s.acquired == [warm] and warm.private_blocks == []  # it waits for the pass that writes A
    ran(s, out)
    out = s.schedule()
    assert out.warmed == [warm] and out.is_empty and not s.acquired
    assert s.cache.pins_of("warm") == ["A"]  # held until the engine finishes it
    s.remove(warm)
    assert s.cache.lookup("A", touch=False).pin_count == 0 and s.cache.num_evictable_blocks == 2
    s.cache.check_integrity()


# --- chunked encoding ---------------------------------------------------------------------------
def test_a_chunk_over_the_budget_is_encoded_in_pieces_after_the_anchor():
    """A 1-token anchor in block 0; a 10-token document at local position 1 and global 3 (delta 2),
    after a 3-token head; a budget of 8 tokens a step."""
    s = scheduler(16, budget=8, anchor_tokens=1, retained=("A",))
    cache = s.cache
    anchor = [BlockEntry(0, 0, 1)]
    assert s.anchor_context == anchor and s.budget.num_usable_blocks == 15
    r = request("r", plan(("H", 3, None), ("A", 10, "a"), tail=2, local_start=1), 1.0)
    s.add(r)

    out = s.schedule()
    # the head alone (no context), then A's first 5 tokens after the anchor; the budget is spent,
    # so the request's prefill waits for A's last piece
    assert out.chunk_prefills == [job("H", 3, [1]), job("A", 10, [2, 3, 4], anchor, 0, 5, local_start=1)]
    assert out.computes == [] and s.acquired == [r] and r.private_blocks == [5]
    assert [t.key for t in s.chunk_tasks] == ["A"]
    ran(s, out)
    assert cache.lookup("H", touch=False).ready and not cache.lookup("A", touch=False).ready
    assert cache.lookup("A", touch=False).pin_count == 2
    cache.check_integrity()

    out = s.schedule()
    assert out.chunk_prefills == [job("A", 10, [2, 3, 4], anchor, 5, local_start=1)]
    assert out.computes == [ComputeJob(r, 0, 2, True)]  # joins the pass that writes A's last piece
    assert out.num_batched_tokens == 7 and s.chunk_tasks == []
    assert r.context_entries == [BlockEntry(1, 0, 3), BlockEntry(2, 2, 4), BlockEntry(3, 2, 4), BlockEntry(4, 2, 2)]
    ran(s, out)
    assert cache.lookup("A", touch=False).ready and cache.lookup("A", touch=False).pin_count == 1
    assert r.num_computed == 2
    cache.check_integrity()


def test_a_prompt_over_the_budget_is_prefilled_in_pieces_even_alone():
    """A 20-token plain prompt and a budget of 8: pieces of 8, 8 and 4 tokens in three steps, also
    with nothing else running (a break-it trial saw a 7,947-token prompt computed in one step past
    a budget of 256, the replica deaf to aborts and stats for the whole of it)."""
    s = scheduler(16, budget=8)
    r = request("r", plan(tail=20), 1.0)
    r.stats.num_computed_tokens = 0
    s.add(r)
    pieces = []
    for _ in range(3):
        out = s.schedule()
        assert out.num_batched_tokens <= 8
        pieces += [(c.start, c.num_tokens, c.sample) for c in out.computes]
        ran(s, out)
    assert pieces == [(0, 8, False), (8, 8, False), (16, 4, True)] and r.num_computed == 20
    s.cache.check_integrity()


# --- preemption ---------------------------------------------------------------------------------
def test_the_newest_request_is_preempted_when_an_older_one_needs_a_block():
    s = scheduler(5, retained=("A",))
    cache = s.cache
    r1 = request("r1", plan(tail=4), 1.0)
    r2 = request("r2", plan(tail=4), 2.0)
    r3 = request("r3", plan(("A", 4, "a"), tail=4), 3.0)
    for r in (r1, r2, r3):
        s.add(r)
    out = s.schedule()  # r1: block 0; r2: 1; r3: A in 2, its tail in 3
    assert out.chunk_prefills == [job("A", 4, [2])]
    assert out.computes == [ComputeJob(r1, 0, 4, True), ComputeJob(r2, 0, 4, True), ComputeJob(r3, 0, 4, True)]
    assert (r1.private_blocks, r2.private_blocks, r3.private_blocks) == ([0], [1], [3])
    assert cache.pool.free_block_ids() == [4]
    ran(s, out)
    r4 = request("r4", plan(tail=4), 4.0)
    s.add(r4)

    out = s.schedule()
    # Each needs a block for its 5th token. r1 takes 4, the last; for r2 nothing is free or
    # evictable, so the newest request not in this step, r3, gives back block 3 and its pin on A
    # and goes back first in line, before r4; r2 takes block 3. r3's re-admission (5 tokens to
    # compute: 2 blocks) finds none free and A pinned by itself: it waits
    assert out.computes == [ComputeJob(r1, 4, 1, True), ComputeJob(r2, 4, 1, True)]
    assert (r1.private_blocks, r2.private_blocks) == ([0, 4], [1, 3])
    assert r3.status is RequestStatus.WAITING and r3.private_blocks == [] and cache.pins_of("r3") == []
    assert r3.num_computed == 0 and r3.output_ids == [SAMPLED]  # recomputed later from what it streamed
    assert r3.num_preemptions == 1 and s.counters.num_preemptions == 1
    assert out.released_ids == ["r3"]  # preempted while running: its block table goes with this step
    assert list(s.waiting) == [r3, r4] and s.running == [r1, r2]
    entry = cache.lookup("A", touch=False)
    assert entry.ready and entry.pin_count == 0 and cache.num_evictable_blocks == 1  # A stays cached
    assert cache.pool.free_block_ids() == []
    cache.check_integrity()
    ran(s, out)

    s.remove(r1)  # frees 0 and 4
    out = s.schedule()
    assert out.released_ids == ["r1"]  # finished; r3 waiting released nothing the runner keeps
    assert out.chunk_prefills == []  # A was kept: a hit now
    assert out.computes == [ComputeJob(r2, 5, 1, True), ComputeJob(r3, 0, 5, True)]
    assert r3.private_blocks == [0, 4] and r3.context_entries == [BlockEntry(2, 0, 4)]
    assert (r3.stats.docs_missed, r3.stats.docs_hit) == (["a"], [])  # counted at its first admission only
    assert cache.lookup("A", touch=False).pin_count == 1
    assert list(s.waiting) == [r4]  # no block free and nothing evictable
    cache.check_integrity()


# --- a prompt head seeded from a plain prompt's exact-prefix blocks (issue 36) ----------------------
def seeded_head_setup():
    """A plain prompt ``r1`` (the 10 head tokens, then 4 more) ran and left; its 3 full blocks
    (0, 1, 2) stay cached as exact-prefix entries. ``r2`` places the same 10 tokens as a prompt
    head not cached (as a learned layout of the next plain ask does), then a 3-token tail."""
    s = scheduler(16)
    head = tokens_of("H", 10)
    query = head + (7, 7, 7, 7)
    keys = PrefixKeys(query, "seed", BS)
    served_and_left(s, PromptPlan((), query, prefix_block_keys=keys))
    p2 = PromptPlan((ChunkSegment("H", head, 0, 0, None),), (1, 2, 3), head_prefix_keys=PrefixKeys(head, "seed", BS))
    r2 = request("r2", p2, 2.0)
    s.add(r2)
    return s, r2, list(keys)


def test_a_head_not_cached_copies_a_plain_prompts_cached_blocks_and_encodes_only_the_rest():
    s, r2, keys = seeded_head_setup()
    cache = s.cache
    out = s.schedule()
    # the head gets blocks 4-6; blocks 0 and 1 are copied into 4 and 5 before the pass, tokens 8-9 encoded
    assert out.head_seeds == [HeadSeedJob("H", keys[:2], [0, 1], [4, 5])]
    assert out.chunk_prefills == [job("H", 10, [4, 5, 6], start=8)]
    assert r2.num_seeded_tokens == 8 and r2.stats.num_exact_prefix_tokens == 8 and r2.stats.num_computed_tokens == 5
    assert [cache.lookup(k, touch=False).pin_count for k in keys] == [1, 1, 0]  # for this step's copy only
    ran(s, out)
    assert [cache.lookup(k, touch=False).pin_count for k in keys] == [0, 0, 0]
    assert cache.lookup("H", touch=False).ready and cache.pins_of("r2") == ["H"]
    cache.check_integrity()


def test_a_seeded_head_whose_step_fails_is_dropped_and_its_sources_let_go():
    s, r2, keys = seeded_head_setup()
    cache = s.cache
    out = s.schedule()
    assert s.abandon(out) == [r2]
    assert cache.lookup("H", touch=False, include_dead=True) is None and s.chunk_tasks == []
    assert [cache.lookup(k, touch=False).pin_count for k in keys] == [0, 0, 0]
    cache.check_integrity()


def test_a_head_of_whole_cached_blocks_is_copied_and_not_encoded():
    """A head of exactly two cached blocks: both copied, no encode; readable from this step's
    pass (its request computes its tail in the same pass) and ready after it."""
    s = scheduler(16)
    head = tokens_of("H", 8)
    keys = PrefixKeys(head + (7,), "seed", BS)
    served_and_left(s, PromptPlan((), head + (7,), prefix_block_keys=keys))
    r2 = request("r2", PromptPlan((ChunkSegment("H", head, 0, 0, None),), (1,),
                                  head_prefix_keys=PrefixKeys(head, "seed", BS)), 2.0)
    s.add(r2)
    out = s.schedule()
    assert out.head_seeds == [HeadSeedJob("H", list(keys), [0, 1], [3, 4], complete=True)]
    assert out.chunk_prefills == [] and s.chunk_tasks == [] and out.computes == [ComputeJob(r2, 0, 1, True)]
    assert r2.stats.num_exact_prefix_tokens == 8 and r2.stats.num_computed_tokens == 1
    ran(s, out)
    assert s.cache.lookup("H", touch=False).ready and s.cache.lookup("H", touch=False).pin_count == 1  # r2's
    s.cache.check_integrity()


def test_seed_sources_are_pinned_before_the_room_check_and_dropped_when_room_needs_them():
    """Found by an adversarial review. 13 blocks free and r1's 3 exact-prefix blocks evictable:
    r2 needs 15 (head 3, document A 10, own 2), room only by evicting the seed's sources, so the
    seed is dropped and the head encoded whole, instead of failing after the sources were pinned."""
    s = scheduler(16, retained=("A",))
    head = tokens_of("H", 10)
    query = head + (7, 7, 7, 7)
    served_and_left(s, PromptPlan((), query, prefix_block_keys=PrefixKeys(query, "seed", BS)))
    p2 = PromptPlan((ChunkSegment("H", head, 0, 0, None), ChunkSegment("A", tokens_of("A", 40), 0, 10, "a")),
                    tuple(range(500, 507)), head_prefix_keys=PrefixKeys(head, "seed", BS))
    r2 = request("r2", p2, 2.0)
    s.add(r2)
    out = s.schedule()
    assert out.failed == [] and out.head_seeds == [] and r2.num_seeded_tokens == 0
    assert out.chunk_prefills[0] == job("H", 10, [4, 5, 6])  # encoded from token 0
    assert r2.private_blocks == [2, 0]  # the room: two of r1's exact-prefix blocks, evicted
    s.cache.check_integrity()


def test_the_heads_own_blocks_never_evict_its_seed_sources():
    """Found by an adversarial review: with 4 blocks free and a newer chunk X evictable, the head's
    blocks come from X, not from the older exact-prefix blocks it is seeded from."""
    s = scheduler(7, retained=("X",))
    head = tokens_of("H", 10)
    query = head + (7, 7, 7, 7)
    keys = PrefixKeys(query, "seed", BS)
    served_and_left(s, PromptPlan((), query, prefix_block_keys=keys))  # blocks 0-2 cached, 3-6 free
    r0 = request("r0", plan(("X", 8, "x"), tail=3), 1.5)
    s.add(r0)
    ran(s, s.schedule())
    s.remove(r0)
    r2 = request("r2", PromptPlan((ChunkSegment("H", head, 0, 0, None),), (1, 2, 3),
                                  head_prefix_keys=PrefixKeys(head, "seed", BS)), 2.0)
    s.add(r2)
    out = s.schedule()
    assert [seed.src_keys for seed in out.head_seeds] == [list(keys)[:2]] and r2.num_seeded_tokens == 8
    assert s.cache.lookup("X", touch=False) is None  # evicted for the room instead
    s.cache.check_integrity()


def test_a_cached_block_of_other_tokens_is_never_a_seed_and_is_counted():
    s = scheduler(16)
    head = tokens_of("H", 10)
    keys = PrefixKeys(head, "seed", BS)
    s.cache.insert(keys[0], s.cache.allocate(1), BS, 0, (1, 2, 3, 4), exact_prefix=True)  # the key, other tokens
    r2 = request("r2", PromptPlan((ChunkSegment("H", head, 0, 0, None),), (1, 2, 3), head_prefix_keys=keys), 2.0)
    s.add(r2)
    out = s.schedule()
    assert out.head_seeds == [] and r2.num_seeded_tokens == 0 and s.counters.num_key_collisions == 1
    s.cache.check_integrity()


# --- a failed step -----------------------------------------------------------------------------
def test_abandon_releases_the_steps_requests_and_the_holders_of_its_chunks():
    """prefill_with_encodes=False keeps r1 and r2 out of the step that encodes their chunks:
    they are released because they hold those chunks; r0 because its decode was in the step.
    B was to take two steps: its task goes too."""
    s = scheduler(16, budget=16, prefill_with_encodes=False, retained=("A", "B"))
    cache = s.cache
    r0 = request("r0", plan(tail=4), 0.0)
    r1 = request("r1", plan(("A", 6, "a"), tail=3), 1.0)
    r2 = request("r2", plan(("B", 10, "b"), tail=3), 2.0)
    for r in (r0, r1, r2):
        s.add(r)

    out = s.schedule()
    # budget 16: r0's 4 tokens, A's 6, then the first 6 of B's 10
    assert out.computes == [ComputeJob(r0, 0, 4, True)]
    assert out.chunk_prefills == [job("A", 6, [1, 2]), job("B", 10, [4, 5, 6], (), 0, 6)]
    assert (r0.private_blocks, r1.private_blocks, r2.private_blocks) == ([0], [3], [7])
    assert s.running == [r0] and s.acquired == [r1, r2] and [t.key for t in s.chunk_tasks] == ["B"]
    cache.check_integrity()

    victims = s.abandon(out)  # the forward pass raised
    assert victims == [r0, r1, r2]
    assert s.running == [] and s.acquired == [] and s.chunk_tasks == [] and cache.num_entries == 0
    assert all(r.private_blocks == [] and cache.pins_of(r.request_id) == [] for r in victims)
    # freed in order: r0's, r1's and r2's own blocks, then B's pending entry, then A's
    assert cache.pool.free_block_ids() == list(range(8, 16)) + [0, 3, 7, 4, 5, 6, 1, 2]
    cache.check_integrity()
    out = s.schedule()
    assert out.is_empty and out.released_ids == ["r0"] and not s.has_unfinished()  # r1, r2 never ran



def test_a_request_preempted_and_readmitted_in_one_step_is_reported_released_in_that_step():
    """Found by an adversarial review: r4 is preempted for r1's next block, a dead chunk's
    prefill task is dropped in the same schedule() (freeing its blocks) and r4 is admitted again
    at once. Its old packed context (kept by the runner) must be dropped before this very step's
    inputs are prepared, so r4 is in this output's released_ids, not the next one's."""
    s = scheduler(12, budget=6, retained=("X",))
    cache = s.cache
    r1 = request("r1", plan(tail=4), 1.0)
    s.add(r1)
    ran(s, s.schedule())  # r1: 4 tokens in block 0
    r3 = request("r3", plan(("X", 24, "x"), tail=1), 3.0)
    s.add(r3)
    out = s.schedule()  # r1's 5th token takes block 1; X gets 2-7 and its first piece, r3's tail 8
    assert out.chunk_prefills == [job("X", 24, [2, 3, 4, 5, 6, 7], length=5)] and r3.private_blocks == [8]
    ran(s, out)
    s.remove(r3)  # r3's caller leaves: X's prefill goes on under its own pin; block 8 is free again
    r4 = request("r4", plan(tail=16), 4.0)
    s.add(r4)
    for _ in range(3):  # r4 is admitted into 9, 10, 11, 8 and runs; the pool is full
        ran(s, s.schedule())
    assert r4.status is RequestStatus.RUNNING and r4.private_blocks == [9, 10, 11, 8] and r4.num_computed > 0
    assert r1.private_blocks == [0, 1] and cache.pool.num_free == 0 and [t.key for t in s.chunk_tasks] == ["X"]
    while r1.num_private_blocks(r1.num_computed + 1, BS) == len(r1.private_blocks):  # until r1 needs a block
        ran(s, s.schedule())
    assert cache.pool.num_free == 0 and cache.num_evictable_blocks == 0 and r4.num_preemptions == 0
    cache.release_key("X")  # X's document goes: only its prefill task holds it
    out = s.schedule()
    assert r4.num_preemptions == 1 and r4.status is RequestStatus.RUNNING  # preempted, then admitted again
    assert s.chunk_tasks == [] and cache.lookup("X", touch=False, include_dead=True) is None
    assert [c.request for c in out.computes] == [r1, r4] and out.computes[1].start == 0
    assert out.released_ids == ["r4"]  # in this step's output: its stale table goes before inputs are prepared
    cache.check_integrity()


def test_private_token_slice_and_count_match_the_private_token_list():
    """A decode step reads its tokens through ``private_token_slice`` and counts through
    ``num_private_tokens``; both must equal the full list's slice and length, across text
    segments, a query tail after a prefix-cache hit, and generated tokens."""
    from lazyattn_rag.engine.planning.prompt_plan import TextSegment

    p = PromptPlan((ChunkSegment("a", tokens_of("a", 6), 0, 0, "a"),), tuple(range(500, 509)),
                   texts=(TextSegment((1, 2, 3), 6), TextSegment((4, 5), 9)))
    r = request("r", p, 0.0)
    r.num_prefix_tokens = 3
    r.output_ids += [70, 71, 72]
    full = r.private_token_ids
    assert r.num_private_tokens == len(full) == 5 + 6 + 3
    for start in range(len(full) + 1):
        for end in range(start, len(full) + 2):
            assert r.private_token_slice(start, end) == full[start:end]


def test_a_fork_shares_the_prompts_blocks_and_copies_its_last_partial_block():
    """``n`` answers: after the parent's prompt ran, a child holds the parent's chunks (pinned
    under its own id), its full private blocks (one more reference each) and a new block that
    the next step fills with a slot copy of the prompt's last, partly filled block."""
    from lazyattn_rag.engine.scheduling.scheduler_output import SlotCopyJob

    s = scheduler(10, retained=("A",))
    cache = s.cache
    parent = request("p", plan(("A", 6, "a"), tail=6), 1.0)  # A in 0-1; the tail's 6 tokens in 2 (full) and 3 (2 slots)
    s.add(parent)
    ran(s, s.schedule())
    child = request("p-1", parent.plan, 1.0)
    assert s.fork(parent, child) and child.status is RequestStatus.RUNNING
    assert parent.private_blocks == [2, 3] and child.private_blocks == [2, 4]
    assert [cache.pool.ref_count(b) for b in (2, 3, 4)] == [2, 1, 1]
    assert cache.pins_of("p-1") == ["A"] and cache.lookup("A", touch=False).pin_count == 2
    assert child.context_entries == parent.context_entries and child.num_computed == parent.num_computed == 6
    child.output_ids.append(SAMPLED)
    out = s.schedule()
    assert out.slot_copies == [SlotCopyJob(3, 4, 0, 2, 0)]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.computes] == [("p", 6, 1), ("p-1", 6, 1)]
    ran(s, out)
    s.remove(parent)
    assert [cache.pool.ref_count(b) for b in (2, 3, 4)] == [1, 0, 1] and cache.pins_of("p-1") == ["A"]
    s.remove(child)
    assert cache.lookup("A", touch=False).pin_count == 0 and cache.pool.num_free == 8
    cache.check_integrity()


def test_a_fork_that_cannot_share_computes_its_prompt_itself():
    s = scheduler(4, retained=("A",))  # A 0-1, the tail 2-3: no block left for the copy
    parent = request("p", plan(("A", 6, "a"), tail=6), 1.0)
    s.add(parent)
    ran(s, s.schedule())
    child = request("p-1", parent.plan, 1.0)
    assert not s.fork(parent, child)
    assert child.status is RequestStatus.WAITING and list(s.waiting) == [child] and child.private_blocks == []
    assert s.cache.pins_of("p-1") == []
