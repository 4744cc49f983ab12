"""The block pool: storage bookkeeping for physical KV blocks.

The pool owns reference counts and the free list, nothing else (which key a block
holds, pinning and eviction belong to :mod:`lazyattn_rag.engine.kv.chunk_cache`). Every
holder of a block (a cached chunk, a running request's private blocks) holds one
reference; a block returns to the free list when its count reaches zero.

Free blocks are handed out in FIFO order of their release, so allocation order is
deterministic and testable.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks for an allocation (after whatever eviction the caller tried)."""


class BlockPool:
    """Reference-counted physical block ids ``0 .. num_blocks - 1``.

    Args:
        num_blocks: total blocks (>= 1).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with reference count 1.

        Raises:
            NoFreeBlocksError: fewer than ``n`` are free (nothing is taken then).
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._ref_counts[b] = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Add one reference to each (already allocated) block."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self._ref_counts[b] += 1

    def decref(self, block_ids: list[int]) -> list[int]:
        """Drop one reference from each block; returns the blocks that became free."""
        freed = []
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"decref of free block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)
                freed.append(b)
        return freed

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """The free list in allocation order."""
        return list(self._free)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the free list and reference counts disagree."""
        free = list(self._free)
        free_set = set(free)
        assert len(free) == len(free_set), "a block is on the free list twice"
        for b in range(self.num_blocks):
            on_free = b in free_set
            assert (self._ref_counts[b] == 0) == on_free, f"block {b}: ref {self._ref_counts[b]}, free {on_free}"
