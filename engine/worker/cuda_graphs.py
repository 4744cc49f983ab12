"""Decode steps replayed from CUDA graphs, one graph per bucketed batch size.

A decode step (every sequence has one new token) launches a few hundred small kernels whose
Python and launch overhead exceeds their GPU time for small batches. The runner captures the
whole forward pass of a decode batch once per bucket size (1, 2, 4, 8, 16, 32, 64, then
multiples of 64 up to ``max_num_seqs``) over static input buffers, and a step copies its
inputs into those buffers and replays the graph of the smallest bucket that holds it (as
vLLM and SGLang do).

A step's inputs travel in one host-to-device copy: the step fills a pinned host buffer laid
out like the graphs' static inputs (token ids, positions, slots, sequence lengths, block
counts, then the block-table rows in use) and copies its used part at once, instead of
building five device tensors and copying each into the buffers (less host work: ``torch.tensor``
0.26 -> 0.10 ms a step; on an H200 the engine's decode step did not change beyond its 9 % spread).

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

from lazyattn_rag.engine.worker.attention import AttentionMetadata, SequenceInput, check_sequence_input


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
    """Views of one flat int64 buffer (``flat``); graph ``b`` reads the first ``b`` rows of each.

    The layout (``n`` rows, ``w`` block-table words per row): ``input_ids``, ``positions`` and
    ``slot_mapping`` take ``n`` words each, ``seq_lens`` and ``num_blocks_per_seq`` share the next
    ``n`` words as ``2 n`` int32, and row ``i`` of ``block_tables`` is words
    ``4 n + i w .. 4 n + (i + 1) w``: the inputs of a step with ``k`` rows are its first
    ``4 n + k w`` words.
    """

    flat: torch.Tensor  # [4 * max_batch + max_batch * max_blocks_per_seq] int64
    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64
    seq_lens: torch.Tensor  # [max_batch] int32
    num_blocks_per_seq: torch.Tensor  # [max_batch] int32
    block_tables: torch.Tensor  # [max_batch, max_blocks_per_seq] int64 packed

    @classmethod
    def allocate(cls, num_rows: int, width: int, padding_slot: int, device: torch.device,
                 pin_memory: bool = False) -> _StaticInputs:
        """Zeroed buffers, slots set to ``padding_slot`` (``pin_memory``: page-locked host memory)."""
        flat = torch.zeros(4 * num_rows + num_rows * width, dtype=torch.int64, device=device, pin_memory=pin_memory)
        lens = flat[3 * num_rows: 4 * num_rows].view(torch.int32)
        inputs = cls(flat=flat, input_ids=flat[:num_rows], positions=flat[num_rows: 2 * num_rows],
                     slot_mapping=flat[2 * num_rows: 3 * num_rows], seq_lens=lens[:num_rows],
                     num_blocks_per_seq=lens[num_rows:], block_tables=flat[4 * num_rows:].view(num_rows, width))
        inputs.slot_mapping.fill_(padding_slot)
        return inputs

    def num_words(self, num_rows_used: int) -> int:
        """Words of ``flat`` that hold the inputs of a step with ``num_rows_used`` rows."""
        return 4 * self.input_ids.numel() + num_rows_used * self.block_tables.shape[1]


class DecodeGraphs:
    """Captured decode forward passes of one model runner.

    Args:
        forward: ``forward(input_ids, positions, metadata) -> [num_rows, vocab_size]`` float32
            logits of every row (the model over the runner's KV caches and backend).
        plan: the attention backend's capture hook
            (:meth:`~lazyattn_rag.engine.worker.attention.AttentionBackend.plan_graph_decode`), run inside
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
        n, on_cuda = self.batch_sizes[-1], device.type == "cuda"
        self.inputs = _StaticInputs.allocate(n, max_blocks_per_seq, padding_slot, device)
        # The host side of the step's one copy, and the event after which it may be refilled.
        self.staging = _StaticInputs.allocate(n, max_blocks_per_seq, padding_slot, torch.device("cpu"),
                                              pin_memory=on_cuda)
        self.staged = torch.cuda.Event() if on_cuda else None
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # one row per sequence
        self.seq_ids = torch.arange(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        if capture:
            self._capture_all()

    def _metadata(self, batch: int) -> AttentionMetadata:
        s, max_seq_len = self.inputs, self.max_blocks_per_seq * self.block_size
        metadata = AttentionMetadata(
            block_size=self.block_size, cu_seqlens_q=self.cu_seqlens_q[: batch + 1], seq_lens=s.seq_lens[:batch],
            num_blocks_per_seq=s.num_blocks_per_seq[:batch], block_tables=s.block_tables[:batch],
            slot_mapping=s.slot_mapping[:batch], max_query_len=1, max_seq_len=max_seq_len,
            query_lens=[1] * batch, seq_lens_list=[max_seq_len] * batch)
        return metadata

    def _run_static(self, batch: int) -> torch.Tensor:
        """The captured work: plan and forward over the first ``batch`` rows of the buffers."""
        metadata = self._metadata(batch)
        self.plan(metadata, self.seq_ids[:batch])
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

        Raises:
            ValueError: a sequence that is not self-consistent
                (:func:`~lazyattn_rag.engine.worker.attention.metadata.check_sequence_input`).
        """
        batch = self.bucket(seqs)
        if batch is None or max(q.block_table.numel() for q in seqs) > self.max_blocks_per_seq:
            return None
        for i, q in enumerate(seqs):
            check_sequence_input(i, q)
        self._stage(seqs, batch)
        n, words = len(seqs), self.inputs.num_words(len(seqs))
        self.inputs.flat[:words].copy_(self.staging.flat[:words], non_blocking=True)
        if self.staged is not None:
            self.staged.record(torch.cuda.current_stream(self.device))  # the stream the copy went on
        self.num_replays += 1
        if batch in self.graphs:
            self.graphs[batch].replay()
            return self.outputs[batch][:n]
        return self._run_static(batch)[:n]

    def _stage(self, seqs: list[SequenceInput], batch: int) -> None:
        """Fill the host staging buffer with the rows of ``seqs`` and padding rows up to ``batch``."""
        if self.staged is not None:
            self.staged.synchronize()  # the previous step's copy has read the buffer
        n, h = len(seqs), self.staging
        h.input_ids[:n] = torch.tensor([q.token_ids[0] for q in seqs])
        h.positions[:n] = torch.tensor([q.positions[0] for q in seqs])
        h.slot_mapping[:n] = torch.tensor([q.slot_mapping[0] for q in seqs])
        h.slot_mapping[n:batch] = self.padding_slot
        h.seq_lens[:n] = torch.tensor([q.seq_len for q in seqs], dtype=torch.int32)
        h.num_blocks_per_seq[:n] = torch.tensor([q.block_table.numel() for q in seqs], dtype=torch.int32)
        h.num_blocks_per_seq[n:batch] = 0
        for i, q in enumerate(seqs):
            h.block_tables[i, : q.block_table.numel()] = q.block_table
