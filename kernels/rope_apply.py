"""RoPE of a layer's query and key heads in one Triton launch (the compiled layers' rotation).

Its reference is :func:`~lazyattn_rag.kernels.rope.apply_rotation`, the same float32 arithmetic
(``x1 cos - x2 sin``, ``x2 cos + x1 sin``, rounded once to the input's dtype); under the
interpreter (numpy, no fused multiply-add) the results are equal bit for bit, compiled they
agree to one rounding.

Why a kernel of our own (issue 19): in the 20k-token prefill of the Llama-3.1-8B shape the
kernel inductor fuses from ``apply_rotation`` took 31 ms of device time (about 1 ms a layer) to
read and write 420 MB a layer; alone on the H200 it moves 0.56 TB/s at 20,480 tokens, this
kernel 3.59 (``benchmarks/rope_apply.py``). One program rotates ``BLOCK_T``
tokens of ``BLOCK_H`` heads: it loads each token's angles once for all of its heads and each
pair's two halves as two tiles.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# One token and 8 heads per program, 4 warps: the only tiles of the H200 sweep (benchmarks/rope_apply.py:
# 1-8 tokens, 1-8 heads, 1-4 warps; 1 to 20,480 tokens of Llama-3.1-8B's
# q and k) within 5.2 % of the best at every size from 2 tokens up (3.59 TB/s at 20,480), and at
# 1 token (1.33 us) still below inductor's fused rotation (1.37 us).
BLOCK_T = 1  # tokens per program
BLOCK_H = 8  # heads per program
NUM_WARPS = 4


@triton.jit
def rope_kernel(
    x_ptr,  # [num_tokens, num_heads, head_dim] input heads; head_dim contiguous
    cos_ptr,  # [num_tokens, HALF] float32 cos of each token's angles (row stride stride_ct)
    sin_ptr,  # [num_tokens, HALF] float32 sin (row stride stride_st)
    out_ptr,  # [num_tokens, num_heads, head_dim] rotated heads; head_dim contiguous
    num_tokens, num_heads,
    stride_xt, stride_xh,  # x strides (tokens, heads)
    stride_ct, stride_st,  # cos and sin row strides
    stride_ot, stride_oh,  # out strides (tokens, heads)
    HALF: tl.constexpr,  # rotary_dim // 2: pairs per head
    HALF_P2: tl.constexpr,  # next power of two >= HALF
    PAIR_STRIDE: tl.constexpr,  # 1 half-split (pair i: columns i, i + HALF), 2 interleaved (2i, 2i + 1)
    X2_OFF: tl.constexpr,  # column of a pair's second element minus its first's: HALF or 1
    REST: tl.constexpr,  # head_dim - rotary_dim: trailing columns copied unrotated
    REST_P2: tl.constexpr,  # next power of two >= REST (1 when REST is 0)
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # heads per program
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_i = tl.arange(0, HALF_P2)  # [HALF_P2] pair index
    t_ok = offs_t < num_tokens
    th_ok = t_ok[:, None, None] & (offs_h < num_heads)[None, :, None]  # [BLOCK_T, BLOCK_H, 1]
    t64 = offs_t.to(tl.int64)
    pair_ok = th_ok & (offs_i < HALF)[None, None, :]  # [BLOCK_T, BLOCK_H, HALF_P2]

    angle_ok = t_ok[:, None] & (offs_i < HALF)[None, :]  # [BLOCK_T, HALF_P2]
    c = tl.load(cos_ptr + t64[:, None] * stride_ct + offs_i[None, :], mask=angle_ok, other=0.0)[:, None, :]
    s = tl.load(sin_ptr + t64[:, None] * stride_st + offs_i[None, :], mask=angle_ok, other=0.0)[:, None, :]

    h64 = offs_h.to(tl.int64)  # head-major views can put heads 2**31 elements apart
    x_rows = x_ptr + t64[:, None, None] * stride_xt + h64[None, :, None] * stride_xh  # [BLOCK_T, BLOCK_H, 1]
    o_rows = out_ptr + t64[:, None, None] * stride_ot + h64[None, :, None] * stride_oh
    col1 = (offs_i * PAIR_STRIDE)[None, None, :]  # [1, 1, HALF_P2] each pair's first column
    x1 = tl.load(x_rows + col1, mask=pair_ok, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_H, HALF_P2]
    x2 = tl.load(x_rows + col1 + X2_OFF, mask=pair_ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(o_rows + col1, (x1 * c - x2 * s).to(dtype), mask=pair_ok)
    tl.store(o_rows + col1 + X2_OFF, (x2 * c + x1 * s).to(dtype), mask=pair_ok)
    if REST > 0:  # partial rotary: the trailing columns pass through
        col_r = 2 * HALF + tl.arange(0, REST_P2)[None, None, :]  # [1, 1, REST_P2]
        rest_ok = th_ok & (col_r < 2 * HALF + REST)
        tl.store(o_rows + col_r, tl.load(x_rows + col_r, mask=rest_ok, other=0.0), mask=rest_ok)


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
               interleaved: bool) -> torch.Tensor:
    """:func:`~lazyattn_rag.kernels.rope.apply_rotation` in one launch (RoPE: RoFormer, Su et al. 2021, Sec. 3.4.2).

    Args:
        x: ``[num_tokens, num_heads, head_dim]``, float16, bfloat16 or float32, ``head_dim``
            contiguous (heads and tokens may be strided: q and k as views of a fused product).
        cos, sin: ``[num_tokens, rotary_dim // 2]`` float32 angles' cos and sin (may carry a
            magnitude factor), rows contiguous, on ``x``'s device.
        rotary_dim: leading columns of each head that rotate (even, ``<= head_dim``); the rest
            are copied.
        interleaved: GPT-J pairing ``(2i, 2i + 1)`` instead of half-split ``(i, i + rotary_dim / 2)``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``x``'s dtype, contiguous (float32 arithmetic,
        rounded once).

    Raises:
        ValueError: a shape, dtype, layout or device :func:`rope_applies` refuses (which one).

    Example:
        >>> qk = rope_apply(qk, rope.cos, rope.sin, rope.rotary_dim, rope.interleaved)
    """
    problem = _problem(x, cos, sin, rotary_dim)
    if problem:
        raise ValueError(f"rope_apply: {problem}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        launch(x, cos, sin, out, rotary_dim, interleaved, BLOCK_T, BLOCK_H, NUM_WARPS)
    return out


def launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, rotary_dim: int,
           interleaved: bool, block_t: int, block_h: int, num_warps: int) -> None:
    """One launch of :func:`rope_kernel` into ``out`` (``x``'s shape, ``head_dim`` contiguous) with
    the given tiles, unchecked: :func:`rope_apply` checks its inputs first, the tile sweep of
    ``benchmarks/rope_apply.py`` calls it directly."""
    num_tokens, num_heads, head_dim = x.shape
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads, block_h))
    rope_kernel[grid](
        x, cos, sin, out, num_tokens, num_heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        out.stride(0), out.stride(1),
        HALF=half, HALF_P2=triton.next_power_of_2(half), PAIR_STRIDE=2 if interleaved else 1,
        X2_OFF=1 if interleaved else half, REST=rest, REST_P2=triton.next_power_of_2(max(rest, 1)),
        BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps,
    )


@torch.library.custom_op("lazyattn_rag::rope_apply", mutates_args=())
def rope_apply_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                  interleaved: bool) -> torch.Tensor:
    """:func:`rope_apply` as an operator opaque to ``torch.compile``, which the compiled layers
    call: inductor schedules it as one external kernel. (Traced as a plain Triton launch inside
    the whole compiled layer, inductor 2.11's scheduler failed on it: ``KeyError`` in
    ``compute_ancestors``, on the H200; the launch alone compiled.)"""
    return rope_apply(x, cos, sin, rotary_dim, interleaved)


@rope_apply_op.register_fake
def _(x, cos, sin, rotary_dim, interleaved):
    problem = _problem(x, cos, sin, rotary_dim)
    if problem:  # refused while tracing, as the real operator would refuse it
        raise ValueError(f"rope_apply: {problem}")
    return x.new_empty(x.shape)  # contiguous, x's dtype and device


def rope_applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> bool:
    """Whether :func:`rope_apply` takes these inputs (the compiled layers fall back to
    ``apply_rotation`` otherwise)."""
    return not _problem(x, cos, sin, rotary_dim)


def _problem(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> str:
    """What :func:`rope_apply` cannot take in these inputs, or ``""``."""
    if x.dim() != 3:
        return f"x must be [num_tokens, num_heads, head_dim], got shape {list(x.shape)}"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"x must be float16, bfloat16 or float32, got {x.dtype}"
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"x is on {x.device}: the kernel runs on CUDA (or on the CPU under TRITON_INTERPRET=1)"
    num_tokens, _, head_dim = x.shape
    if x.stride(2) != 1:
        return "x must be contiguous along head_dim"
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        return f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}"
    for t, name in ((cos, "cos"), (sin, "sin")):
        if tuple(t.shape) != (num_tokens, rotary_dim // 2) or t.dtype != torch.float32:
            return f"{name} must be [{num_tokens}, {rotary_dim // 2}] float32, got {list(t.shape)} {t.dtype}"
        if t.device != x.device:
            return f"{name} is on {t.device}, x on {x.device}"
        if t.shape[1] > 1 and t.stride(1) != 1:
            return f"{name} must be contiguous along its rows, got column stride {t.stride(1)}"
    if torch.is_grad_enabled() and x.requires_grad:
        return "no backward: call it under torch.no_grad() or inference_mode()"
    return ""
