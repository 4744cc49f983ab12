"""Deferred-RoPE paged decode (one new token per sequence): Triton kernels and their launcher.

Its pure-PyTorch reference is :func:`~lazyattn_rag.kernels.reference.decode_reference`.

Decode is bandwidth-bound: every K/V byte of the context is read once per step, so the kernel
rotates the *query* instead of the keys (LazyAttention, arXiv 2606.04302, Sec. 3):
``(R_m q) . (R_(j+delta) k) = (R_(-delta) R_m q) . (R_j k)``. Keys are read exactly as stored.

Kernel structure (one program = one KV head of one sequence x one split of its blocks):

* The ``GROUP`` query heads that share the KV head are processed together (rows of one
  ``tl.dot``, padded to 16), so each K/V byte is loaded once for the whole group.
* The walk goes one *run* at a time (consecutive blocks with one ``delta``, from
  :func:`~lazyattn_rag.kernels.launch.block_runs`: a chunk, the prefix, the request's own
  tokens). At a run whose ``delta`` differs from the one the query was last rotated for, the
  query is rotated again from the ORIGINAL query (never from the previous rotated one, so
  rounding does not accumulate): once per chunk. Inside a run the loop reads tiles of
  ``BLOCK_N // block_size`` blocks, one packed int64 word per block (id | valid-1 | delta), and
  feeds K as stored, full head width, straight into one dot; a run's last tile may be partly
  idle. The rotation reads each column's rotary partner (``triton_helpers.rotary_columns``).
* Split-KV (flash-decoding): with few sequences and long contexts, each (sequence, KV head) is
  split into ``num_splits`` ranges of whole tiles (each sequence's own blocks spread evenly,
  so short sequences leave later splits empty) processed by separate programs; each writes a
  normalized partial output and its log-sum-exp, and a small reduction kernel combines them.
  With one split the main kernel writes the output directly.
* Chunk attention scaling (APE, :class:`~lazyattn_rag.kernels.launch.ChunkScaling`): with
  ``CHUNK_SCALING``, a run whose blocks carry the ``scaled`` flag is scored with
  ``sm_scale / temperature`` and ``log2(weight)`` added, so its keys' softmax weights are
  ``weight * exp(scale * q.k / temperature)``; the split reduction combines these like any other.
* Offsets into the cache are int64; a sequence with no blocks (padding) gets zeros.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lazyattn_rag.kernels.launch import (
    BlockRuns,
    ChunkScaling,
    Rotation,
    addressable_table,
    block_runs,
    launch_prologue,
    rotation_code,
)
from lazyattn_rag.kernels.triton_helpers import (fp8_to_f16, mma, rotated_rows, rotation, run_score_scale,
                                                 word_block_id, word_delta, word_valid)
from lazyattn_rag.types.kv_quant import FP8_DTYPES


@triton.jit(do_not_specialize=["stride_bt", "stride_rsr"])  # step-varying widths: see prefill_kernel
def decode_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr,  # [num_cache_blocks, block_size, num_kv_heads] float32 (KV_SCALED; strides stride_s*)
    v_scale_ptr,  # [num_cache_blocks, block_size, num_kv_heads] float32 (KV_SCALED; the same strides)
    out_ptr,  # [num_tokens, num_heads, head_dim] (written without SPLIT_KV)
    part_out_ptr,  # [num_work, num_heads, num_splits, head_dim] float32 (SPLIT_KV)
    part_lse_ptr,  # [num_work, num_heads, num_splits] float32 log2-sum-exp2 (SPLIT_KV)
    block_tables_ptr,  # [num_seqs, max_blocks] int64 packed (id | valid-1 | delta)
    run_starts_ptr,  # [num_seqs, max_blocks + 1] int32 first block of each run of equal delta, then n_blocks
    num_runs_ptr,  # [num_seqs] int32 runs per sequence
    num_blocks_ptr,  # [num_seqs] int32 used block-table entries
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32: the sequence's query row is cu_seqlens_q[seq]
    seq_ids_ptr,  # [num_work] int32 sequences this launch handles (grid axis 0)
    inv_freq_ptr,  # [HALF] float32 RoPE frequencies
    sm_scale_log2,  # float: softmax scale * log2(e)
    chunk_inv_temperature,  # float: 1 / temperature for scaled blocks (ChunkScaling; CHUNK_SCALING only)
    chunk_log2_weight,  # float: log2(weight) added to scaled blocks' scores (CHUNK_SCALING only)
    stride_qt, stride_qh,  # q strides (tokens, heads); head_dim is contiguous
    stride_kb, stride_ks, stride_kh,  # key-cache strides (block, slot, head)
    stride_vb, stride_vs, stride_vh,  # value-cache strides (block, slot, head)
    stride_ot, stride_oh,  # out strides (tokens, heads)
    stride_sb, stride_ss, stride_sh,  # K and V scales' strides (block, slot, head) (KV_SCALED)
    stride_bt,  # block_tables row stride
    stride_rsr,  # run_starts row stride
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot rows)
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    PAIR_STRIDE: tl.constexpr,  # 1 half-split, 2 interleaved
    X2_OFF: tl.constexpr,  # column offset of a pair's second element
    BLOCK_SIZE: tl.constexpr,  # slots per cache block
    KV_SCALED: tl.constexpr,  # FP8 caches with one scale per token and KV head (kv_quant.py)
    BLOCK_N: tl.constexpr,  # key lanes per tile (a power of two >= BLOCK_SIZE)
    TILE_BLOCKS: tl.constexpr,  # blocks per tile: BLOCK_N // BLOCK_SIZE (lanes past them idle)
    SPLIT_KV: tl.constexpr,  # more than one split (the count is grid axis 2, read at run time)
    ROTATION: tl.constexpr,  # 0 none (benchmark of its cost only), 1 query by -delta per run
    CHUNK_SCALING: tl.constexpr,  # runs of flagged blocks use ChunkScaling (False: the flag is ignored)
    ACCURATE_TRIG: tl.constexpr,  # libdevice cos/sin (GPU); tl.cos/tl.sin under the interpreter
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, None (default) for half types
    DOT_UPCAST: tl.constexpr,  # interpreter only: dots in float32
    FP8_DOTS_F16: tl.constexpr,  # KV_SCALED with a half-type query: both dots in float16 (see below)
):
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq = tl.load(seq_ids_ptr + work)
    q_row = tl.load(cu_seqlens_q_ptr + seq)
    n_blocks = tl.load(num_blocks_ptr + seq)
    n_runs = tl.load(num_runs_ptr + seq)
    # Each sequence spreads its own tiles evenly over the splits (whole tiles per split), so a
    # launch's shape does not depend on the batch's longest sequence (CUDA-graph replays reuse it).
    blocks_per_split = tl.cdiv(tl.cdiv(n_blocks, TILE_BLOCKS), num_splits) * TILE_BLOCKS
    split_lo = split * blocks_per_split
    split_hi = tl.minimum(split_lo + blocks_per_split, n_blocks)
    dtype = q_ptr.dtype.element_ty
    if FP8_DOTS_F16:  # FP8 widens to float16 in one instruction (cvt.f16x2.e4m3x2); to bfloat16 via float32
        dtype = tl.float16

    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < GROUP
    heads = kv_head * GROUP + offs_g  # [BLOCK_G] query heads of this KV head
    offs_n = tl.arange(0, BLOCK_N)
    slot = offs_n % BLOCK_SIZE
    blk_in_tile = offs_n // BLOCK_SIZE
    lane_ok = offs_n < TILE_BLOCKS * BLOCK_SIZE  # all True when BLOCK_SIZE is a power of two
    offs_d = tl.arange(0, HEAD_DIM)

    q_rows = q_row.to(tl.int64) * stride_qt + heads * stride_qh  # [BLOCK_G]
    q_ptrs = q_ptr + q_rows[:, None] + offs_d[None, :]  # [BLOCK_G, HEAD_DIM]
    qr = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0).to(dtype)  # the query rotated by -cur_delta (starts unrotated: delta 0)
    cur_delta = tl.full([], 0, tl.int64)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    rs_row = run_starts_ptr + seq.to(tl.int64) * stride_rsr
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: a split without keys stays NaN-free
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for r in range(0, n_runs):
        b0 = tl.maximum(tl.load(rs_row + r), split_lo)
        b1 = tl.minimum(tl.load(rs_row + r + 1), split_hi)
        if b0 < b1:  # this run overlaps this split
            word0 = tl.load(bt_row + b0)
            score_scale = sm_scale_log2
            score_bias = 0.0
            if CHUNK_SCALING:  # one flag per run (block_runs splits at a change)
                score_scale, score_bias = run_score_scale(word0, sm_scale_log2, chunk_inv_temperature,
                                                          chunk_log2_weight)
            if ROTATION == 1:  # "query" (launch.ROTATION_CODES)
                delta = word_delta(word0)  # one delta per run
                if delta != cur_delta:  # a new chunk: rotate the ORIGINAL query (re-read) by -delta
                    cos, sin, partner = rotation(-delta, inv_freq_ptr, HEAD_DIM, HALF, PAIR_STRIDE, X2_OFF,
                                                 ACCURATE_TRIG)
                    qr = rotated_rows(q_ptr + q_rows, g_ok, cos, sin, partner, HEAD_DIM).to(dtype)
                    cur_delta = delta
            for first in range(b0, b1, TILE_BLOCKS):
                blk = first + blk_in_tile  # [BLOCK_N] block-table index per key
                blk_ok = lane_ok & (blk < b1)
                word = tl.load(bt_row + blk, mask=blk_ok, other=0)  # [BLOCK_N] int64
                block_id = word_block_id(word)
                key_ok = blk_ok & (slot < word_valid(word))
                k_rows = block_id * stride_kb + slot * stride_ks + kv_head * stride_kh  # [BLOCK_N] int64
                v_rows = block_id * stride_vb + slot * stride_vs + kv_head * stride_vh
                k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
                v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
                if KV_SCALED:
                    s_rows = block_id * stride_sb + slot * stride_ss + kv_head * stride_sh  # [BLOCK_N] int64
                    k_scale = tl.load(k_scale_ptr + s_rows, mask=key_ok, other=0.0)  # [BLOCK_N]
                    v_scale = tl.load(v_scale_ptr + s_rows, mask=key_ok, other=0.0)  # [BLOCK_N]
                    k = k.to(dtype)
                    if FP8_DOTS_F16 and not DOT_UPCAST:  # widened in registers: see fp8_to_f16
                        v = fp8_to_f16(v)
                    else:
                        v = v.to(dtype)
                # prefill's triton_helpers.attend computes the same update, but called here it took
                # the wide-tile launch (128 keys, no split) from 212 to 255 registers per thread
                # (offline sm_90a, Triton 3.6), so decode keeps its own, measured, order of operations
                s = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
                s = mma(qr, tl.trans(k), s, DOT_PRECISION, DOT_UPCAST)  # [BLOCK_G, BLOCK_N] raw dot products
                if KV_SCALED:
                    s = s * k_scale[None, :]
                s = tl.where(key_ok[None, :], s, float("-inf"))
                # the scale inside the row max and the exponent's multiply-add (score_scale > 0)
                m_new = tl.maximum(m_i, tl.max(s, axis=1) * score_scale + score_bias)
                alpha = tl.math.exp2(m_i - m_new)
                p = tl.math.exp2(s * score_scale + (score_bias - m_new)[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None]
                if FP8_DOTS_F16:  # weights times V scales, over each row's largest (float16's range),
                    p = p * v_scale[None, :]  # then the row's product times that largest in float32
                    row_top = tl.maximum(tl.max(p, axis=1), 1.0e-30)  # [BLOCK_G]
                    pv = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
                    p = (p * (1.0 / row_top)[:, None]).to(dtype)
                    acc += mma(p, v, pv, DOT_PRECISION, DOT_UPCAST) * row_top[:, None]
                else:
                    if KV_SCALED:  # each key's weight times its V scale: P @ (V * scale) without a scaled tile
                        p = p * v_scale[None, :]
                    acc = mma(p.to(dtype), v, acc, DOT_PRECISION, DOT_UPCAST)
                m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # [BLOCK_G, HEAD_DIM]
    if not SPLIT_KV:
        o_rows = q_row.to(tl.int64) * stride_ot + heads * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        part = (work.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=g_ok[:, None])
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_ok)


@triton.jit(do_not_specialize=["num_splits"])  # any count: one compile per SPLITS_POW2
def decode_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_work, num_heads, num_splits, head_dim] float32
    part_lse_ptr,  # [num_work, num_heads, num_splits] float32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_ids_ptr,  # [num_work] int32
    stride_ot, stride_oh,  # out strides (tokens, heads)
    num_splits,  # int: partial outputs per (sequence, head)
    HEAD_DIM: tl.constexpr,
    SPLITS_POW2: tl.constexpr,  # num_splits rounded up to a power of two (tl.arange's length)
):
    work = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(cu_seqlens_q_ptr + tl.load(seq_ids_ptr + work))
    base = work.to(tl.int64) * tl.num_programs(1) + head
    splits = tl.arange(0, SPLITS_POW2)
    split_ok = splits < num_splits
    lse = tl.load(part_lse_ptr + base * num_splits + splits, mask=split_ok, other=float("-inf"))  # [SPLITS_POW2]
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, output 0
    w = tl.math.exp2(lse - m)  # [SPLITS_POW2], 0 for empty and padding splits
    parts = tl.load(part_out_ptr + (base * num_splits + splits)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :],
                    mask=split_ok[:, None], other=0.0)  # [SPLITS_POW2, HEAD_DIM]
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)  # [HEAD_DIM]
    o = q_row.to(tl.int64) * stride_ot + head * stride_oh + tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + o, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


# Decode programs resident per multiprocessor (4 warps, ~165 registers per thread and 40 KB of
# shared memory: 3 by both limits on an H200, Nsight Compute). The split choice's cost model,
# fitted to the H200 split sweep (13 counts on six shapes, benchmarks/results/decode_splits_h200.jsonl;
# cold, it picks the fastest count or one within 1.4 % of it): a launch's time
# goes as (1 / wave fill) ** FILL_EXPONENT (a partly filled wave runs each program faster, so
# filling it gains less than the idle slots suggest) times (1 + SPLIT_COST * splits) (partial
# outputs, shorter pipelines).
PROGRAMS_PER_SM, FILL_EXPONENT, SPLIT_COST, MAX_SPLITS = 3, 0.4, 0.008, 64
# FP8 caches' programs take ~180-183 registers and 75 KB of shared memory at their 2 stages (106 KB
# at 3: the FP8 tiles' pipeline plus the V tile widened to float16 for ldmatrix.trans; sm_90a
# compiled offline, where the bf16 program takes 142 and 39 KB): 2 resident per multiprocessor
# (registers; maxnreg=168 would fit 3 but spills 80 B a thread). Sized for 3, a serving step
# (16 sequences x 2.7k over 5 documents, H100) ran 3 splits, a wave and a half: 0.085 ms, slower
# than bf16's 0.081, against 0.068 at the 2 splits this count gives
# (benchmarks/results/fp8_decode_h100.json).
FP8_PROGRAMS_PER_SM = 2


def wave_fill(num_programs: int, num_sms: int, programs_per_sm: int = PROGRAMS_PER_SM) -> float:
    """The share of resident-program slots that ``num_programs`` (>= 1) fill over the waves they take."""
    slots = programs_per_sm * max(1, num_sms)
    return num_programs / (-(-num_programs // slots) * slots)


def split_cost(num_programs: int, num_splits: int, num_sms: int, programs_per_sm: int = PROGRAMS_PER_SM) -> float:
    """The cost model's relative time of a decode launch of ``num_programs`` per split (see above)."""
    fill = wave_fill(num_programs * num_splits, num_sms, programs_per_sm)
    return fill ** -FILL_EXPONENT * (1.0 + SPLIT_COST * num_splits)


# Launches of at least this many programs per multiprocessor at one split (batch >= 32 at 8 KV
# heads on an H200's 132) run wide tiles: 128 keys at d128 with 2 stages and no split. On the H200
# sweep (benchmarks/results/decode_wide_tile_sweep_h200.jsonl) that is 6.1-7.9 % faster than the split rule's
# 64-key tiles at batch 32 x 8k, 64 x 4k and 128 x 2k, and 2-10x slower at batch 1-8 (too few programs).
WIDE_TILE_MIN_PROGRAMS_PER_SM, WIDE_TILE_BLOCK_N, WIDE_TILE_STAGES = 1.9, 128, 2


def uses_wide_tiles(num_work: int, num_kv_heads: int, head_dim: int, num_sms: int) -> bool:
    """Whether a default GPU decode launch of ``num_work`` sequences runs wide tiles (see above;
    measured at head_dim 128 only, so other head dims keep the split rule)."""
    return head_dim == 128 and num_work * num_kv_heads >= WIDE_TILE_MIN_PROGRAMS_PER_SM * num_sms


@functools.lru_cache(maxsize=4096)  # called once per layer of every eager decode step
def choose_num_splits(num_work: int, num_kv_heads: int, max_tiles: int, num_sms: int,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits per (sequence, KV head): the count of least :func:`split_cost` (any count, not only
    powers of two; the smallest among equals), at most :data:`MAX_SPLITS` and with at least 4
    tiles per split. On the H200 sweep of six shapes (batch 1 x 20k to 128 x 2k) the counts it
    picks are the fastest measured or next to it; the power-of-two rule it replaced left
    launches in part of one wave, 2-21 % slower."""
    programs = max(1, num_work * num_kv_heads)
    cap = max(1, min(max_tiles // 4, MAX_SPLITS))
    return min(range(1, cap + 1), key=lambda splits: (split_cost(programs, splits, num_sms, programs_per_sm), splits))


def paged_decode(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated at global positions
    key_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64 packed
    num_blocks_per_seq: torch.Tensor,  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    max_seq_len: int,
    inv_freq: torch.Tensor,  # [rotary_dim // 2] float32
    scale: float,
    *,
    interleaved: bool = False,
    runs: BlockRuns | None = None,  # from block_runs (computed when not given)
    seq_ids: torch.Tensor | None = None,  # [num_work] int32 decode sequences, default all
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,  # >= 1; default from choose_num_splits
    rotation: Rotation = "query",  # see Rotation: "query" or "none" (decode never rotates K)
    chunk_scaling: ChunkScaling | None = None,  # APE on flagged blocks (None: plain attention)
    block_n: int | None = None,  # key lanes per tile (rounded up to a power of two >= block_size)
    num_warps: int | None = None,
    num_stages: int | None = None,
    key_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32 (FP8 caches)
    value_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32, key_scale's strides
    fp8_dots_f16: bool = True,  # False: FP8 tiles widened to the query's dtype (only to measure the gain)
) -> torch.Tensor:
    """Attention of each listed sequence's single new token (row ``cu_seqlens_q[seq]``) over its
    paged context, with the query rotated by ``-delta`` once per chunk (see module doc).

    ``max_seq_len`` (a host int) bounds the split count; a sequence with no blocks gets zeros.
    ``rotation="none"`` skips the rotation (only for measuring its cost: the result is then wrong
    for any block with a nonzero delta). ``chunk_scaling``: keys of blocks flagged ``scaled`` are
    scored by APE's temperature and weight (:class:`~lazyattn_rag.kernels.launch.ChunkScaling`).
    FP8 caches (``lazyattn_rag/types/kv_quant.py``) come with ``key_scale`` and ``value_scale`` (of
    any layout, both with the same strides, e.g. a view of ``[num_cache_blocks, num_kv_heads,
    block_size]`` storage, where one head's scales of a block are contiguous): each key's
    raw score is multiplied by its K scale and its softmax weight by its V scale (the FP8 tiles are
    widened for the dots, never rescaled element by element). With a bfloat16 or float16 query both
    dots take float16 inputs (``fp8_dots_f16``): every FP8 value is exact in float16, whose widening
    from FP8 is one instruction on sm_89+ where bfloat16's goes through float32; the query must then
    stay within float16's range (|q| < 65504), and each tile's softmax weights times their V
    scales are divided by their row's largest before the dot (so the row's heaviest key weighs
    1.0 in float16), the dot's result multiplied by it in float32. GPUs before sm_89 (no FP8
    conversion instruction) keep bfloat16 dots.
    Compiled, the V tile is widened in registers where it is loaded
    (:func:`~lazyattn_rag.kernels.triton_helpers.fp8_to_f16`).

    Returns:
        ``out`` (allocated like ``query`` when not given).
    Raises:
        ValueError, NotImplementedError: inputs the kernel would misread
            (:func:`~lazyattn_rag.kernels.launch.check_inputs`), a ``rotation`` other than
            ``"query"`` or ``"none"``, a ``num_splits`` below 1.

    Example:
        >>> out = paged_decode(q, kc, vc, md.block_tables, md.num_blocks_per_seq, md.cu_seqlens_q,
        ...                    md.max_seq_len, rotary.inv_freq.to(q.device), scale)
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = key_cache.shape
    launch = launch_prologue(query, key_cache, value_cache, block_tables, inv_freq, scale,
                             interleaved=interleaved, out=out, seq_ids=seq_ids, key_scale=key_scale,
                             value_scale=value_scale)
    out, seq_ids, interpreter = launch.out, launch.seq_ids, launch.interpreter
    code = rotation_code(rotation, ("query", "none"))
    num_work = seq_ids.numel()
    if num_work == 0:
        return out
    group = num_heads // num_kv_heads
    # ~16 KB of K per tile on the GPU (H200 sweep): 64 keys at d128, 128 keys at d64 (FP8 caches:
    # twice the keys, the same bytes); wide tiles for launches with programs enough to fill the
    # GPU without a split (uses_wide_tiles).
    fp8 = key_cache.dtype in FP8_DTYPES
    # FP8: 2 stages (see FP8_PROGRAMS_PER_SM; 0.0417 against 0.0426 ms at 1 x 20k and 0.0656 against
    # 0.0662 at the serving step, H100, benchmarks/results/fp8_decode_warps_h100.json)
    default_block_n, default_stages = (32, 1) if interpreter else (max(64, 8192 // head_dim) * (2 if fp8 else 1),
                                                                    2 if fp8 else 3)
    if (not interpreter and block_n is None and num_stages is None and num_splits in (None, 1)
            and uses_wide_tiles(num_work, num_kv_heads, head_dim, _num_sms(query.device))):
        default_block_n, default_stages, num_splits = WIDE_TILE_BLOCK_N, WIDE_TILE_STAGES, 1
    block_n = triton.next_power_of_2(max(block_n or default_block_n, block_size))
    tile_blocks = block_n // block_size
    # Every block holds >= 1 key, so a sequence has at most min(max_blocks, max_seq_len) blocks.
    max_blocks = max(1, min(block_tables.shape[1], max_seq_len))
    max_tiles = -(-max_blocks // tile_blocks)
    if num_splits is None:
        num_splits = choose_num_splits(num_work, num_kv_heads, max_tiles, _num_sms(query.device),
                                       FP8_PROGRAMS_PER_SM if fp8 else PROGRAMS_PER_SM)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if block_tables.shape[1] == 0:  # padding only: a column to point at (its runs are empty)
        block_tables, runs = addressable_table(block_tables), None
    if runs is None:
        runs = block_runs(block_tables, num_blocks_per_seq, block_size)
    scaling = (chunk_scaling or ChunkScaling()).kernel_args()
    if num_splits > 1:
        part_out = torch.empty(num_work, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_work, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    decode_kernel[(num_work, num_kv_heads, num_splits)](
        query, key_cache, value_cache, *launch.scales, out, part_out, part_lse,
        block_tables, runs.starts, runs.num_runs, num_blocks_per_seq, cu_seqlens_q, seq_ids,
        launch.inv_freq, launch.sm_scale_log2, scaling["chunk_inv_temperature"], scaling["chunk_log2_weight"],
        *launch.strides, *launch.scale_strides,
        block_tables.stride(0), runs.starts.stride(0),
        **launch.constexprs,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        TILE_BLOCKS=tile_blocks,
        SPLIT_KV=num_splits > 1,
        ROTATION=code,
        CHUNK_SCALING=scaling["CHUNK_SCALING"],
        FP8_DOTS_F16=fp8 and fp8_dots_f16 and query.dtype in (torch.bfloat16, torch.float16)
        and (interpreter or torch.cuda.get_device_capability(query.device) >= (8, 9)),  # the cvt needs sm_89
        num_warps=num_warps or 4,
        num_stages=num_stages or default_stages,
    )
    if num_splits > 1:
        decode_reduce_kernel[(num_work, num_heads)](
            out, part_out, part_lse, cu_seqlens_q, seq_ids,
            out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim,
            SPLITS_POW2=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
