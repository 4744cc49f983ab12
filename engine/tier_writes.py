"""What the engine writes to the storage tiers: evicted chunks to the host tier (write-back), newly
computed chunks to the persistent tiers (disk, Redis). Runs on the engine thread; the copies off the
device happen on the tiers' writer thread."""

from __future__ import annotations

import logging

from lazyattn_rag.engine.kv.chunk_cache import ChunkCache, ChunkEntry
from lazyattn_rag.engine.kv.kv_pool import KVPool
from lazyattn_rag.engine.scheduling.scheduler_output import SchedulerOutput
from lazyattn_rag.engine.tiers.chunk_format import ChunkKV
from lazyattn_rag.engine.tiers.chunk_tiers import ChunkTiers
from lazyattn_rag.engine.tiers.host_arena import gather_event

logger = logging.getLogger(__name__)


def storable(entry: ChunkEntry | None) -> bool:
    """A chunk the storage tiers take: written, its tokens known, position-agnostic (not a
    positioned copy, nor an exact-prefix block, which only the KV pool looks up), and live: a
    dead chunk's document was deleted or changed, so no later request needs it, and a deleted
    document's K/V must not land in a tier after the delete."""
    return (entry is not None and entry.ready and entry.token_ids is not None and entry.source_key is None
            and not entry.exact_prefix and not entry.dead)


class TierWrites:
    """Queues chunks' K/V for the storage tiers.

    Args:
        tiers: the configured tiers.
        cache: the chunk cache (a computed chunk's entry is looked up there).
        kv_pool: where the K/V are gathered from.
        model_digest: the model fingerprint's digest, stored with every chunk.
    """

    def __init__(self, tiers: ChunkTiers, cache: ChunkCache, kv_pool: KVPool, model_digest: str):
        self.tiers, self.cache, self.kv_pool, self.model_digest = tiers, cache, kv_pool, model_digest

    def save(self, entry: ChunkEntry, tiers: list) -> None:
        """Queue ``entry``'s K/V for ``tiers``: gathered on the device now (before any later kernel
        can reuse its blocks), copied off it by the tiers' writer thread, so the step neither
        waits for the copy nor allocates host memory for it."""
        keys, values = self.kv_pool.gather(entry.block_ids, entry.num_tokens)
        chunk = ChunkKV(entry.key, self.model_digest, entry.token_ids, entry.local_start, keys, values)
        self.tiers.save(chunk, tiers, gather_event(self.kv_pool.device))

    def write_back(self, entry: ChunkEntry) -> None:
        """The pool evicts ``entry`` (its blocks still hold its K/V): queue it for the host tier."""
        host = self.tiers.host
        if not storable(entry) or entry.key in host:
            return
        try:
            self.save(entry, [host])
        except Exception:  # noqa: BLE001 - a lost write-back costs a recompute, never the step
            logger.exception("write-back of chunk %s failed", entry.key[:12])

    def persist(self, out: SchedulerOutput) -> None:
        """Queue the chunks step ``out`` computed for the persistent tiers (disk, Redis): those
        whose last piece it encoded, and prompt heads it seeded whole from exact-prefix blocks."""
        tiers = self.tiers.persistent
        keys = [job.key for job in out.chunk_prefills if job.final]
        keys += [seed.dst_key for seed in out.head_seeds if seed.complete]
        for key in keys:
            entry = self.cache.lookup(key, touch=False, include_dead=True)
            targets = [t for t in tiers if key not in t] if storable(entry) else []
            if targets:
                try:
                    self.save(entry, targets)
                except Exception:  # noqa: BLE001 - as write_back
                    logger.exception("storing chunk %s failed", key[:12])
