"""The scheduler: decides what one engine step computes and hands the runner one typed plan.

Each step mixes, under a token budget (``max_num_batched_tokens``):

1. running requests, oldest first: one decode token each, or the next piece of a query
   prefill (long plain prompts are prefilled in pieces);
2. chunks being encoded, oldest first: the next piece of each (chunked encoding: a chunk
   larger than what is left of the budget is encoded over several steps, each piece
   attending the pieces before it, so a cold document never waits for the batch to drain);
3. requests whose chunks became ready: their query prefill;
4. waiting requests, first come first served: acquire their chunks, once the cache has room
   for the misses and the request's own prompt tokens (else it waits). Hits are pinned
   (re-validated now: a chunk evicted while the request waited is simply a miss), misses
   get blocks, a *pending* cache entry and an encode task whose first piece runs in this
   step if budget is left. The request's query prefill joins the step of its chunks' last
   pieces when the budget allows: one forward pass, in which each layer writes the whole
   batch's K/V before its attention reads any. A request that needs a chunk another request
   is encoding pins the pending entry: a chunk is encoded once, and read only in or after
   the forward pass that writes its last piece. The encode task holds a pin of its own, so
   requests may leave mid-encode; the chunk is still finished (and cached) unless its
   document is gone.

When a running request needs a block and the cache cannot free one (everything else is
pinned), the newest request is preempted: its private blocks are freed and its pins
dropped, and it is recomputed later from its query and the tokens it already produced. A
request that could not fit even in an empty cache fails alone.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from lazyattn_rag.engine.chunk_cache import ChunkCache, block_table_entries
from lazyattn_rag.engine.request import Request, RequestStatus
from lazyattn_rag.types.errors import CacheCapacityError
from lazyattn_rag.kernels.block_table import pack_entries
from lazyattn_rag.engine.prompt import ChunkSegment


@dataclass
class EncodeJob:
    """Encode a piece of one chunk alone, in this step's forward pass.

    ``token_ids`` are the chunk's tokens ``start .. start + len(token_ids)`` at positions
    ``local_start + start ..``; they attend ``context`` (the anchor), the chunk's first
    ``start`` tokens (already in ``block_ids``, written by earlier steps) and themselves,
    causally. ``final``: the piece completes the chunk (it is read from this step's pass on).
    """

    key: str
    token_ids: tuple[int, ...]
    local_start: int
    block_ids: list[int]
    context: list[tuple[int, int, int]]
    start: int = 0
    final: bool = True


@dataclass
class EncodeTask:
    """A chunk being encoded across steps (chunked encoding), in pieces under the step budget.

    The task holds the pending entry's first pin (taken by ``insert_pending``) until its final
    piece ran: requests that wait for the chunk pin it too, and may leave meanwhile.
    """

    key: str
    token_ids: tuple[int, ...]
    local_start: int
    block_ids: list[int]
    context: list[tuple[int, int, int]]
    num_done: int = 0  # tokens scheduled in earlier steps

    def next_piece(self, budget: int) -> EncodeJob:
        n = min(len(self.token_ids) - self.num_done, budget)
        job = EncodeJob(self.key, self.token_ids[self.num_done:self.num_done + n], self.local_start, self.block_ids,
                        self.context, self.num_done, self.num_done + n == len(self.token_ids))
        self.num_done += n
        return job


@dataclass
class CopyJob:
    """Copy a positioned chunk to a new offset: K rotated by ``delta``, V as is (``block_attention``)."""

    src_key: str
    dst_key: str
    src_blocks: list[int]
    dst_blocks: list[int]
    num_tokens: int
    delta: int


@dataclass
class ComputeJob:
    """Compute ``num_tokens`` private tokens of ``request`` from index ``start``; sample if ``sample``."""

    request: Request
    start: int
    num_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    """Everything one step runs; the only contract between the scheduler and the engine."""

    encodes: list[EncodeJob] = field(default_factory=list)
    copies: list[CopyJob] = field(default_factory=list)
    computes: list[ComputeJob] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    warmed: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.encodes) + sum(c.num_tokens for c in self.computes)

    @property
    def is_empty(self) -> bool:
        return not (self.encodes or self.copies or self.computes)

    def written_keys(self) -> set[str]:
        """Chunks this step completes: their last piece encoded in its forward pass (each layer
        writes the batch's K/V before its attention reads any of it) or copied before that pass."""
        return {e.key for e in self.encodes if e.final} | {c.dst_key for c in self.copies}


class Scheduler:
    """Continuous batching over the chunk cache.

    Args:
        cache: the chunk cache (and through it the block pool).
        max_num_batched_tokens: token budget of one step (a single larger item runs alone).
        max_num_seqs: most requests holding resources at once.
        anchor_context: block-table entries of the anchor documents are encoded after
            (permanently pinned by the engine; empty without an anchor).
        anchor_key: the anchor's chunk key (its blocks are not counted against requests).
        prefill_with_encodes: see :class:`lazyattn_rag.types.config.SchedulerConfig`.
    """

    def __init__(self, cache: ChunkCache, max_num_batched_tokens: int, max_num_seqs: int,
                 anchor_context: list[tuple[int, int, int]], anchor_key: str | None = None,
                 prefill_with_encodes: bool = True):
        self.cache = cache
        self.prefill_with_encodes = prefill_with_encodes
        self.block_size = cache.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.anchor_context = anchor_context
        self.anchor_key = anchor_key
        self.waiting: deque[Request] = deque()
        self.acquired: list[Request] = []
        self.running: list[Request] = []
        self.encoding: list[EncodeTask] = []  # chunks being encoded, oldest first
        self.num_preemptions = 0

    # --- queue management -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.acquired or self.running or self.encoding)

    def drop_encodes(self, keys: set[str] | None = None) -> None:
        """Abandon the encode tasks of ``keys`` (all when ``None``): their pending entries are
        discarded (a step that wrote them failed, or every request was failed)."""
        for task in [t for t in self.encoding if keys is None or t.key in keys]:
            self.encoding.remove(task)
            if self.cache.lookup(task.key, touch=False, include_dead=True) is not None:
                self.cache.discard_pending(task.key)

    def remove(self, request: Request) -> None:
        """Take a request out of every queue and release what it holds."""
        for queue in (self.acquired, self.running):
            if request in queue:
                queue.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.release(request)

    def release(self, request: Request) -> None:
        if request.private_blocks:
            self.cache.pool.decref(request.private_blocks)
            request.private_blocks = []
        for key in request.pinned:
            self.cache.unpin(key)
        request.pinned = []
        request.context_words = None
        request.context_entries = []
        request.context_len = 0
        request.num_computed = 0
        request.num_prefix_tokens = 0
        request.num_prefix_registered = 0

    # --- capacity -------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request may ever hold: the pool less the anchor's (pinned for good)."""
        return self.cache.pool.num_blocks - len(self.anchor_context)

    def describe_capacity(self) -> str:
        anchor = f", {len(self.anchor_context)} of them held by the anchor" if self.anchor_context else ""
        return f"{self.cache.pool.num_blocks} blocks of {self.block_size} tokens{anchor}"

    def num_blocks_needed(self, request: Request, num_private_tokens: int) -> int:
        """Blocks ``request`` holds at once with ``num_private_tokens`` private tokens (text
        segments, tail, generated) written: its chunks' (each starts a block; the anchor's are
        not counted) plus its private blocks."""
        chunks = {c.key: c for c in request.plan.chunks if c.key != self.anchor_key}
        return (sum(self.blocks_for(len(c.token_ids)) for c in chunks.values())
                + request.num_private_blocks(num_private_tokens, self.block_size))

    # --- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        budget = self._schedule_encodes(out, self.encoding, budget)
        budget = self._promote_ready(out, budget)
        self._schedule_waiting(out, budget)
        return out

    def _schedule_encodes(self, out: SchedulerOutput, tasks: list[EncodeTask], budget: int) -> int:
        """The next piece of each task, oldest first, within ``budget``; returns the budget left.

        A chunk larger than a step's budget is encoded over several steps (as a long prompt is
        prefilled in pieces), so a cold document never waits for the running batch to drain. A
        task whose chunk no request wants any more (its document was removed) is dropped.
        """
        for task in list(tasks):
            entry = self.cache.held(task.key)
            if entry.dead and entry.pin_count == 1:  # only the encoder holds it: nobody will read it
                self.encoding.remove(task)
                self.cache.discard_pending(task.key)
                continue
            if budget <= 0:
                break
            job = task.next_piece(budget)
            out.encodes.append(job)
            budget -= len(job.token_ids)
            if job.final:
                self.encoding.remove(task)
        return budget

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            budget -= self._schedule_compute(out, request, budget, may_preempt=True)
        return budget

    def _schedule_compute(self, out: SchedulerOutput, request: Request, budget: int, may_preempt: bool) -> int:
        """Schedule the next private tokens of ``request``; returns the tokens scheduled."""
        todo = request.num_tokens_to_compute
        n = todo if out.is_empty and todo > budget else min(todo, budget)
        if n <= 0:
            return 0
        need = request.num_private_blocks(request.num_computed + n, self.block_size) - len(request.private_blocks)
        while need > 0 and not self.cache.can_allocate(need):
            if not may_preempt:
                return 0
            victim = self._newest_preemptible(out)
            if victim is None:
                return 0
            self.preempt(victim)
            if victim is request:
                return 0
        if need > 0:
            request.private_blocks += self.cache.allocate(need)
        total = len(request.private_token_ids)
        out.computes.append(ComputeJob(request, request.num_computed, n, request.num_computed + n == total))
        return n

    def _newest_preemptible(self, out: SchedulerOutput) -> Request | None:
        scheduled = {id(c.request) for c in out.computes}
        candidates = [r for r in self.running + self.acquired if id(r) not in scheduled]
        return max(candidates, key=lambda r: r.arrival_time, default=None)

    def preempt(self, request: Request) -> None:
        """Free a request's blocks and pins; it is recomputed later (kept first in line)."""
        for queue in (self.acquired, self.running):
            if request in queue:
                queue.remove(request)
        self.release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _promote_ready(self, out: SchedulerOutput, budget: int) -> int:
        for request in list(self.acquired):
            budget -= self._promote(out, request, budget)
        return budget

    def _promote(self, out: SchedulerOutput, request: Request, budget: int) -> int:
        """Move an acquired request whose chunks are all written, or written by this step, to
        running; schedule its prefill (in the same forward pass as the encodes it waits for).
        A warm-up finishes only once its chunks are written."""
        written = all(self.cache.held(k).ready for k in request.pinned)
        if not written:
            # Join this step only with a prefill to run in it: a request that waited here on a
            # step whose forward pass then failed would hold chunks that were never written.
            this_step = out.written_keys() if self.prefill_with_encodes and not request.warm_only else set()
            if budget <= 0 or not all(self.cache.held(k).ready or k in this_step for k in request.pinned):
                return 0
        self.acquired.remove(request)
        if request.warm_only:
            out.warmed.append(request)
            return 0
        context = self._context_of(request)
        request.context_entries = context
        request.context_words = pack_entries(context)
        request.context_len = sum(e[2] for e in context)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if budget <= 0:
            return 0
        return self._schedule_compute(out, request, budget, may_preempt=False)

    def _context_of(self, request: Request) -> list[tuple[int, int, int]]:
        """Block-table entries of everything before the query tail, in prompt order: chunks at
        their offsets, text segments in their own (private, delta 0) blocks, prefix-cache hits."""
        entries = []
        text_runs = iter(request.private_runs(self.block_size))
        for segment in request.plan.segments():
            if isinstance(segment, ChunkSegment):
                entry = self.cache.held(segment.key)
                entries += block_table_entries(entry.block_ids, entry.num_tokens,
                                               segment.global_start - entry.local_start, self.block_size)
            else:
                run = next(text_runs)
                blocks = request.private_blocks[run.first_block: run.first_block + self.blocks_for(run.length)]
                entries += block_table_entries(blocks, run.length, 0, self.block_size)
        for key in request.plan.prefix_block_keys[: request.num_prefix_tokens // self.block_size]:
            entries.append((self.cache.held(key).block_ids[0], 0, self.block_size))
        return entries

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and len(self.acquired) + len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_tasks = len(self.encoding)
            try:
                status = self._acquire(request, out, budget)
            except Exception as error:  # fails this request alone; what it took is given back
                self.waiting.popleft()
                out.failed.append((request, error))
                continue
            if status == "wait":
                return
            self.waiting.popleft()
            if status == "failed":
                continue
            budget = self._schedule_encodes(out, self.encoding[num_tasks:], budget)
            self.acquired.append(request)
            request.status = RequestStatus.ACQUIRED
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
            budget -= self._promote(out, request, budget)  # all hits: prefill in this step

    def _acquire(self, request: Request, out: SchedulerOutput, budget: int) -> str:
        """Pin hits and schedule encodes of misses: ``"ok"``, ``"wait"`` (no room now) or ``"failed"``."""
        chunks = {c.key: c for c in request.plan.chunks}  # unique, in prompt order
        num_private = 0 if request.warm_only else len(request.private_token_ids) + 1  # + the next token
        total_blocks = self.num_blocks_needed(request, num_private)
        if total_blocks > self.num_usable_blocks:  # the engine's admission check makes this rare
            out.failed.append((request, CacheCapacityError(
                f"request needs {total_blocks} KV blocks ({request.plan.num_prompt_tokens} prompt tokens) but "
                f"the cache has {self.describe_capacity()}")))
            return "failed"
        hits, misses = [], []
        for key, chunk in chunks.items():
            # a dead entry still held by others holds exactly this content: a hit
            entry = self.cache.lookup(key, touch=False, include_dead=True)
            if entry is not None:
                entry.check_tokens(chunk.token_ids)  # never serve another sequence's K/V
            (hits if entry is not None else misses).append(chunk)
        self._acquire_prefix(request)
        for chunk in hits:
            self.cache.pin(chunk.key, allow_dead=True)
            request.pinned.append(chunk.key)
        # Copy sources (block_attention mode) are pinned before the room check: pinning them later
        # would take their blocks out of the evictable ones the check counted.
        sources = self._copy_sources(misses)
        for src in sources.values():
            self.cache.pin(src.key)
        # Room for the misses and for the private prompt too (query tail, or the whole prompt in
        # full mode), whose blocks are taken now: a request admitted without them would only be
        # preempted again at once, or take them from running requests and throw their work away.
        num_private = request.num_private_blocks(request.num_tokens_to_compute, self.block_size)
        need = sum(self.blocks_for(len(c.token_ids)) for c in misses) + num_private
        if sources and not self.cache.can_allocate(need):  # room only by evicting the sources: encode instead
            for src in sources.values():
                self.cache.unpin(src.key)
            sources = {}
        if not self.cache.can_allocate(need):
            self.release(request)
            return "wait"
        created: list[str] = []
        try:
            copied = self._start_misses(request, misses, out, sources, created)
            request.private_blocks += self.cache.allocate(num_private)
        except Exception:  # never keep what a failed acquisition took
            for key, src in sources.items():
                if key not in created:  # its copy job was never made, so nothing else unpins it
                    self.cache.unpin(src.key)
            self._abandon_acquire(request, out, created)
            raise
        for chunk in hits:  # a hit for the eviction policy once per admission, not per step spent waiting
            self.cache.lookup(chunk.key, include_dead=True)
        self._account(request, {c.key for c in misses}, copied)
        return "ok"

    def _abandon_acquire(self, request: Request, out: SchedulerOutput, created: list[str]) -> None:
        """Undo an acquisition that raised: drop the jobs and pending entries it ``created``
        (never those of other requests that it merely pinned), then release its pins."""
        mine = set(created)
        for job in [j for j in out.encodes if j.key in mine]:
            out.encodes.remove(job)
        self.encoding = [t for t in self.encoding if t.key not in mine]
        for job in [j for j in out.copies if j.dst_key in mine]:
            out.copies.remove(job)
            self.cache.unpin(job.src_key)
        request.pinned = [k for k in request.pinned if k not in mine]
        for key in created:
            self.cache.discard_pending(key)
        self.release(request)

    def _copy_sources(self, misses) -> dict:
        """block_attention mode: a ready copy of each missing chunk's document at another offset."""
        sources = {}
        for chunk in misses:
            ready = self.cache.ready_copies(chunk.source_key) if chunk.source_key else []
            if ready:
                ready[0].check_tokens(chunk.token_ids)  # a copy must hold the tokens it is copied for
                sources[chunk.key] = ready[0]
        return sources

    def _start_misses(self, request: Request, misses, out: SchedulerOutput, sources: dict,
                      created: list[str]) -> set[str]:
        """Blocks, pending entries and encode (or copy) jobs for missing chunks; returns copied keys.

        ``sources`` maps a chunk key to its (already pinned) copy source; the copy job takes over
        that pin (the engine drops it once the copy ran). Each inserted key is appended to
        ``created`` at once, so a failure part-way can undo exactly what was made.
        """
        copied = set()
        for chunk in misses:
            blocks = self.cache.allocate(self.blocks_for(len(chunk.token_ids)))
            try:
                self.cache.insert_pending(chunk.key, blocks, len(chunk.token_ids), chunk.local_start,
                                          chunk.source_key, document=chunk.doc_id is not None,
                                          token_ids=chunk.token_ids)
            except Exception:
                self.cache.pool.decref(blocks)
                raise
            created.append(chunk.key)
            self.cache.pin(chunk.key, allow_dead=True)  # the request's pin; the first is the encoder's
            request.pinned.append(chunk.key)
            src = sources.get(chunk.key)
            if src is not None:  # position-aware cache: re-rotate another offset's copy into new blocks
                out.copies.append(CopyJob(src.key, chunk.key, src.block_ids, blocks, src.num_tokens,
                                          chunk.local_start - src.local_start))
                copied.add(chunk.key)
                continue
            request.encoded_keys.add(chunk.key)
            context = self.anchor_context if chunk.doc_id is not None and chunk.source_key is None else []
            self.encoding.append(EncodeTask(chunk.key, chunk.token_ids, chunk.local_start, blocks, context))
        return copied

    def _acquire_prefix(self, request: Request) -> None:
        """Prefix mode: pin the longest run of cached full blocks of the prompt (exact prefix)."""
        if not request.plan.prefix_block_keys:
            return
        bs, prompt = self.block_size, request.plan.query_token_ids
        for j, key in enumerate(request.plan.prefix_block_keys):
            entry = self.cache.lookup(key)
            if entry is None or not entry.ready:
                break
            entry.check_tokens(prompt[j * bs:(j + 1) * bs])
            self.cache.pin(key)
            request.pinned.append(key)
            request.num_prefix_tokens += self.block_size
        total = len(request.plan.query_token_ids)
        if request.num_prefix_tokens >= total:  # keep at least one prompt token to compute
            last = request.pinned.pop()
            self.cache.unpin(last)
            request.num_prefix_tokens -= self.block_size

    @staticmethod
    def _account(request: Request, missed_keys: set[str], copied_keys: set[str]) -> None:
        """Per-request stats: documents hit/missed and prompt-head tokens cached (first acquisition),
        prompt tokens computed."""
        stats = request.stats
        encoded = sum(len(c.token_ids) for c in {c.key: c for c in request.plan.chunks}.values()
                      if c.key in missed_keys and c.key not in copied_keys)
        stats.num_computed_tokens += encoded
        if request.num_preemptions == 0:
            stats.num_computed_tokens -= request.num_prefix_tokens
            stats.num_cached_head_tokens = sum(len(c.token_ids) for c in request.plan.chunks if c.doc_id is None
                                               and (c.key not in missed_keys or c.key in copied_keys))
            for c in request.plan.chunks:
                if c.doc_id is not None:
                    (stats.docs_missed if c.key in missed_keys else stats.docs_hit).append(c.doc_id)
