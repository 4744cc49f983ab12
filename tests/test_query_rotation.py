"""Queries rotated beforehand for the paged prefill (``kernels/query_rotation.py``, issue 43): the
host layout with exact values, the rotated rows against the float32 reference rotation, and
``rotation="prerotated"`` against the in-kernel query rotation bit for bit.

On the CPU these run under TRITON_INTERPRET=1 (tests/conftest.py); on a GPU they run compiled.
"""

import pytest
import torch
from kernel_tolerances import assert_close
from paged_case import SeqSpec, make_case

from lazyattn_rag.kernels.prefill import paged_prefill
from lazyattn_rag.kernels.query_rotation import plan_query_rotations, rotate_queries
from lazyattn_rag.kernels.reference import prefill_reference, rotate

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SPECS = [
    SeqSpec(chunks=[(1, 7), (15, -4), (16, 40), (17, 2**24 - 9), (37, 300)], own_len=21, query_len=19),
    SeqSpec(chunks=[], own_len=6, query_len=6),  # nothing to rotate
    SeqSpec(chunks=[(17, 5), (20, 5), (9, -3)], own_len=3, query_len=1),  # one delta twice: one set of rows
    SeqSpec(chunks=[(16, -(2**24) + 1)], own_len=40, query_len=33),
]


def layout(case):
    return plan_query_rotations(case.block_tables.cpu(), case.num_blocks_per_seq.cpu(), case.cu_seqlens_q.cpu(),
                                case.query.device, block_size=case.key_cache.shape[1])


def test_the_layout_lists_each_sequences_distinct_nonzero_deltas_in_table_order():
    case = make_case(SPECS, num_heads=2, num_kv_heads=1, head_dim=16, device="cpu", seed=1)
    plan = layout(case)
    assert plan.deltas.tolist() == [[7, -4, 40, 2**24 - 9, 300], [0] * 5, [5, -3, 0, 0, 0],
                                    [-(2**24) + 1, 0, 0, 0, 0]]
    assert plan.num_deltas.tolist() == [5, 0, 2, 1]
    assert plan.row_base.tolist() == [0, 95, 95, 97]  # 5 x 19 rows, none, 2 x 1, then 1 x 33
    assert plan.num_rows == 130
    # each run's first rotated row (-1: the query as given); a partly filled block ends a run, and
    # the sequence's own tokens are a run of delta 0
    assert plan.run_rows.tolist() == [[0, 19, 38, 57, 76, -1],  # five chunks, then its own tokens
                                      [-1, -1, -1, -1, -1, -1],  # its own tokens only
                                      [95, 95, 96, -1, -1, -1],  # delta 5 twice (two runs: 17 tokens end one)
                                      [97, -1, -1, -1, -1, -1]]


def test_the_layout_of_chosen_sequences_only():
    case = make_case(SPECS, num_heads=2, num_kv_heads=1, head_dim=16, device="cpu", seed=1)
    plan = plan_query_rotations(case.block_tables, case.num_blocks_per_seq, case.cu_seqlens_q, "cpu", seqs=[3, 2],
                                block_size=case.key_cache.shape[1])
    assert plan.num_deltas.tolist() == [0, 0, 2, 1] and plan.row_base.tolist() == [0, 0, 0, 2]
    assert plan.deltas[2, :2].tolist() == [5, -3] and plan.num_rows == 2 + 33
    assert plan.run_rows[:, :4].tolist() == [[-1] * 4, [-1] * 4, [0, 0, 1, -1], [2, -1, -1, -1]]


def test_the_layout_reads_host_tables_only():
    case = make_case(SPECS[:1], num_heads=2, num_kv_heads=1, head_dim=16, device="cpu", seed=1)
    with pytest.raises(ValueError, match="reads block_tables on the host; got a tensor on meta"):
        plan_query_rotations(case.block_tables.to("meta"), case.num_blocks_per_seq, case.cu_seqlens_q, "cpu",
                             block_size=16)


@pytest.mark.parametrize("interleaved,rotary_dim", [(False, 64), (True, 32)])
def test_rotated_rows_are_each_query_rotated_by_minus_its_delta(interleaved, rotary_dim):
    case = make_case(SPECS, num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=2,
                     interleaved=interleaved, rotary_dim=rotary_dim)
    plan = layout(case)
    rows = rotate_queries(case.query, plan, case.cu_seqlens_q, case.max_query_len, case.inv_freq, interleaved)
    assert rows.shape == (plan.num_rows, 4, 64) and rows.dtype == case.query.dtype
    cu = case.cu_seqlens_q.tolist()
    for s in range(len(SPECS)):
        q = case.query[cu[s]:cu[s + 1]]
        for k in range(int(plan.num_deltas[s])):
            delta = int(plan.deltas[s, k])
            start = int(plan.row_base[s]) + k * q.shape[0]
            expected = rotate(q, torch.full((q.shape[0],), -delta), case.inv_freq, interleaved)
            assert_close(rows[start:start + q.shape[0]], expected, torch.float32, f"seq {s} delta {delta}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prerotated_queries_give_the_in_kernel_rotations_result_bit_for_bit(dtype):
    case = make_case(SPECS, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, device=DEVICE, seed=3)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
            case.seq_lens, case.cu_seqlens_q, case.max_query_len, case.inv_freq, case.scale)
    pre = paged_prefill(*args, rotation="prerotated", query_rotations=layout(case))
    assert torch.equal(pre, paged_prefill(*args, rotation="query"))
    ref = prefill_reference(case.query, case.key_cache, case.value_cache, case.block_tables,
                            case.num_blocks_per_seq, case.cu_seqlens_q, case.inv_freq, case.scale, False)
    assert_close(pre, ref, dtype)
    unrotated = paged_prefill(*args, rotation="none")
    assert (unrotated.float().cpu() - ref.float().cpu()).abs().max() > 1e-2  # the rows really are rotated


def test_a_batch_with_nothing_to_rotate_reads_the_query_as_given():
    case = make_case([SeqSpec([(20, 0)], own_len=9, query_len=9), SPECS[1]], num_heads=4, num_kv_heads=2,
                     head_dim=64, device=DEVICE, seed=5)
    plan = layout(case)
    assert plan.num_rows == 0 and plan.num_deltas.tolist() == [0, 0]
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
            case.seq_lens, case.cu_seqlens_q, case.max_query_len, case.inv_freq, case.scale)
    assert torch.equal(paged_prefill(*args, rotation="prerotated", query_rotations=plan),
                       paged_prefill(*args, rotation="query"))


def test_listed_sequences_read_their_rows_and_leave_the_others_alone():
    case = make_case(SPECS, num_heads=4, num_kv_heads=2, head_dim=64, device=DEVICE, seed=6)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
            case.seq_lens, case.cu_seqlens_q, case.max_query_len, case.inv_freq, case.scale)
    seq_ids = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    plan = plan_query_rotations(case.block_tables.cpu(), case.num_blocks_per_seq.cpu(), case.cu_seqlens_q.cpu(),
                                case.query.device, seqs=[3, 0], block_size=case.key_cache.shape[1])
    pre = paged_prefill(*args, rotation="prerotated", query_rotations=plan, seq_ids=seq_ids,
                        out=torch.full_like(case.query, 7.0))
    assert torch.equal(pre, paged_prefill(*args, rotation="query", seq_ids=seq_ids, out=torch.full_like(case.query, 7.0)))
    cu = case.cu_seqlens_q.tolist()
    assert torch.all(pre[cu[1]:cu[3]] == 7.0)  # sequences 1 and 2 were not listed


def test_the_rotation_and_its_layout_go_together():
    case = make_case(SPECS[:2], num_heads=2, num_kv_heads=1, head_dim=64, device=DEVICE, seed=4)
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
            case.seq_lens, case.cu_seqlens_q, case.max_query_len, case.inv_freq, case.scale)
    with pytest.raises(ValueError, match="takes query_rotations .* got rotation='prerotated' with query_rotations None"):
        paged_prefill(*args, rotation="prerotated")
    with pytest.raises(ValueError, match="got rotation='query' with query_rotations given"):
        paged_prefill(*args, rotation="query", query_rotations=layout(case))
    other = make_case(SPECS[:1], num_heads=2, num_kv_heads=1, head_dim=64, device=DEVICE, seed=4)
    with pytest.raises(ValueError, match="query_rotations covers 1 sequences on .*; the block tables have 2 on"):
        paged_prefill(*args, rotation="prerotated", query_rotations=layout(other))
