"""The fused Triton deferred-RoPE attention backend (CUDA; or the interpreter for tests).

Per forward call: :func:`~lazyattn_rag.kernels.kv_write.write_kv_cache` scatters the new tokens'
K/V (one launch for both), then the batch is split by
sequence kind and each kind runs its own kernel, both writing into one output tensor:

* sequences with one new token run :func:`~lazyattn_rag.kernels.decode.paged_decode` (one query
  row, rotated by ``-delta`` once per chunk; split-KV for long contexts);
* the others run :func:`~lazyattn_rag.kernels.prefill.paged_prefill` (a query tile rotated by
  ``-delta`` once per chunk, K tiles read as stored; causal over the new tokens, whose own keys
  it reads from this call's ``key``/``value`` rather than back through the block table). A
  batch in which no block has a nonzero delta (``metadata.any_delta``: prompts computed whole,
  chunks being encoded, prefix-cache hits) launches it with the rotation compiled out.

The split (sequence ids per kernel), each block's first key index and the runs of equal delta
are derived once per batch from the metadata (device ops, no host sync) and kept in
``metadata.backend_state["triton"]``, so every layer reuses them.
There is no fallback: without CUDA this backend runs only under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lazyattn_rag.engine.worker.attention.base import AttentionBackend
from lazyattn_rag.engine.worker.attention.metadata import AttentionMetadata
from lazyattn_rag.types.cache_config import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from lazyattn_rag.kernels.launch import BlockRuns
    from lazyattn_rag.kernels.query_rotation import QueryRotations

# The kernels (and triton, ~0.4 s to import) load on first use: the CPU engine imports this module
# (engine/worker/cuda_graphs.py uses plan_decode_batch) without ever running a kernel.


@dataclass
class _TritonPlan:
    decode_ids: torch.Tensor | None  # [n_decode] int32 sequences with one new token
    prefill_ids: torch.Tensor | None  # [n_prefill] int32 the others
    key_starts: torch.Tensor | None  # [num_seqs, max_blocks] int32 first key index of each block
    runs: BlockRuns  # runs of blocks with one delta (one per chunk), shared by both kernels
    max_decode_seq_len: int
    max_prefill_query_len: int
    max_prefill_context_len: int  # cached keys before a prefill sequence's new tokens, at most
    num_rows: int  # rows of the batch that belong to a sequence
    query_rotations: QueryRotations | None = None  # prerotate_queries: the step's layout, planned once


def _plan(metadata: AttentionMetadata, device: torch.device) -> _TritonPlan:
    cached = metadata.backend_state.get("triton")
    if cached is not None:
        return cached
    from lazyattn_rag.kernels.launch import block_key_starts, block_runs

    decode = [i for i, q in enumerate(metadata.query_lens) if q == 1]
    prefill = [i for i, q in enumerate(metadata.query_lens) if q > 1]

    def ids(seq_list: list[int]) -> torch.Tensor | None:
        return torch.tensor(seq_list, dtype=torch.int32, device=device) if seq_list else None

    plan = _TritonPlan(
        decode_ids=ids(decode),
        prefill_ids=ids(prefill),
        key_starts=block_key_starts(metadata.block_tables, metadata.num_blocks_per_seq) if prefill else None,
        runs=block_runs(metadata.block_tables, metadata.num_blocks_per_seq, metadata.block_size),
        max_decode_seq_len=max((metadata.seq_lens_list[i] for i in decode), default=0),
        max_prefill_query_len=max((metadata.query_lens[i] for i in prefill), default=0),
        max_prefill_context_len=max((metadata.seq_lens_list[i] - metadata.query_lens[i] for i in prefill), default=0),
        num_rows=sum(metadata.query_lens),
    )
    metadata.backend_state["triton"] = plan
    return plan


def plan_decode_batch(metadata: AttentionMetadata, seq_ids: torch.Tensor) -> None:
    """Store the plan of a batch in which every sequence has one new token, from device ops only.

    Used inside CUDA-graph capture (``engine/worker/cuda_graphs.py``): no host-to-device copy happens,
    so the captured work is the same on every replay; ``seq_ids`` (``[num_seqs]`` int32) is a
    tensor made before capture and ``max_seq_len`` of the metadata sizes the split-KV launch.
    """
    from lazyattn_rag.kernels.launch import block_runs

    metadata.backend_state["triton"] = _TritonPlan(
        decode_ids=seq_ids,
        prefill_ids=None,
        key_starts=None,
        runs=block_runs(metadata.block_tables, metadata.num_blocks_per_seq, metadata.block_size),
        max_decode_seq_len=metadata.max_seq_len,
        max_prefill_query_len=0,
        max_prefill_context_len=0,
        num_rows=metadata.num_seqs,
    )


def _query_rotations(plan: _TritonPlan, metadata: AttentionMetadata, device: torch.device) -> QueryRotations:
    """The step's pre-rotated query layout, planned from the host tables on the first layer."""
    if plan.query_rotations is None:
        from lazyattn_rag.kernels.query_rotation import plan_query_rotations

        cu = torch.tensor([0, *itertools.accumulate(metadata.query_lens)], dtype=torch.int32)
        host = metadata.host_block_tables  # entries past a row's blocks are 0 (delta 0: nothing to rotate)
        prefill = [i for i, q in enumerate(metadata.query_lens) if q > 1]  # the rows the prefill reads
        plan.query_rotations = plan_query_rotations(host, torch.full((host.shape[0],), host.shape[1]), cu, device,
                                                    seqs=prefill, block_size=metadata.block_size)
    return plan.query_rotations


class TritonAttentionBackend(AttentionBackend):
    """Fused deferred-RoPE paged attention; see the module docstring.

    Attributes:
        prerotate_queries: prefill batches with a moved chunk read each chunk's queries rotated
            beforehand by a small kernel (``rotation="prerotated"``,
            ``kernels/query_rotation.py``) instead of rotating them in the attention loop: the
            same result bit for bit. Off by default until the GPU measurement of issue 43
            says which is faster; benchmarks set it on an engine's backend to compare.

    Raises:
        NotImplementedError: (at construction) a head layout the kernels do not cover
            (head_dim not a power of two >= 16, or rotary halves not powers of two).
    """

    name = "triton"
    supports_cuda_graphs = True
    supported_kv_cache_dtypes = KV_CACHE_DTYPES  # every one (FP8: kernels read rows times their scales)

    def __init__(self, rotary, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 chunk_scaling=None):
        super().__init__(rotary, num_heads, num_kv_heads, head_dim, scale, chunk_scaling)
        from lazyattn_rag.kernels.launch import rope_layout

        rope_layout(head_dim, rotary.rotary_dim, rotary.interleaved)  # fail early on unsupported shapes
        self.prerotate_queries = False

    def kv_cache_dtype_error(self, kv_cache_dtype, device):
        from lazyattn_rag.kernels.launch import fp8_dtype_error

        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return super().kv_cache_dtype_error(kv_cache_dtype, device) or fp8_dtype_error(kv_cache_dtype, capability)

    def plan_graph_decode(self, metadata, seq_ids):
        plan_decode_batch(metadata, seq_ids)

    def forward(self, query, key, value, key_cache, value_cache, metadata, key_scale=None, value_scale=None):
        if query.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 for tests); "
                "use the torch backend on the CPU"
            )
        from lazyattn_rag.kernels.decode import paged_decode
        from lazyattn_rag.kernels.kv_write import write_kv_cache
        from lazyattn_rag.kernels.prefill import paged_prefill

        scaled = key_scale is not None  # an FP8 cache: the kernels compute in the query's dtype
        dtype = query.dtype if scaled else key_cache.dtype
        key, value = key.to(dtype), value.to(dtype)  # as stored, or unrounded for FP8 (no copy when equal)
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping, key_scale, value_scale)
        self.copy_step_slots(key_cache, value_cache, metadata, (key_scale, value_scale) if scaled else None)
        plan = _plan(metadata, query.device)
        q = query.to(dtype)  # no copy when equal
        out = torch.empty_like(q)
        if plan.num_rows < q.shape[0]:
            out[plan.num_rows :].zero_()  # padding rows past the last sequence
        inv_freq = self.rotary.inv_freq_on(query.device)
        if plan.decode_ids is not None:
            paged_decode(
                q, key_cache, value_cache, metadata.block_tables, metadata.num_blocks_per_seq,
                metadata.cu_seqlens_q, plan.max_decode_seq_len, inv_freq, self.scale,
                interleaved=self.rotary.interleaved, runs=plan.runs, seq_ids=plan.decode_ids, out=out,
                chunk_scaling=self.chunk_scaling, key_scale=key_scale, value_scale=value_scale,
            )
        if plan.prefill_ids is not None:
            rotation, rotations = ("query" if metadata.any_delta else "none"), None  # no chunk moved: nothing to rotate
            if metadata.any_delta and self.prerotate_queries and metadata.host_block_tables is not None:
                rotation, rotations = "prerotated", _query_rotations(plan, metadata, query.device)
            paged_prefill(
                q, key_cache, value_cache, metadata.block_tables, metadata.num_blocks_per_seq,
                metadata.seq_lens, metadata.cu_seqlens_q, plan.max_prefill_query_len, inv_freq, self.scale,
                interleaved=self.rotary.interleaved, key_starts=plan.key_starts, runs=plan.runs,
                seq_ids=plan.prefill_ids, out=out, chunk_scaling=self.chunk_scaling,
                key=key, value=value,  # the new tokens' K/V as just stored
                max_context_len=plan.max_prefill_context_len,
                rotation=rotation, query_rotations=rotations,
                key_scale=key_scale, value_scale=value_scale,
            )
        return out if out.dtype == query.dtype else out.to(query.dtype)
