"""Attention metadata: the batch layout every layer's attention reads, built once per forward.

One forward pass runs a batch of *sequences*. Each sequence has ``query_len`` new tokens
(a chunk being encoded, a query being prefilled, or one decode token) and a key context of
``seq_len`` tokens described by a block table. Context keys are numbered ``0 .. seq_len-1``
in block-table order over valid slots; that index equals the key's global position (the
prompt plan is contiguous). The new tokens are the last ``query_len`` keys of their
sequence: their K/V are written to ``slot_mapping`` before attention, and new token ``i``
attends key ``j`` iff ``j <= seq_len - query_len + i``.

Each block-table entry is one packed int64 (``lazyattn_rag.kernels.block_table``):
block id, the RoPE offset ``delta`` of the chunk that owns the block, and valid slots. The
runner's input preparation (``engine/worker/input_prep.py``) packs them; this module only lays the
packed rows out as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from lazyattn_rag.kernels.block_table import DELTA_SHIFT


@dataclass
class SequenceInput:
    """One sequence of a forward batch, in plain Python (the runner's input).

    Attributes:
        token_ids: the ``query_len`` new token ids.
        positions: their global RoPE positions (``query_len`` ints).
        block_table: ``[num_blocks]`` int64 packed words (``kernels/block_table.py``: block id,
            delta, valid slots), in key order; covers the new tokens' blocks (``delta = 0``).
        seq_len: valid keys in ``block_table`` (the new tokens included).
        slot_mapping: flat slot (``block_id * block_size + offset``) per new token.
    """

    token_ids: list[int]
    positions: list[int]
    block_table: torch.Tensor
    seq_len: int
    slot_mapping: list[int]

    @property
    def query_len(self) -> int:
        return len(self.token_ids)


class SlotCopies(NamedTuple):
    """Cache slots a step copies in every layer after writing its new tokens' K/V and before
    attending (the cached tokens behind recomputed chunk heads, whose chunk may be written by the
    same pass)."""

    src: torch.Tensor  # [num_slots_copied] int64 flat source slots
    dst: torch.Tensor  # [num_slots_copied] int64 flat destination slots
    shift: Any  # PositionTables of each copied slot's delta (RotaryEmbedding.shifts)


@dataclass
class AttentionMetadata:
    """Batch layout shared by all layers of one forward pass.

    Attributes:
        block_size: slots per KV block.
        cu_seqlens_q: ``[num_seqs + 1]`` int32, start of each sequence's rows in the flat batch.
        seq_lens: ``[num_seqs]`` int32, valid context keys per sequence (new tokens included).
        num_blocks_per_seq: ``[num_seqs]`` int32, used entries of each block-table row.
        block_tables: ``[num_seqs, max_num_blocks]`` int64 packed words; entries past a row's
            ``num_blocks_per_seq`` are never read (0 here; a CUDA-graph step's static rows keep
            an earlier step's words there).
        slot_mapping: ``[num_tokens]`` int64, where each new token's K/V is written.
        max_query_len: largest ``query_len`` in the batch.
        max_seq_len: largest ``seq_len`` in the batch.
        query_lens, seq_lens_list: the same counts as Python lists (no device sync needed).
        any_delta: whether any block of the batch has a nonzero RoPE offset ``delta`` (a chunk
            placed away from its encoding position), known on the host; ``False`` lets a
            backend leave out its rotation code (the same result). ``True`` when not known.
        host_block_tables: ``block_tables`` as built on the host, or ``None`` (a CUDA-graph
            decode step plans on the device); read by a backend that plans from the deltas on
            the host (the triton backend's queries rotated beforehand).
        slot_copies: :class:`SlotCopies` each layer makes between its write and its attention
            (:meth:`AttentionBackend.copy_step_slots`), or ``None``.
        backend_state: per-backend derived data (e.g. gather indices), built lazily once.
    """

    block_size: int
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    num_blocks_per_seq: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens: list[int]
    seq_lens_list: list[int]
    any_delta: bool = True
    host_block_tables: torch.Tensor | None = None
    slot_copies: SlotCopies | None = None
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence has exactly one new token."""
        return self.max_query_len == 1


def check_sequence_input(index: int, seq: SequenceInput) -> None:
    """Check that ``seq`` (the ``index``-th of its batch) is self-consistent.

    Raises:
        ValueError: no new tokens, a position or slot list of the wrong length, a ``seq_len``
            below the number of new tokens, or an empty block table (the valid slots of the
            table's words are not summed here: the runner packs them from ``seq_len``).
    """
    if seq.block_table.numel() == 0:
        raise ValueError(f"sequence {index}: empty block table for {seq.query_len} new tokens")
    if seq.query_len == 0 or len(seq.positions) != seq.query_len or len(seq.slot_mapping) != seq.query_len:
        raise ValueError(f"sequence {index}: {seq.query_len} tokens, {len(seq.positions)} positions, "
                         f"{len(seq.slot_mapping)} slots")
    if seq.seq_len < seq.query_len:
        raise ValueError(f"sequence {index}: block table holds {seq.seq_len} keys < {seq.query_len} new tokens")


def build_attention_metadata(
    seqs: list[SequenceInput], block_size: int, device: torch.device | str
) -> AttentionMetadata:
    """Build :class:`AttentionMetadata` for a batch (the one builder every backend uses).

    Raises:
        ValueError: an empty batch, or a sequence that :func:`check_sequence_input` refuses.
    """
    if not seqs:
        raise ValueError("empty batch")
    query_lens, seq_lens, rows = [], [], []
    for i, s in enumerate(seqs):
        check_sequence_input(i, s)
        query_lens.append(s.query_len)
        seq_lens.append(s.seq_len)
        rows.append(s.block_table)
    max_blocks = max(r.numel() for r in rows)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int64)
    for i, r in enumerate(rows):
        block_tables[i, : r.numel()] = r
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    slots = [x for s in seqs for x in s.slot_mapping]
    return AttentionMetadata(
        block_size=block_size,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_blocks_per_seq=torch.tensor([r.numel() for r in rows], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens=query_lens,
        seq_lens_list=seq_lens,
        any_delta=bool((block_tables >> DELTA_SHIFT).any()),  # delta: the words' signed top bits
        host_block_tables=block_tables,
    )
