"""FP8 K/V with one float32 scale per token and KV head: the reference of every kernel that
writes or reads an FP8 KV cache (``kv_write.py`` quantizes, ``prefill.py`` and ``decode.py``
dequantize).

A row ``x`` (one token's K or V of one KV head, ``head_dim`` values) is stored as
``round(x / scale)`` in FP8 with ``scale = max|x| / fp8_max`` (448 for e4m3, 57344 for e5m2;
``1`` where that is 0: a row of zeros, or of float32 values below ~3e-43 whose scale underflows),
and read as ``fp8 * scale`` in float32. One scale per row keeps a token's outliers from costing
the other tokens their precision, and a row's bytes and scale are final once written, so a chunk
encoded over several steps, or moved between tiers, never changes.
Keys are stored rotated at their local positions (DESIGN.md); the deferred rotation is applied to
the query, or to the dequantized key, after this. Scheme and measurements: docs/quality.md
(issue 42: per token and head scored closest to full precision of the four schemes tried).
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 ``dtype`` (448.0 for e4m3fn, 57344.0 for e5m2).

    Raises:
        ValueError: ``dtype`` is not one of :data:`FP8_DTYPES`.
    """
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{dtype} is not an FP8 KV cache dtype {FP8_DTYPES}")
    return float(torch.finfo(dtype).max)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (``[..., head_dim]``, any float dtype) as FP8 values and scales.

    Returns:
        ``(values [..., head_dim] in dtype, scales [...] float32)`` with
        ``values.float() * scales[..., None] ~= x`` (round to nearest even, as the kernels'
        conversion).
    Raises:
        ValueError: ``dtype`` is not FP8.
    """
    limit = fp8_max(dtype)
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=-1)  # [...]
    # a tensor divisor: CUDA divides a tensor by a Python number as a multiply by its reciprocal,
    # one unit in the last place off the kernels' correctly rounded division now and then
    scales = amax / torch.full_like(amax, limit)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero rows, and rows whose scale underflows
    return (x / scales[..., None]).clamp(-limit, limit).to(dtype), scales


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``values.float() * scales[..., None]``: FP8 rows ``[..., head_dim]`` back in float32."""
    return values.to(torch.float32) * scales.to(torch.float32)[..., None]


def check_scales(
    key_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    key_scale: torch.Tensor | None,  # [num_cache_blocks, block_size, num_kv_heads] float32
    value_scale: torch.Tensor | None,
    *,
    contiguous: bool = True,
) -> bool:
    """Whether the caches are FP8 with per-token scales (``kv_quant``), checking the scales fit.

    ``contiguous=False`` (the attention kernels, which index scales by their strides) accepts
    scales of any layout, as long as both have the same strides; ``True`` (the quantizing write)
    needs contiguous scales and caches.

    Raises:
        ValueError: FP8 caches without both scales, scales with caches of another dtype, scales
            that are not float32 ``[num_cache_blocks, block_size, num_kv_heads]``, contiguous
            ones (and caches) where ``contiguous``, else two of different strides.
    """
    fp8 = key_cache.dtype in FP8_DTYPES
    if (key_scale is None) != (value_scale is None) or fp8 != (key_scale is not None):
        raise ValueError(f"a {key_cache.dtype} cache needs {'both' if fp8 else 'no'} key_scale and value_scale")
    if not fp8:
        return False
    shape = tuple(key_cache.shape[:3])
    kind = "contiguous float32" if contiguous else "float32"
    for name, s in (("key_scale", key_scale), ("value_scale", value_scale)):
        if tuple(s.shape) != shape or s.dtype != torch.float32 or (contiguous and not s.is_contiguous()):
            raise ValueError(f"{name} must be {kind} {list(shape)}, got {s.dtype} {list(s.shape)}")
    if not contiguous and key_scale.stride() != value_scale.stride():
        raise ValueError(f"key_scale and value_scale must have the same strides, got {key_scale.stride()} "
                         f"and {value_scale.stride()}")
    if contiguous and not key_cache.is_contiguous():
        raise ValueError("FP8 caches must be contiguous (their scales are indexed by row)")
    return True
