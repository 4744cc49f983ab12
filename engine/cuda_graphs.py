"""Decode steps replayed from CUDA graphs, one graph per bucketed batch size.

A decode step (every sequence has one new token) launches a few hundred small kernels whose
Python and launch overhead exceeds their GPU time for small batches. The runner captures the
whole forward pass of a decode batch once per bucket size (1, 2, 4, 8, 16, 32, 64, then
multiples of 64 up to ``max_num_seqs``) over static input buffers, and a step copies its
inputs into those buffers and replays the graph of the smallest bucket that holds it (as
vLLM and SGLang do).

Padding rows of a bucket have no blocks (their attention output is zero) and write their
K/V to ``padding_slot``, a slot the block pool never hands out. Block tables are
``max_blocks_per_seq`` words wide; a step with a wider table, more sequences than the largest
bucket, or any prefill row runs eagerly. Graphs need a backend whose ``forward`` does no
host sync (``AttentionBackend.supports_cuda_graphs``: the ``triton`` backend).

Without CUDA (``capture=False``, tests) every "replay" runs the same static-buffer function
eagerly, which checks the buffer handling on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lazyattn_rag.engine.attention import AttentionMetadata, SequenceInput, build_attention_metadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Bucket sizes for ``max_num_seqs`` (ascending; the last one is at least ``max_num_seqs``).

    Raises:
        ValueError: ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [1]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 64 else sizes[-1] + 64)
    return sizes


# Block-table width beyond max_model_len / block_size: room for one partly filled block per chunk
# of up to this many chunks; a wider table runs eagerly.
EXTRA_BLOCKS_PER_SEQ = 64


def graph_block_table_width(max_model_len: int, block_size: int) -> int:
    """Static block-table width of captured decode steps (a context's blocks plus one partly
    filled block per chunk, for up to :data:`EXTRA_BLOCKS_PER_SEQ` chunks)."""
    return -(-max_model_len // block_size) + EXTRA_BLOCKS_PER_SEQ


@dataclass
class _StaticInputs:
    """Buffers sized for the largest bucket; graph ``b`` reads their first ``b`` rows."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64
    seq_lens: torch.Tensor  # [max_batch] int32
    num_blocks_per_seq: torch.Tensor  # [max_batch] int32
    block_tables: torch.Tensor  # [max_batch, max_blocks_per_seq] int64 packed
    cu_seqlens_q: torch.Tensor  # [max_batch + 1] int32 (0, 1, 2, ...: one row per sequence)
    seq_ids: torch.Tensor  # [max_batch] int32 (0, 1, 2, ...)


class DecodeGraphs:
    """Captured decode forward passes of one model runner.

    Args:
        forward: ``forward(input_ids, positions, metadata) -> [num_rows, vocab_size]`` float32
            logits of every row (the model over the runner's KV caches and backend).
        plan: the attention backend's capture hook
            (:meth:`~lazyattn_rag.engine.attention.AttentionBackend.plan_graph_decode`), run inside
            the graph before the forward pass.
        batch_sizes: bucket sizes, ascending.
        max_blocks_per_seq: static block-table width.
        block_size: slots per KV block.
        padding_slot: flat KV slot written by padding rows (outside the block pool).
        device: where the buffers live.
        capture: capture CUDA graphs (``False``: run the static-buffer function eagerly).
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 plan: Callable[[AttentionMetadata, torch.Tensor], None], batch_sizes: list[int],
                 max_blocks_per_seq: int, block_size: int, padding_slot: int, device: torch.device,
                 capture: bool = True):
        self.forward, self.plan, self.batch_sizes = forward, plan, sorted(batch_sizes)
        self.max_blocks_per_seq, self.block_size = max_blocks_per_seq, block_size
        self.padding_slot, self.device = padding_slot, device
        n = self.batch_sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.inputs = _StaticInputs(
            input_ids=torch.zeros(n, **i64), positions=torch.zeros(n, **i64),
            slot_mapping=torch.full((n,), padding_slot, **i64), seq_lens=torch.zeros(n, **i32),
            num_blocks_per_seq=torch.zeros(n, **i32), block_tables=torch.zeros(n, max_blocks_per_seq, **i64),
            cu_seqlens_q=torch.arange(n + 1, **i32), seq_ids=torch.arange(n, **i32))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        if capture:
            self._capture_all()

    def _metadata(self, batch: int) -> AttentionMetadata:
        s, max_seq_len = self.inputs, self.max_blocks_per_seq * self.block_size
        metadata = AttentionMetadata(
            block_size=self.block_size, cu_seqlens_q=s.cu_seqlens_q[: batch + 1], seq_lens=s.seq_lens[:batch],
            num_blocks_per_seq=s.num_blocks_per_seq[:batch], block_tables=s.block_tables[:batch],
            slot_mapping=s.slot_mapping[:batch], max_query_len=1, max_seq_len=max_seq_len,
            query_lens=[1] * batch, seq_lens_list=[max_seq_len] * batch)
        return metadata

    def _run_static(self, batch: int) -> torch.Tensor:
        """The captured work: plan and forward over the first ``batch`` rows of the buffers."""
        metadata = self._metadata(batch)
        self.plan(metadata, self.inputs.seq_ids[:batch])
        return self.forward(self.inputs.input_ids[:batch], self.inputs.positions[:batch], metadata)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._run_static(batch)  # compiles the kernels and warms the allocator outside capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[batch] = self._run_static(batch)
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)

    def bucket(self, seqs: list[SequenceInput]) -> int | None:
        """The bucket that runs ``seqs``, or ``None`` when the step must run eagerly."""
        if not seqs or len(seqs) > self.batch_sizes[-1] or any(s.query_len != 1 for s in seqs):
            return None
        return next(b for b in self.batch_sizes if b >= len(seqs))

    def run(self, seqs: list[SequenceInput]) -> torch.Tensor | None:
        """Logits ``[len(seqs), vocab_size]`` float32 of a decode batch, or ``None`` (run it eagerly).

        The returned tensor is a view of the graph's output: valid until the next call.
        """
        batch = self.bucket(seqs)
        if batch is None:
            return None
        metadata = build_attention_metadata(seqs, self.block_size, self.device)
        width = metadata.block_tables.shape[1]
        if width > self.max_blocks_per_seq:
            return None
        n, s = len(seqs), self.inputs
        s.input_ids[:n].copy_(torch.tensor([q.token_ids[0] for q in seqs], dtype=torch.int64), non_blocking=True)
        s.positions[:n].copy_(torch.tensor([q.positions[0] for q in seqs], dtype=torch.int64), non_blocking=True)
        s.slot_mapping[:n].copy_(metadata.slot_mapping)
        s.slot_mapping[n:batch].fill_(self.padding_slot)
        s.seq_lens[:n].copy_(metadata.seq_lens)
        s.num_blocks_per_seq[:n].copy_(metadata.num_blocks_per_seq)
        s.num_blocks_per_seq[n:batch].zero_()
        s.block_tables[:n, :width].copy_(metadata.block_tables)
        self.num_replays += 1
        if batch in self.graphs:
            self.graphs[batch].replay()
            return self.outputs[batch][:n]
        return self._run_static(batch)[:n]
