"""The KV cache's configuration (``CacheConfig``) and a request's answer-fidelity remedies
(``RequestRemedies``): frozen, documented dataclasses, re-exported by ``types/config.py``."""

from __future__ import annotations

from dataclasses import dataclass

ANCHOR_MODES = ("none", "bos", "head")


def check_int(name: str, value, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
# the stored K/V's element type: "auto" (the model's dtype) or FP8 with per-token scales ("fp8" is
# "fp8_e4m3", as vLLM spells it); engine/kv/kv_layout.py maps them to torch dtypes (FP8_STORAGE)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
CACHE_MODES = ("lazy", "block_attention", "prefix", "full")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache and chunk encoding.

    Attributes:
        block_size: token slots per KV block (1..128; 16 by default).
        kv_cache_bytes: memory for K and V of all layers; ``None`` means 512 MiB on the CPU and
            ``kv_cache_fraction`` of free device memory on CUDA. Ignored when ``num_blocks`` is set.
        kv_cache_fraction: fraction of free device memory for the KV cache (CUDA; default 0.4).
        num_blocks: exact number of KV blocks (overrides ``kv_cache_bytes``).
        kv_cache_dtype: element type of the stored K/V (``engine/kv/kv_layout.py``): ``"auto"`` (the
            default): the model's dtype; ``"fp8_e4m3"`` (alias ``"fp8"``) or ``"fp8_e5m2"``: FP8
            with one float32 scale per token and KV head (``lazyattn_rag/types/kv_quant.py``), half the bytes
            of bfloat16 per token; a prefill's own new tokens still see each other in full
            precision. It is part of every chunk's cache key, and each attention backend declares
            the ones it reads (``supported_kv_cache_dtypes``).
        anchor: what a document chunk is encoded after (LazyAttention encodes chunks alone):
            ``"bos"`` (default): after one attention-sink token, the tokenizer's BOS (or, for a
            tokenizer without one, such as Qwen's, the first token of the prompt head);
            ``"none"``: local positions from 0, no context (the LazyAttention / Block-Attention
            setting); ``"head"``: after the prompt's fixed head (system turn and the opening of
            the user turn). Part of every chunk's cache key. The default is the quality
            benchmark's decision (``docs/quality.md``, "Default encoding").
        eviction_policy: order in which unpinned chunks are evicted: ``"lru"``, ``"lfu"`` (LFU
            with dynamic aging; keeps a Zipf-popular working set) or ``"gdsf"``
            (Greedy-Dual-Size-Frequency). See ``engine/kv/eviction.py``.
        mode: what is reused, for comparisons on one engine (``benchmarks/serving.py``):
            ``"lazy"`` (ours: one position-agnostic copy per document, RoPE deferred to attention),
            ``"block_attention"`` (position-aware: one copy per (document, offset); a miss at a new
            offset re-rotates another copy into new blocks; documents are encoded alone, no anchor),
            ``"prefix"`` (exact-prefix block reuse only, as vLLM's automatic prefix caching) or
            ``"full"`` (no reuse: every prompt is prefilled in full).
        host_memory_bytes: budget of the host-memory tier below the KV pool (0, the default:
            off). A chunk the pool evicts is copied there (write-back) and a later miss loads it
            instead of recomputing it (``engine/tiers/chunk_tiers.py``).
        disk_dir: directory of the disk tier (``None``, the default: off; ``lazyattn chat`` and
            ``ask`` use one under the user cache directory). Chunks are written there when
            computed, so a restarted process, or another on the same machine, loads them.
        disk_bytes: the disk tier's budget (default 2 GiB); past it, the least recently used go.
        redis_url: a Redis server shared by processes and replicas (``redis://host:port/db``;
            ``None``, the default: off; needs the ``redis`` extra). Chunks are written there when
            computed. The server keeps the budget: give it ``maxmemory`` and
            ``maxmemory-policy allkeys-lru``. A server that is down or slow costs only speed.
        redis_ttl_seconds: expiry of chunks written to Redis (``None``: none).
        tier_eviction_policy: eviction order within the host and disk tiers (lru, lfu or gdsf).
        tier_loads: ``"auto"`` (the default): a chunk found in a tier is loaded only when this
            process's measured speeds say loading beats recomputing it (``LoadCosts``);
            ``"always"``: every chunk found is loaded (e.g. to keep GPUs free of recompute, or
            for a reproducible run).
        Tiers serve ``mode="lazy"`` only (the other modes are baselines).
        recompute_chunk_head_tokens: ``k``: the first ``k`` tokens of every document placed in a
            request are computed fresh by that request, attending to everything before them
            (the prompt head, earlier documents), instead of read from the document's cached
            chunk; the rest of the chunk is read as cached (EPIC, Hu et al. 2024, "LegoLink").
            Recovers some of what encoding documents alone loses (docs/quality.md), for ``k``
            extra prefill tokens per document. The cached chunk is unchanged and shared (its
            key, bytes and hit ratio do not depend on ``k``); the fresh tokens live in the
            request's own blocks, freed with it. 0 (default): plain reuse; ``mode="lazy"`` only.
        recompute_first_chunk_head: whether chunk-head recompute also recomputes the first
            document's head (default True). The first document follows only the prompt head,
            so its cached K/V miss less of their context than later documents' do (those miss
            the documents before them too); ``False`` leaves it read as cached and saves ``k``
            tokens a request.
        recompute_selective_ratio: ``r`` in ``[0, 1]``: selective recompute (CacheBlend, Yao et
            al., EuroSys 2025, section 4). Before a request's first step, one dense pass over
            its whole prompt through the first two layers gives each document token's fresh
            K/V at the second layer (the first whose K/V depends on the context); the
            ``ceil(r * n)`` tokens of each ``n``-token document whose fresh K/V differ most
            from the cached (squared L2 over K, rotated to its position, and V) are then
            recomputed at every layer, attending to everything before them, and the others
            read as cached. Their K/V go into the request's own copies of the blocks that hold
            them, freed with it; the cached chunk is unchanged. ``r = 1`` is full attention.
            0 (default): plain reuse; ``mode="lazy"`` only, not together with
            ``recompute_chunk_head_tokens``.
        chunk_attention_scaling: whether requests read their documents with chunk attention
            scaling (APE, Yang, Chen and Chen, ICLR 2025, section 4) unless they say otherwise
            (default False). An attention-level remedy: nothing is recomputed. When a request's
            query and answer tokens attend, each document key ``j`` gets the softmax weight
            ``chunk_attention_weight * exp(q.k_j / (sqrt(head_dim) * chunk_attention_temperature))``
            and every other key (the prompt head, text, the request's own tokens) its plain
            ``exp(q.k / sqrt(head_dim))``, normalised together: a temperature below 1 sharpens
            the attention to documents that were encoded alone, the weight rescales their share.
            Both kernels apply it per run of blocks (one multiply-add per score); the cached
            chunks and their hit ratio are unchanged. ``mode="lazy"`` only, not together with
            the recompute remedies.
        chunk_attention_temperature: APE's temperature ``T`` (> 0, default 1).
        chunk_attention_weight: APE's scaling factor ``S`` (> 0, default 1).
        chunk_attention_scope: which keys of a document chunk chunk attention scaling reads
            scaled: ``"chunk"`` (default: all of them, as APE) or ``"head"`` (only its first
            block, ``block_size`` tokens: where a chunk encoded alone grows an attention sink
            of its own, which a prompt under full attention has once; with a weight below 1
            those tokens' share of attention is turned down, nothing recomputed. Measured on
            SmolLM2 with the BOS anchor it moves answers away from full attention, not toward
            it: docs/quality.md, "First measurements").
        prefix_caching: exact-prefix caching of what is not a document or passage (default
            True, as vLLM's automatic prefix caching): the full KV blocks of a request's own
            prompt tokens are kept in the cache under a chained hash of their tokens and of
            everything before them (for a plain prompt, the model; after placed documents, the
            documents' keys, offsets and the text between them), and a later request whose
            prompt starts the same reads them instead of computing them: a byte-identical
            repeat computes at most one block, a chat's next turn its new messages. Prefix
            blocks live in the KV pool under the same eviction policy as chunks. ``mode="lazy"``
            only (``"prefix"`` always caches prefixes, ``"full"`` and ``"block_attention"`` never).
        learn_passages: serve passages that recur in plain prompts from cached chunks (default
            True; ``engine/planning/passage_learning.py``). A plain chat prompt (text with no document
            placed by id) is split at the boundaries RAG templates produce (blank lines,
            separator lines, ``Context:``/``Question:`` labels; fenced code is never split), in
            its system messages and its last user message only; a piece of at least
            ``passage_min_tokens`` tokens that earlier requests contained whole at least
            ``passage_min_sightings`` times is placed as a position-agnostic chunk, keyed by
            namespace, model, anchor and tokens as a registered document with that text is, and
            read from the cache at whatever offset it recurs. Text seen fewer times is computed
            as it is today, and a request takes the learned layout only when it computes fewer
            tokens than the plain prompt with its exact-prefix blocks (a passage encoded for
            the first time counts as free: it serves every later request), and never when the
            plain prompt computes at most one block. Like documents, a reused passage does not
            attend to the text before it. ``mode="lazy"`` only.
        passage_min_tokens: the shortest passage learned, in tokens with its separator (default 16,
            one block: a template's fixed sentence, such as LlamaIndex's closing instruction, counts).
        passage_min_sightings: earlier requests that must have contained a passage before it is
            served from a chunk (default 1: its second occurrence is encoded as a chunk, its
            third is a hit; 0 turns every eligible piece into a chunk at first sight).
        passage_history: distinct passages whose sightings are remembered (an LRU; default
            100,000, about 10 MB).
    """

    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None
    num_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    anchor: str = "bos"
    eviction_policy: str = "lfu"
    mode: str = "lazy"
    host_memory_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 2 << 30
    redis_url: str | None = None
    redis_ttl_seconds: int | None = None
    tier_eviction_policy: str = "lru"
    tier_loads: str = "auto"
    recompute_chunk_head_tokens: int = 0
    recompute_first_chunk_head: bool = True
    recompute_selective_ratio: float = 0.0
    chunk_attention_scaling: bool = False
    chunk_attention_temperature: float = 1.0
    chunk_attention_weight: float = 1.0
    chunk_attention_scope: str = "chunk"
    prefix_caching: bool = True
    learn_passages: bool = True
    passage_min_tokens: int = 16
    passage_min_sightings: int = 1
    passage_history: int = 100_000

    @property
    def has_tiers(self) -> bool:
        """Whether any storage tier below the KV pool is configured."""
        return bool(self.host_memory_bytes or self.disk_dir or self.redis_url)

    def __post_init__(self):
        check_int("block_size", self.block_size, 1)
        check_int("num_blocks", self.num_blocks, 1, optional=True)
        check_int("kv_cache_bytes", self.kv_cache_bytes, 1, optional=True)
        if not 1 <= self.block_size <= 128:
            raise ValueError(f"block_size must be in [1, 128], got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.anchor not in ANCHOR_MODES:
            raise ValueError(f"anchor must be one of {ANCHOR_MODES}, got {self.anchor!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.kv_cache_fraction is not None and (isinstance(self.kv_cache_fraction, bool)
                                                   or not 0 < self.kv_cache_fraction < 1):
            raise ValueError(f"kv_cache_fraction must be in (0, 1), got {self.kv_cache_fraction}")
        if self.mode not in CACHE_MODES:
            raise ValueError(f"mode must be one of {CACHE_MODES}, got {self.mode!r}")
        if self.eviction_policy not in ("lru", "lfu", "gdsf"):
            raise ValueError(f"eviction_policy must be lru, lfu or gdsf, got {self.eviction_policy!r}")
        check_int("host_memory_bytes", self.host_memory_bytes, 0)
        check_int("disk_bytes", self.disk_bytes, 1)
        check_int("redis_ttl_seconds", self.redis_ttl_seconds, 1, optional=True)
        if self.tier_eviction_policy not in ("lru", "lfu", "gdsf"):
            raise ValueError(f"tier_eviction_policy must be lru, lfu or gdsf, got {self.tier_eviction_policy!r}")
        if self.tier_loads not in ("auto", "always"):
            raise ValueError(f"tier_loads must be 'auto' or 'always', got {self.tier_loads!r}")
        if self.disk_dir is not None and not str(self.disk_dir):
            raise ValueError("disk_dir must be a directory path or None")
        if self.redis_url is not None and not str(self.redis_url).startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        check_int("recompute_chunk_head_tokens", self.recompute_chunk_head_tokens, 0)
        if self.recompute_chunk_head_tokens and self.mode != "lazy":
            raise ValueError(f"recompute_chunk_head_tokens recomputes the heads of position-agnostic chunks: mode "
                             f"must be 'lazy', got {self.mode!r}")
        check_selective_ratio(self.recompute_selective_ratio, self.mode, self.recompute_chunk_head_tokens)
        self._check_chunk_attention()
        for name in ("prefix_caching", "learn_passages", "recompute_first_chunk_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_int("passage_min_tokens", self.passage_min_tokens, 1)
        check_int("passage_min_sightings", self.passage_min_sightings, 0)
        check_int("passage_history", self.passage_history, 1)
        if self.has_tiers and self.mode != "lazy":
            raise ValueError(f"storage tiers (host_memory_bytes, disk_dir, redis_url) serve position-agnostic "
                             f"chunks: mode must be 'lazy', got {self.mode!r}")


    def _check_chunk_attention(self) -> None:
        for name in ("chunk_attention_temperature", "chunk_attention_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.chunk_attention_scope not in ("chunk", "head"):
            raise ValueError(f"chunk_attention_scope must be 'chunk' or 'head', got {self.chunk_attention_scope!r}")
        if not isinstance(self.chunk_attention_scaling, bool):
            raise ValueError(f"chunk_attention_scaling must be True or False, got {self.chunk_attention_scaling!r}")
        if self.chunk_attention_scaling:
            check_chunk_attention_scaling(self, self.recompute_chunk_head_tokens, self.recompute_selective_ratio)


@dataclass(frozen=True)
class RequestRemedies:
    """One request's answer-fidelity remedies, as its caller asked (``None``: ``CacheConfig``'s).

    A request asking for one remedy (``k > 0``, ``r > 0`` or ``True``) turns the others it leaves
    unset off (:meth:`~lazyattn_rag.engine.planning.planner.PromptPlanner.plan`).

    Attributes:
        recompute_chunk_head_tokens: chunk-head recompute's ``k`` (EPIC).
        recompute_selective_ratio: selective recompute's ``r`` (CacheBlend).
        chunk_attention_scaling: chunk attention scaling (APE) on or off.
    """

    recompute_chunk_head_tokens: int | None = None
    recompute_selective_ratio: float | None = None
    chunk_attention_scaling: bool | None = None

    def asks_any(self) -> bool:
        return bool(self.recompute_chunk_head_tokens or self.recompute_selective_ratio or self.chunk_attention_scaling)


def check_chunk_attention_scaling(cache: CacheConfig, head_tokens: int, selective_ratio: float) -> None:
    """Raises ``ValueError`` unless chunk attention scaling can serve a request with these
    remedies: ``mode="lazy"``, a temperature or weight other than 1, and no recompute remedy."""
    if cache.mode != "lazy":
        raise ValueError(f"chunk_attention_scaling scales attention to position-agnostic chunks: mode must be "
                         f"'lazy', got {cache.mode!r}")
    if cache.chunk_attention_temperature == 1 and cache.chunk_attention_weight == 1:
        raise ValueError("chunk_attention_scaling with chunk_attention_temperature = chunk_attention_weight = 1 "
                         "changes nothing: set CacheConfig.chunk_attention_temperature or chunk_attention_weight")
    if head_tokens or selective_ratio:
        raise ValueError("chunk_attention_scaling cannot be combined with recompute_chunk_head_tokens or "
                         "recompute_selective_ratio: choose one remedy")


def check_selective_ratio(ratio: float, mode: str, head_tokens: int) -> None:
    """Raises ``ValueError`` unless ``ratio`` is a number in ``[0, 1]``, and 0 outside ``lazy``
    mode or together with chunk-head recompute."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute_selective_ratio must be a number in [0, 1], got {ratio!r}")
    if ratio and mode != "lazy":
        raise ValueError(f"recompute_selective_ratio recomputes tokens of position-agnostic chunks: mode must be "
                         f"'lazy', got {mode!r}")
    if ratio and head_tokens:
        raise ValueError("recompute_selective_ratio and recompute_chunk_head_tokens cannot both be set: choose one "
                         "remedy")
