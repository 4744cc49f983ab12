"""Trace-driven simulation of document KV caches on the engine's own cache code.

Every simulated cache is the engine's :class:`~lazyattn_rag.engine.kv.chunk_cache.ChunkCache`
over a :class:`~lazyattn_rag.engine.kv.block_pool.BlockPool` with a policy from
:func:`~lazyattn_rag.engine.kv.eviction.make_policy`; only the *key* of a document placement
differs between the caches compared:

* ``agnostic`` (ours, LazyAttention): key = the document. One copy serves every offset.
* ``position_aware`` (Block-Attention's cache): key = (document, position). One copy per
  offset the document was placed at.
* ``prefix`` (exact prefix caching, as vLLM's automatic prefix caching): key = the chained
  hash of every (position, document) up to and including this one. A placement hits only if
  every document before it in the request hit too (the match stops at the first miss).

A request pins the entries of its documents while it runs (as the engine's scheduler does),
so placing its later documents never evicts its earlier ones; a document that cannot get
blocks even after evicting everything evictable runs uncached (counted as a miss and as
``num_bypassed``).

The workload: a pool of documents with log-normal token lengths; requests of ``k``
distinct documents drawn from a Zipf(α) popularity over the pool (rank -> document is a
random permutation, so popularity is independent of length); each request places its
documents at ``k`` distinct positions out of ``D`` (the number of distinct offsets a document
can take), in increasing position order.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from lazyattn_rag.engine.kv.block_pool import BlockPool
from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.kv.eviction import EVICTION_POLICIES, EvictionPolicy, PriorityPolicy, make_policy

CACHE_KINDS = ("prefix", "position_aware", "agnostic")
# policies the simulator knows: the engine's, plus an oracle for the closed-form check
SIM_POLICIES = (*EVICTION_POLICIES, "static_lfu")
# K and V of all layers, bytes per token: layers * kv_heads * head_dim * 2 (K, V) * dtype bytes.
LLAMA31_8B_BF16_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # 131072 = 128 KiB


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V one token occupies over all layers."""
    return num_layers * num_kv_heads * head_dim * 2 * dtype_bytes


def kv_bytes_per_token_from_config(config: dict, dtype_bytes: int = 2) -> int:
    """:func:`kv_bytes_per_token` from a Hugging Face ``config.json`` dict (Llama-family keys).

    Raises:
        KeyError: ``num_hidden_layers`` or ``num_attention_heads`` is missing.
    """
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return kv_bytes_per_token(config["num_hidden_layers"], config.get("num_key_value_heads", heads), head_dim,
                              dtype_bytes)


class StaticLFUPolicy(PriorityPolicy):
    """Perfect LFU: evicts the entry with the fewest accesses *ever* (counts survive eviction).

    On a stationary popularity this converges to keeping the most popular keys, the ideal
    static cache the closed form assumes. Not an engine policy: an oracle for the check.
    """

    name = "static_lfu"

    def __init__(self):
        super().__init__()
        self._ever: Counter[str] = Counter()  # every key ever seen -> accesses

    def on_insert(self, key, num_tokens, num_blocks):
        self._ever[key] += 1
        super().on_insert(key, num_tokens, num_blocks)

    def on_hit(self, key):
        self._ever[key] += 1
        super().on_hit(key)

    def _priority(self, key):
        return self._ever[key]


def sim_policy(name: str) -> EvictionPolicy:
    """An engine policy (``lru``, ``lfu``, ``gdsf``) or ``static_lfu``. Raises ``ValueError`` otherwise."""
    return StaticLFUPolicy() if name == "static_lfu" else make_policy(name)


@dataclass(frozen=True)
class Workload:
    """Workload knobs.

    Attributes:
        num_docs: documents in the pool (>= docs_per_request).
        doc_tokens_median: median document length in tokens (log-normal).
        doc_tokens_sigma: log-normal sigma of the length (0 = every document the median).
        min_doc_tokens, max_doc_tokens: length clip in tokens.
        docs_per_request: ``k``, distinct documents per request.
        num_positions: ``D``, distinct positions a document can take (>= docs_per_request).
        zipf_alpha: popularity exponent α (document of rank ``i`` drawn with weight ``i^-α``).
        num_requests: requests in the trace.
        seed: seed of the trace.
    """

    num_docs: int = 20_000
    doc_tokens_median: int = 512
    doc_tokens_sigma: float = 0.5
    min_doc_tokens: int = 32
    max_doc_tokens: int = 4096
    docs_per_request: int = 5
    num_positions: int = 20
    zipf_alpha: float = 1.5
    num_requests: int = 20_000
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.docs_per_request <= min(self.num_docs, self.num_positions):
            raise ValueError(f"need 1 <= docs_per_request <= min(num_docs, num_positions), got "
                             f"{self.docs_per_request}, {self.num_docs}, {self.num_positions}")
        if self.zipf_alpha < 0 or self.num_requests < 1 or not 1 <= self.min_doc_tokens <= self.max_doc_tokens:
            raise ValueError("need zipf_alpha >= 0, num_requests >= 1 and 1 <= min_doc_tokens <= max_doc_tokens")


@dataclass(frozen=True)
class Trace:
    """A request trace.

    Attributes:
        doc_tokens: ``[num_docs]`` token length of each document.
        docs: ``[num_requests, k]`` document ids of each request, in prompt order.
        positions: ``[num_requests, k]`` position index (``0 .. D-1``) of each, increasing per row.
    """

    doc_tokens: np.ndarray
    docs: np.ndarray
    positions: np.ndarray


def make_trace(w: Workload) -> Trace:
    """Draw a trace for a workload (deterministic given ``w.seed``)."""
    rng = np.random.default_rng(w.seed)
    lengths = np.exp(np.log(w.doc_tokens_median) + w.doc_tokens_sigma * rng.standard_normal(w.num_docs))
    doc_tokens = np.clip(np.rint(lengths), w.min_doc_tokens, w.max_doc_tokens).astype(np.int64)
    weights = np.arange(1, w.num_docs + 1, dtype=np.float64) ** -w.zipf_alpha
    cdf = np.cumsum(weights / weights.sum())
    doc_of_rank = rng.permutation(w.num_docs)
    k = w.docs_per_request
    docs = np.empty((w.num_requests, k), dtype=np.int64)
    for r in range(w.num_requests):
        chosen: list[int] = []
        while len(chosen) < k:  # k distinct documents by rejection (draws in batches)
            for rank in np.searchsorted(cdf, rng.random(2 * k), side="right"):
                d = int(doc_of_rank[min(rank, w.num_docs - 1)])
                if d not in chosen:
                    chosen.append(d)
                    if len(chosen) == k:
                        break
        docs[r] = chosen
    positions = np.sort(np.argsort(rng.random((w.num_requests, w.num_positions)), axis=1)[:, :k], axis=1)
    return Trace(doc_tokens, docs, positions)


def placement_keys(kind: str, docs: np.ndarray, positions: np.ndarray) -> list[str]:
    """Cache keys of one request's document placements under a cache kind.

    Raises:
        ValueError: unknown kind.
    """
    if kind == "agnostic":
        return [f"d{d}" for d in docs]
    if kind == "position_aware":
        return [f"d{d}@{p}" for d, p in zip(docs, positions)]
    if kind == "prefix":
        keys, chain = [], ()
        for d, p in zip(docs, positions):
            chain = (*chain, int(p), int(d))
            keys.append("p" + ",".join(map(str, chain)))
        return keys
    raise ValueError(f"unknown cache kind {kind!r}; choose from {', '.join(CACHE_KINDS)}")


@dataclass
class SimResult:
    """Hit accounting of one simulated cache over a trace.

    Attributes:
        num_lookups: document placements looked up (requests x k).
        num_hits: placements served from the cache.
        num_tokens: document tokens placed.
        num_hit_tokens: document tokens served from the cache.
        num_bypassed: placements that could not be cached at all (request larger than the budget).
        num_evictions: entries evicted by the policy.
        budget_blocks: the pool size in blocks.
    """

    num_lookups: int = 0
    num_hits: int = 0
    num_tokens: int = 0
    num_hit_tokens: int = 0
    num_bypassed: int = 0
    num_evictions: int = 0
    budget_blocks: int = 0

    @property
    def doc_hit_ratio(self) -> float:
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.num_hit_tokens / self.num_tokens if self.num_tokens else 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__, doc_hit_ratio=self.doc_hit_ratio, token_hit_ratio=self.token_hit_ratio)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def unlimited_blocks(trace: Trace, kind: str, block_size: int) -> int:
    """A pool size that never evicts: the blocks of every distinct key in the trace."""
    seen: dict[str, int] = {}
    for docs, pos in zip(trace.docs, trace.positions):
        for key, d in zip(placement_keys(kind, docs, pos), docs):
            seen[key] = blocks_for(int(trace.doc_tokens[d]), block_size)
    return max(1, sum(seen.values()))


def budget_blocks(budget_bytes: float, bytes_per_token: int, block_size: int) -> int:
    """Whole KV blocks that fit in ``budget_bytes`` (block = ``block_size`` tokens)."""
    return max(1, int(budget_bytes // (bytes_per_token * block_size)))


def simulate(trace: Trace, kind: str, policy: str, num_blocks: int, block_size: int = 16,
             warmup_requests: int = 0, check_every: int = 0) -> SimResult:
    """Run a trace through one cache and count hits.

    Args:
        trace: the requests.
        kind: ``agnostic``, ``position_aware`` or ``prefix``.
        policy: ``lru``, ``lfu``, ``gdsf`` (the engine's) or ``static_lfu`` (oracle).
        num_blocks: the byte budget as KV blocks.
        block_size: tokens per block.
        warmup_requests: leading requests that fill the cache but are not counted.
        check_every: run the cache's ``check_integrity`` every this many requests (0 = never).
    Returns:
        the :class:`SimResult` of the counted requests.
    """
    cache = ChunkCache(BlockPool(num_blocks), block_size, sim_policy(policy))
    res = SimResult(budget_blocks=num_blocks)
    for r, (docs, pos) in enumerate(zip(trace.docs, trace.positions)):
        counted = r >= warmup_requests
        held: list[str] = []
        chain_intact = True
        for key, d in zip(placement_keys(kind, docs, pos), docs):
            tokens = int(trace.doc_tokens[d])
            hit = False
            if kind != "prefix" or chain_intact:
                hit = cache.lookup(key) is not None
            elif cache.lookup(key, touch=False) is not None:  # recomputed, but the same KV is already cached
                cache.pin(key)
                held.append(key)
            if hit:
                cache.pin(key)
                held.append(key)
            elif key not in held:
                chain_intact = False
                need = blocks_for(tokens, block_size)
                if cache.can_allocate(need):
                    cache.insert_pending(key, cache.allocate(need), tokens, 0)  # pinned for this request
                    cache.mark_ready(key)
                    held.append(key)
                elif counted:
                    res.num_bypassed += 1
            if counted:
                res.num_lookups += 1
                res.num_tokens += tokens
                res.num_hits += hit
                res.num_hit_tokens += tokens if hit else 0
        for key in held:
            cache.unpin(key)
        if check_every and r % check_every == 0:
            cache.check_integrity()
    res.num_evictions = cache.num_evictions
    return res


def zipf_partial_sum(n: int, alpha: float) -> float:
    """``Σ_{i=1..n} i^-α`` (0 for n < 1)."""
    return float((np.arange(1, n + 1, dtype=np.float64) ** -alpha).sum()) if n >= 1 else 0.0


def closed_form_ratio(num_entries: int, num_positions: int, alpha: float) -> float:
    """Agnostic / position-aware hit-ratio ratio of ideal caches of ``C`` entries.

    With one document per request at one of ``D`` equally likely positions, an ideal cache of
    ``C`` equal-size entries holds the ``C`` most popular documents (agnostic) or the
    ``⌊C/D⌋`` most popular documents at all ``D`` positions (aware), so the ratio is
    ``Σ_{i≤C} i^-α / Σ_{i≤⌊C/D⌋} i^-α``.

    Raises:
        ValueError: ``C < D`` (the aware cache holds no whole document).
    """
    if num_entries < num_positions:
        raise ValueError(f"need C >= D, got C={num_entries}, D={num_positions}")
    return zipf_partial_sum(num_entries, alpha) / zipf_partial_sum(num_entries // num_positions, alpha)


def closed_form_hit_ratio(num_entries: int, num_docs: int, alpha: float) -> float:
    """Hit ratio of an ideal cache holding the ``C`` most popular of ``N`` Zipf(α) documents."""
    return zipf_partial_sum(min(num_entries, num_docs), alpha) / zipf_partial_sum(num_docs, alpha)


def closed_form_check(num_entries: int = 100, num_positions: int = 20, alpha: float = 0.85, num_docs: int = 2000,
                      num_requests: int = 60_000, policy: str = "static_lfu", seed: int = 0) -> dict:
    """Simulate the closed form's setting and compare.

    One single-block document per request (every entry is one block, so the budget is ``C``
    entries plus one block for the request being placed), ``D`` uniform positions, Zipf(α)
    over ``num_docs``; the first 20% of the trace warms the cache and is not counted.

    Returns:
        dict with the simulated and closed-form hit ratios and their ratio.
    """
    w = Workload(num_docs=num_docs, doc_tokens_median=16, doc_tokens_sigma=0.0, min_doc_tokens=16,
                 max_doc_tokens=16, docs_per_request=1, num_positions=num_positions, zipf_alpha=alpha,
                 num_requests=num_requests, seed=seed)
    trace = make_trace(w)
    warm = num_requests // 5
    agnostic = simulate(trace, "agnostic", policy, num_entries + 1, 16, warm)
    aware = simulate(trace, "position_aware", policy, num_entries + 1, 16, warm)
    expected = closed_form_ratio(num_entries, num_positions, alpha)
    simulated = agnostic.doc_hit_ratio / aware.doc_hit_ratio if aware.doc_hit_ratio else math.inf
    return {
        "C": num_entries, "D": num_positions, "alpha": alpha, "num_docs": num_docs, "num_requests": num_requests,
        "policy": policy,
        "agnostic_hit_ratio": agnostic.doc_hit_ratio,
        "aware_hit_ratio": aware.doc_hit_ratio,
        "agnostic_hit_ratio_closed_form": closed_form_hit_ratio(num_entries, num_docs, alpha),
        "aware_hit_ratio_closed_form": closed_form_hit_ratio(num_entries // num_positions, num_docs, alpha),
        "ratio_simulated": simulated,
        "ratio_closed_form": expected,
        "relative_error": simulated / expected - 1,
    }
