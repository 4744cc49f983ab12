"""Eviction policies of the chunk cache: which unpinned chunk to drop when blocks run out.

A policy only orders keys; the chunk cache tells it about inserts, hits, removals and
which entries are evictable (unpinned and ready), and asks for a victim.

* ``lru``: least recently used first.
* ``lfu``: LFU with dynamic aging (Arlitt et al., "Evaluating content management
  techniques for Web proxy caches", 2000): priority ``L + frequency``, where ``L`` is the
  priority of the last victim. Aging lets a once-popular chunk leave after its popularity
  fades; frequency keeps a Zipf-popular working set through bursts of one-off documents.
* ``gdsf``: Greedy-Dual-Size-Frequency (same paper): priority ``L + frequency * cost / size``
  with ``cost`` the chunk's tokens (what a miss recomputes) and ``size`` its blocks (what it
  occupies), so among equally popular chunks, small ones that are costly per block stay.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict

EVICTION_POLICIES = ("lru", "lfu", "gdsf")


class EvictionPolicy(ABC):
    """Orders cached chunks for eviction. Keys are the chunk cache's content keys."""

    name = "abstract"

    @abstractmethod
    def on_insert(self, key: str, num_tokens: int, num_blocks: int) -> None:
        """A new entry (counts as one access)."""

    @abstractmethod
    def on_hit(self, key: str) -> None:
        """An existing entry was used by a request."""

    @abstractmethod
    def on_remove(self, key: str, evicted: bool) -> None:
        """The entry left the cache: ``evicted`` by the policy's choice, or dropped (dead)."""

    @abstractmethod
    def set_evictable(self, key: str, evictable: bool) -> None:
        """Pinned or pending entries are not evictable; unpinned ready ones are."""

    @abstractmethod
    def victim(self) -> str | None:
        """The next evictable key to drop (not removed until :meth:`on_remove`), or ``None``."""

    @abstractmethod
    def eviction_order(self) -> list[str]:
        """All evictable keys, next victim first (for tests and introspection)."""


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self):
        self._order: OrderedDict[str, bool] = OrderedDict()  # key -> evictable, oldest first

    def on_insert(self, key, num_tokens, num_blocks):
        self._order[key] = False

    def on_hit(self, key):
        self._order.move_to_end(key)

    def on_remove(self, key, evicted):
        self._order.pop(key, None)

    def set_evictable(self, key, evictable):
        self._order[key] = evictable

    def victim(self):
        return next((k for k, ok in self._order.items() if ok), None)

    def eviction_order(self):
        return [k for k, ok in self._order.items() if ok]


class PriorityPolicy(EvictionPolicy):
    """Lowest priority first; ties broken by least recent access. Subclasses define
    :meth:`_priority` (of a key, from ``_freq``, ``_size`` and ``_inflation``).

    A lazy-deletion heap: a re-prioritized, pinned or removed key leaves its old heap entry
    behind, skipped when it surfaces. Once stale entries outnumber live (evictable) ones by
    ``_MAX_STALE_RATIO`` (and at least ``_MIN_REBUILD`` entries are held), the heap is rebuilt
    from the live entries alone, so it holds at most about ``_MAX_STALE_RATIO + 1`` entries per
    evictable key (amortized O(1) extra work per push).
    """

    _MAX_STALE_RATIO = 2
    _MIN_REBUILD = 64

    def __init__(self):
        self._inflation = 0.0  # L: priority of the last victim
        self._freq: dict[str, int] = {}
        self._size: dict[str, tuple[int, int]] = {}
        self._prio: dict[str, tuple[float, int]] = {}
        self._evictable: set[str] = set()
        self._heap: list[tuple[float, int, str]] = []
        self._tick = itertools.count()

    def _priority(self, key: str) -> float:
        raise NotImplementedError

    def _refresh(self, key: str) -> None:
        entry = (self._priority(key), next(self._tick))
        self._prio[key] = entry
        if key in self._evictable:
            self._push(key)

    def _push(self, key: str) -> None:
        p, t = self._prio[key]
        heapq.heappush(self._heap, (p, t, key))
        if len(self._heap) > max(self._MIN_REBUILD, (self._MAX_STALE_RATIO + 1) * len(self._evictable)):
            self._heap = [(*self._prio[k], k) for k in self._evictable]
            heapq.heapify(self._heap)

    @property
    def heap_size(self) -> int:
        """Entries the heap holds, stale ones included (bounded; see the class docstring)."""
        return len(self._heap)

    def on_insert(self, key, num_tokens, num_blocks):
        self._freq[key] = 1
        self._size[key] = (num_tokens, max(num_blocks, 1))
        self._refresh(key)

    def on_hit(self, key):
        self._freq[key] += 1
        self._refresh(key)

    def on_remove(self, key, evicted):
        if evicted and key in self._prio:
            self._inflation = max(self._inflation, self._prio[key][0])
        for d in (self._freq, self._size, self._prio):
            d.pop(key, None)
        self._evictable.discard(key)

    def set_evictable(self, key, evictable):
        if evictable and key not in self._evictable:
            self._evictable.add(key)
            self._push(key)
        elif not evictable:
            self._evictable.discard(key)

    def victim(self):
        while self._heap:
            p, t, key = self._heap[0]
            if key in self._evictable and self._prio.get(key) == (p, t):
                return key
            heapq.heappop(self._heap)  # stale: re-prioritized, pinned or removed
        return None

    def eviction_order(self):
        return [k for _, _, k in sorted((self._prio[k][0], self._prio[k][1], k) for k in self._evictable)]


class LFUAgingPolicy(PriorityPolicy):
    name = "lfu"

    def _priority(self, key):
        return self._inflation + self._freq[key]


class GDSFPolicy(PriorityPolicy):
    name = "gdsf"

    def _priority(self, key):
        tokens, blocks = self._size[key]
        return self._inflation + self._freq[key] * tokens / blocks


def make_policy(name: str) -> EvictionPolicy:
    """``lru``, ``lfu`` or ``gdsf``. Raises ``ValueError`` for other names."""
    policies = {"lru": LRUPolicy, "lfu": LFUAgingPolicy, "gdsf": GDSFPolicy}
    if name not in policies:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(EVICTION_POLICIES)}")
    return policies[name]()
