"""The output processor: sampled logits -> tokens -> detokenized deltas, finishing, per-request stats.

After each forward pass the engine hands it the step's compute jobs and their logits rows;
for each job that samples it applies the penalties and a structured output's mask, picks the token (greedy rows share one
device sync), records the first token's time (TTFT), checks stop ids, stop strings and
length, and hands a :class:`~lazyattn_rag.types.outputs.StreamDelta` to the request's sink.
A finished, failed or aborted request is released through the scheduler and counted once in
:class:`EngineCounters`. A consumer whose sink raises loses only its own request.
"""

from __future__ import annotations

import logging
import time
import torch

from lazyattn_rag.engine.counters import EngineCounters
from lazyattn_rag.engine.scheduling.request import Request, RequestStatus
from lazyattn_rag.engine.output.grammar import mask_rows
from lazyattn_rag.engine.output.output_state import OutputState, Sink
from lazyattn_rag.engine.output.sampler import apply_penalties, sample
from lazyattn_rag.engine.scheduling.scheduler import Scheduler
from lazyattn_rag.engine.scheduling.scheduler_output import ComputeJob
from lazyattn_rag.types.outputs import StreamDelta, VocabLogprobs

logger = logging.getLogger(__name__)
__all__ = ["OutputProcessor", "OutputState", "Sink", "token_logprobs"]


class OutputProcessor:
    """Turns each step's logits into tokens and deltas, and ends requests.

    Args:
        scheduler: releases a request's blocks and pins when it ends.
        counters: the engine's counters.
        max_model_len: the context limit (a request stops with ``"length"`` there).

    Attributes:
        requests: unfinished requests by id (submitted, not yet finished, failed or aborted).
        states: their :class:`OutputState` by id.
    """

    def __init__(self, scheduler: Scheduler, counters: EngineCounters, max_model_len: int):
        self.scheduler, self.counters, self.max_model_len = scheduler, counters, max_model_len
        self.requests: dict[str, Request] = {}
        self.states: dict[str, OutputState] = {}
        self._forked: set[str] = set()  # answers that share another's prompt: counted for their tokens only

    def add(self, request: Request, state: OutputState) -> None:
        """Take ``request`` in, with what its output needs."""
        self.requests[request.request_id] = request
        self.states[request.request_id] = state

    def process(self, computes: list[ComputeJob], logits: torch.Tensor) -> None:
        """Sample and emit for every job that samples.

        Args:
            computes: the step's compute jobs.
            logits: ``[len(computes), vocab_size]`` float32, each job's last row.
        """
        grammars = {i: state.grammar for i, job in enumerate(computes) if job.sample
                    and (state := self.states.get(job.request.request_id)) is not None and state.grammar is not None}
        failed: dict[int, Exception] = {}  # a grammar that raised fails its own request only
        masked = mask_rows(logits, grammars, failed.__setitem__)  # structured output's masks: one launch
        greedy = masked.argmax(dim=-1).tolist()  # one device sync for every greedy request of the step
        for i, (job, raw, row, token) in enumerate(zip(computes, logits, masked, greedy)):
            if not job.sample:
                continue
            if i in failed:
                self.fail(job.request, failed[i])
                continue
            try:
                self._emit_token(job.request, raw, row, token)
            except Exception as error:  # e.g. sampling failed: this request fails, the others go on
                if job.request.status is not RequestStatus.FINISHED:
                    self.fail(job.request, error)

    def _emit_token(self, r: Request, raw: torch.Tensor, logits: torch.Tensor, greedy_token: int) -> None:
        """Sample ``r``'s next token and emit it. ``raw``: its ``[vocab_size]`` logits row as the
        model gave it (for logprobs); ``logits``: the same row with its structured output's mask
        applied (``raw`` itself without one); ``greedy_token``: the argmax of ``logits``."""
        state = self.states[r.request_id]
        if state.forks:  # the prompt is computed: the other answers start from it and these logits
            self._fork(r, state, raw, logits, greedy_token)
        if r.params.has_penalties:
            logits = apply_penalties(logits, r.params, r.prompt_token_ids, r.output_ids)
            greedy_token = int(torch.argmax(logits))
        token = greedy_token if r.params.greedy else sample(logits, r.params, state.generator)
        self._record_first_token(r, state)
        logprobs = token_logprobs(raw, token, r.params.logprobs) if r.params.logprobs is not None else None
        if state.grammar is not None:
            state.grammar.accept(token)
        if token in state.stop_token_ids or (state.grammar is not None and state.grammar.is_terminated):
            self.finish(r, "stop", logprobs=logprobs)
            return
        r.output_ids.append(token)
        text = state.detokenizer.add(token)
        reason = None
        if state.detokenizer.stopped:
            reason = "stop"
        elif len(r.output_ids) >= r.params.max_tokens or (
                r.plan.num_prompt_tokens + len(r.output_ids) >= self.max_model_len):
            reason = "length"
        if not self._emit(r, StreamDelta(text, token, logprobs=logprobs)):  # nobody listens any more: drop it
            self.abort(r)
        elif reason is not None:
            self.finish(r, reason)

    def _fork(self, parent: Request, state: OutputState, raw: torch.Tensor, logits: torch.Tensor,
              greedy_token: int) -> None:
        """Start each other answer of ``parent`` (``SamplingParams.n``) on its computed prompt and
        sample its first token from the same ``raw`` and masked ``logits`` (the answers share
        their sampling parameters, so their grammars start in the parent's state); one that
        cannot share the prompt is queued to compute it (``Scheduler.fork``)."""
        forks, state.forks = state.forks, []
        for child, child_state in forks:
            self.add(child, child_state)
            if not self.scheduler.fork(parent, child):
                continue
            self._forked.add(child.request_id)
            s, p = child.stats, parent.stats
            s.docs_hit, s.doc_sources, s.doc_tiers = p.docs_hit + p.docs_missed, dict(p.doc_sources), dict(p.doc_tiers)
            s.num_exact_prefix_tokens = p.num_exact_prefix_tokens + p.num_computed_tokens  # read where computed
            s.num_computed_tokens = s.num_recomputed_tokens = 0
            try:
                self._emit_token(child, raw, logits, greedy_token)
            except Exception as error:  # its sampling failed: it alone fails
                self.fail(child, error)

    def _end_forks(self, state: OutputState, error: Exception | None = None) -> None:
        """End the answers still waiting to fork from a request that ended before its first
        token: aborted with it, or failed with its ``error``."""
        forks, state.forks = state.forks, []
        for child, child_state in forks:
            child_state.sink(error if error is not None else StreamDelta("", None, True, "abort", child.stats))

    def _record_first_token(self, r: Request, state: OutputState) -> None:
        if state.first_token_time is not None:
            return
        state.first_token_time = time.perf_counter()
        r.stats.ttft_ms = (state.first_token_time - r.arrival_time) * 1e3
        if self.counters.first_request_ttft_ms is None:
            self.counters.first_request_ttft_ms = r.stats.ttft_ms

    # --- ending requests ------------------------------------------------------------------
    def finish(self, r: Request, reason: str, release: bool = True, logprobs=None) -> None:
        """End ``r`` with ``reason`` (``stop``, ``length``, ``warm`` or ``abort``): release what it
        holds (unless the caller did), fill its stats, and send the final delta (with
        ``logprobs``: the stop token's step, when asked for)."""
        if release:
            self.scheduler.remove(r)
        r.status = RequestStatus.FINISHED
        state = self.states[r.request_id]
        state.finish_reason = reason
        self._end_forks(state)
        self.requests.pop(r.request_id, None)
        _fill_stats(r, state)
        if reason != "abort":
            self._count_finished(r)
        self._emit(r, StreamDelta(state.detokenizer.flush(), None, True, reason, r.stats, logprobs))
        self.states.pop(r.request_id, None)

    def abort(self, r: Request) -> None:
        """Cancel ``r``: release it and send its final delta (``finish_reason="abort"``)."""
        self._forked.discard(r.request_id)
        self.scheduler.remove(r)
        self.counters.num_requests_aborted += 1
        self.finish(r, "abort", release=False)

    def fail(self, r: Request, error: Exception, release: bool = True) -> None:
        """End ``r`` with ``error``, which its sink receives (its stream raises it)."""
        self._forked.discard(r.request_id)
        if release:
            self.scheduler.remove(r)
        r.status = RequestStatus.FINISHED
        self.requests.pop(r.request_id, None)
        self.counters.num_requests_failed += 1
        if r.request_id in self.states:
            self._end_forks(self.states[r.request_id], error)
        self._emit(r, error)
        self.states.pop(r.request_id, None)

    def _count_finished(self, r: Request) -> None:
        c, s = self.counters, r.stats
        if r.request_id in self._forked:  # another answer of a request counted once: its tokens only
            self._forked.discard(r.request_id)
            c.num_output_tokens += s.num_output_tokens
            return
        c.num_requests_finished += 1
        c.num_prompt_tokens += s.num_prompt_tokens
        c.num_cached_prompt_tokens += s.num_cached_tokens
        c.num_doc_lookups += len(s.docs_hit) + len(s.docs_missed)
        c.num_doc_hits += len(s.docs_hit)
        c.num_output_tokens += s.num_output_tokens
        c.num_exact_prefix_tokens += s.num_exact_prefix_tokens
        c.num_shifted_tokens += s.num_shifted_tokens
        c.num_computed_prompt_tokens += s.num_computed_tokens
        c.num_recomputed_tokens += s.num_recomputed_tokens
        for doc_id in s.docs_hit + s.docs_missed:
            source = s.doc_sources.get(doc_id, "id")
            c.doc_placements[source] = c.doc_placements.get(source, 0) + 1
        for name, histogram in c.latencies.items():
            value_ms = getattr(s, f"{name}_ms")
            if value_ms is not None:
                histogram.observe(value_ms / 1e3)

    def _emit(self, r: Request, item: StreamDelta | BaseException) -> bool:
        """Hand ``item`` to the request's sink; ``False`` if the sink raised (e.g. its asyncio
        loop is closed). A broken consumer costs only its own request, never the step."""
        state = self.states.get(r.request_id)
        if state is None:  # already ended: its consumer has had its last item
            return False
        try:
            state.sink(item)
            return True
        except Exception:  # noqa: BLE001 - logged; the other requests of the step go on
            logger.warning("request %s: its consumer raised; dropping it", r.request_id, exc_info=True)
            return False


def token_logprobs(logits: torch.Tensor, token: int, num: int) -> dict[int, float] | VocabLogprobs:
    """``{token_id: log-probability}`` of the ``num`` most likely tokens of ``logits``
    (``[vocab_size]`` float32; ``-1``: all of them) and of ``token``."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    if num == -1 or num >= logp.numel():
        return VocabLogprobs(logp.cpu())
    values, ids = torch.topk(logp, num) if num else (logp[:0], torch.empty(0, dtype=torch.int64))
    out = dict(zip(ids.tolist(), values.tolist()))
    out[token] = float(logp[token])
    return out


def _fill_stats(r: Request, state: OutputState) -> None:
    """The request's final timings and token counts (its cached/computed split and documents
    were counted by the scheduler when it acquired its chunks)."""
    now, s = time.perf_counter(), r.stats
    s.num_output_tokens = len(r.output_ids)
    s.e2e_ms = (now - r.arrival_time) * 1e3
    s.queue_ms = ((r.first_scheduled_time or now) - r.arrival_time) * 1e3
    s.num_preemptions = r.num_preemptions
    s.loop_stopped = state.detokenizer.looped
    if state.first_token_time is not None and len(r.output_ids) > 1:
        s.tpot_ms = (now - state.first_token_time) * 1e3 / (len(r.output_ids) - 1)
    s.num_cached_tokens = max(0, s.num_prompt_tokens - s.num_computed_tokens)
    s.num_exact_prefix_tokens = min(s.num_exact_prefix_tokens, s.num_cached_tokens)
    s.num_shifted_tokens = s.num_cached_tokens - s.num_exact_prefix_tokens
