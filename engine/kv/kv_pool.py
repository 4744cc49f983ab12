"""The KV pool: the paged K/V tensors of every layer and every operation that moves stored K/V.

Nothing else indexes these tensors: the model's forward pass receives them per layer
(:attr:`KVPool.layers`) for the attention backend to write the step's new tokens and read
the context; loads, copies, gathers and the rotated copies of position-aware reuse happen here.
"""

from __future__ import annotations

import math
import mmap
from typing import Protocol

import torch

from lazyattn_rag.engine.kv.kv_layout import KVLayout
from lazyattn_rag.types.kv_quant import dequantize_rows, quantize_rows


class Rotation(Protocol):
    """What the pool needs of a rotary embedding (``kernels/rope.py: RotaryEmbedding``)."""

    def shifts(self, deltas: torch.Tensor):
        """Tables whose ``apply(x)`` rotates ``x`` ``[n, num_kv_heads, head_dim]`` by ``deltas`` ``[n]``."""


def copy_layer_slots(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [n] int64 flat source slots
    dst: torch.Tensor,  # [n] int64 flat destination slots
    shift,  # Rotation.shifts(deltas) of the n slots
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # FP8: (key_scale, value_scale) [num_blocks, block_size, num_kv_heads]
) -> None:
    """Copy one layer's slots ``src`` to ``dst``: one gather, K rotated by ``shift``, one scatter;
    V as is (:meth:`KVPool.copy_slots` for every layer; a pass's in-layer copies,
    ``AttentionBackend.copy_step_slots``). FP8 rows a nonzero shift moves are dequantized, rotated
    and quantized again; the others (and every V row) are copied with their scales, bytes as they are."""
    flat_k = key_cache.view(-1, *key_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim]
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_v[dst] = flat_v[src]
    if scales is None:
        flat_k[dst] = shift.apply(flat_k[src])
        return
    key_scale, value_scale = (s.view(-1, s.shape[-1]) for s in scales)  # [num_slots, num_kv_heads]
    value_scale[dst] = value_scale[src]
    rows, row_scales = flat_k[src], key_scale[src]
    rotated, rotated_scales = quantize_rows(shift.apply(dequantize_rows(rows, row_scales)), flat_k.dtype)
    moved = (shift.sin != 0).any(dim=-1)  # [n] rows whose rotation is not the identity (no host sync)
    flat_k[dst] = torch.where(moved[:, None, None], rotated.view(torch.uint8), rows.view(torch.uint8)).view(rows.dtype)
    key_scale[dst] = torch.where(moved[:, None], rotated_scales, row_scales)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose host memory is committed only where it is written.

    On the CPU it lives in an anonymous mapping: the kernel hands out zero pages on first
    touch, so the default 512 MiB KV cache costs neither start-up time (``torch.zeros`` writes
    every byte) nor resident memory until blocks are used. Elsewhere it is ``torch.zeros``.
    """
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    buffer = mmap.mmap(-1, nbytes)  # private, zero-filled; unmapped when the tensor is freed
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


class KVPool:
    """The K and V tensors of ``num_blocks`` blocks (plus one: its first slot, ``padding_slot``,
    takes the K/V of CUDA-graph padding rows) in every layer.

    Args:
        layout: what a block holds (:class:`KVLayout`).
        num_blocks: blocks the block pool hands out.
        device: where the tensors live.
    Attributes:
        layers: per layer ``(key_cache, value_cache)``, each ``[num_blocks + 1, block_size,
            num_kv_heads, head_dim]`` in ``layout.dtype``, followed for an FP8 layout
            (``layout.scaled``) by ``(key_scale, value_scale)``, each ``[num_blocks + 1,
            block_size, num_kv_heads]`` float32: what the forward pass hands the attention
            backend, layer by layer.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device):
        self.layout, self.num_blocks, self.device = layout, num_blocks, torch.device(device)
        shape = (num_blocks + 1, *layout.block_shape)
        self.padding_slot = num_blocks * layout.block_size
        scale_shape = (num_blocks + 1, *layout.scale_shape)
        self.layers = [(zeros(shape, layout.dtype, device), zeros(shape, layout.dtype, device))
                       + ((zeros(scale_shape, torch.float32, device), zeros(scale_shape, torch.float32, device))
                          if layout.scaled else ())
                       for _ in range(layout.num_layers)]

    def close(self) -> None:
        """Free the tensors; the pool holds nothing afterwards."""
        self.layers = []

    def _flat(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, *cache.shape[2:])  # [num_slots, num_kv_heads, head_dim]

    def slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """``[num_tokens]`` int64 flat slots of tokens laid out from the first block's slot 0."""
        bs = self.layout.block_size
        offsets = torch.arange(num_tokens, device=self.device)
        return torch.tensor(block_ids, device=self.device)[offsets // bs] * bs + offsets % bs

    def write(self, block_ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a chunk's K/V (as :meth:`gather` returns it, on any device) into ``block_ids``.

        Raises:
            ValueError: the tensors do not fit the layout (:meth:`KVLayout.mismatch`), or the
                blocks cannot hold their tokens. Nothing is written then.
        """
        num_tokens = keys.shape[1] if keys.dim() == 4 else -1
        problem = self.layout.mismatch((keys.shape, keys.dtype), (values.shape, values.dtype), num_tokens)
        if problem:
            raise ValueError(f"chunk {problem}")
        if len(block_ids) * self.layout.block_size < num_tokens:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens")
        slots = self.slots(block_ids, num_tokens)
        keys, values = keys.to(self.device), values.to(self.device)  # one host-to-device copy each (or none)
        for layer, caches in enumerate(self.layers):
            for cache, rows in zip(caches, self._unpacked(keys[layer], values[layer])):
                cache.view(-1, *cache.shape[2:])[slots] = rows

    def _unpacked(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One layer of a chunk as the pool's tensors of that layer hold it: ``(keys, values)``, or
        for packed FP8 rows ``(keys, values, key_scales, value_scales)``."""
        if not self.layout.scaled:
            return keys, values
        (k, ks), (v, vs) = self.layout.unpack_rows(keys), self.layout.unpack_rows(values)
        return k, v, ks, vs

    def gather(self, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's K/V gathered into new tensors on the pool's device (stream-ordered: what later
        kernels write into the blocks does not reach them).

        Args:
            block_ids: the chunk's blocks, in order.
            num_tokens: its valid tokens (the last block may be partly filled).
        Returns:
            ``(keys, values)``, each ``layout.chunk_shape(num_tokens)`` in ``layout.chunk_dtype``
            (an FP8 layout's rows packed with their scales, :meth:`KVLayout.pack_rows`).
        """
        slots = self.slots(block_ids, num_tokens)
        rows = [[c.view(-1, *c.shape[2:])[slots] for c in caches] for caches in self.layers]
        if self.layout.scaled:  # (k, v, ks, vs) per layer -> packed K and V rows
            rows = [(self.layout.pack_rows(k, ks), self.layout.pack_rows(v, vs)) for k, v, ks, vs in rows]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def read(self, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`gather`, copied to the CPU (waits for the device)."""
        keys, values = self.gather(block_ids, num_tokens)
        return keys.cpu(), values.cpu()

    def gather_layer(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V at ``slots`` (``[n]`` int64), each ``[n, num_kv_heads, head_dim]``
        (an FP8 layout's dequantized to float32)."""
        caches = self.layers[layer]
        k, v = self._flat(caches[0])[slots], self._flat(caches[1])[slots]
        if self.layout.scaled:
            ks, vs = (c.view(-1, c.shape[-1])[slots] for c in caches[2:])
            return dequantize_rows(k, ks), dequantize_rows(v, vs)
        return k, v

    def copy_rotated(self, src_blocks: list[int], dst_blocks: list[int], num_tokens: int, delta: int,
                     rotary: Rotation) -> None:
        """Copy a chunk's K/V into other blocks, K rotated by ``delta`` (destination position minus
        source position: a position-aware copy) with ``rotary``'s pure rotation.

        Args:
            src_blocks, dst_blocks: equally many block ids.
            num_tokens: valid tokens of the chunk (the last block may be partial).
        """
        src, dst = self.slots(src_blocks, num_tokens), self.slots(dst_blocks, num_tokens)
        self.copy_slots(src, dst, torch.full((num_tokens,), delta, device=self.device), rotary)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, deltas: torch.Tensor, rotary: Rotation) -> None:
        """Copy slots ``src`` to ``dst`` in every layer, K rotated by ``deltas`` (each ``[n]`` int64
        on the pool's device): one gather, rotation and scatter per layer, the rotation tables
        made once for all layers."""
        shift = rotary.shifts(deltas)
        for key_cache, value_cache, *scales in self.layers:
            copy_layer_slots(key_cache, value_cache, src, dst, shift, tuple(scales) or None)
