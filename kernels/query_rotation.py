"""Queries rotated once per sequence and chunk offset, before the paged prefill reads them.

The prefill kernel's default (``rotation="query"``) rotates its query tile by ``-delta`` at every
run of blocks with a nonzero ``delta`` (LazyAttention, arXiv 2606.04302, Sec. 3:
``(R_m q) . (R_(j+delta) k) = (R_(-delta) R_m q) . (R_j k)``), inside the attention loop. Compiled
for sm_90a that rotation (angles, the partner columns, float32 arithmetic) costs the cached-context
launch 168 B of spills per thread against 24 B without it (``benchmarks/kernel_resources.py``).
Here a small kernel computes the same rotated rows beforehand, once per (sequence, distinct nonzero
delta) for all query heads, and the prefill kernel (``rotation="prerotated"``) only loads them.

* :func:`plan_query_rotations` (host, once per step: the block tables' deltas are read on the
  host) lays out each sequence's distinct nonzero deltas and where their rows go;
* :func:`rotate_queries` (per layer) fills ``[num_rows, num_heads, head_dim]`` rows in the
  query's dtype: sequence ``s``'s ``k``-th delta's rows are ``row_base[s] + k * query_len[s] + i``
  for its new tokens ``i``, each the query rotated by ``-deltas[s, k]`` and rounded to the query's
  dtype exactly as the in-kernel rotation rounds it.

Its pure-PyTorch reference is :func:`~lazyattn_rag.kernels.reference.rotate` (float32); the tests
also compare the prefill reading these rows with the in-kernel rotation bit for bit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lazyattn_rag.kernels.block_table import DELTA_SHIFT
from lazyattn_rag.kernels.launch import block_runs, on_interpreter, rope_layout
from lazyattn_rag.kernels.triton_helpers import rotated_rows, rotation


@dataclass(frozen=True)
class QueryRotations:
    """Where each sequence's pre-rotated query rows go (:func:`plan_query_rotations`), valid for
    the block tables it was planned from (one step).

    Attributes:
        deltas: ``[num_seqs, max_deltas]`` int64: each sequence's distinct nonzero deltas, in
            block-table order (unused entries 0).
        num_deltas: ``[num_seqs]`` int32: how many of a sequence's entries are used.
        row_base: ``[num_seqs]`` int32: the first row of the sequence's rotated queries.
        num_rows: total rows (host int): ``sum(num_deltas[s] * query_len[s])``.
        run_rows: ``[num_seqs, max_runs]`` int32: for run ``r`` of sequence ``s``
            (:func:`~lazyattn_rag.kernels.launch.block_runs`' runs of the same tables), the first
            of its rotated rows, or -1 where the run reads the query as given (delta 0, or a
            sequence not rotated). The prefill kernel loads it with the run's number alone, so the
            rotated tile's address does not wait on the run's block-table word and a search of
            the deltas (a chain of dependent loads per run before its first product).
    """

    deltas: torch.Tensor
    num_deltas: torch.Tensor
    row_base: torch.Tensor
    num_rows: int
    run_rows: torch.Tensor

    def check(self, num_seqs: int, device: torch.device) -> None:
        """``ValueError`` unless the layout covers ``num_seqs`` sequences on ``device`` (what
        :func:`~lazyattn_rag.kernels.prefill.paged_prefill` can check without reading the GPU)."""
        if self.deltas.shape[0] != num_seqs or self.deltas.device != device:
            raise ValueError(f"query_rotations covers {self.deltas.shape[0]} sequences on {self.deltas.device}; "
                             f"the block tables have {num_seqs} on {device}")


def plan_query_rotations(block_tables: torch.Tensor, num_blocks_per_seq: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         device: torch.device | str, seqs: list[int] | None = None, *,
                         block_size: int) -> QueryRotations:
    """The layout of the sequences' rotated query rows, from host copies of the step's tables.

    Args:
        block_tables: ``[num_seqs, max_blocks]`` int64 packed words, on the CPU.
        num_blocks_per_seq: ``[num_seqs]`` used entries per row, on the CPU (entries past them
            may be counted too if they hold delta 0: the runs before them are the same).
        cu_seqlens_q: ``[num_seqs + 1]`` new-token offsets, on the CPU.
        device: where the layout's tensors go (the kernels' device).
        seqs: the sequences whose rows are rotated (the ones the prefill runs); ``None``: all.
        block_size: slots per block (the runs split after a partly filled block).

    Raises:
        ValueError: a table on another device than the CPU (reading it would wait for the GPU).
    """
    for name, t in (("block_tables", block_tables), ("num_blocks_per_seq", num_blocks_per_seq),
                    ("cu_seqlens_q", cu_seqlens_q)):
        if t.device.type != "cpu":
            raise ValueError(f"plan_query_rotations reads {name} on the host; got a tensor on {t.device}")
    query_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    chosen = set(range(len(query_lens)) if seqs is None else seqs)
    rows = (block_tables >> DELTA_SHIFT).tolist()  # every word's delta, one conversion
    per_seq = [[d for d in dict.fromkeys(row[:n]) if d != 0] if s in chosen else []  # distinct, table order
               for s, (row, n) in enumerate(zip(rows, num_blocks_per_seq.tolist()))]
    width = max(1, max(map(len, per_seq), default=0))
    bases = [0, *itertools.accumulate(len(d) * q for d, q in zip(per_seq, query_lens))]
    runs = block_runs(block_tables, num_blocks_per_seq, block_size)  # the kernel's runs of the same tables
    run_rows = []
    for s, (row, starts, n) in enumerate(zip(rows, runs.starts.tolist(), runs.num_runs.tolist())):
        where = {d: bases[s] + k * query_lens[s] for k, d in enumerate(per_seq[s])}
        run_rows.append([where.get(row[start], -1) for start in starts[:n]])
    runs_width = max(1, max(map(len, run_rows), default=0))
    return QueryRotations(torch.tensor([d + [0] * (width - len(d)) for d in per_seq], dtype=torch.int64).to(device),
                          torch.tensor([len(d) for d in per_seq], dtype=torch.int32).to(device),
                          torch.tensor(bases[:-1], dtype=torch.int32).to(device), bases[-1],
                          torch.tensor([r + [-1] * (runs_width - len(r)) for r in run_rows], dtype=torch.int32).to(device))


@triton.jit
def rotate_queries_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    out_ptr,  # [num_rows, num_heads, head_dim] the rotated rows (QueryRotations' layout)
    deltas_ptr,  # [num_seqs, max_deltas] int64
    num_deltas_ptr,  # [num_seqs] int32
    row_base_ptr,  # [num_seqs] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    inv_freq_ptr,  # [HALF] float32
    stride_qt, stride_qh,  # query strides (tokens, heads); head_dim contiguous
    stride_ot, stride_oh,  # out strides (rows, heads)
    stride_dr,  # deltas row stride
    max_deltas,  # int: deltas' row width
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PAIR_STRIDE: tl.constexpr, X2_OFF: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    ACCURATE_TRIG: tl.constexpr,  # libdevice cos/sin (GPU); tl.cos/tl.sin under the interpreter
):
    """One program: ``BLOCK_M`` new tokens of one sequence, one of its deltas, one query head."""
    seq = tl.program_id(0) // max_deltas
    k = tl.program_id(0) % max_deltas
    head = tl.program_id(2)
    if k >= tl.load(num_deltas_ptr + seq):
        return
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < q_len
    delta = tl.load(deltas_ptr + seq.to(tl.int64) * stride_dr + k)
    cos, sin, partner = rotation(-delta, inv_freq_ptr, HEAD_DIM, HALF, PAIR_STRIDE, X2_OFF, ACCURATE_TRIG)
    q_rows = (q_start + offs_m).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M]
    qr = rotated_rows(q_ptr + q_rows, row_ok, cos, sin, partner, HEAD_DIM)  # [BLOCK_M, HEAD_DIM] float32
    o_rows = (tl.load(row_base_ptr + seq) + k * q_len + offs_m).to(tl.int64) * stride_ot + head * stride_oh
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], qr.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def rotate_queries(query: torch.Tensor, rotations: QueryRotations, cu_seqlens_q: torch.Tensor,
                   max_query_len: int, inv_freq: torch.Tensor, interleaved: bool = False,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Every sequence's new-token queries rotated by ``-delta`` for each of its nonzero deltas.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` rotated at global positions (float32 or half).
        rotations: the layout (:func:`plan_query_rotations`).
        cu_seqlens_q: ``[num_seqs + 1]`` int32 on the query's device; ``max_query_len`` its widest gap.
        inv_freq: ``[rotary_dim // 2]`` float32 on the query's device.
        out: ``[rotations.num_rows, num_heads, head_dim]`` of the query's dtype (allocated when not given).

    Returns:
        the rotated rows (``QueryRotations``' layout).
    Raises:
        NotImplementedError: a head layout the kernels do not cover (:func:`rope_layout`).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    layout = rope_layout(head_dim, 2 * inv_freq.numel(), interleaved)
    if out is None:
        out = torch.empty(rotations.num_rows, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if rotations.num_rows == 0 or max_query_len == 0:
        return out
    interpreter = on_interpreter(query)
    block_m = 16 if interpreter else 64
    max_deltas = rotations.deltas.shape[1]
    grid = (rotations.deltas.shape[0] * max_deltas, triton.cdiv(max_query_len, block_m), num_heads)
    rotate_queries_kernel[grid](
        query, out, rotations.deltas, rotations.num_deltas, rotations.row_base, cu_seqlens_q,
        inv_freq.to(torch.float32).contiguous(),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), rotations.deltas.stride(0), max_deltas,
        HEAD_DIM=head_dim, HALF=layout.half, PAIR_STRIDE=layout.pair_stride, X2_OFF=layout.x2_offset,
        BLOCK_M=block_m, ACCURATE_TRIG=not interpreter, num_warps=4,
    )
    return out
