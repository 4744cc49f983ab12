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
