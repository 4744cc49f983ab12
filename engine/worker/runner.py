"""The model runner: owns the paged KV tensors and runs one forward pass for a batch."""

from __future__ import annotations

import math
import mmap

import torch

from lazyattn_rag.engine.worker.attention import AttentionBackend, AttentionMetadata, SequenceInput, build_attention_metadata
from lazyattn_rag.engine.model.compiled_layers import CompiledLayers
from lazyattn_rag.engine.worker.cuda_graphs import DecodeGraphs
from lazyattn_rag.engine.worker.input_prep import InputPreparer
from lazyattn_rag.engine.model.transformer import CausalLM
from lazyattn_rag.engine.scheduling.scheduler_output import SchedulerOutput, SelectionJob, SlotCopyJob
from lazyattn_rag.engine.scheduling.selective_recompute import SELECTION_LAYER, kv_deviation, top_tokens
from lazyattn_rag.kernels.rope import apply_rotation


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of one block over all layers."""
    cfg = model.config
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose host memory is committed only where it is written.

    On the CPU it lives in an anonymous mapping: the kernel hands out zero pages on first
    touch, so the default 512 MiB KV cache costs neither start-up time (``torch.zeros`` writes
    every byte) nor resident memory until blocks are used. Elsewhere it is
    ``torch.zeros``.
    """
    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    buffer = mmap.mmap(-1, nbytes)  # private, zero-filled; unmapped when the tensor is freed
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


class ModelRunner:
    """Runs :class:`CausalLM` over a step's jobs against a paged KV cache.

    It owns the KV tensors, model-input preparation (:class:`InputPreparer`: positions, slot
    mapping, the packed block tables it keeps per running request) and the CUDA graphs of
    decode steps.

    Args:
        model: the model (already on ``device`` in ``dtype``).
        backend: the attention backend.
        num_blocks: KV blocks of the block pool per layer (one more is allocated: its first slot,
            ``padding_slot``, takes the K/V of CUDA-graph padding rows).
        block_size: slots per block.
        device, dtype: where and in what the K/V live.
    """

    def __init__(self, model: CausalLM, backend: AttentionBackend, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        cfg = model.config
        self.model, self.backend = model, backend
        self.block_size, self.device = block_size, device
        shape = (num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.padding_slot = num_blocks * block_size
        self.graphs: DecodeGraphs | None = None
        self.compiled: CompiledLayers | None = None
        self.inputs = InputPreparer(block_size)
        self.kv_caches = [(zeros(shape, dtype, device), zeros(shape, dtype, device)) for _ in range(cfg.num_layers)]

    def close(self) -> None:
        """Free the KV tensors, the CUDA graphs (they hold their own memory pool) and the kept
        block tables; the runner cannot run afterwards."""
        self.kv_caches = []
        self.graphs = None
        self.inputs.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def execute_step(self, out: SchedulerOutput) -> torch.Tensor:
        """Run a step: its loads and copies, then one forward pass of its chunk prefills and computes (the
        caller has released the tables of ``out.released_ids`` first: :meth:`InputPreparer.release`).

        Returns:
            ``[len(out.computes), vocab_size]`` float32 logits of each compute job's last token
            (a graph's output buffer: valid until the next call); ``[0, vocab_size]`` without
            compute jobs.
        Raises:
            whatever a copy or the forward pass raises; the caller abandons the whole step.
        """
        for load in out.loads:
            self.write_blocks(load.block_ids, load.chunk.keys, load.chunk.values)
        for copy in out.copies:
            self.copy_rotated(copy.src_blocks, copy.dst_blocks, copy.num_tokens, copy.delta)
        if out.slot_copies:
            self.copy_slots(out.slot_copies)
        for job in out.selections:
            job.selected = self.select_tokens(job)
        if not (out.chunk_prefills or out.computes):
            return torch.zeros(0, self.model.config.vocab_size, device=self.device)
        seqs, last_rows = self.inputs.prepare(out)
        return self.execute(seqs)[last_rows]

    @torch.inference_mode()
    def copy_rotated(self, src_blocks: list[int], dst_blocks: list[int], num_tokens: int, delta: int) -> None:
        """Copy a chunk's K/V into other blocks, K rotated by ``delta`` (a position-aware copy).

        Args:
            src_blocks, dst_blocks: equally many block ids.
            num_tokens: valid tokens of the chunk (the last block may be partial).
            delta: RoPE offset between the copies (destination position minus source position).
        """
        src, dst = self._slots(src_blocks, num_tokens), self._slots(dst_blocks, num_tokens)
        deltas = torch.full((num_tokens,), delta, device=self.device)
        rotary = self.model.rotary
        for key_cache, value_cache in self.kv_caches:
            flat_k = key_cache.view(-1, *key_cache.shape[2:])
            flat_v = value_cache.view(-1, *value_cache.shape[2:])
            flat_k[dst] = rotary.rotate_by(flat_k[src], deltas)
            flat_v[dst] = flat_v[src]

    @torch.inference_mode()
    def select_tokens(self, job: SelectionJob) -> dict[int, tuple[int, ...]]:
        """The document tokens ``job.request`` recomputes (``engine/scheduling/selective_recompute.py``):
        each chunk's cached K/V at the selection layer (K rotated to the request's positions)
        against a dense pass over the request's prompt (``CausalLM.dense_kv``).

        Returns:
            chunk index in the plan -> selected local token indices, ascending.
        """
        plan = job.request.plan
        layer = min(SELECTION_LAYER, len(self.kv_caches) - 1)
        ids = torch.tensor(plan.token_ids(), dtype=torch.int64, device=self.device)
        fresh_k, fresh_v = self.model.dense_kv(ids, torch.arange(ids.numel(), device=self.device), layer,
                                               self.backend.scale)  # [prompt tokens, num_kv_heads, head_dim]
        key_cache, value_cache = self.kv_caches[layer]
        flat_k, flat_v = key_cache.view(-1, *key_cache.shape[2:]), value_cache.view(-1, *value_cache.shape[2:])
        selected = {}
        for index, block_ids, num_tokens, delta in job.chunks:
            slots = self._slots(block_ids, num_tokens)
            cached_k = self.model.rotary.rotate_by(flat_k[slots], torch.full((num_tokens,), delta, device=self.device))
            at = slice(plan.chunks[index].global_start, plan.chunks[index].global_start + num_tokens)
            deviation = kv_deviation(fresh_k[at], fresh_v[at], cached_k, flat_v[slots])
            selected[index] = top_tokens(deviation, plan.selective_ratio)
        return selected

    @torch.inference_mode()
    def copy_slots(self, jobs: list[SlotCopyJob]) -> None:
        """Copy each job's slots ``first_slot ..`` (``num_slots``) of ``src_block`` into the same
        slots of ``dst_block`` in every layer, K rotated by the job's ``delta`` (behind a recomputed
        chunk head; whole blocks for selective recompute). One gather, rotation and scatter per
        layer for all of a step's jobs (a request of selective recompute copies up to one block per
        selected token)."""
        bs, src, dst, deltas = self.block_size, [], [], []
        for job in jobs:
            src += range(job.src_block * bs + job.first_slot, job.src_block * bs + job.first_slot + job.num_slots)
            dst += range(job.dst_block * bs + job.first_slot, job.dst_block * bs + job.first_slot + job.num_slots)
            deltas += [job.delta] * job.num_slots
        src_t, dst_t, deltas_t = (torch.tensor(v, dtype=torch.int64, device=self.device) for v in (src, dst, deltas))
        rotary = self.model.rotary
        cos, sin = rotary.cos_sin(deltas_t)  # the rotation by each slot's delta, shared by every layer
        for key_cache, value_cache in self.kv_caches:
            flat_k = key_cache.view(-1, *key_cache.shape[2:])
            flat_v = value_cache.view(-1, *value_cache.shape[2:])
            flat_k[dst_t] = apply_rotation(flat_k[src_t], cos, sin, rotary.rotary_dim, rotary.interleaved)
            flat_v[dst_t] = flat_v[src_t]

    def _slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """``[num_tokens]`` flat slots of tokens laid out from the first block's slot 0."""
        offsets = torch.arange(num_tokens, device=self.device)
        return torch.tensor(block_ids, device=self.device)[offsets // self.block_size] * self.block_size \
            + offsets % self.block_size

    @torch.inference_mode()
    def gather_blocks(self, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's K/V gathered out of the pool into new tensors on its device (stream-ordered:
        what later kernels write into the blocks does not reach them).

        Args:
            block_ids: the chunk's blocks, in order.
            num_tokens: its valid tokens (the last block may be partly filled).
        Returns:
            ``(keys, values)``, each ``[num_layers, num_tokens, num_kv_heads, head_dim]`` in the
            pool's dtype, on the runner's device.
        """
        slots = self._slots(block_ids, num_tokens)
        keys = torch.stack([k.view(-1, *k.shape[2:])[slots] for k, _ in self.kv_caches])
        values = torch.stack([v.view(-1, *v.shape[2:])[slots] for _, v in self.kv_caches])
        return keys, values

    def read_blocks(self, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`gather_blocks`, copied to the CPU (waits for the device)."""
        keys, values = self.gather_blocks(block_ids, num_tokens)
        return keys.cpu(), values.cpu()

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Load a chunk's K/V (as :meth:`read_blocks` returns it) into ``block_ids``.

        Raises:
            ValueError: the tensors do not match this pool's layers, heads, head size or dtype,
                or the blocks cannot hold their tokens.
        """
        layers, num_tokens = len(self.kv_caches), keys.shape[1] if keys.dim() == 4 else -1
        cache = self.kv_caches[0][0]
        expected = (layers, num_tokens, *cache.shape[2:])
        if keys.shape != expected or values.shape != expected or keys.dtype != cache.dtype \
                or values.dtype != cache.dtype:
            raise ValueError(f"chunk K/V {tuple(keys.shape)} {keys.dtype} does not fit this pool "
                             f"({expected}, {cache.dtype})")
        if len(block_ids) * self.block_size < num_tokens:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens")
        slots = self._slots(block_ids, num_tokens)
        keys, values = keys.to(self.device), values.to(self.device)  # one host-to-device copy each (or none)
        for layer, (key_cache, value_cache) in enumerate(self.kv_caches):
            key_cache.view(-1, *key_cache.shape[2:])[slots] = keys[layer]
            value_cache.view(-1, *value_cache.shape[2:])[slots] = values[layer]

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
                                   max_blocks_per_seq, self.block_size, self.padding_slot, self.device, capture)

    def _forward_all_rows(self, input_ids: torch.Tensor, positions: torch.Tensor,
                          metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.backend, self.kv_caches, metadata, compiled=self.compiled)

    @torch.inference_mode()
    def execute(self, seqs: list[SequenceInput]) -> torch.Tensor:
        """Write the batch's new K/V and return the logits of each sequence's last new token
        (sequences prepared by :class:`InputPreparer`, or by hand in tests and checks).

        A decode batch replays a captured CUDA graph when graphs are enabled and it fits one.

        Returns:
            ``[len(seqs), vocab_size]`` float32 (a graph's output buffer: valid until the next call).
        """
        if self.graphs is not None:
            logits = self.graphs.run(seqs)
            if logits is not None:
                return logits
        metadata = build_attention_metadata(seqs, self.block_size, self.device)
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64, device=self.device)
        positions = torch.tensor([p for s in seqs for p in s.positions], dtype=torch.int64, device=self.device)
        last_rows = (metadata.cu_seqlens_q[1:] - 1).to(torch.int64)
        return self.model(input_ids, positions, self.backend, self.kv_caches, metadata, last_rows,
                          compiled=self.compiled)

