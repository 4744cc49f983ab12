"""Block-table entries before packing: which block, moved by which RoPE offset, with how many valid slots.

The scheduler describes each request's context and each job's blocks with these; the runner's
input preparation (``engine/worker/input_prep.py``) packs them into the kernels' 64-bit words
(``kernels/block_table.py``).
"""

from __future__ import annotations

from typing import NamedTuple


class BlockEntry(NamedTuple):
    """One block-table entry before packing: a physical block, the RoPE offset ``delta`` of the
    chunk that owns it (``g - l``; 0 for a request's private blocks), its valid slots, and whether
    the request reads it with chunk attention scaling (APE: a document block, ``PromptPlan.chunk_scaling``)."""

    block_id: int
    delta: int
    num_valid: int
    scaled: bool = False


class SelectedQuery(NamedTuple):
    """One document token a request recomputes (selective recompute): its id and position, and
    where its K/V go: slot ``slot`` of the request's copy ``block_id`` of the chunk's block, which
    is context entry ``entry_index`` (``num_keys_before`` valid keys precede that entry). It
    attends to the entries before its block and the block's slots up to its own."""

    token_id: int
    position: int
    entry_index: int
    num_keys_before: int
    block_id: int
    slot: int


def block_table_entries(block_ids: list[int], num_tokens: int, delta: int, block_size: int,
                        scaled: bool = False, num_scaled_blocks: int = 0) -> list[BlockEntry]:
    """The entries of ``num_tokens`` tokens laid out from the first block's slot 0, all with
    ``delta``; ``scaled`` on the first ``num_scaled_blocks`` (0: on all of them); blocks past the
    last token are left out."""
    return [BlockEntry(b, delta, min(block_size, num_tokens - i * block_size),
                       scaled and (not num_scaled_blocks or i < num_scaled_blocks))
            for i, b in enumerate(block_ids) if num_tokens > i * block_size]
