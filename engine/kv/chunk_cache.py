"""The chunk cache: policy over the block pool (keys -> blocks, pinning, eviction).

A *chunk* is a token sequence encoded alone (a document, the prompt head, an anchor)
whose K/V blocks are stored once, position-agnostic, and shared by every request that
places it, at any offset. The cache maps a content key (see
:mod:`lazyattn_rag.engine.planning.fingerprint`) to its blocks and counts, per key, the registered
documents that use it (the registry, ``engine/planning/registry.py``, knows which).

Locking contract:
    * The cache holds one pool reference on each block of every entry.
    * An entry is inserted *pending* (``ready=False``) when a request schedules its encode,
      and marked ready once the forward pass that writes it has run. Nobody reads a
      pending entry; a request that needs it pins it and waits.
    * A request that will read an entry pins it under its id (:meth:`pin`); the cache is the
      one record of its pins, dropped together when it finishes or is preempted
      (:meth:`release`); pinned or pending entries are never evicted or dropped.
    * When the last registered document using a key lets it go (its text changed or it was
      removed: :meth:`release_key`), the key's entry is dead; a dead entry is dropped as soon
      as it is unpinned. :meth:`lookup` hides it from new plans, but a request planned before
      the change may still find and pin it (``include_dead``): its content is the key's.
    * :meth:`allocate` evicts unpinned ready entries in the eviction policy's order until
      the pool can serve the request. An entry leaves the key map *before* its blocks
      return to the pool, so a reused block can never be found under its old key.

The file is a little over the project's 350 lines on purpose: these rules hold across
insertion, pinning, document references and eviction, and :meth:`ChunkCache.check_integrity`
checks them all, so they stay in one class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lazyattn_rag.engine.kv.block_pool import BlockPool, NoFreeBlocksError
from lazyattn_rag.engine.kv.eviction import EvictionPolicy, LRUPolicy


class ChunkKeyCollisionError(RuntimeError):
    """Two different token sequences reached one content key (a digest collision, or a key
    built without all of its content): the cached K/V is never served for the other one."""


@dataclass
class ChunkEntry:
    """One cached chunk.

    Attributes:
        key: content key (hex sha256).
        block_ids: physical blocks, in order; the last may be partly filled.
        num_tokens: tokens stored (valid slots over all blocks).
        local_start: position of the chunk's first token when it was encoded (``l``).
        ready: its K/V has been written.
        pin_count: pins held on it: requests' (the cache records each request's, see
            :meth:`ChunkCache.pins_of`) and anonymous ones (its writer, a copy's source, the anchor).
        dead: no registered document uses it any more (or it was purged); dropped when unpinned.
        token_ids: the tokens whose K/V the blocks hold (compared on every hit), or ``None``
            where the inserter did not give them.
    """

    key: str
    block_ids: list[int]
    num_tokens: int
    local_start: int
    ready: bool = False
    pin_count: int = 0
    dead: bool = False
    source_key: str | None = None  # block_attention mode: the document this is a positioned copy of
    listed_evictable: bool = False  # what the policy and the evictable count were last told
    token_ids: tuple[int, ...] | None = None
    exact_prefix: bool = False  # a block of a request's own prompt (prefix caching): read in place, never stored below

    def holds(self, token_ids: tuple[int, ...] | list[int]) -> bool:
        """Whether this entry holds exactly ``token_ids`` (a tuple comparison: cheap next to the
        attention it saves; an entry inserted without its tokens is taken at its key's word)."""
        return self.token_ids is None or self.token_ids == tuple(token_ids)

    def check_tokens(self, token_ids: tuple[int, ...] | list[int]) -> None:
        """Raise :class:`ChunkKeyCollisionError` unless this entry holds exactly ``token_ids``."""
        if not self.holds(token_ids):
            raise ChunkKeyCollisionError(
                f"chunk key {self.key[:12]} holds {len(self.token_ids)} other tokens than the "
                f"{len(token_ids)} requested; refusing to serve its K/V")

    @property
    def evictable(self) -> bool:
        return self.ready and self.pin_count == 0 and not self.dead


class ChunkCache:
    """Content-keyed chunk entries over a :class:`BlockPool`.

    Args:
        pool: the block pool the entries' blocks come from.
        block_size: slots per block.
        policy: eviction order (default :class:`~lazyattn_rag.engine.kv.eviction.LRUPolicy`).
    """

    def __init__(self, pool: BlockPool, block_size: int, policy: EvictionPolicy | None = None):
        self.pool = pool
        self.block_size = block_size
        self.policy = policy or LRUPolicy()
        self._entries: dict[str, ChunkEntry] = {}
        self._document_refs: dict[str, int] = {}  # key -> registered documents using it
        self._copies: dict[str, set[str]] = {}  # source key -> keys of its positioned copies
        self._held: dict[str, list[str]] = {}  # holder (a request id) -> keys it pinned, in order
        self._num_evictable_blocks = 0
        self.num_evictions = 0
        # Called with each entry evicted for room, before its blocks go back to the pool (their
        # K/V still intact): the engine's write-back to the host-memory tier.
        self.on_evict: Callable[[ChunkEntry], None] | None = None

    # --- lookup and insertion -------------------------------------------------------------
    def lookup(self, key: str, touch: bool = True, include_dead: bool = False) -> ChunkEntry | None:
        """The live entry for ``key`` (ready or pending), or ``None``; ``touch`` counts a hit.

        ``include_dead`` also returns a dead entry that requests still pin: its content is
        exactly ``key``'s, so a request planned before its document changed may still read it.
        """
        entry = self._entries.get(key)
        if entry is None or (entry.dead and not include_dead):
            return None
        if touch:
            self.policy.on_hit(key)
        return entry

    def held(self, key: str) -> ChunkEntry:
        """The entry a request pinned (live or dead). Raises ``KeyError`` if there is none."""
        return self._entries[key]

    def insert_pending(self, key: str, block_ids: list[int], num_tokens: int, local_start: int,
                       source_key: str | None = None, document: bool = False,
                       token_ids: tuple[int, ...] | None = None) -> ChunkEntry:
        """Add a pending entry (its encode is scheduled), pinned once for the encoder.

        The cache takes over the caller's one pool reference on each block. A ``document``
        chunk that no registered document uses any more (its document was removed or changed
        while the request waited) is born dead: it serves the requests that pin it, then goes.

        Raises:
            KeyError: ``key`` is already cached.
            ValueError: the blocks cannot hold ``num_tokens`` in whole blocks.
        """
        if key in self._entries:
            raise KeyError(f"chunk {key[:12]} is already cached")
        need = -(-num_tokens // self.block_size)
        if len(block_ids) != need:
            raise ValueError(f"{num_tokens} tokens need {need} blocks, got {len(block_ids)}")
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ValueError(f"{len(token_ids)} token ids for {num_tokens} tokens")
        entry = ChunkEntry(key, list(block_ids), num_tokens, local_start, pin_count=1, source_key=source_key,
                           token_ids=None if token_ids is None else tuple(token_ids))
        entry.dead = document and not self._document_refs.get(source_key or key)
        if source_key is not None:
            self._copies.setdefault(source_key, set()).add(key)
        self._entries[key] = entry
        self.policy.on_insert(key, num_tokens, len(block_ids))
        return entry

    def mark_ready(self, key: str) -> None:
        """The entry's K/V is written; it may now be read (and evicted once unpinned)."""
        entry = self._entries[key]
        entry.ready = True
        self._sync_evictable(entry)

    def insert(self, key: str, block_ids: list[int], num_tokens: int, local_start: int,
               token_ids: tuple[int, ...] | None = None, exact_prefix: bool = False) -> ChunkEntry:
        """Insert an already-written entry, unpinned (``insert_pending`` + ``mark_ready`` + ``unpin``);
        ``exact_prefix``: a block of a request's own prompt (see :attr:`ChunkEntry.exact_prefix`)."""
        entry = self.insert_pending(key, block_ids, num_tokens, local_start, token_ids=token_ids)
        entry.exact_prefix = exact_prefix
        self.mark_ready(key)
        self.unpin(key)
        return entry

    def discard_pending(self, key: str) -> None:
        """Drop a pending entry whose encode failed (its pins are void)."""
        entry = self._entries[key]
        if entry.ready:
            raise RuntimeError(f"chunk {key[:12]} is ready, not pending")
        for keys in self._held.values():
            while key in keys:
                keys.remove(key)
        entry.pin_count = 0
        self._drop(entry, evicted=False)

    def ready_copies(self, source_key: str) -> list[ChunkEntry]:
        """Live, written positioned copies of ``source_key`` (``block_attention`` mode)."""
        entries = (self._entries.get(k) for k in self._copies.get(source_key, ()))
        return [e for e in entries if e is not None and e.ready and not e.dead]

    # --- pinning --------------------------------------------------------------------------
    # A pin keeps an entry from eviction. Requests pin under their id (``holder``), and the cache
    # is the one record of what each holds (:meth:`pins_of`, :meth:`release`); a pending entry's
    # writer (its chunk prefill or copy), a copy's source and the anchor pin anonymously.
    def pin(self, key: str, allow_dead: bool = False, holder: str | None = None) -> ChunkEntry:
        """Pin a live entry (not evictable until unpinned), for ``holder`` if given;
        ``allow_dead`` also pins a dead one that is still held (see :meth:`lookup`).
        Raises ``KeyError`` if absent (or dead)."""
        entry = self._entries.get(key)
        if entry is None or (entry.dead and not allow_dead):
            raise KeyError(f"chunk {key[:12]} is not cached")
        entry.pin_count += 1
        if holder is not None:
            self._held.setdefault(holder, []).append(key)
        self._sync_evictable(entry)
        return entry

    def pins_of(self, holder: str) -> list[str]:
        """Keys ``holder`` has pinned, in the order it pinned them."""
        return list(self._held.get(holder, ()))

    def release(self, holder: str) -> None:
        """Drop every pin ``holder`` holds (a request that finished, failed or was preempted)."""
        for key in self._held.pop(holder, []):
            self.unpin(key)

    def unpin(self, key: str, holder: str | None = None) -> None:
        """Drop one pin (``holder``'s, if given). A dead entry goes with its last pin.

        Raises:
            KeyError: no such entry. RuntimeError: it is not pinned (or not by ``holder``).
        """
        entry = self._entries[key]
        if entry.pin_count <= 0:
            raise RuntimeError(f"unpin of unpinned chunk {key[:12]}")
        if holder is not None:
            keys = self._held.get(holder, [])
            if key not in keys:
                raise RuntimeError(f"chunk {key[:12]} is not pinned by {holder!r}")
            keys.remove(key)
        entry.pin_count -= 1
        if entry.pin_count == 0 and entry.dead:
            self._drop(entry, evicted=False)
        else:
            self._sync_evictable(entry)

    def _sync_evictable(self, entry: ChunkEntry) -> None:
        now = entry.evictable
        if entry.listed_evictable != now:
            self._num_evictable_blocks += len(entry.block_ids) if now else -len(entry.block_ids)
            entry.listed_evictable = now
            self.policy.set_evictable(entry.key, now)

    # --- document references (counted for the registry) -------------------------------------
    def num_document_refs(self, key: str) -> int:
        """Registered documents that use ``key``."""
        return self._document_refs.get(key, 0)

    def retain_key(self, key: str) -> None:
        """One more registered document uses ``key``. A dead entry under it (or a copy of it)
        still pinned by a running request (the text was changed or removed and is now
        registered again) is revived: it holds exactly this content, so it serves again."""
        self._document_refs[key] = self._document_refs.get(key, 0) + 1
        for entry in self._bound_entries(key):
            if entry.dead:
                entry.dead = False
                self._sync_evictable(entry)

    def release_key(self, key: str) -> None:
        """One registered document less uses ``key``; at none, its entry and copies are dead
        (dropped now where unpinned).

        Raises:
            KeyError: no registered document uses ``key``.
        """
        if key not in self._document_refs:
            raise KeyError(f"no registered document uses chunk {key[:12]}")
        self._document_refs[key] -= 1
        if self._document_refs[key]:
            return
        del self._document_refs[key]
        for entry in self._bound_entries(key):
            entry.dead = True
            self._sync_evictable(entry)
            if entry.pin_count == 0:
                self._drop(entry, evicted=False)

    def _bound_entries(self, key: str) -> list[ChunkEntry]:
        """The entry under ``key`` and its positioned copies."""
        keys = [key, *self._copies.get(key, ())]
        return [self._entries[k] for k in keys if k in self._entries]

    def purge(self, key: str) -> tuple[int, int]:
        """Drop the entry under ``key`` and its positioned copies, whatever registered documents
        still use them (a deleted document's K/V; the caller checked that no other document needs
        it): each unpinned one now, each pinned one when its last reader releases it (dead
        meanwhile: found by no new plan and, by the engine, never written to a storage tier).

        Returns:
            ``(blocks freed now, entries still read by running requests)``.
        """
        freed, in_use = 0, 0
        for entry in self._bound_entries(key):
            entry.dead = True
            self._sync_evictable(entry)
            if entry.pin_count == 0:
                freed += len(entry.block_ids)
                self._drop(entry, evicted=False)
            else:
                in_use += 1
        return freed, in_use

    def holds_key(self, key: str) -> bool:
        """Whether any entry (live or dead, or a positioned copy) holds ``key``'s K/V now."""
        return bool(self._bound_entries(key))

    # --- allocation and eviction ----------------------------------------------------------
    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether :meth:`allocate` would succeed (free plus evictable blocks suffice)."""
        return self.pool.num_free + self._num_evictable_blocks >= num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Allocate blocks from the pool, evicting in policy order if needed.

        Raises:
            NoFreeBlocksError: even evicting every evictable entry would not free enough
                (nothing is evicted then).
        """
        if not self.can_allocate(num_blocks):
            raise NoFreeBlocksError(
                f"need {num_blocks} KV blocks: {self.pool.num_free} free and {self._num_evictable_blocks} "
                f"evictable of {self.pool.num_blocks}; the rest are pinned by running requests"
            )
        while self.pool.num_free < num_blocks:
            victim = self.policy.victim()
            if victim is None:  # an evictable entry shared its blocks: a broken invariant, not a full cache
                raise RuntimeError(f"evictable block count {self._num_evictable_blocks} is not backed by victims")
            self.evict(victim)
        return self.pool.allocate(num_blocks)

    def evict(self, key: str) -> None:
        """Drop an evictable entry now. Raises ``RuntimeError`` if it is pinned or pending."""
        entry = self._entries[key]
        if not entry.evictable:
            raise RuntimeError(f"cannot evict chunk {key[:12]}: pinned or pending")
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(entry)
        self._drop(entry, evicted=True)

    def _drop(self, entry: ChunkEntry, evicted: bool) -> None:
        entry.pin_count = 0
        entry.dead = True  # not evictable any more: updates the evictable count
        self._sync_evictable(entry)
        del self._entries[entry.key]  # the key goes first, then the blocks
        if entry.source_key is not None:
            self._copies[entry.source_key].discard(entry.key)
            if not self._copies[entry.source_key]:
                del self._copies[entry.source_key]
        self.policy.on_remove(entry.key, evicted)
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

    def eviction_order(self) -> list[str]:
        """Keys of evictable entries, next victim first."""
        return self.policy.eviction_order()

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` on any broken invariant of the cache or the pool."""
        self.pool.check_integrity()
        seen: set[int] = set()
        evictable_blocks = 0
        held: dict[str, int] = {}
        for keys in self._held.values():
            for key in keys:
                held[key] = held.get(key, 0) + 1
        for key, n in held.items():
            assert key in self._entries and self._entries[key].pin_count >= n, \
                f"chunk {key[:12]} has {n} holder pins but a pin count of {getattr(self._entries.get(key), 'pin_count', 0)}"
        for key, e in self._entries.items():
            assert e.key == key
            assert not (e.dead and e.pin_count == 0), f"dead unpinned entry {key[:12]} not dropped"
            assert e.ready or e.pin_count > 0, f"pending entry {key[:12]} has no holder"
            evictable_blocks += len(e.block_ids) if e.evictable else 0
            for b in e.block_ids:
                assert b not in seen, f"block {b} owned by two entries"
                assert self.pool.ref_count(b) >= 1, f"entry {key[:12]} holds free block {b}"
                # evicting an evictable entry must free its blocks, or can_allocate over-counts room
                assert not e.evictable or self.pool.ref_count(b) == 1, f"evictable entry {key[:12]} shares block {b}"
                seen.add(b)
        assert evictable_blocks == self._num_evictable_blocks, "evictable block count drifted"
        assert all(n > 0 for n in self._document_refs.values()), "a key kept with no document using it"
        order = self.policy.eviction_order()
        assert sorted(order) == sorted(k for k, e in self._entries.items() if e.evictable), "policy disagrees"
