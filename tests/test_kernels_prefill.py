"""Paged deferred-RoPE prefill kernel vs its float32 PyTorch reference.

On the CPU these run under TRITON_INTERPRET=1 (tests/conftest.py) on small shapes; on a GPU the
same tests run compiled, plus ``gpu``-marked ones with block ids whose offsets overflow int32.
"""

import os

import pytest
import torch
from kernel_tolerances import assert_close
from paged_case import GQA_SHAPES, SeqSpec, check_bf16_on_gpu, make_case

from lazyattn_rag.kernels.launch import block_key_starts, block_runs
from lazyattn_rag.kernels.prefill import paged_prefill
from lazyattn_rag.kernels.reference import prefill_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Chunk lengths around a 16-slot block boundary, at assorted offsets (one straddles 2**24).
MIXED = [
    SeqSpec(chunks=[(1, 7), (15, -4), (16, 40), (17, 2**24 - 9), (37, 300)], own_len=21, query_len=19),
    SeqSpec(chunks=[], own_len=6, query_len=6),  # no chunk at all (its only chunk was empty)
    SeqSpec(chunks=[(17, 5)], own_len=3, query_len=1),  # a decode row inside a prefill batch
    SeqSpec(chunks=[(16, -(2**24) + 1)], own_len=40, query_len=33),  # new tokens span 3 blocks
]


def run(case, **kw):
    out = paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
                        case.seq_lens, case.cu_seqlens_q, case.max_query_len, case.inv_freq, case.scale,
                        interleaved=case.interleaved, **kw)
    ref = prefill_reference(case.query, case.key_cache, case.value_cache, case.block_tables,
                            case.num_blocks_per_seq, case.cu_seqlens_q, case.inv_freq, case.scale, case.interleaved)
    return out, ref


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", GQA_SHAPES)
def test_gqa_ratios_and_head_dims(num_heads, num_kv_heads, head_dim):
    specs = [MIXED[0], MIXED[1]] if num_heads <= 9 else [SeqSpec([(17, 2**24 - 9), (15, 3)], own_len=9, query_len=9)]
    case = make_case(specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, device=DEVICE,
                     seed=num_heads * 7 + head_dim)
    out, ref = run(case)
    assert_close(out, ref, torch.float32, f"{num_heads}/{num_kv_heads} d{head_dim}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_dtypes(dtype):
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, device=DEVICE, seed=1)
    out, ref = run(case)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("block_size", [8, 24, 64])
def test_block_sizes(block_size):
    """A non-power-of-two block size leaves idle lanes in each tile; 64 makes one block per tile."""
    case = make_case(MIXED[:2], num_heads=4, num_kv_heads=1, head_dim=64, block_size=block_size, device=DEVICE,
                     seed=block_size)
    out, ref = run(case)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("interleaved,rotary_dim", [(True, 64), (False, 32), (True, 32)])
def test_interleaved_and_partial_rotary(interleaved, rotary_dim):
    case = make_case(MIXED[:1], num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=rotary_dim,
                     interleaved=interleaved, device=DEVICE, seed=3)
    out, ref = run(case)
    assert_close(out, ref, torch.float32)


def test_padding_sequence_gives_zeros_and_no_nan():
    """A sequence without blocks (a padding row of a fixed-size batch) attends nothing: zeros out."""
    specs = [SeqSpec([(15, 11)], own_len=5, query_len=5), SeqSpec([], own_len=0, query_len=3)]
    case = make_case(specs, num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=4)
    out, ref = run(case, out=torch.full_like(case.query, float("nan")))
    assert_close(out, ref, torch.float32)
    assert torch.count_nonzero(out[5:]) == 0


def test_seq_ids_writes_only_listed_sequences():
    case = make_case(MIXED[:2], num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=5)
    poison = torch.full_like(case.query, 7.0)
    out, ref = run(case, seq_ids=torch.tensor([1], dtype=torch.int32, device=DEVICE), out=poison)
    n0 = MIXED[0].query_len
    assert torch.all(out[:n0] == 7.0)
    assert_close(out[n0:], ref[n0:], torch.float32)


def test_seq_ids_with_rotated_runs_leave_other_rows_alone():
    """A listed sequence over chunks at nonzero offsets (its rotated query tiles are staged in
    its own output rows) next to unlisted ones: their rows keep what they held, the query is
    not touched."""
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=6)
    query_before = case.query.clone()
    poison = torch.full_like(case.query, 7.0)
    out, ref = run(case, seq_ids=torch.tensor([0, 3], dtype=torch.int32, device=DEVICE), out=poison)
    bounds = case.cu_seqlens_q.tolist()
    for seq in (1, 2):
        assert torch.all(out[bounds[seq]:bounds[seq + 1]] == 7.0)
    for seq in (0, 3):
        assert_close(out[bounds[seq]:bounds[seq + 1]], ref[bounds[seq]:bounds[seq + 1]], torch.float32)
    assert torch.equal(case.query, query_before)


def test_rotation_compiled_out_matches_when_all_deltas_are_zero():
    specs = [SeqSpec([(37, 0), (17, 0)], own_len=9, query_len=9)]
    case = make_case(specs, num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=6)
    out, ref = run(case, rotation="none")
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_tile_rotation_mode(dtype):
    """rotation="key" (each K tile rotated by delta) computes the same attention."""
    case = make_case(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, device=DEVICE, seed=8)
    out, ref = run(case, rotation="key")
    assert_close(out, ref, dtype)


def test_block_runs():
    case = make_case(MIXED[:2], num_heads=2, num_kv_heads=1, head_dim=16, device="cpu", seed=7)
    runs = block_runs(case.block_tables, case.num_blocks_per_seq, 16)
    # seq 0 blocks: 1 | 15 | 16 | 17,17 | 37,37,37 | own 21: 2 blocks -> runs start at 0,1,2,3,5,8; 10 blocks
    assert runs.num_runs.tolist() == [6, 1]
    assert runs.starts[0, :7].tolist() == [0, 1, 2, 3, 5, 8, 10]
    assert runs.starts[1, :2].tolist() == [0, 1]
    # equal deltas still split after a partial block: 37 (16,16,5) then 17 (16,1) then 9, all delta 0
    case = make_case([SeqSpec([(37, 0), (17, 0)], own_len=9)], num_heads=2, num_kv_heads=1, head_dim=16, seed=9)
    runs = block_runs(case.block_tables, case.num_blocks_per_seq, 16)
    assert runs.starts[0, : int(runs.num_runs[0]) + 1].tolist() == [0, 3, 5, 6]


def test_block_key_starts():
    case = make_case(MIXED[:2], num_heads=2, num_kv_heads=1, head_dim=16, device="cpu", seed=7)
    ks = block_key_starts(case.block_tables, case.num_blocks_per_seq)
    # chunks 1, 15, 16, 17 (2 blocks), 37 (3 blocks), own 21 (2 blocks)
    assert ks[0, :10].tolist() == [0, 1, 16, 32, 48, 49, 65, 81, 86, 102]
    assert ks[1, :1].tolist() == [0]


@pytest.mark.gpu
@gpu
def test_block_ids_past_int32_offsets():
    """block_id * block_size * num_kv_heads * head_dim > 2**31: offsets must be int64."""
    num_kv_heads, head_dim, block_size = 8, 128, 16
    min_block = 2**31 // (block_size * num_kv_heads * head_dim) + 10  # past 2**31 elements (4.3 GB)
    specs = [SeqSpec([(37, 1000), (17, -5)], own_len=70, query_len=70), SeqSpec([(15, 2**24)], own_len=3, query_len=2)]
    case = make_case(specs, num_heads=32, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                     dtype=torch.bfloat16, device="cuda", min_block_id=min_block, spare_blocks=4)
    assert case.key_cache.numel() > 2**31
    out, ref = run(case)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_long_prefill_with_chunks_gpu(num_heads, num_kv_heads, head_dim):
    specs = [SeqSpec([(1000, 12), (777, 5000), (1, 2**24 - 1)], own_len=600, query_len=600),
             SeqSpec([(300, -7)], own_len=1, query_len=1), SeqSpec([], own_len=257, query_len=257)]
    check_bf16_on_gpu(run, specs, 11, num_heads, num_kv_heads, head_dim)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("options", [dict(num_stages=2), dict(num_stages=3)])
def test_long_prefill_launch_options_gpu(options):
    """The launch options the H200 sweep measures (benchmarks/kernels.py) give the same result."""
    specs = [SeqSpec([(1000, 12), (777, 5000)], own_len=600, query_len=600), SeqSpec([], own_len=1000, query_len=1000)]
    check_bf16_on_gpu(run, specs, 13, **options)


def test_out_beside_the_query_in_one_buffer_and_empty_batches_are_accepted():
    case = make_case(MIXED[:2], num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=8)
    buf = torch.zeros(2, *case.query.shape, dtype=case.query.dtype, device=DEVICE)
    buf[0] = case.query
    out, ref = run(case.__class__(**{**case.__dict__, "query": buf[0]}), out=buf[1])  # disjoint halves
    assert_close(out, ref, torch.float32)
    empty = case.query[:0]
    kept = paged_prefill(empty, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
                         case.seq_lens, case.cu_seqlens_q, 0, case.inv_freq, case.scale, out=empty.clone())
    assert kept.shape == empty.shape


def test_bad_inputs_raise_clear_errors():
    case = make_case(MIXED[:1], num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=10)
    with pytest.raises(ValueError, match="overlap the query"):  # the rotated query is staged in out
        run(case, out=case.query)
    with pytest.raises(ValueError, match="overlap the query"):
        run(case, out=case.query[1:])
    with pytest.raises(ValueError, match="query's dtype torch.float32, got torch.float16"):
        run(case, out=torch.empty_like(case.query, dtype=torch.float16))
    with pytest.raises(ValueError, match="share a dtype"):
        run(case.__class__(**{**case.__dict__, "query": case.query.half()}))
    with pytest.raises(ValueError, match="int64"):
        run(case.__class__(**{**case.__dict__, "block_tables": case.block_tables.to(torch.int32)}))
    with pytest.raises(NotImplementedError, match="power-of-two head_dim"):
        run(case.__class__(**{**case.__dict__, "query": case.query[..., :48]}))
    with pytest.raises(ValueError, match="rotation must be one of"):
        run(case, rotation="keys")


def test_step_varying_int_arguments_are_not_specialized():
    """The block-table width changes every step; a Triton specialization on it (== 1, divisible
    by 16) would compile a new kernel variant mid-run. Checked on the compiled (non-interpreted)
    kernels, whose decoration needs no GPU."""
    import subprocess
    import sys

    code = ("from lazyattn_rag.kernels import prefill, decode\n"
            "for k in (prefill.prefill_kernel, decode.decode_kernel):\n"
            "    print(sorted(p.name for p in k.params if p.do_not_specialize))\n")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["['search_steps', 'stride_bt', 'stride_ksr', 'stride_qrr', 'stride_rsr']",
                                "['stride_bt', 'stride_rsr']"]
