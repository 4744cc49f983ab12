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
def mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b``; ``UPCAST`` computes in float32 (the interpreter's half-type dot is wrong)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)
