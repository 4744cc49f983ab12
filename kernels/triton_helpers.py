"""``@triton.jit`` helpers that both paged kernels (``prefill.py``, ``decode.py``) call."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


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
    ``scaled`` flag (bit 30) is set, else ``(sm_scale_log2, 0)``."""
    scaled = ((word >> 30) & 1) != 0
    return (tl.where(scaled, sm_scale_log2 * chunk_inv_temperature, sm_scale_log2),
            tl.where(scaled, chunk_log2_weight, 0.0))


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
def rotation_vectors(angle_scale, inv_freq_cols, sign, rotates, ACCURATE_TRIG: tl.constexpr):
    """``cos`` and signed ``sin`` per column ([HEAD_DIM] float32) of a rotation by ``angle_scale``
    positions: ``x'[c] = x[c] * cos[c] + x[partner[c]] * sin[c]``."""
    c, s = cos_sin(angle_scale * inv_freq_cols, ACCURATE_TRIG)
    return tl.where(rotates, c, 1.0), tl.where(rotates, sign * s, 0.0)
