"""The attention-backend interface shared by the ``torch`` reference and the ``triton`` kernels."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from lazyattn_rag.engine.kv.kv_pool import copy_layer_slots
from lazyattn_rag.engine.worker.attention.metadata import AttentionMetadata
from lazyattn_rag.types.kv_quant import quantize_rows
from lazyattn_rag.kernels.launch import ChunkScaling
from lazyattn_rag.kernels.rope import RotaryEmbedding


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    key_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32 (FP8 caches)
    value_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32
) -> None:
    """Scatter new tokens' K/V into their cache slots (``slot = block_id * block_size + offset``);
    into an FP8 cache each row quantized with its own scale (``lazyattn_rag/types/kv_quant.py``), the scale
    stored at the same slot of ``key_scale``/``value_scale``."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_slots = num_blocks * block_size
    for x, cache, scales in ((key, key_cache, key_scale), (value, value_cache, value_scale)):
        if scales is None:
            cache.view(num_slots, num_kv_heads, head_dim)[slot_mapping] = x.to(cache.dtype)
        else:
            rows, row_scales = quantize_rows(x, cache.dtype)
            cache.view(num_slots, num_kv_heads, head_dim)[slot_mapping] = rows
            scales.view(num_slots, num_kv_heads)[slot_mapping] = row_scales


class AttentionBackend(ABC):
    """Deferred-RoPE paged attention over a batch described by :class:`AttentionMetadata`.

    A backend writes the new tokens' K/V into the paged cache and returns the attention
    output of the new tokens. Cached keys are stored rotated at their *local* positions;
    the backend moves each block to its global position by the block's ``delta``
    (LazyAttention, arXiv 2606.04302, Sec. 3): it rotates K by ``delta`` for prefill rows,
    or the query by ``-delta`` for decode rows. Queries arrive already rotated at their
    global positions.
    """

    name: str = "abstract"
    # Decode steps may be captured in CUDA graphs: ``forward`` does no host sync or host-to-device
    # copy once :meth:`plan_graph_decode` has stored the metadata's plan.
    supports_cuda_graphs: bool = False
    # The ``CacheConfig.kv_cache_dtype`` values whose stored K/V this backend reads ("auto": the
    # model's dtype); the engine refuses any other at start-up.
    supported_kv_cache_dtypes: tuple[str, ...] = ("auto",)

    def kv_cache_dtype_error(self, kv_cache_dtype: str, device: torch.device) -> str | None:
        """Why this backend cannot read ``kv_cache_dtype`` on ``device`` (``None``: it can);
        the engine refuses it at start-up with this reason."""
        if kv_cache_dtype not in self.supported_kv_cache_dtypes:
            return f"the {self.name!r} attention backend reads kv_cache_dtype {self.supported_kv_cache_dtypes}"
        return None

    def __init__(self, rotary: RotaryEmbedding, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 chunk_scaling: ChunkScaling | None = None):
        """``chunk_scaling``: APE's temperature and weight for keys of flagged blocks
        (``kernels/block_table.py``; ``CacheConfig.chunk_attention_scaling``); ``None``: the flag
        is ignored."""
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.rotary = rotary
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.chunk_scaling = chunk_scaling if chunk_scaling is not None and not chunk_scaling.is_identity else None

    @staticmethod
    def copy_step_slots(key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
                        scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The step's in-layer slot copies (``metadata.slot_copies``), after the new tokens' K/V are
        written and before any attention reads them: a backend calls it right after its write
        (``scales``: an FP8 cache's ``(key_scale, value_scale)``)."""
        if metadata.slot_copies is not None:
            copies = metadata.slot_copies
            copy_layer_slots(key_cache, value_cache, copies.src, copies.dst, copies.shift, scales)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated at global positions
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated at global positions
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        key_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32 (FP8 caches)
        value_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] float32 (FP8 caches)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], dtype of query
        """Write K/V at ``metadata.slot_mapping`` then attend; see the class docstring.

        An FP8 cache (``key_scale``/``value_scale``, ``lazyattn_rag/types/kv_quant.py``) is written quantized
        and read dequantized (each stored row times its scale, in float32, before the deferred
        rotation); a prefill's new tokens attend to each other's K/V in full precision wherever
        they lie in the sequence's last run of blocks with delta 0 and no scaling flag (the
        request's own tokens, a chunk being encoded: ``fresh_step_keys``), as the Triton prefill
        reads them from the step; a decode token reads its own K/V as stored."""

    def plan_graph_decode(
        self,
        metadata: AttentionMetadata,  # a decode batch over static buffers (one row per sequence)
        seq_ids: torch.Tensor,  # [num_seqs] int32, 0 .. num_seqs - 1
    ) -> None:
        """CUDA-graph capture hook: store in ``metadata.backend_state`` whatever ``forward`` needs,
        computed from device tensors only (it runs inside the captured graph, before the model).

        Raises:
            NotImplementedError: the backend cannot be captured (``supports_cuda_graphs`` is false).
        """
        raise NotImplementedError(f"the {self.name!r} attention backend cannot run in CUDA graphs")
