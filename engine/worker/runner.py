"""The model runner: owns the paged KV tensors and runs one forward pass for a batch."""

from __future__ import annotations

import torch

from lazyattn_rag.engine.kv.kv_layout import KVLayout
from lazyattn_rag.engine.kv.kv_pool import KVPool
from lazyattn_rag.engine.worker.attention import (AttentionBackend, AttentionMetadata, SequenceInput, SlotCopies,
                                                  build_attention_metadata)
from lazyattn_rag.engine.model.compiled_layers import CompiledLayers
from lazyattn_rag.engine.worker.cuda_graphs import DecodeGraphs
from lazyattn_rag.engine.worker.input_prep import InputPreparer
from lazyattn_rag.engine.model.transformer import CausalLM
from lazyattn_rag.engine.scheduling.scheduler_output import SchedulerOutput, SelectionJob, SlotCopyJob
from lazyattn_rag.engine.scheduling.selective_recompute import SELECTION_LAYER, kv_deviation, top_tokens


class ModelRunner:
    """Runs :class:`CausalLM` over a step's jobs against a paged KV cache.

    It owns the KV pool (:class:`KVPool`: the tensors and every operation that moves stored K/V),
    model-input preparation (:class:`InputPreparer`: positions, slot
    mapping, the packed block tables it keeps per running request) and the CUDA graphs of
    decode steps.

    Args:
        model: the model (already on ``device`` in ``dtype``).
        backend: the attention backend.
        layout: what a KV block holds (:class:`KVLayout`; ``layout.num_layers`` etc. match the model).
        num_blocks: KV blocks of the block pool (the KV pool allocates one more: see :class:`KVPool`).
        device: where the K/V live.
    """

    def __init__(self, model: CausalLM, backend: AttentionBackend, layout: KVLayout, num_blocks: int,
                 device: torch.device):
        self.model, self.backend = model, backend
        self.block_size, self.device = layout.block_size, device
        self.kv_pool = KVPool(layout, num_blocks, device)
        self.graphs: DecodeGraphs | None = None
        self.compiled: CompiledLayers | None = None
        self.inputs = InputPreparer(layout.block_size)

    def close(self) -> None:
        """Free the KV tensors, the CUDA graphs (they hold their own memory pool) and the kept
        block tables; the runner cannot run afterwards."""
        self.kv_pool.close()
        self.graphs = None
        self.inputs.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def execute_step(self, out: SchedulerOutput) -> torch.Tensor:
        """Run a step: its loads, copies and head seeds, then one forward pass of its chunk prefills
        and computes (the caller has released the tables of ``out.released_ids`` first:
        :meth:`InputPreparer.release`).

        Returns:
            ``[len(out.computes), vocab_size]`` float32 logits of each compute job's last token
            (a graph's output buffer: valid until the next call); ``[0, vocab_size]`` without
            compute jobs.
        Raises:
            whatever a copy or the forward pass raises; the caller abandons the whole step.
        """
        for load in out.loads:
            self.kv_pool.write(load.block_ids, load.chunk.keys, load.chunk.values)
        for copy in out.copies:
            self.copy_rotated(copy.src_blocks, copy.dst_blocks, copy.num_tokens, copy.delta)
        for seed in out.head_seeds:  # whole blocks at their own positions: rotation 0, bit for bit
            self.copy_rotated(seed.src_blocks, seed.dst_blocks, len(seed.src_blocks) * self.block_size, 0)
        if out.slot_copies:
            self.copy_slots(out.slot_copies)
        for job in out.selections:
            job.selected = self.select_tokens(job)
        if not (out.chunk_prefills or out.computes):
            return torch.zeros(0, self.model.config.vocab_size, device=self.device)
        seqs, last_rows = self.inputs.prepare(out)
        return self.execute(seqs, self._slot_copies(out.head_copies))[last_rows]

    @torch.inference_mode()
    def copy_rotated(self, src_blocks: list[int], dst_blocks: list[int], num_tokens: int, delta: int) -> None:
        """:meth:`KVPool.copy_rotated` with the model's rotary embedding (a position-aware copy)."""
        self.kv_pool.copy_rotated(src_blocks, dst_blocks, num_tokens, delta, self.model.rotary)

    @torch.inference_mode()
    def select_tokens(self, job: SelectionJob) -> dict[int, tuple[int, ...]]:
        """The document tokens ``job.request`` recomputes (``engine/scheduling/selective_recompute.py``):
        each chunk's cached K/V at the selection layer (K rotated to the request's positions)
        against a dense pass over the request's prompt (``CausalLM.dense_kv``).

        Returns:
            chunk index in the plan -> selected local token indices, ascending.
        """
        plan = job.request.plan
        layer = min(SELECTION_LAYER, self.kv_pool.layout.num_layers - 1)
        ids = torch.tensor(plan.token_ids(), dtype=torch.int64, device=self.device)
        fresh_k, fresh_v = self.model.dense_kv(ids, torch.arange(ids.numel(), device=self.device), layer,
                                               self.backend.scale)  # [prompt tokens, num_kv_heads, head_dim]
        selected = {}
        for index, block_ids, num_tokens, delta in job.chunks:
            cached_k, cached_v = self.kv_pool.gather_layer(layer, self.kv_pool.slots(block_ids, num_tokens))
            cached_k = self.model.rotary.rotate_by(cached_k, torch.full((num_tokens,), delta, device=self.device))
            at = slice(plan.chunks[index].global_start, plan.chunks[index].global_start + num_tokens)
            deviation = kv_deviation(fresh_k[at], fresh_v[at], cached_k, cached_v)
            selected[index] = top_tokens(deviation, plan.selective_ratio)
        return selected

    @torch.inference_mode()
    def copy_slots(self, jobs: list[SlotCopyJob]) -> None:
        """Copy each job's slots ``first_slot ..`` (``num_slots``) of ``src_block`` into the same
        slots of ``dst_block`` in every layer, K rotated by the job's ``delta`` (a fork's prompt end;
        whole blocks for selective recompute), now. One gather, rotation and scatter per layer for
        all of a step's jobs (a request of selective recompute copies up to one block per selected
        token)."""
        src, dst, deltas = self._flat_slots(jobs)
        self.kv_pool.copy_slots(src, dst, deltas, self.model.rotary)

    def _slot_copies(self, jobs: list[SlotCopyJob]) -> SlotCopies | None:
        """``jobs`` as the :class:`SlotCopies` every layer of the next pass makes after its write
        (the cached tokens behind recomputed chunk heads), or ``None``."""
        if not jobs:
            return None
        src, dst, deltas = self._flat_slots(jobs)
        return SlotCopies(src, dst, self.model.rotary.shifts(deltas))

    def _flat_slots(self, jobs: list[SlotCopyJob]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(src, dst, deltas)``: ``[n]`` int64 flat slots and deltas of every slot ``jobs`` copy."""
        bs, src, dst, deltas = self.block_size, [], [], []
        for job in jobs:
            src += range(job.src_block * bs + job.first_slot, job.src_block * bs + job.first_slot + job.num_slots)
            dst += range(job.dst_block * bs + job.first_slot, job.dst_block * bs + job.first_slot + job.num_slots)
            deltas += [job.delta] * job.num_slots
        src_t, dst_t, deltas_t = (torch.tensor(v, dtype=torch.int64, device=self.device) for v in (src, dst, deltas))
        return src_t, dst_t, deltas_t

    def enable_torch_compile(self) -> None:
        """Run the non-attention part of every layer through ``torch.compile``d functions
        (``engine/model/compiled_layers.py``): compiled on the first forward pass of each batch-size
        class (1, and any other); results match the eager model to rounding, not bit for bit.
        Call it before :meth:`enable_cuda_graphs`, whose captures then replay the compiled kernels."""
        self.compiled = CompiledLayers(self.model)

    @torch.inference_mode()
    def enable_cuda_graphs(self, batch_sizes: list[int], max_blocks_per_seq: int, capture: bool = True) -> None:
        """Capture decode forward passes for ``batch_sizes`` (see ``engine/worker/cuda_graphs.py``).

        Raises:
            ValueError: the backend cannot be captured (``supports_cuda_graphs`` is false), or
                ``capture`` without a CUDA device.
        """
        if not self.backend.supports_cuda_graphs:
            raise ValueError(f"the {self.backend.name!r} attention backend cannot run in CUDA graphs")
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the runner is on {self.device}")
        self.graphs = DecodeGraphs(self._forward_all_rows, self.backend.plan_graph_decode, batch_sizes,
                                   max_blocks_per_seq, self.block_size, self.kv_pool.padding_slot, self.device, capture)

    def _forward_all_rows(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.backend, self.kv_pool.layers, metadata, compiled=self.compiled)

    @torch.inference_mode()
    def execute(self, seqs: list[SequenceInput], slot_copies: SlotCopies | None = None) -> torch.Tensor:
        """Write the batch's new K/V and return the logits of each sequence's last new token
        (sequences prepared by :class:`InputPreparer`, or by hand in tests and checks).
        ``slot_copies``: made in every layer after its write (:class:`SlotCopies`).

        A decode batch replays a captured CUDA graph when graphs are enabled and it fits one (and
        has no slot copies).

        Returns:
            ``[len(seqs), vocab_size]`` float32 (a graph's output buffer: valid until the next call).
        """
        if self.graphs is not None and slot_copies is None:
            logits = self.graphs.run(seqs)
            if logits is not None:
                return logits
        metadata = build_attention_metadata(seqs, self.block_size, self.device)
        metadata.slot_copies = slot_copies
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64, device=self.device)
        positions = torch.tensor([p for s in seqs for p in s.positions], dtype=torch.int64, device=self.device)
        last_rows = (metadata.cu_seqlens_q[1:] - 1).to(torch.int64)
        return self.model(input_ids, positions, self.backend, self.kv_pool.layers, metadata, last_rows,
                          compiled=self.compiled)

