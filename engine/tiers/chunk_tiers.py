"""The storage tiers below the KV pool, in lookup order, and the writer that fills them (issue 17).

A chunk's K/V is position-agnostic, so one stored copy serves every request, process and
replica on the same model. Tiers (``engine/tiers/chunk_store.py``, ``engine/tiers/redis_store.py``) hold
encoded chunks (``engine/tiers/chunk_format.py``) under the chunk's content key:

* **host memory** is filled by *write-back*: a chunk the KV pool evicts is copied off the device
  into pages of a preallocated (on a GPU, pinned) arena and kept there as it is, with its
  checksum (``engine/tiers/host_arena.py``), so a later miss loads it with host-to-device copies,
  checked on the device, instead of recomputing it;
* **persistent tiers** (disk, Redis) are filled when a chunk is *computed*, so a restarted
  process, or another worker sharing the directory or the server, loads it on its first use;
  a chunk loaded from Redis is also written to the local disk tier.

Writes run on one background thread: the engine thread only gathers the K/V on the device and
queues it; the writer copies it to the host, checksums it, encodes it for the persistent tiers
and writes it, so a step never waits for any of that. Past ``max_queued_bytes`` a write is
dropped and counted, never waited for. A miss looks the tiers up fastest first and loads the
first whole, checked copy; a payload that fails the checks (truncated, damaged, another
model, key or format, other tokens) is counted, deleted from its tier and the chunk recomputed.
Whether loading beats recomputing is decided per tier from measured speeds
(:class:`LoadCosts`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lazyattn_rag.engine.tiers.chunk_format import ChunkKV, CorruptChunkError, decode_chunk, encode_chunk
from lazyattn_rag.engine.tiers.chunk_store import Tier
from lazyattn_rag.engine.tiers.host_arena import HostChunk, copy_to_host
from lazyattn_rag.types.histogram import Histogram

if TYPE_CHECKING:
    import torch

    from lazyattn_rag.engine.kv.kv_layout import KVLayout

logger = logging.getLogger(__name__)


@dataclass
class TierTimes:
    """Per tier: load (read + decode + checks) and store (encode + write) latencies, and the
    payloads found unusable (each deleted)."""

    load: Histogram = field(default_factory=Histogram)
    store: Histogram = field(default_factory=Histogram)
    num_corrupt: int = 0


class LoadCosts:
    """Load or recompute? Measured speeds, per tier, against measured prefill speed.

    A tier's bytes/s (read, decode, check) and the engine's prefill tokens/s are moving
    averages of what this process measured; a chunk of ``num_tokens`` is loaded from a tier
    when ``num_tokens * bytes_per_token / tier_bytes_per_s`` is below
    ``num_tokens / prefill_tokens_per_s``. Until both are measured, loading is tried; a tier
    found slower is still tried on every ``probe_every``-th miss so a changed speed is seen.

    Args:
        bytes_per_token: encoded K/V bytes of one token (all layers).
        always: load every chunk found, whatever the speeds (``CacheConfig.tier_loads="always"``).
    """

    def __init__(self, bytes_per_token: int, probe_every: int = 16, smoothing: float = 0.3, always: bool = False):
        self.bytes_per_token, self.probe_every, self.smoothing = bytes_per_token, probe_every, smoothing
        self.always = always
        self.tier_bytes_per_s: dict[str, float] = {}
        self.prefill_tokens_per_s: float | None = None
        self._num_skipped: dict[str, int] = {}

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def record_load(self, tier: str, num_bytes: int, seconds: float) -> None:
        if seconds > 0:
            self.tier_bytes_per_s[tier] = self._average(self.tier_bytes_per_s.get(tier), num_bytes / seconds)

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        if seconds > 0 and num_tokens > 0:
            self.prefill_tokens_per_s = self._average(self.prefill_tokens_per_s, num_tokens / seconds)

    def worth_loading(self, tier: str, num_tokens: int) -> bool:
        bps, tps = self.tier_bytes_per_s.get(tier), self.prefill_tokens_per_s
        if self.always or bps is None or tps is None or num_tokens * self.bytes_per_token / bps < num_tokens / tps:
            return True
        skipped = self._num_skipped[tier] = self._num_skipped.get(tier, 0) + 1
        return skipped % self.probe_every == 0


@dataclass(frozen=True)
class TierHit:
    """A chunk found below the pool: its K/V (on the pool's device for a host-tier hit, on the
    CPU otherwise) and where it came from."""

    tier: str
    chunk: ChunkKV
    seconds: float


class ChunkTiers:
    """Tiers in lookup order (fastest first) with a background writer.

    Args:
        tiers: the configured tiers; one named ``"host"`` is filled by write-back, the rest
            when a chunk is computed.
        model_digest: the model fingerprint's digest (checked on every load).
        bytes_per_token: K/V bytes of one token over all layers (for :class:`LoadCosts`).
        max_queued_bytes: K/V waiting to be written beyond which a write is dropped (counted).
        device: the KV pool's device: a host-tier hit is copied there and checked there
            (:meth:`~lazyattn_rag.engine.tiers.host_arena.HostChunk.load`).
        always_load: load every chunk found (:class:`LoadCosts`' ``always``).
        layout: the KV pool's :class:`KVLayout`: a stored chunk of another shape or dtype is
            refused as corrupt (``None``: not checked).
    """

    def __init__(self, tiers: list[Tier], model_digest: str, bytes_per_token: int,
                 max_queued_bytes: int = 1 << 30, device: torch.device | str = "cpu", always_load: bool = False,
                 layout: KVLayout | None = None):
        self.tiers, self.model_digest, self.device, self.layout = list(tiers), model_digest, device, layout
        self.costs = LoadCosts(bytes_per_token, always=always_load)
        self.times = {t.name: TierTimes() for t in self.tiers}
        self.max_queued_bytes = max_queued_bytes
        self.num_dropped_writes = 0
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="lazyattn-tier-writer", daemon=True)
        self._writer.start()

    @property
    def host(self) -> Tier | None:
        return next((t for t in self.tiers if t.name == "host"), None)

    @property
    def persistent(self) -> list[Tier]:
        return [t for t in self.tiers if t.name != "host"]

    # --- loading (engine thread) ------------------------------------------------------------
    def find(self, key: str, token_ids: tuple[int, ...]) -> TierHit | None:
        """The chunk ``key`` from the fastest tier that holds a usable copy and is worth loading
        from, or ``None`` (compute it). Never raises for a tier's failure or a bad payload."""
        for tier in self.tiers:
            if not tier.available or not self.costs.worth_loading(tier.name, len(token_ids)):
                continue
            start = time.perf_counter()
            data = tier.lease(key) if hasattr(tier, "lease") else tier.get(key)
            if data is None:
                continue
            try:
                if isinstance(data, HostChunk):
                    try:
                        self._check_layout(key, (data.shape, data.dtype), (data.shape, data.dtype), len(token_ids))
                    except CorruptChunkError:
                        data.arena.release(data.pages)  # the lease
                        raise
                    chunk = data.load(key, self.model_digest, self.device, leased=True)
                else:
                    chunk = decode_chunk(data, key, self.model_digest)
                    self._check_layout(key, (chunk.keys.shape, chunk.keys.dtype),
                                       (chunk.values.shape, chunk.values.dtype), len(token_ids))
                if chunk.token_ids != tuple(token_ids):
                    raise CorruptChunkError(f"chunk {key[:12]} holds {len(chunk.token_ids)} other tokens")
            except CorruptChunkError as error:
                logger.warning("%s tier: %s; deleted, recomputing", tier.name, error)
                tier.discard(key)
                self.times[tier.name].num_corrupt += 1
                continue
            seconds = time.perf_counter() - start
            self.costs.record_load(tier.name, chunk.num_bytes, seconds)
            self.times[tier.name].load.observe(seconds)
            if tier.name == "redis":  # a shared copy: keep one on the local disk too
                self.save(chunk, [t for t in self.persistent if t.name == "disk" and key not in t])
            return TierHit(tier.name, chunk, seconds)
        return None

    def _check_layout(self, key: str, keys: tuple, values: tuple, num_tokens: int) -> None:
        """Raises :class:`CorruptChunkError` unless ``keys`` and ``values`` (each ``(shape, dtype)``)
        of ``num_tokens`` tokens fit the pool's layout."""
        problem = self.layout.mismatch(keys, values, num_tokens) if self.layout is not None else None
        if problem:
            raise CorruptChunkError(f"chunk {key[:12]}: {problem}")

    # --- writing (queued from the engine thread, run on the writer thread) ----------------------
    def save(self, chunk: ChunkKV, tiers: list[Tier], gathered=None) -> bool:
        """Queue ``chunk`` to be written to ``tiers``; ``False`` when nothing is to be written or
        the queue is over ``max_queued_bytes`` (the write is dropped, counted). ``chunk``'s K/V
        may still be on the pool's device, gathered before the event ``gathered``
        (:func:`~lazyattn_rag.engine.tiers.host_arena.gather_event`): the writer copies them from
        there, on a side stream, into the host tier's arena and, for the others, to the CPU to
        encode."""
        if not tiers:
            return False
        with self._lock:
            if self._queued_bytes + chunk.num_bytes > self.max_queued_bytes:
                self.num_dropped_writes += 1
                return False
            self._queued_bytes += chunk.num_bytes
        self._queue.put((chunk, tiers, gathered))
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            chunk, tiers, gathered = item
            try:
                data = None
                for tier in tiers:
                    start = time.perf_counter()
                    if tier.name == "host":  # K/V as they are, in the arena: no encoding either way
                        stored = tier.put_kv(chunk, gathered)
                    else:
                        data = data if data is not None else encode_chunk(copy_to_host(chunk, gathered))
                        stored = tier.put(chunk.key, data)
                    if stored:
                        self.times[tier.name].store.observe(time.perf_counter() - start)
            except Exception:  # noqa: BLE001 - a failed write costs only a later recompute
                logger.exception("writing chunk %s to the storage tiers failed", chunk.key[:12])
            finally:
                with self._lock:
                    self._queued_bytes -= chunk.num_bytes
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued write ran (tests, ``lazyattn cache warm``, closing)."""
        self._queue.join()

    def close(self, close_tiers: bool = True) -> None:
        """Finish the queued writes, stop the writer and (unless ``close_tiers`` is false: tiers
        shared with another user) close the tiers. Idempotent."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
            if close_tiers:
                for tier in self.tiers:
                    tier.close()

    # --- introspection ----------------------------------------------------------------------
    def stats(self) -> dict[str, dict]:
        """Per tier: hits, misses, puts, evictions, errors, outages, bytes read and written,
        bytes held (``None`` for a server tier), availability, corrupt payloads found, load and store latency histograms
        and the measured load speed."""
        out = {}
        for tier in self.tiers:
            times = self.times[tier.name]
            # a server tier's size is a scan of the server (``lazyattn cache info``), not a stat
            num_bytes = tier.num_bytes if tier.capacity_bytes is not None else None
            out[tier.name] = {**tier.stats.__dict__, "available": tier.available, "num_bytes": num_bytes,
                              "capacity_bytes": tier.capacity_bytes, "num_corrupt": times.num_corrupt,
                              "load_seconds": times.load.as_dict(), "store_seconds": times.store.as_dict(),
                              "load_bytes_per_s": self.costs.tier_bytes_per_s.get(tier.name)}
        return out
