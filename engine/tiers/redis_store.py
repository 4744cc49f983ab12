"""A storage tier on a Redis server: encoded chunks shared by every engine process that reaches it.

:class:`RedisStore` offers the :class:`~lazyattn_rag.engine.tiers.chunk_store.Tier` protocol over a real
Redis server through redis-py. Each chunk is one Redis string value under ``key_prefix + key``,
stored whole: a Redis value may be up to 512 MB, and a 512-token chunk of an 8B model (32 layers,
8 K/V heads of 128, bfloat16, keys and values) is 64 MiB. Writes are a single ``SET`` (optionally
with ``EX``), which replaces the value atomically, so two processes writing one key leave one whole
value, never a mix; readers see a whole old value or a whole new one.

The budget is the server's: ``capacity_bytes`` is ``None``. Give the server a ``maxmemory`` and
``maxmemory-policy allkeys-lru`` (recommended; under the default ``noeviction`` a full server
refuses writes, which ``put`` reports as ``False`` and counts as an error). The tier never
interprets the bytes; the caller decodes them and calls :meth:`RedisStore.discard` for one that
fails (checksum, model, key, version), so it is deleted and counted.

Failures are answered, never raised: a server that is down, slow past ``socket_timeout_s`` or
restarted mid-run makes ``get`` miss, ``put`` return ``False``, ``in`` be false, and so on. A
connection failure or timeout marks the tier unavailable (``available`` false, one
``stats.num_outages`` per outage); for ``retry_after_s`` after that every call answers at once
without touching the network, so a dead server costs one timeout, not one per request. Then one
caller tries again (redis-py reconnects by itself) while the others keep answering misses; a
success marks the tier available again. Other server errors (an out-of-memory refusal, a wrong type
under our key) are counted as errors and leave the tier available.

Thread-safe: redis-py's connection pool hands each thread its own connection; this class's own
state (availability, the retry deadline, ``stats``) is guarded by a lock.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("the Redis tier needs redis-py: pip install 'lazyattn-rag[redis]'") from e

from lazyattn_rag.engine.tiers.chunk_store import StoreStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Failures of the connection itself: the server is gone, unreachable or too slow. They mark an outage.
_CONNECTION_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, TimeoutError, OSError)
_SCAN_BATCH = 1000  # keys asked of each SCAN step (a hint to the server, not a limit)


class _Unanswered(Exception):
    """Internal: the tier could not answer this call (down, in its retry pause, or closed)."""


def _redacted(url: str) -> str:
    """``url`` without a password, for messages."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def _glob_escape(text: str) -> str:
    """``text`` with Redis glob specials escaped, for a ``SCAN MATCH`` pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisStore:
    """Content key -> encoded chunk bytes on a Redis server (see the module docstring).

    Construction does not raise for a server that is not there: it tries one ``PING`` (at most
    ``socket_timeout_s``) and starts unavailable if that fails.

    Args:
        url: a redis-py URL, e.g. ``redis://127.0.0.1:6379/0`` (``rediss://`` for TLS, credentials
            in the URL). A malformed URL raises ``ValueError``.
        ttl_seconds: each value expires this long after it was written (``SET ... EX``); ``None``
            (default) keeps values until the server evicts or someone deletes them.
        socket_timeout_s: the longest one connect or one command may take before the server counts
            as down.
        retry_after_s: how long after an outage calls answer without trying the server.
        key_prefix: prepended to every content key; ``keys``, ``clear`` and ``num_bytes`` see only
            keys under it, so other data on the server is left alone.

    Raises:
        ValueError: a non-positive ``ttl_seconds`` or ``socket_timeout_s``, a negative
            ``retry_after_s``, an empty ``key_prefix`` or a malformed ``url``.
    """

    name = "redis"
    capacity_bytes: int | None = None  # the server's maxmemory keeps the budget

    def __init__(self, url: str, *, ttl_seconds: int | None = None, socket_timeout_s: float = 1.0,
                 retry_after_s: float = 2.0, key_prefix: str = "lazyattn:chunk:"):
        if ttl_seconds is not None and ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be >= 1 or None, got {ttl_seconds}")
        if not socket_timeout_s > 0:
            raise ValueError(f"socket_timeout_s must be > 0, got {socket_timeout_s}")
        if not retry_after_s >= 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        if not key_prefix:
            raise ValueError("key_prefix must not be empty (clear() would delete every key on the server)")
        self.url = url
        self.ttl_seconds = ttl_seconds
        self.socket_timeout_s = socket_timeout_s
        self.retry_after_s = retry_after_s
        self.key_prefix = key_prefix
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._available = True
        self._retry_at = 0.0  # time.monotonic() before which an unavailable tier does not try
        self._closed = False
        # No retries inside redis-py (its default since 6.0 is 3 with backoff): one failed attempt
        # is the outage, and the pause above decides when to try again.
        self._client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=False)
        try:
            self._call(lambda r: r.ping())
        except _Unanswered:
            pass  # counted as an outage; the tier starts unavailable

    # -- state ---------------------------------------------------------------------------------

    @property
    def location(self) -> str:
        """The server's URL without its password (for messages and ``lazyattn cache info``)."""
        return _redacted(self.url)

    @property
    def available(self) -> bool:
        """Whether the last attempt to reach the server succeeded (false during an outage or after
        :meth:`close`)."""
        with self._lock:
            return self._available and not self._closed

    def _call(self, command: Callable[[redis.Redis], T]) -> T:
        """Run ``command(client)`` unless the tier is pausing after an outage or closed.

        Raises:
            _Unanswered: the server was not tried (pause, closed) or failed; the failure is counted
                (an error, and for a connection failure or timeout an outage).
        """
        with self._lock:
            if self._closed:
                raise _Unanswered
            if not self._available:
                now = time.monotonic()
                if now < self._retry_at:
                    raise _Unanswered
                self._retry_at = now + self.retry_after_s  # this caller probes; the others keep waiting
        try:
            result = command(self._client)
        except _CONNECTION_ERRORS as e:
            with self._lock:
                self.stats.num_errors += 1
                if self._available:
                    self.stats.num_outages += 1
                    self._available = False
                    logger.warning("Redis tier %s unavailable (%s); serving without it, trying again every %.0f s",
                                   self.location, type(e).__name__, self.retry_after_s)
                self._retry_at = time.monotonic() + self.retry_after_s
            raise _Unanswered from e
        except redis.exceptions.RedisError as e:  # the server answered with an error: it is up
            with self._lock:
                self.stats.num_errors += 1
                self._available = True
            raise _Unanswered from e
        with self._lock:
            self._available = True
        return result

    def _count(self, **increments: int) -> None:
        with self._lock:
            for field, n in increments.items():
                setattr(self.stats, field, getattr(self.stats, field) + n)

    # -- the Tier protocol ---------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or ``None``: a miss, which includes a server that is
        down, slow or pausing after an outage (counted in ``stats.num_misses``; the failure itself
        also in ``num_errors``/``num_outages``). Never raises for the server's failures."""
        try:
            data = self._call(lambda r: r.get(self.key_prefix + key))
        except _Unanswered:
            data = None
        if data is None:
            self._count(num_misses=1)
            return None
        self._count(num_hits=1, num_bytes_read=len(data))
        return data

    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` under ``key`` (one atomic ``SET``, replacing any value; with ``EX
        ttl_seconds`` when set). Returns whether the server stored it: ``False`` when it is down,
        slow, pausing after an outage, or refused the write (e.g. out of memory under
        ``noeviction``; counted as an error). Never raises for the server's failures."""
        data = bytes(data) if not isinstance(data, bytes) else data
        try:
            self._call(lambda r: r.set(self.key_prefix + key, data, ex=self.ttl_seconds))
        except _Unanswered:
            return False
        self._count(num_puts=1, num_bytes_written=len(data))
        return True

    def discard(self, key: str) -> None:
        """Drop a payload the caller found corrupt: ``DEL`` (best effort) and one error counted,
        whether or not the server answered; a later :meth:`get` misses."""
        self._count(num_errors=1)
        self.delete(key)

    def delete(self, key: str) -> None:
        """Drop ``key`` if stored (best effort: nothing happens while the server is unreachable)."""
        try:
            self._call(lambda r: r.delete(self.key_prefix + key))
        except _Unanswered:
            pass

    def __contains__(self, key: str) -> bool:
        """Whether ``key`` is stored now (``EXISTS``; false when the server cannot answer)."""
        try:
            return bool(self._call(lambda r: r.exists(self.key_prefix + key)))
        except _Unanswered:
            return False

    def _scan(self, r: redis.Redis) -> Iterator[bytes]:
        """Our full Redis key names (bytes), by ``SCAN MATCH <escaped prefix>*`` (may repeat a key
        that was written during the scan; O(keys on the server))."""
        return r.scan_iter(match=_glob_escape(self.key_prefix) + "*", count=_SCAN_BATCH)

    def keys(self) -> list[str]:
        """The content keys stored under our prefix now (``SCAN``; without the prefix, each once);
        ``[]`` when the server cannot answer."""
        start = len(self.key_prefix.encode())
        try:
            names = self._call(lambda r: {name[start:].decode() for name in self._scan(r)})
        except _Unanswered:
            return []
        return sorted(names)

    def clear(self) -> int:
        """Delete every chunk under our prefix (``SCAN`` + ``DEL`` in batches; other keys on the
        server stay). Returns how many were deleted, also when the server failed part way."""
        deleted = 0

        def run(r: redis.Redis) -> None:
            nonlocal deleted
            batch: list[bytes] = []
            for name in self._scan(r):
                batch.append(name)
                if len(batch) == _SCAN_BATCH:
                    deleted += r.delete(*batch)
                    batch.clear()
            if batch:
                deleted += r.delete(*batch)

        try:
            self._call(run)
        except _Unanswered:
            pass
        return deleted

    @property
    def num_bytes(self) -> int:
        """Total size in bytes of the values under our prefix (``STRLEN`` of each, by ``SCAN``;
        O(keys), meant for ``lazyattn cache info``); 0 when the server cannot answer."""

        def run(r: redis.Redis) -> int:
            total = 0
            names = list(self._scan(r))
            for i in range(0, len(names), _SCAN_BATCH):
                pipe = r.pipeline(transaction=False)
                for name in names[i:i + _SCAN_BATCH]:
                    pipe.strlen(name)
                total += sum(pipe.execute())
            return total

        try:
            return self._call(run)
        except _Unanswered:
            return 0

    def close(self) -> None:
        """Close the connections. Later calls answer as for an unreachable server, without trying
        it (``get`` misses, ``put`` returns ``False``); ``available`` is false. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._client.close()
            self._client.connection_pool.disconnect()
        except (redis.exceptions.RedisError, OSError):
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("available" if self._available else "unavailable")
        return f"RedisStore({_redacted(self.url)!r}, key_prefix={self.key_prefix!r}, {state})"
