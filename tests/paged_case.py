"""Random paged-attention batches for kernel tests: chunks at offsets, partial blocks, padding.

A sequence is described by :class:`SeqSpec`: cached chunks (each ``(length, delta)``, each owning
whole blocks from a block boundary, its last block partly filled), then the request's own tokens
(``own_len`` tokens with ``delta = 0``, in private blocks), of which the last ``query_len`` are the
new tokens. ``own_len = 0`` with ``query_len = 0`` and no chunks is a padding sequence (no keys).
Unused cache slots hold NaN so that any read past a valid slot shows up in the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lazyattn_rag.kernels.block_table import pack_entries
from lazyattn_rag.kernels.rope import RotaryEmbedding


# (num_heads, num_kv_heads, head_dim) the kernel tests cover: Llama-3.1-8B's and SmolLM2's heads, query
# heads per KV head 7 and 8 (MQA), 1 (MHA), and head sizes 64 and 128
GQA_SHAPES = [(32, 8, 128), (9, 3, 64), (28, 4, 64), (8, 1, 128), (32, 32, 64), (9, 3, 128)]


@dataclass
class SeqSpec:
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (length, delta) per cached chunk
    own_len: int = 1  # request-owned tokens (delta 0); the last query_len are new
    query_len: int = 1


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    num_blocks_per_seq: torch.Tensor  # [num_seqs] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    inv_freq: torch.Tensor  # [rotary_dim // 2] float32
    scale: float
    interleaved: bool


def make_rotary(head_dim: int, rotary_dim: int | None = None, interleaved: bool = False, theta: float = 1e4) -> RotaryEmbedding:
    rotary_dim = rotary_dim or head_dim
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    return RotaryEmbedding(inv_freq, 1.0, head_dim, rotary_dim, interleaved, "default")


def make_case(
    specs: list[SeqSpec],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    rotary_dim: int | None = None,
    interleaved: bool = False,
    seed: int = 0,
    spare_blocks: int = 3,
    min_block_id: int = 0,
    num_cache_blocks: int | None = None,
) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    tables: list[list[tuple[int, int, int]]] = []
    for spec in specs:
        entries = []
        for length, delta in spec.chunks + ([(spec.own_len, 0)] if spec.own_len else []):
            for start in range(0, length, block_size):
                entries.append((-1, delta, min(block_size, length - start)))
        tables.append(entries)
    n_used = sum(len(t) for t in tables)
    total = num_cache_blocks or (min_block_id + n_used + spare_blocks)
    ids = (min_block_id + torch.randperm(total - min_block_id, generator=g)[:n_used]).tolist()
    key_cache = torch.full((total, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    value_cache = torch.full_like(key_cache, float("nan"))
    it = iter(ids)
    for entries in tables:
        for i, (_, delta, valid) in enumerate(entries):
            b = next(it)
            entries[i] = (b, delta, valid)
            shape = (valid, num_kv_heads, head_dim)
            key_cache[b, :valid] = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
            value_cache[b, :valid] = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    max_blocks = max(1, max(len(t) for t in tables))
    block_tables = torch.zeros(len(specs), max_blocks, dtype=torch.int64)
    for i, entries in enumerate(tables):
        if entries:
            block_tables[i, : len(entries)] = pack_entries(entries)
    q_lens = [s.query_len for s in specs]
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    rotary = make_rotary(head_dim, rotary_dim, interleaved)
    query = torch.randn(cu[-1], num_heads, head_dim, generator=g).to(dtype=dtype, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    return PagedCase(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        num_blocks_per_seq=torch.tensor([len(t) for t in tables], **i32),
        seq_lens=torch.tensor([sum(e[2] for e in t) for t in tables], **i32),
        cu_seqlens_q=torch.tensor(cu, **i32),
        max_query_len=max(q_lens),
        inv_freq=rotary.inv_freq.to(device),
        scale=head_dim**-0.5,
        interleaved=interleaved,
    )


def check_bf16_on_gpu(run, specs: list[SeqSpec], seed: int, num_heads: int = 32, num_kv_heads: int = 8,
                      head_dim: int = 128, **launch) -> None:
    """A kernel on a bf16 CUDA case of ``specs`` against its reference: ``run(case, **launch)``
    returns ``(out, ref)`` (each kernel test module's own ``run``)."""
    from kernel_tolerances import assert_close

    case = make_case(specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.bfloat16,
                     device="cuda", seed=seed)
    out, ref = run(case, **launch)
    assert_close(out, ref, torch.bfloat16, str(launch))


def sequence_input(token_ids: list[int], positions: list[int], entries: list[tuple[int, int, int]],
                   slot_mapping: list[int]):
    """A runner :class:`SequenceInput` from plain ``(block_id, delta, valid)`` entries (packed
    here as the runner's input preparation packs them)."""
    from lazyattn_rag.engine.worker.attention import SequenceInput

    return SequenceInput(list(token_ids), list(positions), pack_entries(entries), sum(e[2] for e in entries),
                         list(slot_mapping))


def our_logits(model, token_ids: list[int], start_pos: int, block_size: int = 16, compiled=None) -> torch.Tensor:
    """All-row logits of our ``CausalLM`` over one sequence prefilled from scratch at positions
    ``start_pos ..`` (torch backend, fresh KV blocks of ``block_size``, CPU; ``compiled``: a
    ``CompiledLayers`` of the model, or eager)."""
    from lazyattn_rag.engine.worker.attention import build_attention_metadata
    from lazyattn_rag.engine.worker.attention.torch_backend import TorchAttentionBackend

    cfg = model.config
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    caches = [(torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
               torch.zeros(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    table = [(b, 0, min(block_size, n - b * block_size)) for b in range(num_blocks)]
    seq = sequence_input(token_ids, list(range(start_pos, start_pos + n)), table, list(range(n)))
    md = build_attention_metadata([seq], block_size, "cpu")
    backend = TorchAttentionBackend(model.rotary, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
    return model(torch.tensor(token_ids), torch.tensor(seq.positions), backend, caches, md, compiled=compiled)


# Backend test batches (tests/test_triton_backend.py, tests/test_kernels_fp8.py)
def make_batch(kinds, block_size, num_kv_heads, head_dim, dtype, seed, device="cuda" if torch.cuda.is_available() else "cpu"):
    """kinds: per sequence ``(chunks, own_before, query_len)``: cached chunks ``[(len, delta)]``, then
    ``own_before`` request tokens already cached, then ``query_len`` new tokens (written this step)."""
    g = torch.Generator().manual_seed(seed)
    next_block = iter(torch.randperm(400, generator=g).tolist())
    seqs, fills = [], []
    for chunks, own_before, query_len in kinds:
        table, slots = [], []
        for length, delta in chunks:
            for start in range(0, length, block_size):
                b, v = next(next_block), min(block_size, length - start)
                table.append((b, delta, v))
                fills.append((b, v))
        own = own_before + query_len
        for start in range(0, own, block_size):
            b, v = next(next_block), min(block_size, own - start)
            table.append((b, 0, v))
            offsets = range(v)
            if own_before:
                fills.append((b, min(v, max(0, own_before - start))))
            slots += [b * block_size + o for o in offsets if start + o >= own_before]
        seq_len = sum(e[2] for e in table)
        seqs.append(sequence_input([0] * query_len, list(range(seq_len - query_len, seq_len)), table, slots))
    cache = torch.full((400, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    k_cache, v_cache = cache.clone(), cache.clone()
    for b, v in fills:
        k_cache[b, :v] = torch.randn(v, num_kv_heads, head_dim, generator=g).to(dtype)
        v_cache[b, :v] = torch.randn(v, num_kv_heads, head_dim, generator=g).to(dtype)
    return seqs, k_cache.to(device), v_cache.to(device), g


KINDS = {
    "decode": [([(37, 5), (16, 2**24 - 2)], 20, 1), ([], 3, 1), ([(17, -9)], 0, 1)],
    "prefill": [([(15, 3), (1, 70)], 0, 18), ([], 0, 5)],
    "mixed": [([(37, 5), (16, 2**24 - 2)], 20, 1), ([(15, 3), (17, 70)], 4, 18), ([], 0, 1), ([], 16, 7)],
    # no block moved (chunks where they were encoded, prompts computed whole): the prefill kernel
    # runs with its rotation compiled out (metadata.any_delta False)
    "prefill_no_delta": [([(15, 0), (17, 0)], 0, 18), ([], 0, 5), ([], 16, 7)],
    # deltas that a wrong any_delta could miss: only negative ones, and two that cancel in a sum
    "prefill_negative_delta": [([(15, -3), (17, -70)], 0, 18), ([], 0, 5)],
    "prefill_cancelling_deltas": [([(15, 3), (17, -3)], 0, 18)],
}
