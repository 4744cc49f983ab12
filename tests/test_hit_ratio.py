"""Hit-ratio simulator: closed-form check, exact accounting on a hand trace, workload and KV sizes."""

import numpy as np
import pytest

from benchmarks.hit_ratio_sim import (
    LLAMA31_8B_BF16_BYTES_PER_TOKEN,
    StaticLFUPolicy,
    Trace,
    Workload,
    budget_blocks,
    closed_form_check,
    closed_form_ratio,
    kv_bytes_per_token_from_config,
    make_trace,
    placement_keys,
    simulate,
    unlimited_blocks,
)


def test_closed_form_ratio_values():
    # Σ_{i<=100} i^-1 / Σ_{i<=5} i^-1 = H(100) / H(5) = 5.18738 / 2.28333
    assert closed_form_ratio(100, 20, 1.0) == pytest.approx(5.187378 / 2.283333, rel=1e-5)
    assert closed_form_ratio(100, 20, 0.85) == pytest.approx(2.87, abs=0.01)  # the "2.86x"
    assert closed_form_ratio(100, 1, 1.3) == 1.0  # one position: both caches are the same
    with pytest.raises(ValueError):
        closed_form_ratio(10, 20, 1.0)


@pytest.mark.parametrize("alpha", [0.85, 1.1])
def test_simulation_matches_closed_form_on_long_trace(alpha):
    check = closed_form_check(num_entries=100, num_positions=20, alpha=alpha, num_docs=2000, num_requests=30_000)
    assert abs(check["relative_error"]) < 0.05, check
    # each side also lands near the ideal static cache's hit ratio
    assert check["agnostic_hit_ratio"] == pytest.approx(check["agnostic_hit_ratio_closed_form"], abs=0.02)
    assert check["aware_hit_ratio"] == pytest.approx(check["aware_hit_ratio_closed_form"], abs=0.02)


# A hand trace: doc 0 = 16 tokens (1 block), doc 1 = 32 (2 blocks), doc 2 = 20 (2 blocks); 2 docs per request.
HAND = Trace(doc_tokens=np.array([16, 32, 20]),
             docs=np.array([[0, 1], [0, 1], [1, 0], [0, 2]]),
             positions=np.array([[0, 1], [0, 1], [0, 1], [0, 1]]))


def test_keys_distinguish_what_each_cache_reuses():
    docs, pos = np.array([4, 7]), np.array([2, 5])
    assert placement_keys("agnostic", docs, pos) == ["d4", "d7"]
    assert placement_keys("position_aware", docs, pos) == ["d4@2", "d7@5"]
    assert placement_keys("prefix", docs, pos) == ["p2,4", "p2,4,5,7"]
    with pytest.raises(ValueError):
        placement_keys("paged", docs, pos)


@pytest.mark.parametrize("kind, hits, hit_tokens", [
    ("agnostic", 5, 48 + 48 + 16),        # r1 both, r2 both (any order), r3 doc 0
    ("position_aware", 3, 48 + 16),       # r1 both; r2 new (doc, position) pairs; r3 doc 0 at 0
    ("prefix", 3, 48 + 16),               # r1 both; r2 another first doc; r3 shares only the first
])
def test_unlimited_budget_accounting(kind, hits, hit_tokens):
    res = simulate(HAND, kind, "lru", unlimited_blocks(HAND, kind, 16), 16, check_every=1)
    assert (res.num_lookups, res.num_hits, res.num_tokens, res.num_hit_tokens) == (8, hits, 180, hit_tokens)
    assert res.num_evictions == 0 and res.num_bypassed == 0
    assert res.doc_hit_ratio == hits / 8 and res.token_hit_ratio == hit_tokens / 180


def test_unlimited_blocks_counts_distinct_keys():
    assert unlimited_blocks(HAND, "agnostic", 16) == 1 + 2 + 2
    assert unlimited_blocks(HAND, "position_aware", 16) == 1 + 2 + 2 + 1 + 2  # 0@0 1@1 1@0 0@1 2@1


def test_tight_budget_evicts_and_bypasses():
    # 3 blocks, LRU: r3 evicts doc 1 (least recent, unpinned) to place doc 2 next to the pinned doc 0
    res = simulate(HAND, "agnostic", "lru", 3, 16, check_every=1)
    assert (res.num_hits, res.num_evictions, res.num_bypassed) == (5, 1, 0)
    # 2 blocks: a request's own pinned documents are never evicted for its later ones, so it
    # bypasses the cache instead: r0 d1, r1 d1, r2 d0 (after evicting d0 for d1), r3 d2
    res = simulate(HAND, "agnostic", "lru", 2, 16, check_every=1)
    assert (res.num_hits, res.num_evictions, res.num_bypassed) == (1, 2, 4)


def test_warmup_requests_are_not_counted():
    res = simulate(HAND, "agnostic", "lru", 5, 16, warmup_requests=2)
    assert (res.num_lookups, res.num_hits, res.num_tokens) == (4, 3, 48 + 36)


def test_prefix_chain_stops_at_first_miss():
    # doc 0 = 8 tokens, 1 = 16, 2 = 12 (1 block each), 3 = 32 (2 blocks); r2 repeats r0's chain
    trace = Trace(np.array([8, 16, 12, 32]), np.array([[0, 1], [2, 3], [0, 1]]), np.array([[0, 1], [0, 1], [0, 1]]))
    res = simulate(trace, "prefix", "gdsf", 6, 16, check_every=1)
    assert (res.num_hits, res.num_evictions) == (2, 0)  # r2 reuses the whole chain of r0
    # 4 blocks, GDSF (priority = frequency * tokens / blocks): r1 evicts p0,0 (8 per block); in r2 the
    # first doc misses (evicting p0,2, 12 per block), so the second cannot hit although its KV is still
    # cached: it is recomputed and deduplicated against the cached entry, not inserted twice
    res = simulate(trace, "prefix", "gdsf", 4, 16, check_every=1)
    assert (res.num_hits, res.num_evictions, res.num_bypassed) == (0, 2, 0)
    assert simulate(trace, "agnostic", "gdsf", 4, 16).num_hits == 1  # ours: doc 1 still hits in r2


def test_static_lfu_keeps_counts_across_evictions():
    policy = StaticLFUPolicy()
    for key, uses in (("a", 3), ("b", 1)):
        policy.on_insert(key, 16, 1)
        for _ in range(uses - 1):
            policy.on_hit(key)
        policy.set_evictable(key, True)
    assert policy.victim() == "b"
    policy.on_remove("a", evicted=True)
    policy.on_insert("a", 16, 1)  # back with 4 accesses in all
    policy.set_evictable("a", True)
    assert policy.eviction_order() == ["b", "a"]


def test_trace_respects_workload():
    w = Workload(num_docs=50, doc_tokens_median=100, doc_tokens_sigma=1.0, min_doc_tokens=20, max_doc_tokens=300,
                 docs_per_request=4, num_positions=6, zipf_alpha=1.2, num_requests=3000, seed=1)
    t = make_trace(w)
    assert t.docs.shape == t.positions.shape == (3000, 4)
    assert all(len(set(row)) == 4 for row in t.docs)
    assert (np.diff(t.positions, axis=1) > 0).all() and t.positions.min() >= 0 and t.positions.max() < 6
    assert t.doc_tokens.min() >= 20 and t.doc_tokens.max() <= 300
    counts = np.bincount(t.docs.ravel(), minlength=50)
    assert counts.max() > 3 * np.median(counts)  # skewed popularity
    assert np.array_equal(make_trace(w).docs, t.docs)  # deterministic given the seed


def test_kv_bytes_per_token_and_budget():
    llama31_8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert kv_bytes_per_token_from_config(llama31_8b) == LLAMA31_8B_BF16_BYTES_PER_TOKEN == 128 * 1024
    assert budget_blocks(2**30, LLAMA31_8B_BF16_BYTES_PER_TOKEN, 16) == 512  # 1 GiB = 8192 tokens
