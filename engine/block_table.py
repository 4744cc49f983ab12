"""Block-table entries before packing: which block, moved by which RoPE offset, with how many valid slots.

The scheduler describes each request's context and each job's blocks with these; the runner's
input preparation (``engine/input_prep.py``) packs them into the kernels' 64-bit words
(``kernels/block_table.py``).
"""

from __future__ import annotations

from typing import NamedTuple


class BlockEntry(NamedTuple):
    """One block-table entry before packing: a physical block, the RoPE offset ``delta`` of the
    chunk that owns it (``g - l``; 0 for a request's private blocks) and its valid slots."""

    block_id: int
    delta: int
    num_valid: int


def block_table_entries(block_ids: list[int], num_tokens: int, delta: int, block_size: int) -> list[BlockEntry]:
    """The entries of ``num_tokens`` tokens laid out from the first block's slot 0, all with
    ``delta``; blocks past the last token are left out."""
    return [BlockEntry(b, delta, min(block_size, num_tokens - i * block_size))
            for i, b in enumerate(block_ids) if num_tokens > i * block_size]
