"""The chunk cache: policy over the block pool (keys -> blocks, pinning, eviction).

A *chunk* is a token sequence encoded alone (a document, the prompt head, an anchor)
whose K/V blocks are stored once, position-agnostic, and shared by every request that
places it, at any offset. The cache maps a content key (see
:mod:`lazyattn_rag.fingerprint`) to its blocks and maps document ids to their current
key.

Locking contract:
    * The cache holds one pool reference on each block of every entry.
    * A request that will read an entry pins it (:meth:`pin`) and unpins it when it
      finishes; pinned entries are never evicted or dropped.
    * Rebinding a document id to a new key (its text changed) or removing it marks the old
      entry dead once no other document id uses that key; a dead entry is dropped as soon
      as it is unpinned and is never returned by :meth:`lookup`.
    * :meth:`allocate` evicts unpinned entries, least recently used first, until the pool
      can serve the request; a freed block's key is cleared before reuse (the entry is
      removed from the key map before its blocks return to the pool).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from lazyattn_rag.engine.block_pool import BlockPool, NoFreeBlocksError


@dataclass
class ChunkEntry:
    """One cached chunk.

    Attributes:
        key: content key (hex sha256).
        block_ids: physical blocks, in order; the last may be partly filled.
        num_tokens: tokens stored (valid slots over all blocks).
        local_start: position of the chunk's first token when it was encoded (``l``).
        pin_count: requests currently reading the entry.
        dead: no document id refers to it any more; dropped when unpinned.
    """

    key: str
    block_ids: list[int]
    num_tokens: int
    local_start: int
    pin_count: int = 0
    dead: bool = False
    doc_ids: set[str] = field(default_factory=set)


class ChunkCache:
    """Content-keyed chunk entries over a :class:`BlockPool` with LRU eviction.

    Args:
        pool: the block pool the entries' blocks come from.
        block_size: slots per block.
    """

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self._entries: dict[str, ChunkEntry] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # unpinned live entries, oldest first
        self._doc_keys: dict[str, str] = {}
        self.num_evictions = 0

    # --- lookup and insertion -------------------------------------------------------------
    def lookup(self, key: str) -> ChunkEntry | None:
        """The live entry for ``key`` (marked most recently used), or ``None``."""
        entry = self._entries.get(key)
        if entry is None or entry.dead:
            return None
        if key in self._lru:
            self._lru.move_to_end(key)
        return entry

    def insert(self, key: str, block_ids: list[int], num_tokens: int, local_start: int) -> ChunkEntry:
        """Add an entry; the cache takes over the caller's one reference on each block.

        Raises:
            KeyError: ``key`` is already cached.
            ValueError: the blocks cannot hold ``num_tokens`` in whole blocks.
        """
        if key in self._entries:
            raise KeyError(f"chunk {key[:12]} is already cached")
        if len(block_ids) != -(-num_tokens // self.block_size):
            raise ValueError(f"{num_tokens} tokens need {-(-num_tokens // self.block_size)} blocks, got {len(block_ids)}")
        entry = ChunkEntry(key, list(block_ids), num_tokens, local_start)
        self._entries[key] = entry
        self._lru[key] = None
        return entry

    # --- pinning --------------------------------------------------------------------------
    def pin(self, key: str) -> ChunkEntry:
        """Pin a live entry (not evictable until unpinned). Raises ``KeyError`` if absent or dead."""
        entry = self._entries.get(key)
        if entry is None or entry.dead:
            raise KeyError(f"chunk {key[:12]} is not cached")
        entry.pin_count += 1
        self._lru.pop(key, None)
        return entry

    def unpin(self, key: str) -> None:
        entry = self._entries[key]
        if entry.pin_count <= 0:
            raise RuntimeError(f"unpin of unpinned chunk {key[:12]}")
        entry.pin_count -= 1
        if entry.pin_count == 0:
            if entry.dead:
                self._drop(entry)
            else:
                self._lru[key] = None

    # --- document ids ---------------------------------------------------------------------
    def document_key(self, doc_id: str) -> str | None:
        return self._doc_keys.get(doc_id)

    def bind_document(self, doc_id: str, key: str) -> None:
        """Point ``doc_id`` at ``key``; a previous key no other document uses becomes dead."""
        old = self._doc_keys.get(doc_id)
        if old == key:
            return
        self._doc_keys[doc_id] = key
        if old is not None:
            self._release_doc(doc_id, old)
        entry = self._entries.get(key)
        if entry is not None:
            entry.doc_ids.add(doc_id)

    def unbind_document(self, doc_id: str) -> None:
        """Forget ``doc_id``; its entry becomes dead if no other document uses it.

        Raises:
            KeyError: unknown document id.
        """
        key = self._doc_keys.pop(doc_id)
        self._release_doc(doc_id, key)

    def attach_documents(self, entry: ChunkEntry) -> None:
        """Record which bound document ids point at a freshly inserted entry."""
        entry.doc_ids.update(d for d, k in self._doc_keys.items() if k == entry.key)

    def _release_doc(self, doc_id: str, key: str) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.doc_ids.discard(doc_id)
        if entry.doc_ids:
            return
        entry.dead = True
        self._lru.pop(key, None)
        if entry.pin_count == 0:
            self._drop(entry)

    # --- allocation and eviction ----------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Allocate blocks from the pool, evicting unpinned entries (LRU first) if needed.

        Raises:
            NoFreeBlocksError: even evicting every unpinned entry would not free enough.
        """
        evictable = sum(len(self._entries[k].block_ids) for k in self._lru)
        if self.pool.num_free + evictable < num_blocks:
            raise NoFreeBlocksError(
                f"need {num_blocks} KV blocks: {self.pool.num_free} free and {evictable} evictable of "
                f"{self.pool.num_blocks}; the rest are pinned by running requests"
            )
        while self.pool.num_free < num_blocks:
            self.evict(next(iter(self._lru)))
        return self.pool.allocate(num_blocks)

    def evict(self, key: str) -> None:
        """Drop an unpinned entry now. Raises ``RuntimeError`` if it is pinned."""
        entry = self._entries[key]
        if entry.pin_count:
            raise RuntimeError(f"cannot evict pinned chunk {key[:12]}")
        self.num_evictions += 1
        self._drop(entry)

    def _drop(self, entry: ChunkEntry) -> None:
        del self._entries[entry.key]
        self._lru.pop(entry.key, None)
        self.pool.decref(entry.block_ids)

    # --- introspection --------------------------------------------------------------------
    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(e.block_ids) for e in self._entries.values())

    def entries(self) -> list[ChunkEntry]:
        return list(self._entries.values())

    def lru_order(self) -> list[str]:
        """Keys of evictable entries, next victim first."""
        return list(self._lru)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` on any broken invariant of the cache or the pool."""
        self.pool.check_integrity()
        seen: set[int] = set()
        for key, e in self._entries.items():
            assert e.key == key
            assert (key in self._lru) == (e.pin_count == 0 and not e.dead), f"{key[:12]} LRU membership"
            assert not (e.dead and e.pin_count == 0), f"dead unpinned entry {key[:12]} not dropped"
            for b in e.block_ids:
                assert b not in seen, f"block {b} owned by two entries"
                assert self.pool.ref_count(b) >= 1, f"entry {key[:12]} holds free block {b}"
                seen.add(b)
        for k in self._lru:
            assert k in self._entries
