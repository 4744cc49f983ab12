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

from lazyattn_rag.engine.scheduling.admission import Admission, ChunkAdmission
from lazyattn_rag.engine.scheduling.forks import RequestForks
from lazyattn_rag.engine.scheduling.head_copies import head_slot_copies
from lazyattn_rag.engine.scheduling.capacity import BlockBudget
from lazyattn_rag.engine.kv.block_table import BlockEntry, block_table_entries
from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.tiers.chunk_tiers import ChunkTiers
from lazyattn_rag.engine.counters import EngineCounters
from lazyattn_rag.engine.planning.prompt_plan import ChunkSegment
from lazyattn_rag.engine.scheduling.request import Request, RequestStatus
from lazyattn_rag.engine.scheduling.scheduler_output import ComputeJob, ChunkPrefillTask, SchedulerOutput
from lazyattn_rag.engine.scheduling.selective_schedule import SelectiveRecompute


class Scheduler:
    """Continuous batching over the chunk cache, composed of the parts it hands each concern:
    :attr:`budget` (block arithmetic), :attr:`admission` (a waiting request acquires its
    chunks) and :attr:`selective` (selective recompute's steps).

    Args:
        cache: the chunk cache (and through it the block pool).
        max_num_batched_tokens: token budget of one step (prompts and chunks go in pieces; only
            selective recompute's text segments run whole, alone when longer).
        max_num_seqs: most requests holding resources at once.
        anchor_context: block-table entries of the anchor documents are encoded after
            (permanently pinned by the engine; empty without an anchor).
        anchor_key: the anchor's chunk key (its blocks are not counted against requests).
        prefill_with_encodes: see :class:`lazyattn_rag.types.config.SchedulerConfig`.
        counters: the engine's counters (preemptions are counted here).
        tiers: storage tiers below the pool where a missing chunk is looked up before it is
            encoded (``engine/tiers/chunk_tiers.py``); ``None``: none.
    """

    def __init__(self, cache: ChunkCache, max_num_batched_tokens: int, max_num_seqs: int,
                 anchor_context: list[BlockEntry], anchor_key: str | None = None,
                 prefill_with_encodes: bool = True, counters: EngineCounters | None = None,
                 tiers: ChunkTiers | None = None):
        self.cache, self.tiers = cache, tiers
        self.prefill_with_encodes = prefill_with_encodes
        self.block_size = cache.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # a running request's first step (selected queries) did not fit this step's budget: no
        # request is admitted until it has run (it runs alone once the others drain)
        self._waiting_for_room = False
        self.anchor_context = anchor_context
        self.anchor_key = anchor_key
        self.waiting: deque[Request] = deque()
        self.acquired: list[Request] = []
        self.running: list[Request] = []
        self.chunk_tasks: list[ChunkPrefillTask] = []  # chunks being encoded, oldest first
        self.counters = counters if counters is not None else EngineCounters()
        self._released: list[str] = []  # request ids released since the last schedule()
        self.selective = SelectiveRecompute(cache)
        self.budget = BlockBudget(cache, anchor_context, anchor_key, self.selective)
        self.admission = ChunkAdmission(cache, self.budget, self.selective, self.chunk_tasks, self.release,
                                        anchor_context, tiers, self.counters)
        self.forks = RequestForks(cache)

    # --- queue management -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def fork(self, parent: Request, child: Request) -> bool:
        """Run ``child`` (another answer of ``parent``'s prompt) on the prompt ``parent`` has just
        computed (``engine/scheduling/forks.py``): ``True``; or queue it to compute the prompt
        itself when it cannot share it: ``False``."""
        if not self.forks.share(parent, child):
            self.add(child)
            return False
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.acquired or self.running or self.chunk_tasks)

    def drop_chunk_prefills(self, keys: set[str] | None = None) -> None:
        """Abandon the encode tasks of ``keys`` (all when ``None``): their pending entries are
        discarded (a step that wrote them failed, or every request was failed)."""
        for task in [t for t in self.chunk_tasks if keys is None or t.key in keys]:
            self.chunk_tasks.remove(task)
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
        """Give back ``request``'s private blocks and pins and reset its progress (it is
        recomputed if it runs again). A request that was running (so the runner may keep its
        block table) is reported in the next output's ``released_ids``."""
        if request.status is RequestStatus.RUNNING:
            self._released.append(request.request_id)
        if request.private_blocks:
            self.cache.pool.decref(request.private_blocks)
            request.private_blocks = []
            self.forks.drop(request.request_id)
        self.selective.release(request)
        self.cache.release(request.request_id)
        request.context_entries = []
        request.context_len = 0
        request.num_computed = 0
        request.num_prefix_tokens = 0
        request.num_prefix_registered = 0
        request.num_seeded_tokens = 0

    # --- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's work (see the module docstring for the order).

        ``released_ids`` is handed over last: it includes requests preempted in this very call,
        which may be admitted again in it (their old block tables must go before this step's
        inputs are prepared)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._waiting_for_room = False
        budget = self._schedule_running(out, budget)
        budget = self._schedule_chunk_prefills(out, self.chunk_tasks, budget)
        budget = self._promote_ready(out, budget)
        if not self._waiting_for_room:  # else no new request: the running ones drain for it
            self._schedule_waiting(out, budget)
        out.released_ids, self._released = self._released, []
        out.slot_copies = self.forks.take_copies() + out.slot_copies  # forked answers' prompt ends, first
        return out

    def update_from_output(self, out: SchedulerOutput) -> None:
        """After the step's forward pass ran: copied and fully encoded chunks become readable
        (their writers let go), and each compute job's tokens count as computed (a plan with
        prefix block keys also hands its newly completed full tail blocks to the cache)."""
        for copy in out.copies:
            self.cache.mark_ready(copy.dst_key)
            self.cache.unpin(copy.dst_key)  # the writer's pin (insert_pending)
            self.cache.unpin(copy.src_key)
        for load in out.loads:
            self.cache.mark_ready(load.key)
            self.cache.unpin(load.key)  # the writer's pin
        for seed in out.head_seeds:  # copied: the head's encode goes on from its own blocks
            for key in seed.src_keys:
                self.cache.unpin(key)
            if seed.complete:  # nothing left to encode: readable now, the writer lets go
                self.cache.mark_ready(seed.dst_key)
                self.cache.unpin(seed.dst_key)
        for job in out.chunk_prefills:
            if job.final:  # the chunk's last piece: readable from now on; the encoder lets go
                self.cache.mark_ready(job.key)
                self.cache.unpin(job.key)
        self.selective.finish(out)
        for job in out.computes:
            job.request.num_computed += job.num_tokens
            if job.request.plan.prefix_block_keys:
                self._register_prefix_blocks(job.request)

    def abandon(self, out: SchedulerOutput) -> list[Request]:
        """The step's loads, copies, selections or forward pass raised: release the step's requests and every
        request holding a chunk the step was writing (admitted or running), drop those chunks'
        pending entries and the copies' source pins. Returns the released requests (they must fail)."""
        pending = {job.key for job in out.chunk_prefills} | {c.dst_key for c in out.copies} | {j.key for j in out.loads}
        pending |= {seed.dst_key for seed in out.head_seeds}  # a head whose seed may not have been copied
        for copy in out.copies:
            self.cache.unpin(copy.src_key)
        for key in (k for seed in out.head_seeds for k in seed.src_keys):
            self.cache.unpin(key)
        victims = {id(j.request): j.request for j in out.computes + out.selections}
        victims.update({id(r): r for r in self.acquired + self.running
                        if pending.intersection(self.cache.pins_of(r.request_id))})
        for r in victims.values():
            self.remove(r)
        self.drop_chunk_prefills(pending)  # chunks whose encoding had more pieces to go
        for key in pending:
            if self.cache.lookup(key, touch=False, include_dead=True) is not None:
                self.cache.discard_pending(key)
        return list(victims.values())

    def _register_prefix_blocks(self, r: Request) -> None:
        """Exact-prefix caching: hand the request's newly completed full blocks of its query tail
        to the cache (``PromptPlan.prefix_block_keys``). The tail's blocks follow its text
        segments' among its private blocks, and a prefix hit's blocks are not among them."""
        bs = self.block_size
        hit_blocks = r.num_prefix_tokens // bs
        text_blocks = sum(self.budget.blocks_for(len(t.token_ids)) for t in r.plan.texts)
        tail_done = min(max(0, r.num_computed - r.plan.num_text_tokens),
                        len(r.plan.query_token_ids) - r.num_prefix_tokens)
        full = (r.num_prefix_tokens + tail_done) // bs
        for j in range(hit_blocks + r.num_prefix_registered, min(full, len(r.plan.prefix_block_keys))):
            key = r.plan.prefix_block_keys[j]
            if self.cache.lookup(key, touch=False) is None:
                block = r.private_blocks[text_blocks + j - hit_blocks]
                self.cache.pool.incref([block])
                self.cache.insert(key, [block], bs, j * bs, tuple(r.plan.query_token_ids[j * bs:(j + 1) * bs]),
                                  exact_prefix=True)
                # Pinned while the request also holds the block: evicting the entry now would not
                # free it, so it must not count as evictable room.
                self.cache.pin(key, holder=r.request_id)
            r.num_prefix_registered += 1

    def _schedule_chunk_prefills(self, out: SchedulerOutput, tasks: list[ChunkPrefillTask], budget: int) -> int:
        """The next piece of each task, oldest first, within ``budget``; returns the budget left.

        A chunk larger than a step's budget is encoded over several steps (as a long prompt is
        prefilled in pieces), so a cold document never waits for the running batch to drain. A
        task whose chunk no request wants any more (its document was removed) is dropped.
        """
        for task in list(tasks):
            entry = self.cache.held(task.key)
            if entry.dead and entry.pin_count == 1:  # only the encoder holds it: nobody will read it
                self.chunk_tasks.remove(task)
                self.cache.discard_pending(task.key)
                continue
            if budget <= 0:
                break
            job = task.next_piece(budget)
            out.chunk_prefills.append(job)
            budget -= len(job.token_ids)
            if job.final:
                self.chunk_tasks.remove(task)
        return budget

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            budget -= self._schedule_compute(out, request, budget, may_preempt=True)
        return budget

    def _schedule_compute(self, out: SchedulerOutput, request: Request, budget: int, may_preempt: bool) -> int:
        """Schedule the next private tokens of ``request``; returns the tokens scheduled."""
        todo = request.num_tokens_to_compute
        n = min(todo, budget)  # a long prompt in pieces even alone: aborts and arrivals are seen between them
        selected = len(request.selected_queries) if request.num_computed == 0 else 0
        if selected:  # the selected queries run with every text segment (a selected token after one attends to it)
            n = max(n, min(request.plan.num_text_tokens, todo))
            if n + selected > budget and not out.is_empty:
                self._waiting_for_room = True  # it runs alone once the running requests drain
                return 0
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
        if request.plan.num_text_tokens and request.num_computed < request.plan.num_text_tokens:
            out.head_copies += head_slot_copies(self.cache, request, request.num_computed, request.num_computed + n)
        total = request.num_private_tokens
        out.computes.append(ComputeJob(request, request.num_computed, n, request.num_computed + n == total, selected))
        return n + selected

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
        self.counters.num_preemptions += 1
        self.waiting.appendleft(request)

    def _promote_ready(self, out: SchedulerOutput, budget: int) -> int:
        for request in list(self.acquired):
            budget -= self._promote(out, request, budget)
        return budget

    def _promote(self, out: SchedulerOutput, request: Request, budget: int) -> int:
        """Move an acquired request whose chunks are all written, or written by this step, to
        running; schedule its prefill (in the same forward pass as the encodes it waits for).
        A warm-up finishes only once its chunks are written."""
        pinned = self.cache.pins_of(request.request_id)
        written = all(self.cache.held(k).ready for k in pinned)
        if not written:
            # Join this step only with a prefill to run in it: a request that waited here on a
            # step whose forward pass then failed would hold chunks that were never written.
            # (A recomputed head's copied slots are copied inside the pass, after each layer's write.)
            # The chunks whose tokens selective recompute measures before the pass must be written already.
            joins = self.prefill_with_encodes and not request.warm_only and not request.plan.selective_ratio
            this_step = out.written_keys() if joins else set()
            if budget <= 0 or not all(self.cache.held(k).ready or k in this_step for k in pinned):
                return 0
        if not request.warm_only and self.selective.pending(request):
            out.selections.append(self.selective.job(request))
            return 0
        self.acquired.remove(request)
        if request.warm_only:
            out.warmed.append(request)
            return 0
        chunk_starts: dict[int, int] = {}
        context = self._context_of(request, chunk_starts)
        if request.plan.selective_ratio:
            self.selective.apply(request, out, context, chunk_starts)
        request.context_entries = context
        request.context_len = sum(e.num_valid for e in context)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if budget <= 0:
            return 0
        return self._schedule_compute(out, request, budget, may_preempt=False)

    def _context_of(self, request: Request, chunk_starts: dict[int, int] | None = None) -> list[BlockEntry]:
        """Block-table entries of everything before the query tail, in prompt order: chunks at
        their offsets, text segments in their own (private, delta 0) blocks, prefix-cache hits.
        A chunk whose head the request recomputes contributes its blocks after the head's
        (:meth:`PromptPlan.head_recompute_copy`: a block the head ends inside is the text's last
        block, its other slots copied from the chunk). A document's entries are flagged when the
        request reads it with chunk attention scaling (``PromptPlan.chunk_scaling``; only its first
        ``PromptPlan.chunk_scaling_blocks`` when that is set). ``chunk_starts`` (if given)
        receives each chunk's index in the plan -> the index of its first entry."""
        entries, bs = [], self.block_size
        text_runs = iter(request.private_runs(bs))
        index_of = {id(c): i for i, c in enumerate(request.plan.chunks)}
        for segment in request.plan.segments():
            if isinstance(segment, ChunkSegment):
                if chunk_starts is not None:
                    chunk_starts[index_of[id(segment)]] = len(entries)
                entry = self.cache.held(segment.key)
                skip = -(-segment.num_skipped // bs)  # blocks covered by the recomputed head
                entries += block_table_entries(entry.block_ids[skip:], entry.num_tokens - skip * bs,
                                               segment.global_start - entry.local_start, bs,
                                               request.plan.chunk_scaling and segment.doc_id is not None,
                                               request.plan.chunk_scaling_blocks)
            else:
                run = next(text_runs)
                copy = request.plan.head_recompute_copy(segment, bs)
                blocks = request.private_blocks[run.first_block: run.first_block + self.budget.blocks_for(run.length)]
                entries += block_table_entries(blocks, run.length + (copy[2] if copy else 0), 0, bs)
        for key in request.plan.prefix_block_keys[: request.num_prefix_tokens // bs]:
            entries.append(BlockEntry(self.cache.held(key).block_ids[0], 0, bs))
        return entries

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and len(self.acquired) + len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_tasks = len(self.chunk_tasks)
            try:
                status = self.admission.acquire(request, out)
            except Exception as error:  # fails this request alone; what it took is given back
                self.waiting.popleft()
                out.failed.append((request, error))
                continue
            if status is Admission.WAIT:
                return
            self.waiting.popleft()
            if status is Admission.FAILED:
                continue
            budget = self._schedule_chunk_prefills(out, self.chunk_tasks[num_tasks:], budget)
            self.acquired.append(request)
            request.status = RequestStatus.ACQUIRED
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.perf_counter()
            budget -= self._promote(out, request, budget)  # all hits: prefill in this step
