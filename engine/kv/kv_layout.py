"""What a KV block holds: the element type, the shape and the per-token scales of an FP8 cache.

One :class:`KVLayout` is read by everything that must agree on the stored K/V: the KV pool
allocates its tensors from it, the chunk keys name it (``ModelFingerprint.kv_format``), the storage
tiers refuse a stored chunk of another layout, and the attention backends declare the
``kv_cache_dtype`` values they read (``supported_kv_cache_dtypes``).

FP8 (``kv_cache_dtype="fp8_e4m3"`` or ``"fp8_e5m2"``; ``"fp8"`` is ``"fp8_e4m3"``, as in vLLM):
each token's K (and V) row of one KV head is stored as ``head_dim`` FP8 values and one float32
scale, ``x ~= fp8 * scale`` with ``scale = max|x| / fp8_max`` (``lazyattn_rag/types/kv_quant.py``; scheme
``"per_token_head"``: docs/quality.md, issue 42, measured it closest to full precision of the
schemes tried). The pool keeps the scales in tensors beside the blocks (the kernels read aligned
FP8 rows); a chunk out of the pool, as the storage tiers hold it, packs each row's FP8 bytes and
its scale's four bytes together (:meth:`KVLayout.pack_rows`), so every tier carries the scales
with the values and never sees a chunk without them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazyattn_rag.types.cache_config import KV_CACHE_DTYPES

# the FP8 kv_cache_dtype names (CacheConfig's KV_CACHE_DTYPES) -> the stored element type; "fp8" is
# vLLM's alias of e4m3
FP8_STORAGE = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_BYTES = 4  # one float32 scale per token and KV head (scheme "per_token_head")


@dataclass(frozen=True)
class KVLayout:
    """The stored K/V of one engine.

    Attributes:
        dtype: element type of the K and V tensors (the model's dtype for ``kv_cache_dtype="auto"``).
        num_layers: decoder layers, each with its own K and V tensor.
        block_size: token slots per block.
        num_kv_heads: key/value heads per token.
        head_dim: elements per head.
        kv_cache_dtype: the configured name (``CacheConfig.kv_cache_dtype``).
        scales: the scaling scheme stored beside the blocks: ``"none"`` (the values as they are)
            or ``"per_token_head"`` (FP8: one float32 scale per token, KV head and K or V).
    """

    dtype: torch.dtype
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    kv_cache_dtype: str = "auto"
    scales: str = "none"

    @classmethod
    def for_model(cls, model_config, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVLayout:
        """The layout of a model whose config has ``num_layers``, ``num_kv_heads`` and ``head_dim``.

        Raises:
            ValueError: ``kv_cache_dtype`` is not one of :data:`KV_CACHE_DTYPES`.
        """
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; supported: {KV_CACHE_DTYPES}")
        stored = FP8_STORAGE.get(kv_cache_dtype)  # None: "auto", the model's dtype
        return cls(stored or dtype, model_config.num_layers, block_size, model_config.num_kv_heads,
                   model_config.head_dim, kv_cache_dtype, "none" if stored is None else "per_token_head")

    @property
    def scaled(self) -> bool:
        """Whether the pool keeps per-token scales beside the blocks (an FP8 cache)."""
        return self.scales != "none"

    @property
    def scale_shape(self) -> tuple[int, int]:
        """``(block_size, num_kv_heads)``: one block of one layer's K (or V) scales (``scaled`` only)."""
        return self.block_size, self.num_kv_heads

    @property
    def chunk_dtype(self) -> torch.dtype:
        """The element type of a chunk out of the pool: ``dtype``, or ``uint8`` for packed FP8 rows."""
        return torch.uint8 if self.scaled else self.dtype

    @property
    def row_width(self) -> int:
        """Elements per token and KV head in a chunk out of the pool: ``head_dim``, plus the scale's
        bytes for packed FP8 rows."""
        return self.head_dim + (SCALE_BYTES if self.scaled else 0)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """``(block_size, num_kv_heads, head_dim)``: one block of one layer's K (or V)."""
        return self.block_size, self.num_kv_heads, self.head_dim

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """``(num_layers, num_tokens, num_kv_heads, row_width)``: a chunk's K (or V) out of the pool."""
        return self.num_layers, num_tokens, self.num_kv_heads, self.row_width

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers (scales included)."""
        element_bytes = torch.empty(0, dtype=self.chunk_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * element_bytes

    def pack_rows(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """FP8 rows ``[..., head_dim]`` and their scales ``[...]`` float32 as packed rows
        ``[..., head_dim + 4]`` uint8 (each row's FP8 bytes, then its scale's bytes)."""
        scale_bytes = scales.to(torch.float32).contiguous().view(torch.uint8).view(*scales.shape, SCALE_BYTES)
        return torch.cat([values.contiguous().view(torch.uint8), scale_bytes], dim=-1)

    def unpack_rows(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`pack_rows` undone: ``(values [..., head_dim] in dtype, scales [...] float32)``."""
        values = packed[..., :self.head_dim].contiguous().view(self.dtype)
        scales = packed[..., self.head_dim:].contiguous().view(torch.float32)[..., 0]
        return values, scales

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block's K and V over all layers."""
        return self.block_size * self.bytes_per_token

    def format_name(self) -> str:
        """What a stored chunk's bytes mean, for chunk keys: e.g. ``"bfloat16/none"``."""
        return f"{str(self.dtype).removeprefix('torch.')}/{self.scales}"

    def mismatch(self, keys: tuple[tuple, torch.dtype], values: tuple[tuple, torch.dtype],
                 num_tokens: int) -> str | None:
        """Why a chunk's K and V (each ``(shape, dtype)``) of ``num_tokens`` tokens do not fit this
        layout, or ``None`` when they do."""
        expected = self.chunk_shape(num_tokens)
        if tuple(keys[0]) == expected and tuple(values[0]) == expected and keys[1] == values[1] == self.chunk_dtype:
            return None
        stored = "packed FP8 rows" if keys[1] == torch.uint8 else f"{keys[1]}"
        return (f"K/V of {num_tokens} tokens, {tuple(keys[0])} {stored} / {tuple(values[0])} {values[1]}, "
                f"does not fit this pool (kv_cache_dtype {self.kv_cache_dtype!r}: {expected} "
                f"{self.format_name()})")
