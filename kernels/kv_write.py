"""Writing the new tokens' K and V into the paged cache: one Triton launch for both.

The plain-PyTorch form is two indexed assignments (``cache.view(-1, heads, dim)[slot_mapping] =
k``), two kernels per layer; in a decode step of a large model at batch 1 each launch costs a few
microseconds of GPU time however little it writes, some 64 per step for a 32-layer model
(Llama-3.1-8B's shape on an H200). This kernel copies both in one launch (K/V of another dtype than
the cache's are converted by ``Tensor.to`` first), so the caches end up bit for bit as the two
assignments leave them. Its reference is
:func:`lazyattn_rag.engine.worker.attention.base.write_kv`.

An FP8 cache (``key_scale``/``value_scale`` given) stores each row quantized with its own scale
(``kv_quant.quantize_rows``: ``max|x| / fp8_max``, the same float32 divisions rounded to nearest).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lazyattn_rag.types.kv_quant import check_scales, fp8_max


@triton.jit
def kv_write_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_slots, num_kv_heads, head_dim] (the cache's blocks flattened)
    v_cache_ptr,  # [num_slots, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64 flat slot of each token
    k_scale_ptr,  # [num_slots, num_kv_heads] float32 (QUANTIZE; else unused)
    v_scale_ptr,  # [num_slots, num_kv_heads] float32 (QUANTIZE; else unused)
    stride_kt, stride_kh,  # key strides (tokens, heads); head_dim is contiguous
    stride_vt, stride_vh,  # value strides (tokens, heads)
    stride_cs, stride_ch,  # cache strides (slots, heads), equal for both caches
    num_slots,  # num_cache_blocks * block_size: a negative slot counts from the end, as torch indexing
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    QUANTIZE: tl.constexpr,  # FP8 caches: each row divided by its scale (max|x| / FP8_MAX), scales stored
    FP8_MAX: tl.constexpr,  # the caches' largest finite value (QUANTIZE only)
    ROUND_SHIFT: tl.constexpr,  # > 0: round to the FP8 grid here (see fp8_grid); 0: the conversion rounds
    MIN_NORMAL: tl.constexpr,  # ROUND_SHIFT only: the FP8 format's smallest normal value
    SUBNORMAL_STEP: tl.constexpr,  # ROUND_SHIFT only: its spacing below MIN_NORMAL
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    slot = tl.where(slot < 0, slot + num_slots, slot)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (heads < NUM_KV_HEADS)[:, None]
    t = token.to(tl.int64)
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=ok)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=ok)
    dst = slot * stride_cs + heads[:, None] * stride_ch + offs_d[None, :]  # [BLOCK_H, HEAD_DIM] int64
    if QUANTIZE:
        scale_dst = slot * NUM_KV_HEADS + heads  # [BLOCK_H]
        k = quantized_rows(k, k_scale_ptr + scale_dst, heads < NUM_KV_HEADS, FP8_MAX)
        v = quantized_rows(v, v_scale_ptr + scale_dst, heads < NUM_KV_HEADS, FP8_MAX)
        if ROUND_SHIFT > 0:
            k = fp8_grid(k, ROUND_SHIFT, MIN_NORMAL, SUBNORMAL_STEP)
            v = fp8_grid(v, ROUND_SHIFT, MIN_NORMAL, SUBNORMAL_STEP)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def quantized_rows(x, scale_ptrs, row_ok, FP8_MAX: tl.constexpr):
    """Rows ``x`` ``[R, HEAD_DIM]`` divided by their scales (``max|x| / FP8_MAX``, 1 where that is 0),
    stored at ``scale_ptrs`` ``[R]``: float32, clamped to the FP8 range, ready to convert."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [R]
    scale = tl.div_rn(amax, FP8_MAX)
    scale = tl.where(scale > 0.0, scale, 1.0)  # a zero row, or one so tiny its scale underflows
    tl.store(scale_ptrs, scale, mask=row_ok)
    y = tl.div_rn(x, scale[:, None])
    return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)


@triton.jit
def fp8_grid(y, ROUND_SHIFT: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEP: tl.constexpr):
    """float32 ``y`` (within the FP8 range) rounded to the nearest FP8 value, ties to even, kept in
    float32: the mantissa cut to ``23 - ROUND_SHIFT`` bits for normal values, multiples of
    ``SUBNORMAL_STEP`` below ``MIN_NORMAL``. Triton's interpreter (3.9 here) converts float32 to FP8
    wrongly where rounding carries into the exponent (125.6 -> 64 instead of 128 in e4m3); the
    conversion of a value already on the grid is exact, so the interpreter rounds here first."""
    bits = y.to(tl.int32, bitcast=True)
    lsb = (bits >> ROUND_SHIFT) & 1
    half = (1 << (ROUND_SHIFT - 1)) - 1
    normal = ((bits + half + lsb) & ~((1 << ROUND_SHIFT) - 1)).to(tl.float32, bitcast=True)
    magic = 8388608.0  # 2**23: float32 addition rounds |y| / step to an integer, ties to even
    tiny = ((tl.abs(y) / SUBNORMAL_STEP + magic) - magic) * SUBNORMAL_STEP
    return tl.where(tl.abs(y) < MIN_NORMAL, tl.where(y < 0.0, -tiny, tiny), normal)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    key_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32 (FP8 caches)
    value_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32
) -> None:
    """Store each token's K and V at its flat slot (``block_id * block_size + offset``), in the
    caches' dtype (converted by ``Tensor.to``; FP8 caches with ``key_scale``/``value_scale``: each
    row quantized with its own scale, stored there, as ``kv_quant.quantize_rows``). A negative slot counts from the end, as in
    ``write_kv``'s indexing; slots must lie in ``[-num_slots, num_slots)`` (not checked on the
    device, where ``write_kv`` would raise).

    Raises:
        ValueError: K/V rows of another shape than the caches', caches of unequal layout, a
            head_dim that is not contiguous, a power-of-two-less ``head_dim``, a slot mapping that
            is not int64 with one slot per token, scales given for caches that are not FP8 (or
            not given for FP8 caches) or not contiguous ``[num_cache_blocks, block_size, num_kv_heads]``
            float32.

    Example:
        >>> write_kv_cache(k, v, key_cache, value_cache, md.slot_mapping)
    """
    num_tokens = key.shape[0]
    _, _, num_kv_heads, head_dim = key_cache.shape
    if key.shape != value.shape or tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} must be "
                         f"[num_tokens, {num_kv_heads}, {head_dim}] like the caches' rows")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have one shape and layout")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("key, value and the caches must be contiguous in head_dim")
    if key_cache.stride(0) != key_cache.shape[1] * key_cache.stride(1):
        raise ValueError("a cache's blocks must be contiguous runs of slots")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} "
                         f"{list(slot_mapping.shape)}")
    quantize = check_scales(key_cache, key_scale, value_scale)
    if num_tokens == 0:
        return
    if not quantize:
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)  # no copy when they match
    kv_write_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key_scale if quantize else key_cache, value_scale if quantize else value_cache,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(1), key_cache.stride(2), key_cache.shape[0] * key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        QUANTIZE=quantize,
        FP8_MAX=fp8_max(key_cache.dtype) if quantize else 0.0,
        **_grid_constants(key_cache.dtype, quantize and key.device.type == "cpu"),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def _grid_constants(dtype: torch.dtype, explicit: bool) -> dict:
    """``fp8_grid``'s constants of an FP8 ``dtype`` when ``explicit`` (under the interpreter), else
    ``ROUND_SHIFT=0`` (the GPU's conversion rounds to nearest even itself)."""
    if not explicit:
        return dict(ROUND_SHIFT=0, MIN_NORMAL=0.0, SUBNORMAL_STEP=0.0)
    info = torch.finfo(dtype)
    mantissa_bits = round(-math.log2(info.eps))  # 3 for e4m3, 2 for e5m2
    return dict(ROUND_SHIFT=23 - mantissa_bits, MIN_NORMAL=float(info.tiny),
                SUBNORMAL_STEP=float(info.tiny) * 2.0 ** -mantissa_bits)
