"""Admission: a waiting request acquires its chunks (the scheduler's half that touches the cache).

Hits are pinned (re-validated now: a chunk evicted while the request waited is simply a miss,
and a hit's tokens are checked against the request's, so another sequence's K/V is never
served: a colliding key is a miss, the chunk encoded under a key salted with its tokens);
misses get blocks, a pending cache entry and an encode task (or a load from a
storage tier below the pool that holds it, or, in ``block_attention`` mode, a copy of another
offset's chunk). Everything is taken only if the
cache has room for the misses and the request's own prompt blocks; an acquisition that raises
gives back exactly what it took.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable

from lazyattn_rag.engine.counters import EngineCounters
from lazyattn_rag.engine.kv.block_table import BlockEntry
from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.planning.fingerprint import chunk_key
from lazyattn_rag.engine.scheduling.capacity import BlockBudget
from lazyattn_rag.engine.scheduling.request import Request
from lazyattn_rag.engine.scheduling.scheduler_output import (
    ChunkPrefillTask,
    CopyJob,
    HeadSeedJob,
    LoadJob,
    SchedulerOutput,
)
from lazyattn_rag.engine.scheduling.selective_schedule import SelectiveRecompute
from lazyattn_rag.engine.tiers.chunk_tiers import ChunkTiers
from lazyattn_rag.types.errors import CacheCapacityError

logger = logging.getLogger(__name__)


class Admission(enum.Enum):
    """What :meth:`ChunkAdmission.acquire` did with a waiting request."""

    ADMITTED = "admitted"  # its chunks are pinned or being made, its private blocks taken
    WAIT = "wait"  # no room now: it holds nothing and stays first in line
    FAILED = "failed"  # it could never fit: reported in the step's ``failed``


class ChunkAdmission:
    """A waiting request acquires its chunks (see the module docstring).

    Args:
        cache: the chunk cache (pins, pending entries, blocks).
        budget: the block arithmetic (:class:`~lazyattn_rag.engine.scheduling.capacity.BlockBudget`).
        selective: selective recompute's part (its block copies are reserved at admission).
        chunk_tasks: the scheduler's list of chunks being encoded (new encodes are appended).
        release: gives back what a request holds (the scheduler's ``release``).
        anchor_context: the anchor's block-table entries (a document chunk is encoded after them).
        tiers: storage tiers a missing chunk is loaded from; ``None``: none.
        counters: the engine's counters (key collisions).
    """

    def __init__(self, cache: ChunkCache, budget: BlockBudget, selective: SelectiveRecompute,
                 chunk_tasks: list[ChunkPrefillTask], release: Callable[[Request], None],
                 anchor_context: list[BlockEntry], tiers: ChunkTiers | None, counters: EngineCounters):
        self.cache, self.budget, self.selective, self.chunk_tasks = cache, budget, selective, chunk_tasks
        self.release, self.anchor_context, self.tiers, self.counters = release, anchor_context, tiers, counters
        self.block_size = cache.block_size

    def acquire(self, request: Request, out: SchedulerOutput) -> Admission:
        """Pin hits and schedule encodes of misses (see :class:`Admission`); what an acquisition
        that raises took is given back before the exception propagates."""
        chunks = {c.key: c for c in request.plan.chunks}  # unique, in prompt order
        num_private = 0 if request.warm_only else request.num_private_tokens + 1  # + the next token
        total_blocks = self.budget.num_blocks_needed(request, num_private)
        if total_blocks > self.budget.num_usable_blocks:  # the engine's admission check makes this rare
            out.failed.append((request, CacheCapacityError(
                f"request needs {total_blocks} KV blocks ({request.plan.num_prompt_tokens} prompt tokens) but "
                f"the cache has {self.budget.describe()}")))
            return Admission.FAILED
        hits, misses = [], []
        for key, chunk in list(chunks.items()):
            # a dead entry still held by others holds exactly this content: a hit
            entry = self.cache.lookup(key, touch=False, include_dead=True)
            if entry is not None and not entry.holds(chunk.token_ids):  # never serve another sequence's K/V
                chunk = self._rekey_collision(request, chunk)
                entry = self.cache.lookup(chunk.key, touch=False, include_dead=True)
                if entry is not None:
                    entry.check_tokens(chunk.token_ids)  # the salted key collides too: refuse
            (hits if entry is not None else misses).append(chunk)
        self._acquire_prefix(request)
        for chunk in hits:
            self.cache.pin(chunk.key, allow_dead=True, holder=request.request_id)
        # Copy sources (block_attention mode) are pinned before the room check: pinning them later
        # would take their blocks out of the evictable ones the check counted.
        sources = self._copy_sources(misses)
        for src in sources.values():
            self.cache.pin(src.key)
        seed = self._find_seed(request, misses)  # its sources pinned now, for the same reason
        # Room for the misses and for the private prompt too (query tail, or the whole prompt in
        # full mode), whose blocks are taken now: a request admitted without them would only be
        # preempted again at once, or take them from running requests and throw their work away.
        # Selective recompute's block copies too (at most one per selected token), reserved now:
        # requests admitted without them could each hold their chunks while waiting for the
        # others' copies, and none ever run.
        num_private = request.num_private_blocks(request.num_tokens_to_compute, self.block_size)
        num_copies = 0 if request.warm_only else self.selective.max_blocks(request)
        need = sum(self.budget.blocks_for(len(c.token_ids)) for c in misses) + num_private + num_copies
        if (sources or seed) and not self.cache.can_allocate(need):  # room only by evicting the sources:
            for src in sources.values():  # encode instead
                self.cache.unpin(src.key)
            sources = {}
            self._release_unused_seed(seed, out)
            seed = None
        if not self.cache.can_allocate(need):
            self.release(request)
            return Admission.WAIT
        created: list[str] = []
        try:
            copied = self._start_misses(request, misses, out, sources, created, seed)
            request.private_blocks += self.cache.allocate(num_private)
            request.selected_blocks = self.cache.allocate(num_copies)
        except Exception:  # never keep what a failed acquisition took
            for key, src in sources.items():
                if key not in created:  # its copy job was never made, so nothing else unpins it
                    self.cache.unpin(src.key)
            self._release_unused_seed(seed, out)  # one handed to the step is let go with it, below
            self._abandon_acquire(request, out, created)
            raise
        self._release_unused_seed(seed, out)
        for chunk in hits:  # a hit for the eviction policy once per admission, not per step spent waiting
            self.cache.lookup(chunk.key, include_dead=True)
        self._account(request, {c.key for c in misses}, copied)
        return Admission.ADMITTED

    def _rekey_collision(self, request: Request, chunk):
        """A cached entry under ``chunk``'s key holds other tokens (a digest collision, or a key
        built without all of its content): serve the chunk as a miss, under a key salted with
        its tokens, in ``request``'s plan (every placement of it). Counted; logged once."""
        salted = chunk_key(chunk.key, "collision", list(chunk.token_ids))
        self.counters.num_key_collisions += 1
        if self.counters.num_key_collisions == 1:
            logger.warning("chunk key %s holds other tokens than a request places (%d); served as a miss under "
                           "a salted key (counted in num_key_collisions, logged once)", chunk.key[:12],
                           len(chunk.token_ids))
        plan = request.plan
        request.plan = dataclasses.replace(plan, chunks=tuple(
            dataclasses.replace(c, key=salted) if c.key == chunk.key else c for c in plan.chunks))
        return dataclasses.replace(chunk, key=salted)

    def _abandon_acquire(self, request: Request, out: SchedulerOutput, created: list[str]) -> None:
        """Undo an acquisition that raised: drop the jobs and pending entries it ``created``
        (never those of other requests that it merely pinned), then release its pins."""
        mine = set(created)
        for job in [j for j in out.chunk_prefills if j.key in mine]:
            out.chunk_prefills.remove(job)
        self.chunk_tasks[:] = [t for t in self.chunk_tasks if t.key not in mine]  # the scheduler's list
        for job in [j for j in out.copies if j.dst_key in mine]:
            out.copies.remove(job)
            self.cache.unpin(job.src_key)
        for seed in [s for s in out.head_seeds if s.dst_key in mine]:
            out.head_seeds.remove(seed)
            for key in seed.src_keys:
                self.cache.unpin(key)
        out.loads[:] = [j for j in out.loads if j.key not in mine]
        for key in created:
            self.cache.discard_pending(key)
        self.release(request)

    def _copy_sources(self, misses) -> dict:
        """block_attention mode: a ready copy of each missing chunk's document at another offset."""
        sources = {}
        for chunk in misses:
            ready = self.cache.ready_copies(chunk.source_key) if chunk.source_key else []
            if ready and ready[0].holds(chunk.token_ids):  # a copy must hold the tokens it is copied for
                sources[chunk.key] = ready[0]
            elif ready:  # a colliding source: encode the chunk instead
                self.counters.num_key_collisions += 1
        return sources

    def _start_misses(self, request: Request, misses, out: SchedulerOutput, sources: dict,
                      created: list[str], seed: HeadSeedJob | None = None) -> set[str]:
        """Blocks, pending entries and encode (or copy, or load) jobs for missing chunks; returns
        the keys copied or loaded (not computed).

        ``sources`` maps a chunk key to its (already pinned) copy source; the copy job takes over
        that pin (the engine drops it once the copy ran). ``seed``: the prompt head's seed
        (:meth:`_find_seed`), handed to the step if the head is encoded (not loaded). Each
        inserted key is appended to ``created`` at once, so a failure part-way can undo exactly
        what was made.
        """
        copied = set()
        for chunk in misses:
            blocks = self.cache.allocate(self.budget.blocks_for(len(chunk.token_ids)))
            try:
                self.cache.insert_pending(chunk.key, blocks, len(chunk.token_ids), chunk.local_start,
                                          chunk.source_key, document=chunk.doc_id is not None and not chunk.learned,
                                          token_ids=chunk.token_ids)
            except Exception:
                self.cache.pool.decref(blocks)
                raise
            created.append(chunk.key)
            self.cache.pin(chunk.key, allow_dead=True, holder=request.request_id)  # the first is the writer's
            src = sources.get(chunk.key)
            if src is not None:  # position-aware cache: re-rotate another offset's copy into new blocks
                out.copies.append(CopyJob(src.key, chunk.key, src.block_ids, blocks, src.num_tokens,
                                          chunk.local_start - src.local_start))
                copied.add(chunk.key)
                continue
            found = self.tiers.find(chunk.key, chunk.token_ids) if self.tiers is not None else None
            if found is not None:  # in a storage tier: written into the blocks before the pass
                out.loads.append(LoadJob(chunk.key, blocks, found.chunk, found.tier))
                request.loaded_tiers[chunk.key] = found.tier
                copied.add(chunk.key)
                continue
            request.prefilled_keys.add(chunk.key)
            context = self.anchor_context if chunk.doc_id is not None and chunk.source_key is None else []
            seeded = self._seed_head(request, chunk, blocks, out, seed) if seed and seed.dst_key == chunk.key else 0
            if seeded < len(chunk.token_ids):
                self.chunk_tasks.append(ChunkPrefillTask(chunk.key, chunk.token_ids, chunk.local_start, blocks,
                                                         context, num_done=seeded))
        return copied

    def _find_seed(self, request: Request, misses) -> HeadSeedJob | None:
        """The seed of a prompt head among ``misses`` (its destination blocks not known yet): the
        leading full blocks of the head that an earlier plain prompt left in the cache as
        exact-prefix blocks (``PromptPlan.head_prefix_keys``), pinned until the step that copies
        them has run (or :meth:`_release_unused_seed`); ``None`` when there is none
        (:meth:`_cached_run`)."""
        head = next((c for c in misses if c.doc_id is None and c.global_start == 0 and c.local_start == 0), None)
        run = self._cached_run(request.plan.head_prefix_keys, head.token_ids) if head is not None else []
        for key, _ in run:
            self.cache.pin(key)
        return HeadSeedJob(head.key, [k for k, _ in run], [e.block_ids[0] for _, e in run], []) if run else None

    def _release_unused_seed(self, seed: HeadSeedJob | None, out: SchedulerOutput) -> None:
        """Let go of ``seed``'s sources if no step will copy them (it was never handed to ``out``:
        dropped for room, or the head came from a storage tier, or the acquisition failed first)."""
        if seed is not None and all(s is not seed for s in out.head_seeds):
            for key in seed.src_keys:
                self.cache.unpin(key)

    def _seed_head(self, request: Request, chunk, blocks: list[int], out: SchedulerOutput, seed: HeadSeedJob) -> int:
        """Hand ``seed`` (:meth:`_find_seed`) to the step: its blocks are copied into the head's
        first ``blocks`` before the pass, and the head's encode starts after them (a head of whole
        cached blocks is not encoded at all). Returns the tokens seeded
        (``request.num_seeded_tokens``)."""
        seed.dst_blocks = blocks[:len(seed.src_keys)]
        seed.complete = len(seed.src_keys) * self.block_size == len(chunk.token_ids)
        out.head_seeds.append(seed)
        request.num_seeded_tokens = len(seed.src_keys) * self.block_size
        return request.num_seeded_tokens

    def _acquire_prefix(self, request: Request) -> None:
        """Prefix mode: pin the longest run of cached full blocks of the prompt (exact prefix)."""
        if not request.plan.prefix_block_keys:
            return
        for key, _ in self._cached_run(request.plan.prefix_block_keys, request.plan.query_token_ids):
            self.cache.pin(key, holder=request.request_id)
            request.num_prefix_tokens += self.block_size
        total = len(request.plan.query_token_ids)
        if request.num_prefix_tokens >= total:  # keep at least one prompt token to compute
            self.cache.unpin(self.cache.pins_of(request.request_id)[-1], holder=request.request_id)
            request.num_prefix_tokens -= self.block_size

    def _cached_run(self, keys, token_ids: tuple[int, ...]) -> list[tuple[str, object]]:
        """``(key, entry)`` of the leading blocks of the exact-prefix chain ``keys`` (over
        ``token_ids``, a block per key; at most as many keys as ``token_ids`` has full blocks)
        that are cached and ready now. A cached block that holds other tokens ends the run (a
        collision: counted in ``num_key_collisions``; computed from there on)."""
        bs, run = self.block_size, []
        for j in range(min(len(keys), len(token_ids) // bs)):
            entry = self.cache.lookup(keys[j])
            if entry is None or not entry.ready:
                break
            if not entry.holds(token_ids[j * bs:(j + 1) * bs]):
                self.counters.num_key_collisions += 1
                break
            run.append((keys[j], entry))
        return run

    @staticmethod
    def _account(request: Request, missed_keys: set[str], copied_keys: set[str]) -> None:
        """Per-request stats: documents hit/missed, tokens reused where they were computed
        (the prompt head, exact-prefix blocks) (first acquisition), prompt tokens computed."""
        stats = request.stats
        if request.num_preemptions == 0:  # what the prompt reused and computed (a preempted request's second
            # admission redoes work, but its prompt's accounting is that of its first)
            stats.num_computed_tokens += sum(len(c.token_ids) for c in {c.key: c for c in request.plan.chunks}.values()
                                             if c.key in missed_keys and c.key not in copied_keys)
            stats.num_computed_tokens -= request.num_prefix_tokens + request.num_seeded_tokens
            stats.num_exact_prefix_tokens = request.num_prefix_tokens + request.num_seeded_tokens + sum(
                len(c.token_ids) for c in request.plan.chunks
                if c.doc_id is None and (c.key not in missed_keys or c.key in copied_keys))
            for c in request.plan.chunks:
                if c.doc_id is None:
                    continue
                loaded = c.key in request.loaded_tiers  # from a storage tier: not computed, a hit
                (stats.docs_missed if c.key in missed_keys and not loaded else stats.docs_hit).append(c.doc_id)
                stats.doc_tiers[c.doc_id] = request.loaded_tiers.get(c.key, "computed" if c.key in missed_keys else "kv")
                stats.doc_sources.setdefault(c.doc_id, c.source)
