"""Paged deferred-RoPE decode kernel (query rotated once per chunk, split-KV) vs its reference.

On the CPU these run under TRITON_INTERPRET=1 (tests/conftest.py) on small shapes; on a GPU the
same tests run compiled, plus ``gpu``-marked ones with block ids whose offsets overflow int32.
"""

import pytest
import torch
from kernel_tolerances import assert_close
from paged_case import GQA_SHAPES, SeqSpec, check_bf16_on_gpu, make_case

from lazyattn_rag.kernels.decode import choose_num_splits, paged_decode, split_cost, uses_wide_tiles, wave_fill
from lazyattn_rag.kernels.reference import decode_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Chunk lengths around a 16-slot block boundary; some tiles straddle two chunks (key rotation path),
# others hold one chunk (query re-rotated when delta changes, including back to a delta seen before).
MIXED = [
    SeqSpec(chunks=[(1, 7), (15, -4), (16, 40), (17, 2**24 - 9), (37, 300), (16, 40)], own_len=21),
    SeqSpec(chunks=[], own_len=6),  # no chunk at all (its only chunk was empty)
    SeqSpec(chunks=[(37, -(2**24) + 3)], own_len=1),  # the new token alone in its block
    SeqSpec(chunks=[(64, 9), (64, 9), (32, 0)], own_len=17),  # neighbouring chunks with equal deltas
]


def run(case, **kw):
    out = paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
                       case.cu_seqlens_q, int(case.seq_lens.max()), case.inv_freq, case.scale,
                       interleaved=case.interleaved, **kw)
    ref = decode_reference(case.query, case.key_cache, case.value_cache, case.block_tables,
                           case.num_blocks_per_seq, case.cu_seqlens_q, case.inv_freq, case.scale, case.interleaved)
    return out, ref


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", GQA_SHAPES)
def test_gqa_ratios_and_head_dims(num_heads, num_kv_heads, head_dim):
    case = make_case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, device=DEVICE,
                     seed=num_heads + head_dim)
    out, ref = run(case)
    assert_close(out, ref, torch.float32, f"{num_heads}/{num_kv_heads} d{head_dim}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])  # 3: the split reduction over a padded power of two
def test_dtypes_and_splits(dtype, num_splits):
    case = make_case(MIXED, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, device=DEVICE, seed=2)
    out, ref = run(case, num_splits=num_splits)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, f"splits {num_splits}")


@pytest.mark.parametrize("block_n", [16, 64])
def test_one_block_per_tile_and_wide_tiles(block_n):
    """block_n 16: every tile is one block, so only the query-rotation path runs; 64: four blocks."""
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=block_n)
    out, ref = run(case, block_n=block_n, num_splits=2)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("block_size", [8, 24])
def test_block_sizes(block_size):
    case = make_case(MIXED, num_heads=4, num_kv_heads=1, head_dim=64, block_size=block_size, device=DEVICE,
                     seed=block_size)
    out, ref = run(case, num_splits=2)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("interleaved,rotary_dim", [(True, 64), (False, 32)])
def test_interleaved_and_partial_rotary(interleaved, rotary_dim):
    case = make_case(MIXED[:2], num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=rotary_dim,
                     interleaved=interleaved, device=DEVICE, seed=3)
    out, ref = run(case)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 8, 5])
def test_padding_sequences_give_zeros_and_no_nan(num_splits):
    """Sequences without blocks (padding of a fixed-size decode batch), and splits with no tiles."""
    specs = [SeqSpec([], own_len=0), SeqSpec([(15, 11)], own_len=2), SeqSpec([], own_len=0)]
    case = make_case(specs, num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=4)
    out, ref = run(case, out=torch.full_like(case.query, float("nan")), num_splits=num_splits)
    assert_close(out, ref, torch.float32)
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[2]) == 0


def test_rows_follow_cu_seqlens_and_seq_ids():
    """In a mixed batch the decode kernel reads row cu_seqlens_q[seq] of the listed sequences only."""
    specs = [SeqSpec([(17, 3)], own_len=4, query_len=3), SeqSpec([(20, -2)], own_len=2, query_len=1)]
    case = make_case(specs, num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=5)
    poison = torch.full_like(case.query, 7.0)
    ids = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    out = paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
                       case.cu_seqlens_q, 22, case.inv_freq, case.scale, seq_ids=ids, out=poison, num_splits=2)
    ref = decode_reference(case.query, case.key_cache, case.value_cache, case.block_tables[1:],
                           case.num_blocks_per_seq[1:], case.cu_seqlens_q[1:], case.inv_freq, case.scale)
    assert torch.all(out[:3] == 7.0)
    assert_close(out[3], ref[3], torch.float32)


def test_rotation_compiled_out_matches_when_all_deltas_are_zero():
    specs = [SeqSpec([(37, 0), (17, 0)], own_len=9)]
    case = make_case(specs, num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=6)
    out, ref = run(case, rotation="none")
    assert_close(out, ref, torch.float32)


def test_key_tile_rotation_is_refused():
    """Decode rotates only the query (once per chunk); ``rotation="key"`` is a prefill-only form."""
    case = make_case(MIXED[:1], num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=6)
    with pytest.raises(ValueError, match="rotation must be one of"):
        run(case, rotation="key")


def test_split_counts_agree_and_bad_counts_are_refused():
    """Every split count gives the same output (up to float32 summation order), powers of two or
    not, and one that leaves splits empty; a count below 1 is refused."""
    case = make_case(MIXED, num_heads=8, num_kv_heads=2, head_dim=64, device=DEVICE, seed=6)
    one, ref = run(case, num_splits=1)
    for splits in (2, 3, 6, 7, 64):
        out, _ = run(case, num_splits=splits)
        assert_close(out, ref, torch.float32, f"splits {splits}")
        torch.testing.assert_close(out, one, atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="num_splits must be >= 1, got 0"):
        run(case, num_splits=0)


def test_choose_num_splits():
    assert choose_num_splits(32, 8, 128, num_sms=132) == 3  # 256 programs fill 0.65 of a wave, 768 0.97 of 2
    assert choose_num_splits(8, 8, 128, num_sms=132) == 6  # 384 of 396 slots
    assert choose_num_splits(32, 3, 64, num_sms=132) == 4  # 96 programs x 4
    assert choose_num_splits(1, 8, 512, num_sms=132) == 49  # one long sequence: 392 programs
    assert choose_num_splits(1, 8, 512, num_sms=4) == 3  # 24 programs: 2 full waves of 12 slots
    assert choose_num_splits(128, 8, 128, num_sms=132) == 3  # 1024 programs fill 0.86 of 3 waves, 3072 0.97 of 8
    for batch in range(43, 50):  # one split already fills 0.87-0.99 of a wave: no jump to 15-20 splits
        assert choose_num_splits(batch, 8, 128, num_sms=132) == 1
    assert choose_num_splits(1, 8, 8, num_sms=132) == 2  # at least 4 tiles per split
    # FP8 caches: 2 programs resident per multiprocessor (FP8_PROGRAMS_PER_SM)
    assert choose_num_splits(16, 8, 21, num_sms=132, programs_per_sm=2) == 2  # 256 of 264 slots
    assert choose_num_splits(16, 8, 21, num_sms=132) == 3  # 384 of 396 slots: 1.45 waves at 2 resident
    assert choose_num_splits(1, 8, 160, num_sms=132, programs_per_sm=2) == 33  # 264 programs, one wave
    assert choose_num_splits(1, 1, 7, num_sms=132) == 1  # too few tiles to split
    assert choose_num_splits(1, 1, 10_000, num_sms=132) == 64  # at most 64
    assert wave_fill(384, 132) == 384 / 396 and wave_fill(400, 132) == 400 / 792
    assert split_cost(256, 3, 132) < split_cost(256, 1, 132) and split_cost(256, 3, 132) < split_cost(256, 6, 132)


def test_uses_wide_tiles():
    assert uses_wide_tiles(32, 8, 128, num_sms=132)  # 256 programs >= 1.9 x 132
    assert not uses_wide_tiles(31, 8, 128, num_sms=132)  # 248
    assert uses_wide_tiles(128, 8, 128, num_sms=132)
    assert not uses_wide_tiles(128, 8, 64, num_sms=132)  # measured at d128 only
    assert uses_wide_tiles(4, 8, 128, num_sms=4)  # 32 programs on 4 SMs


@pytest.mark.gpu
@gpu
def test_wide_tile_default_gpu():
    """Batch 40 x 8 KV heads at d128: the default launch runs wide tiles (128 keys, 2 stages, one split)."""
    specs = [SeqSpec([(100 + 7 * i, 13 * i - 50), (33, 2**24 - i)], own_len=1 + i % 17) for i in range(40)]
    case = make_case(specs, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda", seed=13)
    assert uses_wide_tiles(40, 8, 128, torch.cuda.get_device_properties(0).multi_processor_count)
    out, ref = run(case)
    assert_close(out, ref, torch.bfloat16)
    wide, _ = run(case, block_n=128, num_stages=2, num_splits=1)
    assert torch.equal(out, wide)  # the default launch is the wide one, bit for bit
    split, _ = run(case, num_splits=3)  # the split rule's tiles: the same result
    assert_close(out, split, torch.bfloat16)


@pytest.mark.gpu
@gpu
def test_block_ids_past_int32_offsets():
    """block_id * block_size * num_kv_heads * head_dim > 2**31: offsets must be int64."""
    num_kv_heads, head_dim, block_size = 8, 128, 16
    min_block = 2**31 // (block_size * num_kv_heads * head_dim) + 10
    specs = [SeqSpec([(37, 1000), (17, -5)], own_len=70), SeqSpec([(15, 2**24)], own_len=3)]
    case = make_case(specs, num_heads=32, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                     dtype=torch.bfloat16, device="cuda", min_block_id=min_block, spare_blocks=4)
    assert case.key_cache.numel() > 2**31
    for splits in (1, 4):
        out, ref = run(case, num_splits=splits)
        assert_close(out, ref, torch.bfloat16)


LONG = [SeqSpec([(1000, 12), (777, 5000), (1, 2**24 - 1), (2000, 3)], own_len=600), SeqSpec([(300, -7)], own_len=1),
        SeqSpec([], own_len=4000)]  # long sequences, offsets up to 2**24, one of a single token


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_long_decode_default_splits_gpu(num_heads, num_kv_heads, head_dim):
    check_bf16_on_gpu(run, LONG, 11, num_heads, num_kv_heads, head_dim)



@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("options", [dict(block_n=128), dict(block_n=128, num_stages=3, num_splits=32)])
def test_long_decode_launch_options_gpu(options):
    """The launch shapes the H200 sweep measures (benchmarks/kernels.py) give the same result."""
    check_bf16_on_gpu(run, LONG, 12, **options)


def test_a_batch_of_padding_with_a_zero_width_block_table():
    """Every sequence padding and a block table of no columns (an empty tensor: a null pointer
    unless the launcher substitutes a column): zeros out, nothing read."""
    specs = [SeqSpec([], own_len=0), SeqSpec([], own_len=0)]
    case = make_case(specs, num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=6)
    case = case.__class__(**{**case.__dict__, "block_tables": case.block_tables[:, :0].contiguous()})
    out, _ = run(case, out=torch.full_like(case.query, float("nan")), num_splits=3)
    assert torch.count_nonzero(out) == 0
