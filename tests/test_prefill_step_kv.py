"""The prefill kernel reading the new tokens' own keys from the step's K/V (``key=``/``value=``).

The engine writes the new tokens' K/V into the cache and hands the same tensors to the kernel,
which reads them contiguously instead of through the block table wherever the new tokens lie in
one last run of delta 0 and no scaling flag. These tests make the two sources differ on purpose
(the cache's slots of the new tokens poisoned with NaN, or the step's tensors), so each result
shows which one the kernel read, against the float32 reference on the true values.
"""

import pytest
import torch
from kernel_tolerances import assert_close
from paged_case import SeqSpec, make_case

from lazyattn_rag.kernels.block_table import pack_block_table, unpack_block_table
from lazyattn_rag.kernels.launch import ChunkScaling
from lazyattn_rag.kernels.prefill import paged_prefill
from lazyattn_rag.kernels.reference import prefill_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Chunks around block boundaries; new tokens after earlier own tokens (chunked prefill: the
# run starts before the new tokens, mid-block), a decode row, a sequence with no chunk, a
# padding row (query rows, no keys), new tokens spanning several blocks.
SPECS = [
    SeqSpec(chunks=[(1, 7), (15, -4), (16, 40), (37, 300)], own_len=21, query_len=19),
    SeqSpec(chunks=[], own_len=6, query_len=6),
    SeqSpec(chunks=[(17, 5)], own_len=3, query_len=1),
    SeqSpec(chunks=[], own_len=0, query_len=2),
    SeqSpec(chunks=[(16, -(2**24) + 1)], own_len=70, query_len=70),
]


def new_token_slots(case, seq: int) -> list[tuple[int, int]]:
    """``(block id, slot)`` of each of sequence ``seq``'s new tokens, in key order."""
    n = int(case.num_blocks_per_seq[seq])
    ids, _, valid = unpack_block_table(case.block_tables[seq, :n].cpu())
    slots = [(b, s) for b, v in zip(ids.tolist(), valid.tolist()) for s in range(v)]
    q_len = int(case.cu_seqlens_q[seq + 1] - case.cu_seqlens_q[seq])
    return slots[len(slots) - q_len:] if q_len else []


def step_kv(case) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' K and V as the engine computes them (rows of ``query``'s tokens)."""
    key = torch.zeros(case.query.shape[0], *case.key_cache.shape[2:], dtype=case.key_cache.dtype, device=DEVICE)
    value = torch.zeros_like(key)
    bounds = case.cu_seqlens_q.tolist()
    for seq in range(len(bounds) - 1):
        for row, (b, s) in enumerate(new_token_slots(case, seq)):
            key[bounds[seq] + row] = case.key_cache[b, s]
            value[bounds[seq] + row] = case.value_cache[b, s]
    return key, value


def poison_new_tokens(case, seqs) -> None:
    for seq in seqs:
        for b, s in new_token_slots(case, seq):
            case.key_cache[b, s] = float("nan")
            case.value_cache[b, s] = float("nan")


def reference(case, chunk_scaling=None):
    return prefill_reference(case.query, case.key_cache, case.value_cache, case.block_tables,
                             case.num_blocks_per_seq, case.cu_seqlens_q, case.inv_freq, case.scale,
                             case.interleaved, chunk_scaling)


def prefill(case, key, value, **kw):
    return paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
                         case.seq_lens, case.cu_seqlens_q, case.max_query_len, case.inv_freq, case.scale,
                         interleaved=case.interleaved, key=key, value=value, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotation", ["query", "key"])
@pytest.mark.parametrize("step_tma", [False, True])  # per-lane loads; tensor descriptors (TMA on Hopper)
def test_new_tokens_keys_are_read_from_the_step(dtype, rotation, step_tma):
    """With the cache's slots of every new token poisoned, the output still equals the reference
    on the true values: those keys came from ``key``/``value``, every other key from the cache."""
    case = make_case(SPECS, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, device=DEVICE, seed=21)
    ref = reference(case)
    key, value = step_kv(case)
    poison_new_tokens(case, range(len(SPECS)))
    out = prefill(case, key, value, rotation=rotation, step_tma=step_tma)
    assert_close(out, ref, dtype)
    assert torch.count_nonzero(out[sum(s.query_len for s in SPECS[:3]):][:2]) == 0  # the padding rows


@pytest.mark.parametrize("interleaved,rotary_dim", [(True, 64), (False, 32), (True, 32)])
@pytest.mark.parametrize("step_tma", [False, True])
def test_rope_layouts_with_step_keys(interleaved, rotary_dim, step_tma):
    case = make_case(SPECS[:2], num_heads=6, num_kv_heads=2, head_dim=64, device=DEVICE, seed=22,
                     interleaved=interleaved, rotary_dim=rotary_dim)
    ref = reference(case)
    key, value = step_kv(case)
    poison_new_tokens(case, range(2))
    assert_close(prefill(case, key, value, step_tma=step_tma), ref, torch.float32)


def with_own_run(case, seq: int, delta: int = 0, scaled: bool = False):
    """``case`` with sequence ``seq``'s last run (its own tokens) given ``delta`` and the flag."""
    n = int(case.num_blocks_per_seq[seq])
    ids, deltas, valid = unpack_block_table(case.block_tables[seq, :n].cpu())
    own = deltas == deltas[-1]
    own[: int((~own).nonzero().max()) + 1 if (~own).any() else 0] = False
    tables = case.block_tables.clone()
    tables[seq, :n] = pack_block_table(ids, torch.where(own, delta, deltas), valid, own & scaled).to(DEVICE)
    return case.__class__(**{**case.__dict__, "block_tables": tables})


@pytest.mark.parametrize("delta,scaled", [(3, False), (-(2**20), False), (0, True)])
@pytest.mark.parametrize("step_tma", [False, True])
def test_new_tokens_in_a_rotated_or_scaled_run_are_read_from_the_cache(delta, scaled, step_tma):
    """Where the new tokens' run has a nonzero delta or the scaling flag, the step's K/V (NaN
    here) are not read: the kernel walks the block table for them, as without ``key``/``value``;
    the other sequence of the batch still reads its own from the step."""
    case = with_own_run(make_case(SPECS[:2], num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=23),
                        0, delta, scaled)
    scaling = ChunkScaling(temperature=0.7, weight=1.5) if scaled else None
    ref = reference(case, scaling)
    key, value = step_kv(case)
    rows0 = SPECS[0].query_len
    key[:rows0], value[:rows0] = float("nan"), float("nan")
    poison_new_tokens(case, [1])
    out = prefill(case, key, value, chunk_scaling=scaling, step_tma=step_tma)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("step_tma", [False, True])
def test_step_rows_past_a_sequence_are_never_used(step_tma):
    """A tile of the step's K/V can reach past a sequence's new tokens into the next sequence's
    rows (a descriptor's box is not masked): with those rows NaN (the next sequence reads its own
    keys from the cache), the first sequence's output still equals the reference."""
    case = with_own_run(make_case(SPECS[:2], num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=27),
                        1, delta=3)
    ref = reference(case)
    key, value = step_kv(case)
    rows0 = SPECS[0].query_len
    key[rows0:], value[rows0:] = float("nan"), float("nan")  # sequence 1's step rows: read from the cache
    poison_new_tokens(case, [0])  # sequence 0 must read its own keys from the step
    out = prefill(case, key, value, step_tma=step_tma)
    assert torch.isfinite(out).all()
    assert_close(out, ref, torch.float32)


def test_step_kv_bad_inputs_raise_clear_errors():
    case = make_case(SPECS[:1], num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=24)
    key, value = step_kv(case)
    with pytest.raises(ValueError, match="given together"):
        prefill(case, key, None)
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, num_kv_heads, head_dim\] = \[19, 2, 64\]"):
        prefill(case, key[1:], value)
    with pytest.raises(ValueError, match="value must have the dtype torch.float32 and the cache's device"):
        prefill(case, key, value.half())
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        prefill(case, key, torch.zeros(19, 64, 2, device=DEVICE).transpose(1, 2))
    with pytest.raises(ValueError, match="step_tma=True needs key and value"):
        prefill(case, None, None, step_tma=True)
    heads_apart = torch.zeros(2, 19, 64, device=DEVICE).transpose(0, 1)  # [19, 2, 64], stride(1) = 19 * 64
    with pytest.raises(ValueError, match=r"contiguous heads \(stride\(1\) == head_dim\)"):
        prefill(case, key, heads_apart, step_tma=True)
    assert_close(prefill(case, key, heads_apart.copy_(value), step_tma=None),  # the default: pointers there
                 prefill(case, key, value, step_tma=False), torch.float32)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_long_prefill_with_step_keys_gpu(num_heads, num_kv_heads, head_dim):
    """Compiled tiles: a full causal prefill (all keys from the step), new tokens after chunks,
    chunked prefill (earlier own tokens in the cache), all against the reference."""
    specs = [SeqSpec([(1000, 12), (777, 5000)], own_len=700, query_len=600), SeqSpec([], own_len=1, query_len=1),
             SeqSpec([], own_len=1500, query_len=1500), SeqSpec([(300, -7)], own_len=129, query_len=129)]
    case = make_case(specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=torch.bfloat16, device="cuda", seed=25)
    ref = reference(case)
    key, value = step_kv(case)
    poison_new_tokens(case, range(len(specs)))
    assert_close(prefill(case, key, value), ref, torch.bfloat16)


def test_batch_of_padding_rows_with_an_empty_block_table():
    """Every sequence padding (query rows, no keys) and a block table of zero columns: zeros out,
    and no table entry is read (the step-K/V check used to load column 0 of the empty table)."""
    case = make_case([SeqSpec([], own_len=0, query_len=2), SeqSpec([], own_len=0, query_len=1)],
                     num_heads=2, num_kv_heads=1, head_dim=32, device=DEVICE, seed=26)  # GPU: halves >= 16
    case = case.__class__(**{**case.__dict__, "block_tables": case.block_tables[:, :0].contiguous()})
    key = torch.randn(3, 1, 32, device=DEVICE)
    out = prefill(case, key, torch.randn_like(key), out=torch.full_like(case.query, float("nan")))
    assert torch.count_nonzero(out) == 0


def test_default_tiles_fit_the_device_shared_memory():
    """The tile rule (kernels/prefill.py): the measured H200 choices at head_dim 128, and no
    configuration whose tiles exceed the device's shared memory (head_dim 256, 128-slot blocks)."""
    from lazyattn_rag.kernels.prefill import _default_config, tile_shared_bytes

    h200 = 232448  # shared memory per program, opt-in (bytes)
    pick = lambda *a: tuple(_default_config(*a).values())  # noqa: E731
    assert pick(128, 16, False, 2, 20480, 0, h200) == (128, 64, 8, 3)  # long prompt, no cached keys
    assert pick(128, 16, False, 2, 20480, 512, h200) == (64, 64, 4, 3)  # cached context
    assert pick(128, 16, False, 2, 512, 0, h200) == (64, 64, 4, 3)  # short prompt
    assert pick(128, 16, False, 2, 20480, None, h200) == (64, 64, 4, 3)  # context unknown
    assert pick(128, 16, False, 2, 20480, 0, 100 * 1024) == (64, 64, 4, 2)  # 100 KB parts: 2 stages fit
    for head_dim, block_size in ((128, 16), (128, 128), (256, 16), (256, 128)):
        for q_len, ctx in ((20480, 0), (64, 512)):
            bm, bn, _, stages = pick(head_dim, block_size, False, 2, q_len, ctx, h200)
            assert tile_shared_bytes(bm, bn, stages, head_dim, 2) + 16 * 1024 <= h200, (head_dim, block_size)
