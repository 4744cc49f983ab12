"""Deferred-RoPE paged prefill: a Triton kernel and its launcher (reference: ``reference.py``).

A batch of sequences (varlen, ``cu_seqlens_q``) attends its paged KV context. Context keys are
numbered ``0 .. seq_len-1`` over the valid slots of the block table, in table order; a sequence's
``query_len`` new tokens are its last ``query_len`` keys and new token ``i`` attends key ``j`` iff
``j <= seq_len - query_len + i``. Keys are stored rotated at their *local* positions; each
block-table word carries the block's offset ``delta`` (LazyAttention, arXiv 2606.04302, Sec. 3):
a key of that block belongs at ``R_delta (R_j k) = R_(j+delta) k``.

Where the rotation goes. Scores only need ``(R_m q) . (R_(j+delta) k) = (R_(-delta) R_m q) . (R_j k)``.
A program holds one query tile for its whole life and walks the context one *run* at a time (a
run = consecutive blocks with one ``delta``: a chunk, the prefix, the request's own tokens), so it
rotates its query tile by ``-delta`` once per run (``rotation="query"``, the default) and its inner
loop is a plain flash-attention loop over K tiles as stored. Rotating every K tile by ``delta`` in
registers instead (``rotation="key"``, what issue 4 describes) gives the same scores but repeats
the rotation for every query tile and head and keeps K in registers between load and dot; it is
kept so the benchmark can show the difference (on an H200, +54 % over no rotation at 4k new tokens
after 12k in 4 chunks, where the default costs +4.3 %).

Kernel structure (one program = one query head x ``BLOCK_M`` new tokens of one sequence):

* Tiles are full head width: one QK^T product per tile. A rotation ``x'[c] = x[c] cos + sign *
  x[partner(c)] sin`` reads each column's rotary partner (half-split: ``c +- rotary_dim/2``;
  interleaved: ``c xor 1``; columns past ``rotary_dim`` keep their value), so one code path covers
  every pairing (``triton_helpers.rotary_columns``).
* A K tile is ``BLOCK_N // block_size`` consecutive blocks of one run (``BLOCK_N`` a power of two).
  Tiles that every row sees whole (before the causal diagonal, no partial block) run without any
  mask; the rest (a run's last tile, tiles on the diagonal) mask invalid slots and future keys.
* The walk stops at the last block holding a key the tile's last row can see, found by binary
  search over each block's first key index (``key_starts``). Online softmax in float32 (``exp2``,
  the scale folded into the row max and the exponent's multiply-add); query tiles are scheduled
  longest first.
* The new tokens' own keys (``key=``/``value=``, the step's K/V as written to the cache): where they
  all lie in the sequence's last run with delta 0 and no scaling flag, the block walk stops before
  them and a causal loop reads them contiguously from the step's tensors (no block-table word or
  64-bit row offset per key); otherwise the walk covers them as any other key. On Hopper that
  loop loads each K/V tile with one bulk tensor copy (TMA, through tensor descriptors) instead of
  per-lane loads (``STEP_TMA``; a paged gather cannot use them, the step's tensors can).
* Chunk attention scaling (APE, :class:`~lazyattn_rag.kernels.launch.ChunkScaling`): with
  ``CHUNK_SCALING``, a run whose blocks carry the ``scaled`` flag is scored with
  ``sm_scale / temperature`` and ``log2(weight)`` added (one multiply-add per score, chosen once
  per run).
* Offsets into the cache are int64 (``block_id * block_size * stride`` overflows int32).

Angles are ``float32(delta) * inv_freq`` in float32 exactly as :meth:`RotaryEmbedding.cos_sin`
computes them; on the GPU ``cos``/``sin`` come from libdevice (full range reduction: offsets reach
2**24 tokens, where the fast approximate instructions are wrong).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lazyattn_rag.types.kv_quant import FP8_DTYPES
from lazyattn_rag.kernels.launch import (
    BlockRuns,
    ChunkScaling,
    Rotation,
    addressable_table,
    block_key_starts,
    block_runs,
    launch_prologue,
    rotation_code,
)
from lazyattn_rag.kernels.query_rotation import QueryRotations, rotate_queries
from lazyattn_rag.kernels.triton_helpers import (attend, rotated_rows, rotation, run_score_scale, word_block_id,
                                                 word_delta, word_scaled, word_valid)

try:  # host-side tensor descriptors (TMA on Hopper): Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: the step's K/V are read through pointers
    TensorDescriptor = None


@triton.jit
def prefill_tile(
    acc, m_i, l_i,  # running output [BLOCK_M, HEAD_DIM], row max and row sum [BLOCK_M] (float32)
    qa,  # [BLOCK_M, HEAD_DIM] the query for this run (rotated by -delta, or as given)
    cos, sin, partner,  # [HEAD_DIM] the run's rotation of K (ROTATE_K only): float32 x 2, int32 column
    first_blk, blk_end,  # block-table indices: this tile starts at first_blk; blocks >= blk_end are out
    bt_row, ks_row, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh,  # the K and V scales' strides (block, slot, head) (KV_SCALED)
    row_limit, limit_max,  # [BLOCK_M] last key index each row may see; their maximum
    score_scale, score_bias,  # float32 scalars: this run's log2-domain score is dot * score_scale + score_bias
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TILE_BLOCKS: tl.constexpr,
    MASKED: tl.constexpr,  # False: every lane is a valid key every row may see (no masks at all)
    CHUNK_SCALING: tl.constexpr,  # add score_bias (False: it is 0)
    ROTATE_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    KV_SCALED: tl.constexpr,  # FP8 caches: per-key scales at k_scale_ptr / v_scale_ptr (by stride_s*)
):
    """One K/V tile of ``TILE_BLOCKS`` blocks of one run: scores, online softmax, P @ V."""
    dtype = qa.dtype
    offs_n = tl.arange(0, BLOCK_N)
    slot = offs_n % BLOCK_SIZE  # [BLOCK_N] slot within its block
    blk = first_blk + offs_n // BLOCK_SIZE  # [BLOCK_N] block-table index of each lane
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        blk_ok = (offs_n < TILE_BLOCKS * BLOCK_SIZE) & (blk < blk_end)
        word = tl.load(bt_row + blk, mask=blk_ok, other=0)  # [BLOCK_N] int64
        key_idx = tl.load(ks_row + blk, mask=blk_ok, other=0) + slot  # [BLOCK_N] global key index
    else:
        word = tl.load(bt_row + blk)
    block_id = word_block_id(word)
    if MASKED:  # valid slots no row may see are not read either (their values need not be finite)
        key_ok = blk_ok & (slot < word_valid(word)) & (key_idx <= limit_max)
    k_rows = block_id * stride_kb + slot * stride_ks + kv_head * stride_kh  # [BLOCK_N] int64
    v_rows = block_id * stride_vb + slot * stride_vs + kv_head * stride_vh
    if MASKED:
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :])
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :])
    k_scale = 0.0
    v_scale = 0.0
    if KV_SCALED:
        s_rows = block_id * stride_sb + slot * stride_ss + kv_head * stride_sh  # [BLOCK_N] int64
        if MASKED:
            k_scale = tl.load(k_scale_ptr + s_rows, mask=key_ok, other=0.0)  # [BLOCK_N]
            v_scale = tl.load(v_scale_ptr + s_rows, mask=key_ok, other=0.0)
        else:
            k_scale = tl.load(k_scale_ptr + s_rows)
            v_scale = tl.load(v_scale_ptr + s_rows)
        k = k.to(dtype)
        v = v.to(dtype)
    if ROTATE_K:  # the literal form: R_delta on every K tile, in registers
        if MASKED:
            kp = tl.load(k_cache_ptr + k_rows[:, None] + partner[None, :], mask=key_ok[:, None], other=0.0)
        else:
            kp = tl.load(k_cache_ptr + k_rows[:, None] + partner[None, :])
        k = (k.to(tl.float32) * cos[None, :] + kp.to(tl.float32) * sin[None, :]).to(dtype)
    keep = 0  # no mask
    if MASKED:
        keep = key_ok[None, :] & (key_idx[None, :] <= row_limit[:, None])
    return attend(acc, m_i, l_i, qa, k, v, keep, score_scale, score_bias, k_scale, v_scale,
                  MASKED, CHUNK_SCALING, DOT_PRECISION, DOT_UPCAST, KV_SCALED)


@triton.jit
def step_tile(
    acc, m_i, l_i,  # running output [BLOCK_M, HEAD_DIM], row max and row sum [BLOCK_M] (float32)
    q,  # [BLOCK_M, HEAD_DIM] the query as given (these keys have delta 0)
    k_base, v_base,  # the sequence's first new token's K and V row of this KV head
    stride_nkt, stride_nvt,  # token strides of the new tokens' K and V
    k_desc, v_desc,  # STEP_TMA: descriptors of K and V as [num_tokens, num_kv_heads * head_dim]
    row0, col,  # STEP_TMA: the sequence's first new token's row; this KV head's first column
    t0,  # first new-token index of this tile
    offs_m, q_len,  # [BLOCK_M] rows' new-token indices; the sequence's new tokens
    sm_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is before every row (no masks at all)
    STEP_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """One tile of ``BLOCK_N`` new tokens' keys read from the step's own contiguous K/V: causal."""
    offs_t = t0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] new-token index of each key
    keep = 0  # no mask
    if MASKED:  # per-lane loads: rows past the sequence (the next one's) are not read
        offs_d = tl.arange(0, HEAD_DIM)
        k_ptrs = k_base + offs_t.to(tl.int64)[:, None] * stride_nkt + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
        v_ptrs = v_base + offs_t.to(tl.int64)[:, None] * stride_nvt + offs_d[None, :]
        k = tl.load(k_ptrs, mask=(offs_t < q_len)[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=(offs_t < q_len)[:, None], other=0.0)
        keep = (offs_t[None, :] <= offs_m[:, None]) & (offs_t < q_len)[None, :]
    elif STEP_TMA:  # a whole tile of the sequence's rows: one bulk copy each (TMA on Hopper)
        k = k_desc.load([row0 + t0, col])  # [BLOCK_N, HEAD_DIM]
        v = v_desc.load([row0 + t0, col])
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        k = tl.load(k_base + offs_t.to(tl.int64)[:, None] * stride_nkt + offs_d[None, :])  # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_base + offs_t.to(tl.int64)[:, None] * stride_nvt + offs_d[None, :])
    return attend(acc, m_i, l_i, q, k, v, keep, sm_scale_log2, 0.0, 0.0, 0.0, MASKED, False, DOT_PRECISION, DOT_UPCAST,
                  False)


@triton.jit
def count_at_most(row_ptr, n, limit, search_steps):
    """Number of leading entries of a non-decreasing int row ``row_ptr[0:n]`` that are <= limit."""
    lo = 0
    hi = n
    for _ in range(search_steps):
        active = lo < hi
        mid = (lo + hi) // 2
        value = tl.load(row_ptr + mid, mask=active, other=0)
        right = active & (value <= limit)
        hi = tl.where(active & (value > limit), mid, hi)
        lo = tl.where(right, mid + 1, lo)
    return lo


# Integer arguments that change from step to step (the block-table width) are not specialized:
# Triton compiles a variant per value class (== 1, divisible by 16, other) of each int argument,
# and a variant first met mid-run stalls that step for a compile.
@triton.jit(do_not_specialize=["stride_bt", "stride_ksr", "stride_rsr", "stride_qrr", "search_steps"])
def prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr,  # [num_cache_blocks, block_size, num_kv_heads] float32 (KV_SCALED; strides stride_s*)
    v_scale_ptr,  # [num_cache_blocks, block_size, num_kv_heads] float32 (KV_SCALED; the same strides)
    out_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim] the new tokens' K as written to the cache (IN_STEP)
    value_ptr,  # [num_tokens, num_kv_heads, head_dim] their V (IN_STEP)
    key_desc,  # STEP_TMA: a descriptor of key as [num_tokens, num_kv_heads * head_dim], [BLOCK_N, HEAD_DIM] boxes
    value_desc,  # STEP_TMA: the same of value
    block_tables_ptr,  # [num_seqs, max_blocks] int64 packed (id | valid-1 | delta)
    key_starts_ptr,  # [num_seqs, max_blocks] int32 index of each block's first key
    run_starts_ptr,  # [num_seqs, max_blocks + 1] int32 first block of each run of equal delta, then n_blocks
    num_runs_ptr,  # [num_seqs] int32 runs per sequence
    num_blocks_ptr,  # [num_seqs] int32 used block-table entries
    seq_lens_ptr,  # [num_seqs] int32 keys per sequence (new tokens included)
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32 first row of each sequence in q/out
    seq_ids_ptr,  # [num_work] int32 sequences this launch handles (grid axis 2)
    inv_freq_ptr,  # [HALF] float32 RoPE frequencies
    q_rot_ptr,  # [num_rows, num_heads, head_dim] queries rotated beforehand (ROTATION 3; query_rotation.py)
    qr_run_rows_ptr,  # [num_seqs, max_runs] int32 each run's first rotated row, -1: the query as given (ROTATION 3)
    sm_scale_log2,  # float: softmax scale * log2(e)
    chunk_inv_temperature,  # float: 1 / temperature for scaled blocks (ChunkScaling; CHUNK_SCALING only)
    chunk_log2_weight,  # float: log2(weight) added to scaled blocks' scores (CHUNK_SCALING only)
    stride_qt, stride_qh,  # q strides (tokens, heads); head_dim is contiguous
    stride_kb, stride_ks, stride_kh,  # key-cache strides (block, slot, head)
    stride_vb, stride_vs, stride_vh,  # value-cache strides (block, slot, head)
    stride_ot, stride_oh,  # out strides (tokens, heads)
    stride_nkt, stride_nkh, stride_nvt, stride_nvh,  # new tokens' K and V strides (tokens, heads)
    stride_sb, stride_ss, stride_sh,  # K and V scales' strides (block, slot, head) (KV_SCALED)
    stride_rt, stride_rh,  # q_rot strides (rows, heads) (ROTATION 3)
    stride_qrr,  # qr_run_rows row stride (ROTATION 3)
    stride_bt,  # block_tables row stride
    stride_ksr,  # key_starts row stride
    stride_rsr,  # run_starts row stride
    search_steps,  # int: bit length of max_blocks + 1, binary-search iterations
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    PAIR_STRIDE: tl.constexpr,  # 1 half-split, 2 interleaved
    X2_OFF: tl.constexpr,  # column offset of a pair's second element
    BLOCK_SIZE: tl.constexpr,  # slots per cache block
    KV_SCALED: tl.constexpr,  # FP8 caches with one scale per token and KV head (kv_quant.py)
    BLOCK_M: tl.constexpr,  # new tokens per program
    BLOCK_N: tl.constexpr,  # key lanes per tile (a power of two >= BLOCK_SIZE)
    TILE_BLOCKS: tl.constexpr,  # blocks per tile: BLOCK_N // BLOCK_SIZE (lanes past them idle)
    ROTATION: tl.constexpr,  # 0 none (every delta 0, or measuring), 1 query by -delta per run, 2 each K tile
    # by delta, 3 the query rows rotated beforehand by -delta (q_rot_ptr)
    CHUNK_SCALING: tl.constexpr,  # runs of flagged blocks use ChunkScaling (False: the flag is ignored)
    IN_STEP: tl.constexpr,  # read the new tokens' keys from key_ptr/value_ptr where they have delta 0
    STEP_TMA: tl.constexpr,  # whole step tiles through key_desc/value_desc (IN_STEP only; else unused)
    ACCURATE_TRIG: tl.constexpr,  # libdevice cos/sin (GPU); tl.cos/tl.sin under the interpreter
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs, None (default) for half types
    DOT_UPCAST: tl.constexpr,  # interpreter only: dots in float32
):
    head = tl.program_id(0)
    m_tile = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (causal) tiles first
    seq = tl.load(seq_ids_ptr + tl.program_id(2))
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m_start = m_tile * BLOCK_M
    if m_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    n_blocks = tl.load(num_blocks_ptr + seq)
    n_runs = tl.load(num_runs_ptr + seq)
    ctx_len = seq_len - q_len  # keys before the first new token
    kv_head = head // GROUP
    dtype = q_ptr.dtype.element_ty

    offs_m = m_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] row within the sequence
    row_ok = offs_m < q_len
    row_limit = ctx_len + offs_m  # [BLOCK_M] last key each row may see
    limit_min = ctx_len + m_start
    limit_max = ctx_len + tl.minimum(m_start + BLOCK_M, q_len) - 1
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + offs_m).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
    q_ptrs = q_ptr + q_rows[:, None] + offs_d[None, :]  # [BLOCK_M, HEAD_DIM]

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    ks_row = key_starts_ptr + seq.to(tl.int64) * stride_ksr
    rs_row = run_starts_ptr + seq.to(tl.int64) * stride_rsr
    # The new tokens' own keys come from the step's contiguous K/V (no block-table gather) when
    # they all lie in the last run and that run has delta 0 and no scaling flag (the request's
    # own tokens, or a chunk being encoded); the block walk then stops before them.
    in_step = False
    if IN_STEP:
        has_runs = n_runs > 0  # a sequence without blocks (padding) reads no table entry at all
        last_start = tl.load(rs_row + tl.maximum(n_runs - 1, 0))
        last_word = tl.load(bt_row + last_start, mask=has_runs, other=0)
        last_key = tl.load(ks_row + last_start, mask=has_runs, other=0)
        in_step = has_runs & (last_key <= ctx_len) & (word_delta(last_word) == 0)
        if CHUNK_SCALING:
            in_step = in_step & (word_scaled(last_word) == 0)
        row_limit = tl.where(in_step, ctx_len - 1, row_limit)
        limit_min = tl.where(in_step, ctx_len - 1, limit_min)
        limit_max = tl.where(in_step, ctx_len - 1, limit_max)
    # Blocks any row may see: first key <= limit_max. Blocks every row sees whole: the NEXT block
    # starts at or before limit_min + 1 (so the block's keys are all <= limit_min).
    n_visit = count_at_most(ks_row, n_blocks, limit_max, search_steps)
    n_safe = tl.maximum(count_at_most(ks_row, n_blocks, limit_min + 1, search_steps) - 1, 0)
    if TILE_BLOCKS * BLOCK_SIZE != BLOCK_N:
        n_safe = 0  # idle lanes in every tile: mask them all

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if ROTATION == 3:  # each run's rotated rows start at qr_run_rows[seq, r] (query_rotation.py)
        qr_row = qr_run_rows_ptr + seq.to(tl.int64) * stride_qrr
    for r in range(0, n_runs):
        b0 = tl.load(rs_row + r)
        b1 = tl.load(rs_row + r + 1)
        b_end = tl.minimum(b1, n_visit)
        if b0 < b_end:
            word0 = tl.load(bt_row + b0)
            delta = word_delta(word0)  # one delta for the whole run
            score_scale = sm_scale_log2
            score_bias = 0.0
            if CHUNK_SCALING:  # one flag for the whole run too (block_runs splits at a change)
                score_scale, score_bias = run_score_scale(word0, sm_scale_log2, chunk_inv_temperature,
                                                          chunk_log2_weight)
            # The query is (re)loaded per run (a few KB from L2) rather than kept in registers
            # across the walk, which leaves the registers to the K/V pipeline.
            cos = tl.full([HEAD_DIM], 1.0, tl.float32)
            sin = tl.zeros([HEAD_DIM], tl.float32)
            partner = offs_d
            if ROTATION == 1:  # R_(-delta) on the ORIGINAL query, once per run
                # The rotated tile goes through this program's own output rows (written only at
                # the end) and is loaded back: a loaded tile feeds the QK^T products from shared
                # memory, one computed in registers would hold ~32 registers per thread through
                # the whole walk (measured on an H200: rotation overhead 16k causal +3.1 % -> +1.2 %,
                # 4k after 12k of chunks +6.5 % -> +4.1 %).
                rotated = delta != 0
                o_rows = (q_start + offs_m).to(tl.int64) * stride_ot + head * stride_oh  # [BLOCK_M]
                r_ptrs = out_ptr + o_rows[:, None] + offs_d[None, :]  # [BLOCK_M, HEAD_DIM] the rotated query's scratch
                if rotated:
                    cq, sq, pq = rotation(-delta, inv_freq_ptr, HEAD_DIM, HALF, PAIR_STRIDE, X2_OFF, ACCURATE_TRIG)
                    qr = rotated_rows(q_ptr + q_rows, row_ok, cq, sq, pq, HEAD_DIM)  # [BLOCK_M, HEAD_DIM] float32
                    tl.debug_barrier()  # the previous run's loads of these rows are done
                    tl.store(r_ptrs, qr.to(dtype), mask=row_ok[:, None])
                    tl.debug_barrier()  # every thread's stores are visible to the loads below
                qa = tl.load(tl.where(rotated, r_ptrs, q_ptrs), mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
            elif ROTATION == 3:  # rows rotated by -delta beforehand: only loaded here
                # the run's number alone finds them (no wait on its block-table word or a search)
                run_row = tl.load(qr_row + r)  # -1: delta 0, the query as given
                r_rows = (tl.maximum(run_row, 0) + offs_m).to(tl.int64) * stride_rt + head * stride_rh
                r_ptrs = q_rot_ptr + r_rows[:, None] + offs_d[None, :]  # [BLOCK_M, HEAD_DIM]
                qa = tl.load(tl.where(run_row >= 0, r_ptrs, q_ptrs), mask=row_ok[:, None], other=0.0)
            else:
                qa = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
            if ROTATION == 2:  # R_delta on each K tile; angles once per run
                cos, sin, partner = rotation(delta, inv_freq_ptr, HEAD_DIM, HALF, PAIR_STRIDE, X2_OFF, ACCURATE_TRIG)
            # whole tiles that every row sees entirely (the run's last block may be partial: excluded)
            n_full = tl.maximum(tl.minimum(b1 - 1, n_safe) - b0, 0) // TILE_BLOCKS
            for t in range(0, n_full):
                acc, m_i, l_i = prefill_tile(
                    acc, m_i, l_i, qa, cos, sin, partner, b0 + t * TILE_BLOCKS, b_end,
                    bt_row, ks_row, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                    kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_sb, stride_ss, stride_sh,
                    row_limit, limit_max, score_scale, score_bias,
                    HEAD_DIM, BLOCK_SIZE, BLOCK_N, TILE_BLOCKS,
                    False, CHUNK_SCALING, ROTATION == 2, DOT_PRECISION, DOT_UPCAST, KV_SCALED,
                )
            for first in range(b0 + n_full * TILE_BLOCKS, b_end, TILE_BLOCKS):
                acc, m_i, l_i = prefill_tile(
                    acc, m_i, l_i, qa, cos, sin, partner, first, b_end,
                    bt_row, ks_row, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                    kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_sb, stride_ss, stride_sh,
                    row_limit, limit_max, score_scale, score_bias,
                    HEAD_DIM, BLOCK_SIZE, BLOCK_N, TILE_BLOCKS,
                    True, CHUNK_SCALING, ROTATION == 2, DOT_PRECISION, DOT_UPCAST, KV_SCALED,
                )

    if IN_STEP:
        if in_step:  # causal attention over the new tokens' own keys, as computed this step
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
            k_base = key_ptr + q_start.to(tl.int64) * stride_nkt + kv_head * stride_nkh
            v_base = value_ptr + q_start.to(tl.int64) * stride_nvt + kv_head * stride_nvh
            n_below = m_start // BLOCK_N  # tiles whose keys all precede the tile's first row
            for t in range(0, n_below):
                acc, m_i, l_i = step_tile(acc, m_i, l_i, q, k_base, v_base, stride_nkt, stride_nvt, key_desc,
                                          value_desc, q_start, kv_head * HEAD_DIM, t * BLOCK_N, offs_m, q_len, sm_scale_log2,
                                          HEAD_DIM, BLOCK_N, False, STEP_TMA, DOT_PRECISION, DOT_UPCAST)
            for t0 in range(n_below * BLOCK_N, tl.minimum(m_start + BLOCK_M, q_len), BLOCK_N):
                acc, m_i, l_i = step_tile(acc, m_i, l_i, q, k_base, v_base, stride_nkt, stride_nvt, key_desc,
                                          value_desc, q_start, kv_head * HEAD_DIM, t0, offs_m, q_len, sm_scale_log2,
                                          HEAD_DIM, BLOCK_N, True, STEP_TMA, DOT_PRECISION, DOT_UPCAST)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no keys (padding): zeros
    o_rows = (q_start + offs_m).to(tl.int64) * stride_ot + head * stride_oh
    if ROTATION == 1:
        tl.debug_barrier()  # the last run's loads of the scratch rows are done
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# Tile configurations (block_m, block_n, num_warps, num_stages) at head_dim 128, half types. From
# the H200 runs of 2026-12-03 (benchmarks/results/prefill_ab_h200_v2.json and
# kernels_h200_v7_prefill_sweep.json): 64 x 64 tiles of one warpgroup, 3
# stages (64 KB of shared memory: two programs per multiprocessor) are the fastest measured on
# every batch with cached context (requests of 64 or 512 new tokens over 5 chunks: 2.04x and
# 1.12x the previous default's kernel; 4k new tokens after 12k of chunks: 344 against 311
# TFLOP/s) and on 512-token encodes (1.32x); for long prompts computed whole (no cached keys,
# every key from the step) 128 x 64 tiles of 8 warps are 4-6 % faster (8k prompt 1.245x against
# 1.19x; 16k causal 467 against 442 TFLOP/s), with 128 KB of shared memory.
CONFIG_CACHED = (64, 64, 4, 3)
CONFIG_LONG_STEP = (128, 64, 8, 3)
LONG_STEP_MIN_TOKENS = 4096  # new tokens from which a launch without cached keys takes CONFIG_LONG_STEP


def tile_shared_bytes(block_m: int, block_n: int, num_stages: int, head_dim: int, element_size: int) -> int:
    """Shared memory a launch's tiles take: the query tile and ``num_stages`` K and V tiles."""
    return (block_m + 2 * num_stages * block_n) * head_dim * element_size


def _default_config(head_dim: int, block_size: int, interpreter: bool, element_size: int,
                    max_query_len: int = 0, max_context_len: int | None = None, shared_bytes: int = 0) -> dict:
    """Tile shapes: large on the GPU (tensor cores), small under the interpreter (fast tests).

    ``max_context_len`` (cached keys before the new tokens, host-side; ``None``: unknown) and
    ``shared_bytes`` (the device's shared memory per program, 0 if unknown) choose between the two
    configurations above; a configuration whose tiles do not fit (:func:`tile_shared_bytes`, e.g.
    at head_dim 256) is not taken, and the default then runs fewer stages."""
    if interpreter:
        return {"block_m": 16, "block_n": max(block_size, 32), "num_warps": 4, "num_stages": 1}
    if head_dim <= 64 or element_size > 2:
        # H200 sweep at d64 (kernels_h200_v2.json): 128x64 tiles, 4 warps, 3 stages, 286 TFLOP/s at
        # 16k causal against 253 for 128x128 (8 warps, 2 stages); float32 (tests)
        # at d128 needs these smaller tiles too (128x128 x 2 stages exceeds shared memory).
        return {"block_m": 128, "block_n": max(block_size, 64), "num_warps": 4, "num_stages": 3}
    def fits(cfg: tuple) -> bool:  # 16 KB left for the compiler's own scratch (reductions, layout changes)
        need = tile_shared_bytes(cfg[0], max(block_size, cfg[1]), cfg[3], head_dim, element_size)
        return need + 16 * 1024 <= shared_bytes

    long_step = max_context_len == 0 and max_query_len >= LONG_STEP_MIN_TOKENS and fits(CONFIG_LONG_STEP)
    bm, bn, warps, stages = CONFIG_LONG_STEP if long_step else CONFIG_CACHED
    while shared_bytes and stages > 1 and not fits((bm, bn, warps, stages)):  # head_dim 256, large blocks
        stages -= 1
    return {"block_m": bm, "block_n": max(block_size, bn), "num_warps": warps, "num_stages": stages}


@functools.lru_cache(maxsize=None)
def _shared_bytes(device: torch.device) -> int:
    """Shared memory one program may take on ``device`` (opt-in limit), 0 if unknown."""
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges the two tensors span intersect (empty tensors span nothing)."""
    if a.numel() == 0 or b.numel() == 0:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _check_step_kv(query: torch.Tensor, key_cache: torch.Tensor, key: torch.Tensor | None,
                   value: torch.Tensor | None) -> bool:
    """Whether the launch reads the new tokens' keys from ``key``/``value``; ``ValueError`` for
    tensors it would misread (one given without the other, another shape, dtype or device than
    the cache's rows (an FP8 cache's: the query's dtype), a head_dim that is not contiguous)."""
    if key is None and value is None:
        return False
    if key is None or value is None:
        raise ValueError("key and value must be given together")
    rows = (query.shape[0], key_cache.shape[2], key_cache.shape[3])
    dtype = query.dtype if key_cache.dtype in FP8_DTYPES else key_cache.dtype
    for t, name in ((key, "key"), (value, "value")):
        if tuple(t.shape) != rows:
            raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_dim] = {list(rows)}, got {list(t.shape)}")
        if t.dtype != dtype or t.device != key_cache.device:
            raise ValueError(f"{name} must have the dtype {dtype} and the cache's device {key_cache.device}, "
                             f"got {t.dtype}, {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    return True


def _step_descriptors(key: torch.Tensor, value: torch.Tensor, block_n: int, interpreter: bool,
                      step_tma: bool | None) -> tuple | None:
    """Tensor descriptors of the step's K and V as ``[num_tokens, num_kv_heads * head_dim]`` with
    ``[block_n, head_dim]`` boxes, or ``None`` for the pointer path.

    ``step_tma=None`` takes descriptors on a CUDA device of compute capability 9.0 or later (TMA
    bulk copies: 1.009x to 1.085x the speed of the kernel before them, on an H200) when the layout
    allows them: heads contiguous within a token (``stride(1) == head_dim``, true of the engine's
    views of its fused q/k/v product), 16-byte aligned base and token stride. ``True`` asks for
    them anywhere, the interpreter included (tests), and raises ``ValueError`` where the layout or
    the installed Triton cannot give them; ``False`` never takes them."""
    if step_tma is False:
        return None
    head_dim = key.shape[2]

    def fits(t: torch.Tensor) -> bool:
        elem = t.element_size()
        return (t.stride(1) == head_dim and t.data_ptr() % 16 == 0 and (t.stride(0) * elem) % 16 == 0
                and t.shape[0] > 0)

    if step_tma is None:
        hopper = not interpreter and torch.cuda.get_device_capability(key.device) >= (9, 0)
        if not (hopper and TensorDescriptor is not None and fits(key) and fits(value)):
            return None
    elif TensorDescriptor is None:
        raise ValueError("step_tma=True needs triton.tools.tensor_descriptor (Triton >= 3.3)")
    elif not (fits(key) and fits(value)):
        raise ValueError("step_tma=True needs key and value with contiguous heads (stride(1) == head_dim) "
                         "and a 16-byte aligned base and token stride")
    return tuple(TensorDescriptor(t, [t.shape[0], t.shape[1] * head_dim], [t.stride(0), 1], [block_n, head_dim])
                 for t in (key, value))


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated at global positions
    key_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64 packed
    num_blocks_per_seq: torch.Tensor,  # [num_seqs] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    inv_freq: torch.Tensor,  # [rotary_dim // 2] float32
    scale: float,
    *,
    interleaved: bool = False,
    key_starts: torch.Tensor | None = None,  # [num_seqs, max_blocks] int32, from block_key_starts
    runs: BlockRuns | None = None,  # from block_runs (computed when not given)
    seq_ids: torch.Tensor | None = None,  # [num_work] int32 distinct sequences, default all
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    rotation: Rotation = "query",  # see Rotation: "query", "key", "prerotated" (with query_rotations) or "none"
    chunk_scaling: ChunkScaling | None = None,  # APE on flagged blocks (None: plain attention)
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim] the new tokens' K, as in the cache
    value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim] their V
    max_context_len: int | None = None,  # host-side: most cached keys before a sequence's new tokens
    step_tma: bool | None = None,  # read key/value through tensor descriptors (None: on Hopper, where they fit)
    block_m: int | None = None,
    block_n: int | None = None,  # key lanes per tile (rounded up to a power of two >= block_size)
    num_warps: int | None = None,
    num_stages: int | None = None,
    key_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32 (FP8 caches)
    value_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32, key_scale's strides
    query_rotations: QueryRotations | None = None,  # rotation="prerotated": plan_query_rotations' layout
) -> torch.Tensor:
    """Deferred-RoPE paged attention of every new token of the listed sequences (see module doc).

    Only the rows of the sequences in ``seq_ids`` (each listed once: two programs on the same
    rows would race on the staged query) are written to ``out``; a sequence with no keys
    (padding) gets zeros. ``rotation``: ``"query"`` (default) rotates the query tile by ``-delta``
    once per chunk; ``"key"`` rotates every K tile by ``delta`` in registers (same result, more
    work: kept to measure the difference); ``"prerotated"`` rotates the rows beforehand, once per
    sequence and nonzero delta (:func:`~lazyattn_rag.kernels.query_rotation.rotate_queries`, with
    the layout ``query_rotations`` from :func:`~lazyattn_rag.kernels.query_rotation.plan_query_rotations`
    over the same tables), and the kernel loads them per run: the same result as ``"query"``;
    ``"none"`` compiles the rotation out: the same result
    where every block's delta is 0 (the engine's batches without a moved chunk), and a
    measure of its cost elsewhere.
    ``chunk_scaling``: keys of blocks flagged ``scaled`` are scored by APE's temperature and
    weight (:class:`~lazyattn_rag.kernels.launch.ChunkScaling`). ``key`` and ``value``, the new
    tokens' K/V exactly as written to the cache (rows of ``query``'s tokens): the new tokens' own
    keys are read from them, contiguous, instead of through the block table, for every sequence
    whose new tokens lie in one last run of delta 0 and no scaling flag (the engine's case); the
    result is the same. ``max_context_len`` (``seq_len - query_len`` at most, a host int; ``None``:
    unknown) only picks the default tiles (long prompts without cached keys take larger ones).
    ``step_tma``: how ``key``/``value`` are read, the same result either way (:func:`_step_descriptors`:
    bulk tensor copies on Hopper by default, per-lane loads otherwise). FP8 caches
    (``lazyattn_rag/types/kv_quant.py``) come with ``key_scale`` and ``value_scale`` (any layout, both
    with the same strides): cached keys' scores are
    multiplied by their K scales and their softmax weights by their V scales; ``key``/``value``
    (the new tokens' own, read from the step) stay in the query's dtype: full precision among
    the step's tokens. ``block_m``, ``block_n``,
    ``num_warps`` and ``num_stages`` change the launch only, never the result.

    Returns:
        ``out`` (allocated like ``query`` when not given).
    Raises:
        ValueError, NotImplementedError: inputs the kernel would misread
            (:func:`~lazyattn_rag.kernels.launch.check_inputs`), an unknown ``rotation``, an
            ``out`` of another dtype than ``query`` or overlapping its memory (the kernel stages
            the rotated query in ``out``), ``rotation="prerotated"`` without ``query_rotations``
            (or ``query_rotations`` with another rotation), ``step_tma=True`` where descriptors cannot be had
            (no ``key``/``value``, their layout, the installed Triton).

    Example:
        >>> out = paged_prefill(q, kc, vc, md.block_tables, md.num_blocks_per_seq, md.seq_lens,
        ...                     md.cu_seqlens_q, md.max_query_len, rotary.inv_freq.to(q.device), scale)
    """
    num_heads, head_dim, block_size = query.shape[1], query.shape[2], key_cache.shape[1]
    if out is not None:  # the kernel keeps each run's rotated query tile in its own output rows
        if out.dtype != query.dtype:
            raise ValueError(f"out must have the query's dtype {query.dtype}, got {out.dtype}")
        if _overlaps(out, query):
            raise ValueError("out must not overlap the query's memory")
    in_step = _check_step_kv(query, key_cache, key, value)
    if step_tma and not in_step:
        raise ValueError("step_tma=True needs key and value (the step's K/V to read through descriptors)")
    launch = launch_prologue(query, key_cache, value_cache, block_tables, inv_freq, scale,
                             interleaved=interleaved, out=out, seq_ids=seq_ids, key_scale=key_scale,
                             value_scale=value_scale)
    out, seq_ids = launch.out, launch.seq_ids
    code = rotation_code(rotation, ("query", "key", "none", "prerotated"))
    if (rotation == "prerotated") != (query_rotations is not None):
        raise ValueError(f'rotation="prerotated" takes query_rotations (plan_query_rotations), no other rotation '
                         f'does; got rotation={rotation!r} with query_rotations '
                         f'{"given" if query_rotations is not None else "None"}')
    if query_rotations is not None:
        query_rotations.check(block_tables.shape[0], query.device)
    if seq_ids.numel() == 0 or max_query_len == 0:
        return out
    if query_rotations is not None:
        q_rot = query  # no rows to rotate (no delta but 0): a pointer the kernel never reads
        if query_rotations.num_rows:
            q_rot = rotate_queries(query, query_rotations, cu_seqlens_q, max_query_len, launch.inv_freq, interleaved)
        rotated = (q_rot, query_rotations.run_rows)
        rotated_strides = (q_rot.stride(0), q_rot.stride(1), query_rotations.run_rows.stride(0))
    else:  # unused pointers: any tensor of the right kind
        rotated, rotated_strides = (query, seq_lens), (0, 0, 0)
    cfg = _default_config(head_dim, block_size, launch.interpreter, query.element_size(), max_query_len,
                          max_context_len, _shared_bytes(query.device))
    block_m = block_m or cfg["block_m"]
    block_n = triton.next_power_of_2(max(block_n or cfg["block_n"], block_size))
    if block_tables.shape[1] == 0:  # padding only: a column to point at (its tables and runs are empty)
        block_tables, key_starts, runs = addressable_table(block_tables), None, None
    if key_starts is None:
        key_starts = block_key_starts(block_tables, num_blocks_per_seq)
    if runs is None:
        runs = block_runs(block_tables, num_blocks_per_seq, block_size)
    max_blocks = block_tables.shape[1]
    scaling = (chunk_scaling or ChunkScaling()).kernel_args()
    descriptors = _step_descriptors(key, value, block_n, launch.interpreter, step_tma) if in_step else None
    step_k, step_v = (key, value) if in_step else (query, query)
    grid = (num_heads, triton.cdiv(max_query_len, block_m), seq_ids.numel())
    prefill_kernel[grid](
        query, key_cache, value_cache, *launch.scales, out, step_k, step_v, *(descriptors or (step_k, step_v)),
        block_tables, key_starts, runs.starts, runs.num_runs, num_blocks_per_seq, seq_lens, cu_seqlens_q, seq_ids,
        launch.inv_freq, *rotated, launch.sm_scale_log2, scaling["chunk_inv_temperature"],
        scaling["chunk_log2_weight"],
        *launch.strides,
        *(key.stride(0), key.stride(1), value.stride(0), value.stride(1)) if in_step else (0, 0, 0, 0),
        *launch.scale_strides,
        *rotated_strides,
        block_tables.stride(0), key_starts.stride(0), runs.starts.stride(0),
        max(1, max_blocks + 1).bit_length(),
        **launch.constexprs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        TILE_BLOCKS=block_n // block_size,
        ROTATION=code,
        CHUNK_SCALING=scaling["CHUNK_SCALING"],
        IN_STEP=in_step,
        STEP_TMA=descriptors is not None,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    return out
