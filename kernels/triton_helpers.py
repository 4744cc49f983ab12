"""``@triton.jit`` helpers that both paged kernels (``prefill.py``, ``decode.py``) call."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from lazyattn_rag.kernels.block_table import DELTA_SHIFT, MAX_BLOCK_ID, MAX_VALID, SCALED_SHIFT, VALID_SHIFT

# the packed block-table word's fields (kernels/block_table.py), as constants a kernel may read
_ID_MASK = tl.constexpr(MAX_BLOCK_ID)
_SCALED_SHIFT = tl.constexpr(SCALED_SHIFT)
_VALID_SHIFT = tl.constexpr(VALID_SHIFT)
_VALID_MASK = tl.constexpr(MAX_VALID - 1)
_DELTA_SHIFT = tl.constexpr(DELTA_SHIFT)


@triton.jit
def word_block_id(word):
    """The physical block id of block-table words (any shape)."""
    return word & _ID_MASK


@triton.jit
def word_scaled(word):
    """Whether block-table words carry the chunk-attention-scaling flag (bool, any shape)."""
    return ((word >> _SCALED_SHIFT) & 1) != 0


@triton.jit
def word_valid(word):
    """The filled slots of the blocks of block-table words (1..block size, any shape)."""
    return ((word >> _VALID_SHIFT) & _VALID_MASK) + 1


@triton.jit
def word_delta(word):
    """The RoPE offset of block-table words (signed: an arithmetic shift, any shape)."""
    return word >> _DELTA_SHIFT


@triton.jit
def unpack_word(word):
    """``(block_id, scaled, valid, delta)`` of block-table words: the kernels' reading of the
    layout, one field per helper above (a kernel calls the one it needs: a ``_`` placeholder for
    the others would be a variable the compiler carries through loops); its Python twin is
    ``block_table.unpack_word``."""
    return word_block_id(word), word_scaled(word), word_valid(word), word_delta(word)


@triton.jit
def cos_sin(angle, ACCURATE_TRIG: tl.constexpr):
    """cos and sin of float32 angles; libdevice on the GPU, numpy under the interpreter."""
    if ACCURATE_TRIG:
        return libdevice.cos(angle), libdevice.sin(angle)
    else:
        return tl.cos(angle), tl.sin(angle)


@triton.jit
def run_score_scale(word, sm_scale_log2, chunk_inv_temperature, chunk_log2_weight):
    """``(scale, bias)`` of a run's log2-domain scores (``dot * scale + bias``), from the run's
    first block-table word: chunk attention scaling's (APE, ``launch.ChunkScaling``) when its
    ``scaled`` flag is set, else ``(sm_scale_log2, 0)``."""
    scaled = word_scaled(word)
    return (tl.where(scaled, sm_scale_log2 * chunk_inv_temperature, sm_scale_log2),
            tl.where(scaled, chunk_log2_weight, 0.0))


@triton.jit
def fp8_to_f16(x):
    """``x`` (an FP8 tile, e4m3 or e5m2) as float16, exactly, by the sm_89+ conversion instruction
    applied in registers where the tile was loaded (compiled GPU kernels only: inline PTX).

    ``x.to(tl.float16)`` computes the same values, but Triton moves that conversion past the tile's
    shared-memory read into the dot's operand layout; for the ``P @ V`` dot that layout packs four
    consecutive keys of a column per register, which an FP8 tile (rows contiguous along
    head_dim) can only be read as single bytes (``LDS.U8``: 128 per 128-key tile and thread, 254
    registers, in the decode kernel compiled offline for sm_90a). Widened here, the float16 tile
    goes through ``ldmatrix.trans`` as a bfloat16 one does (180 registers, no byte reads)."""
    if x.dtype == tl.float8e5:
        asm: tl.constexpr = "cvt.rn.f16x2.e5m2x2 $0, $1;"
    else:
        asm: tl.constexpr = "cvt.rn.f16x2.e4m3x2 $0, $1;"
    return tl.inline_asm_elementwise(asm, "=r,h", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                     is_pure=False, pack=2)


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``; ``UPCAST`` computes in float32 (the interpreter's half-type dot is wrong)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def rotary_columns(HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PAIR_STRIDE: tl.constexpr, X2_OFF: tl.constexpr):
    """Per head-dimension column: its rotary pair's frequency index, its partner column, the sign
    of the partner's term, and whether it rotates (``x'[c] = x[c] cos + sign * x[partner] sin``;
    columns past ``2 * HALF`` keep ``x[c]``). Covers half-split and interleaved pairing alike."""
    col = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    rotates = col < 2 * HALF
    second = ((col // X2_OFF) % 2) == 1  # the pair's second element (x2)
    first_col = tl.where(second, col - X2_OFF, col)
    freq_idx = tl.where(rotates, first_col // PAIR_STRIDE, 0)  # [HEAD_DIM] in [0, HALF)
    partner = tl.where(rotates, tl.where(second, col - X2_OFF, col + X2_OFF), col)
    sign = tl.where(second, 1.0, -1.0)
    return freq_idx, partner, sign, rotates


@triton.jit
def rotation(positions, inv_freq_ptr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PAIR_STRIDE: tl.constexpr,
             X2_OFF: tl.constexpr, ACCURATE_TRIG: tl.constexpr):
    """A rotation by ``positions`` (a scalar) per head-dimension column: ``cos`` and signed ``sin``
    ([HEAD_DIM] float32) and the partner column ([HEAD_DIM] int32), for
    ``x'[c] = x[c] * cos[c] + x[partner[c]] * sin[c]`` (angles ``float32(positions) * inv_freq``
    from ``inv_freq_ptr``, ``[HALF]`` float32)."""
    freq_idx, partner, sign, rotates = rotary_columns(HEAD_DIM, HALF, PAIR_STRIDE, X2_OFF)
    inv_freq = tl.load(inv_freq_ptr + freq_idx)  # [HEAD_DIM] each column's pair frequency
    c, s = cos_sin(positions.to(tl.float32) * inv_freq, ACCURATE_TRIG)
    return tl.where(rotates, c, 1.0), tl.where(rotates, sign * s, 0.0), partner


@triton.jit
def rotated_rows(row_ptrs, row_ok, cos, sin, partner, HEAD_DIM: tl.constexpr):
    """Rows ``row_ptrs[:, None] + column`` (``[R]`` pointers to each row's first element, ``row_ok``
    ``[R]``) rotated by :func:`rotation`'s ``cos``, ``sin``, ``partner``: ``[R, HEAD_DIM]`` float32."""
    x = tl.load(row_ptrs[:, None] + tl.arange(0, HEAD_DIM)[None, :], mask=row_ok[:, None], other=0.0)
    xp = tl.load(row_ptrs[:, None] + partner[None, :], mask=row_ok[:, None], other=0.0)
    return x.to(tl.float32) * cos[None, :] + xp.to(tl.float32) * sin[None, :]


@triton.jit
def attend(
    acc, m_i, l_i,  # running output [M, HEAD_DIM], row max and row sum [M] (float32)
    q, k, v,  # [M, HEAD_DIM], [N, HEAD_DIM] x 2
    keep,  # [M, N] or [1, N] bool: the pairs that attend (MASKED only)
    score_scale, score_bias,  # float32 scalars (score_scale > 0): log2-domain score = dot * score_scale + score_bias
    k_scale, v_scale,  # [N] float32 each key's K and V scale (KV_SCALED only: FP8 caches)
    MASKED: tl.constexpr, CHUNK_SCALING: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    """Scores of one tile, the online-softmax update (float32, exp2) and ``acc += P @ V``; both
    paged kernels' inner step.

    The scale is applied inside the row max and the exponent's multiply-add (``score_scale > 0``,
    so ``max(s) * scale = max(s * scale)``): one fused multiply-add per score, no separate scaling.
    With ``KV_SCALED`` (``k``, ``v`` widened from FP8) each key's raw score is multiplied by its K
    scale and its softmax weight by its V scale before ``P @ V`` (``lazyattn_rag/types/kv_quant.py``)."""
    s = tl.zeros([q.shape[0], k.shape[0]], tl.float32)
    s = mma(q, tl.trans(k), s, DOT_PRECISION, DOT_UPCAST)  # [M, N] raw dot products
    if KV_SCALED:
        s = s * k_scale[None, :]
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    if CHUNK_SCALING:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * score_scale + score_bias)
        p = tl.math.exp2(s * score_scale + (score_bias - m_new)[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * score_scale)
        p = tl.math.exp2(s * score_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if KV_SCALED:
        p = p * v_scale[None, :]
    acc = mma(p.to(q.dtype), v, acc, DOT_PRECISION, DOT_UPCAST)
    return acc, m_new, l_i
