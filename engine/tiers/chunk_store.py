"""Storage tiers below the KV pool: content key -> a chunk's encoded K/V, within a byte budget.

Each tier stores the bytes of :func:`~lazyattn_rag.engine.tiers.chunk_format.encode_chunk` under the
chunk's content key, keeps within its own ``capacity_bytes`` by evicting in the order of an
engine eviction policy (``engine/kv/eviction.py``), and counts what happened (:class:`StoreStats`).
Storage is separate from policy, as in the chunk cache. A tier never interprets the bytes:
the caller decodes them (which checks format, key, model and checksum) and calls
:meth:`ChunkStore.discard` for a payload that fails, so it is counted and never served again.

Every tier, in-process or shared (``engine/tiers/redis_store.py``), offers the :class:`Tier` protocol:
``get``, ``put``, ``discard``, ``delete``, ``in``, ``keys``, ``clear``, ``close``, ``stats``,
``available``, ``num_bytes``, ``capacity_bytes`` (``None`` where the server keeps the budget).

* :class:`HostMemoryStore`: chunks in this process's memory; the engine keeps their K/V there
  as they are, in the pages of a preallocated arena (``engine/tiers/host_arena.py``), not as bytes.
* ``DiskStore`` (``engine/tiers/disk_store.py``): one file per chunk under a directory. Writes are atomic (a temporary
  name in the same directory, flushed and fsynced, then renamed over the final name), so a
  reader, in this process or another, sees a whole old file or a whole new one, and two
  writers of one key leave one whole file. A store opened on an existing directory indexes
  the files there (oldest first), so a restarted process finds what the last one stored; a
  key it has not indexed is looked for on disk (another process may have written it since),
  and before each write it re-reads the directory, so processes sharing it keep one budget.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from lazyattn_rag.engine.tiers.chunk_format import ChunkKV
from lazyattn_rag.engine.tiers.host_arena import HostArena, HostChunk, store_in_arena
from lazyattn_rag.engine.kv.eviction import EvictionPolicy, LRUPolicy

SUFFIX = ".lakv"


@dataclass
class StoreStats:
    """What a tier did since it was opened (bytes are encoded chunk sizes)."""

    num_hits: int = 0
    num_misses: int = 0
    num_puts: int = 0
    num_evictions: int = 0
    num_errors: int = 0  # unreadable or corrupt payloads (each discarded), failed writes
    num_bytes_read: int = 0
    num_bytes_written: int = 0
    num_outages: int = 0  # times a server tier became unreachable (always 0 in-process)
    num_too_large: int = 0  # chunks refused because one alone exceeds the tier's budget


class Tier(Protocol):
    """What the engine needs of a storage tier (see the module docstring).

    ``get`` returns ``None`` on a miss and also when the tier cannot answer (a server down:
    ``available`` is then false and the outage is counted in ``stats``); ``put`` returns
    whether the bytes were stored. Neither raises for a tier's own failures.
    """

    name: str
    stats: StoreStats
    capacity_bytes: int | None

    @property
    def available(self) -> bool: ...
    @property
    def num_bytes(self) -> int: ...
    def __contains__(self, key: str) -> bool: ...
    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, data: bytes) -> bool: ...
    def discard(self, key: str) -> None: ...
    def delete(self, key: str) -> None: ...
    def keys(self) -> list[str]: ...
    def clear(self) -> int: ...
    def close(self) -> None: ...


class ChunkStore(ABC):
    """One tier: content key -> encoded chunk bytes, at most ``capacity_bytes`` in all.

    Args:
        capacity_bytes: the tier's budget; storing past it evicts in ``policy``'s order.
        policy: eviction order (default LRU); every stored key is evictable.
    """

    name = "abstract"

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy | None = None):
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.policy = policy or LRUPolicy()
        self.stats = StoreStats()
        self._sizes: dict[str, int] = {}
        self.num_bytes = 0
        self.available = True  # an in-process tier always answers
        self._lock = threading.RLock()  # the engine thread reads while the tiers' writer writes

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes or self._adopt(key)

    def __len__(self) -> int:
        return len(self._sizes)

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key`` (a hit for the policy), or ``None`` (a miss; also when
        the tier could not read them, which is counted as an error and forgets the key)."""
        with self._lock:
            if key not in self._sizes and not self._adopt(key):
                self.stats.num_misses += 1
                return None
        try:
            data = self._read(key)  # outside the lock: a disk read may take a while
        except KeyError:  # evicted since (in-process tiers): a plain miss
            with self._lock:
                self.stats.num_misses += 1
            return None
        except OSError:
            with self._lock:
                if key in self._sizes:  # else it was evicted or replaced meanwhile: a plain miss
                    self._remove(key)
                    self._forget(key, evicted=False)
                    self.stats.num_errors += 1
                self.stats.num_misses += 1
            return None
        with self._lock:
            if key in self._sizes:
                self.policy.on_hit(key)
            self.stats.num_hits += 1
            self.stats.num_bytes_read += self._size_of(data)
        return data

    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` (replacing what was there), evicting others to make room.

        Thread-safe: the payload is staged (a disk tier writes and fsyncs a temporary file)
        outside the store's lock, then committed (renamed) under it.

        Returns:
            ``False`` when ``data`` alone exceeds the capacity or the write failed (counted as an
            error); nothing is stored then.
        """
        size = self._size_of(data)
        if size > self.capacity_bytes:
            with self._lock:
                self.stats.num_too_large += 1
            return False
        try:
            staged = self._stage(key, data)
        except OSError:
            with self._lock:
                self.stats.num_errors += 1
            return False
        with self._lock:
            self._refresh()
            if key in self._sizes:
                self._forget(key, evicted=False)
            self._make_room(size)
            try:
                self._commit(key, staged)
            except OSError:
                self._remove(key)  # neither a partial nor the replaced payload stays behind untracked
                self.stats.num_errors += 1
                return False
            self._record(key, size)
            self.stats.num_puts += 1
            self.stats.num_bytes_written += size
        return True

    def discard(self, key: str) -> None:
        """Drop a payload the caller found corrupt (or the tier could not read): counted as an
        error; a later :meth:`get` misses."""
        with self._lock:
            self.delete(key)
            self.stats.num_errors += 1

    def delete(self, key: str) -> None:
        """Drop ``key`` if stored (e.g. ``lazyattn cache clear``)."""
        with self._lock:
            if key in self._sizes or self._adopt(key):
                self._remove(key)
                self._forget(key, evicted=False)

    def keys(self) -> list[str]:
        """The keys stored now."""
        with self._lock:
            return list(self._sizes)

    def clear(self) -> int:
        """Drop every stored chunk; returns how many."""
        keys = self.keys()
        for key in keys:
            self.delete(key)
        return len(keys)

    def close(self) -> None:
        """Nothing to release for an in-process tier (a server tier closes its connections)."""

    def _forget(self, key: str, evicted: bool) -> None:
        self.num_bytes -= self._sizes.pop(key)
        self.policy.on_remove(key, evicted)

    def _make_room(self, num_bytes: int) -> None:
        """Evict in the policy's order until ``num_bytes`` more fit the capacity."""
        while self.num_bytes + num_bytes > self.capacity_bytes:
            victim = self.policy.victim()
            self._remove(victim)
            self._forget(victim, evicted=True)
            self.stats.num_evictions += 1

    def _record(self, key: str, size: int) -> None:
        """Count ``key``'s ``size`` stored bytes (a write, or a file found at start-up)."""
        self._sizes[key] = size
        self.num_bytes += size
        self.policy.on_insert(key, 1, 1)
        self.policy.set_evictable(key, True)

    @abstractmethod
    def _read(self, key: str) -> bytes: ...

    def _adopt(self, key: str) -> bool:
        """Whether ``key``, not in the index, is stored all the same (written by another process
        sharing the storage); if so it is indexed now. In-process tiers: never."""
        return False

    def _refresh(self) -> None:
        """Bring the index in line with what the storage holds (others' writes and deletions),
        before room is made for a write, so a shared budget holds for all its writers."""

    @staticmethod
    def _size_of(data) -> int:
        """Bytes a stored value takes (its length; the host tier stores K/V tensors)."""
        return len(data)

    def _stage(self, key: str, data: bytes):
        """Prepare ``data`` for :meth:`_commit` (outside the lock); raises ``OSError``."""
        return data

    @abstractmethod
    def _commit(self, key: str, staged) -> None:
        """Make the staged payload the one under ``key`` (under the lock); raises ``OSError``."""

    @abstractmethod
    def _remove(self, key: str) -> None: ...


class HostMemoryStore(ChunkStore):
    """Chunks in this process's memory (gone with it).

    Args:
        capacity_bytes: the budget (with ``arena``, the arena's size).
        policy: the eviction order.
        arena: where :meth:`put_kv` keeps K/V tensors as they are
            (:class:`~lazyattn_rag.engine.tiers.host_arena.HostChunk`, a value's size is its pages);
            without one, only encoded bytes can be stored (:meth:`put`).
    """

    name = "host"

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy | None = None, arena: HostArena | None = None):
        super().__init__(arena.capacity_bytes if arena is not None else capacity_bytes, policy)
        self.arena = arena
        self._data: dict[str, HostChunk | bytes] = {}

    def put_kv(self, chunk: ChunkKV, gathered=None) -> bool:
        """Store ``chunk``'s K/V (on the pool's device; ``gathered``: the event after which they
        may be read, from :func:`~lazyattn_rag.engine.tiers.host_arena.gather_event`) in the arena,
        evicting others to make room; the copy runs outside the store's lock. One writer at a
        time (the tiers' writer thread).

        Returns:
            ``False`` when it cannot fit, or its pages are still being read out (counted as an
            error); nothing is stored then.
        Raises:
            ValueError: the store has no arena.
        """
        if self.arena is None:
            raise ValueError("this host store has no arena for K/V tensors; store encoded bytes with put()")
        need = 2 * self.arena.pages_for(chunk.num_bytes // 2) * self.arena.page_bytes
        if need > self.capacity_bytes:
            with self._lock:
                self.stats.num_too_large += 1
            return False
        with self._lock:
            self.delete(chunk.key)
            self._make_room(need)
        value = store_in_arena(self.arena, chunk, gathered)
        if value is None:  # freed pages a load is still copying from come back when it ends
            with self._lock:
                self.stats.num_errors += 1
            return False
        return self.put(chunk.key, value)

    def lease(self, key: str) -> HostChunk | bytes | None:
        """:meth:`get` for a load: a :class:`HostChunk`'s pages are held (taken under the store's
        lock, so an eviction in between cannot reuse them) until its ``load(leased=True)`` ends,
        or :meth:`HostChunk.arena.release` of its pages."""
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.stats.num_misses += 1
                return None
            self.policy.on_hit(key)
            self.stats.num_hits += 1
            self.stats.num_bytes_read += self._size_of(value)
            if isinstance(value, HostChunk):
                value.arena.acquire(value.pages)
            return value

    @staticmethod
    def _size_of(data: HostChunk | bytes) -> int:
        return data.num_bytes if isinstance(data, HostChunk) else len(data)

    def _read(self, key: str) -> HostChunk | bytes:
        return self._data[key]

    def _stage(self, key: str, data: HostChunk | bytes) -> HostChunk | bytes:
        return data

    def _commit(self, key: str, staged: HostChunk | bytes) -> None:
        self._remove(key)  # a replaced chunk's pages go back
        self._data[key] = staged

    def _remove(self, key: str) -> None:
        value = self._data.pop(key, None)
        if isinstance(value, HostChunk):
            value.release()
