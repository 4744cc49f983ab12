"""What a KV block holds: the element type, the shape and (room for) per-block scales.

One :class:`KVLayout` is read by everything that must agree on the stored K/V: the KV pool
allocates its tensors from it, the chunk keys name it (``ModelFingerprint.kv_format``), the storage
tiers refuse a stored chunk of another layout, and the attention backends declare the
``kv_cache_dtype`` values they read (``supported_kv_cache_dtypes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """The stored K/V of one engine.

    Attributes:
        dtype: element type of the K and V tensors (the model's dtype for ``kv_cache_dtype="auto"``).
        num_layers: decoder layers, each with its own K and V tensor.
        block_size: token slots per block.
        num_kv_heads: key/value heads per token.
        head_dim: elements per head.
        kv_cache_dtype: the configured name (``CacheConfig.kv_cache_dtype``), ``"auto"`` today.
        scales: the scaling scheme stored beside the blocks (``"none"``: the values are stored
            as they are; a quantized dtype will name its per-block scales here).
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
            ValueError: ``kv_cache_dtype`` is not ``"auto"``.
        """
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; supported: 'auto'")
        return cls(dtype, model_config.num_layers, block_size, model_config.num_kv_heads, model_config.head_dim,
                   kv_cache_dtype)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """``(block_size, num_kv_heads, head_dim)``: one block of one layer's K (or V)."""
        return self.block_size, self.num_kv_heads, self.head_dim

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """``(num_layers, num_tokens, num_kv_heads, head_dim)``: a chunk's K (or V) out of the pool."""
        return self.num_layers, num_tokens, self.num_kv_heads, self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers."""
        element_bytes = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

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
        expected = (self.chunk_shape(num_tokens), self.dtype)
        if tuple(keys[0]) == expected[0] and tuple(values[0]) == expected[0] and keys[1] == values[1] == self.dtype:
            return None
        return (f"K/V of {num_tokens} tokens, {tuple(keys[0])} {keys[1]} / {tuple(values[0])} {values[1]}, "
                f"does not fit this pool ({expected[0]} {self.dtype})")
