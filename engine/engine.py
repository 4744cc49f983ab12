"""The engine: submission and ``step()`` = schedule -> run -> process.

Request lifecycle (``docs/architecture.md`` has the one-page map):

1. ``submit_*``: the planner (``engine/planning/planner.py``) turns the question, messages or prompt
   over registered documents (``engine/planning/registry.py``) into a prompt plan, validated at once;
   bad input raises here, touching nothing. The request joins the scheduler's queue.
2. ``step``: the scheduler (``engine/scheduling/scheduler.py``) picks encodes of missing chunks, query
   prefills and decodes under a token budget; the runner (``engine/worker/runner.py``) prepares the
   model inputs and computes them in one forward pass; the scheduler marks written chunks
   ready; the output processor (``engine/output/output_processor.py``) samples, detokenizes and
   hands :class:`~lazyattn_rag.types.outputs.StreamDelta` s to each request's sink.
3. finish / abort: private blocks are freed and pins dropped; the chunks stay cached.

The engine is single-threaded: :mod:`lazyattn_rag.engine.loop` drives it from one thread
and serializes every call into it. One exception: :meth:`LLMEngine.plan_plain_chat` (chat
messages that place no document) runs in another thread (one of the client's planning threads), so
that tokenizing a long pasted prompt does not hold up the steps.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lazyattn_rag.engine.kv.block_table import BlockEntry, block_table_entries
from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.cpu_threads import engine_cpu_threads
from lazyattn_rag.engine.document_removal import purge_replaced
from lazyattn_rag.engine.engine_stats import engine_stats
from lazyattn_rag.engine.tier_writes import TierWrites
from lazyattn_rag.engine.tiers.chunk_tiers import ChunkTiers
from lazyattn_rag.engine.counters import EngineCounters
from lazyattn_rag.engine.output.detokenizer import IncrementalDetokenizer
from lazyattn_rag.engine.output.grammar import GrammarCompiler
from lazyattn_rag.engine.output.output_processor import OutputProcessor, OutputState, Sink
from lazyattn_rag.engine.output.output_state import indexed_sink
from lazyattn_rag.engine.planning.passage_learning import PassageLearner
from lazyattn_rag.engine.planning.planner import PromptPlanner
from lazyattn_rag.engine.planning.prompt_plan import PrefixKeys, PromptPlan
from lazyattn_rag.engine.planning.registry import DocumentRegistry, RegisteredDocument
from lazyattn_rag.engine.scheduling.capacity import check_capacity, fit_max_model_len
from lazyattn_rag.engine.scheduling.request import Request
from lazyattn_rag.engine.worker.runner import ModelRunner
from lazyattn_rag.engine.scheduling.scheduler import Scheduler
from lazyattn_rag.engine.scheduling.scheduler_output import ChunkPrefillJob, SchedulerOutput
from lazyattn_rag.types.config import EngineConfig, RequestRemedies
from lazyattn_rag.types.errors import CacheCapacityError, DocumentTooLongError
from lazyattn_rag.types.messages import DocumentRef, Message
from lazyattn_rag.types.outputs import RequestStats
from lazyattn_rag.types.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """What one step ran, for step listeners.

    Attributes:
        output: the scheduler's output (jobs, failed and warmed requests).
        logits: ``[len(output.computes), vocab_size]`` float32, each compute job's last row (a
            view that the next step may overwrite: copy what you keep).
        seconds: the step's wall time, the device synchronized before and after.
    """

    output: SchedulerOutput
    logits: torch.Tensor
    seconds: float


StepListener = Callable[[StepResult], None]


class LLMEngine:
    """Position-agnostic chunk reuse over a paged KV cache with continuous batching.

    Args:
        runner: the model runner (model, backend, KV tensors, input preparation).
        cache: the chunk cache over the runner's block pool.
        tokenizer: the model's tokenizer.
        model_digest: :meth:`ModelFingerprint.digest` of the loaded model.
        config: engine configuration (anchor mode, prompt, scheduler limits).
        max_model_len: context limit in tokens (lowered to what the KV cache holds).
        eos_token_ids: end-of-sequence ids besides the tokenizer's own.
        tiers: storage tiers below the KV pool (``engine/tiers/chunk_tiers.py``), or ``None``. The
            engine copies a chunk's K/V off the device when the pool evicts it (for the host
            tier) and when a step computes it (for the persistent tiers); the tiers' writer
            thread encodes and stores it.

    Attributes:
        documents: the :class:`DocumentRegistry`.
        planner: the :class:`PromptPlanner`.
        scheduler, outputs: the :class:`Scheduler` and the :class:`OutputProcessor`.
        counters: the :class:`EngineCounters`.
        step_listeners: called with a :class:`StepResult` after each step that ran jobs; while
            any is registered the step synchronizes the device so the time is the step's own
            (benchmarks, the self-check, tests). Add and remove them on the engine thread.
        grammars: the :class:`GrammarCompiler` of structured output (safe to call from any thread).
        default_sampling: sampling when a call passes none (greedy, or the model's generation config).
        info, startup, fingerprint: the loaded model's facts, the start-up timings and the
            :class:`~lazyattn_rag.engine.planning.fingerprint.ModelFingerprint` (set by ``engine/factory.py``).
    """

    def __init__(self, runner: ModelRunner, cache: ChunkCache, tokenizer, model_digest: str,
                 config: EngineConfig, max_model_len: int, eos_token_ids: set[int] | None = None,
                 tiers: ChunkTiers | None = None):
        self.runner, self.cache, self.tokenizer, self.config = runner, cache, tokenizer, config
        self.tiers = tiers
        self.model_digest, self.block_size = model_digest, cache.block_size
        self.documents = DocumentRegistry(cache, self._prepare_document,
                                          lambda old, doc_id, namespace: purge_replaced(self, old, doc_id, namespace))
        self.planner = PromptPlanner(tokenizer, config, model_digest, cache.block_size,
                                     runner.model.config.vocab_size, max_model_len, self.documents)
        self.eos_token_ids = set(eos_token_ids or ())
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.grammars = GrammarCompiler(tokenizer, runner.model.config.vocab_size, self.eos_token_ids)
        self.generator = torch.Generator(device=runner.device).manual_seed(config.seed)  # sampling on device
        self.counters = EngineCounters()
        sched = config.scheduler
        self.scheduler = Scheduler(cache, sched.max_num_batched_tokens, sched.max_num_seqs, self._encode_anchor(),
                                   self.planner.anchor_key, sched.prefill_with_encodes, self.counters, tiers)
        self.tier_writes = TierWrites(tiers, cache, runner.kv_pool, model_digest) if tiers is not None else None
        if tiers is not None and tiers.host is not None:
            cache.on_evict = self.tier_writes.write_back
        self.max_model_len = self.planner.max_model_len = fit_max_model_len(max_model_len, self.scheduler.budget, self.config.max_model_len is not None)
        self.outputs = OutputProcessor(self.scheduler, self.counters, self.max_model_len)
        learn = config.cache.learn_passages and config.cache.mode == "lazy"
        self.passages = PassageLearner(self.planner, cache, config.cache) if learn else None
        self.step_listeners: list[StepListener] = []
        self.cpu_threads = engine_cpu_threads(config.cpu_threads, runner.device)  # on the engine thread
        self.default_sampling = SamplingParams()  # the factory sets the model's own under generation_config="auto"
        self.info: dict = {}
        self.startup: dict = {}
        self.fingerprint = None

    def _encode_anchor(self) -> list[BlockEntry]:
        """Encode the anchor once and pin it for the engine's lifetime; its block-table entries."""
        key, ids = self.planner.anchor_key, self.planner.anchor_ids
        if key is None:
            return []
        blocks = self.cache.allocate(-(-len(ids) // self.block_size))
        entry = self.cache.insert_pending(key, blocks, len(ids), 0, token_ids=ids)
        self.runner.execute_step(SchedulerOutput(chunk_prefills=[ChunkPrefillJob(key, ids, 0, blocks, [])]))
        self.cache.mark_ready(key)
        return block_table_entries(entry.block_ids, len(ids), 0, self.block_size)

    def _prepare_document(self, doc_id: str, text: str, namespace: str = "") -> RegisteredDocument:
        """The planner's checks, then: one request with the document must fit the KV cache (a
        chunk starts a block of its own, so tokens under the context limit are not enough).

        Raises:
            EmptyInputError, DocumentTooLongError: naming the document (and the blocks needed).
        """
        doc = self.planner.prepare_document(doc_id, text, namespace)
        blocks, planner = self.scheduler.budget.blocks_for, self.planner
        head = 0 if planner.head_key == planner.anchor_key else blocks(len(planner.head_ids))
        need = head + blocks(len(doc.token_ids)) + blocks(planner.min_tail_tokens + 1)
        if need > self.scheduler.budget.num_usable_blocks:
            raise DocumentTooLongError(
                f"document {doc_id!r} has {len(doc.token_ids)} tokens; with the prompt head and a question one "
                f"request needs {need} KV blocks, but the cache has {self.scheduler.budget.describe()}")
        return doc

    # --- submission -----------------------------------------------------------------------
    def submit_question(self, question: str, doc_ids: list[str], documents: list[tuple[str, str]],
                        params: SamplingParams, sink: Sink, namespace: str = "",
                        remedies: RequestRemedies = RequestRemedies()) -> Request:
        """Plan ``question`` over ``doc_ids`` then the inline ``documents`` (registered first, all
        or none, and only if the request is accepted), all in ``namespace``, and queue it.

        Raises:
            what :meth:`DocumentRegistry.add`, :meth:`PromptPlanner.plan` and :meth:`submit`
            raise; then nothing is registered or queued.
        """
        with self.documents.inline(documents, namespace):
            return self.submit(self.planner.plan(question, doc_ids + [d for d, _ in documents], namespace, remedies),
                               params, sink)

    def submit_chat(self, messages: list[Message], documents: list[tuple[str, str]], params: SamplingParams,
                    sink: Sink, namespace: str = "", remedies: RequestRemedies = RequestRemedies(),
                    plans: list[PromptPlan | Callable[[], PromptPlan]] | None = None) -> Request:
        """Plan chat ``messages`` (:meth:`PromptPlanner.plan_messages`) with inline ``documents``
        in ``namespace`` and queue it; errors as :meth:`submit_question`. With
        ``CacheConfig.learn_passages``, passages of their text that recur are placed from cached
        chunks when that computes less (``engine/planning/passage_learning.py``). ``plans``: what
        :meth:`plan_plain_chat` gave for the same arguments off the engine thread (the first
        that fits the cache is queued); ``None`` plans here.
        """
        with self.documents.inline(documents, namespace):
            if plans is None:
                plans = self._chat_plans(messages, namespace, remedies)
            for plan in plans[:-1]:
                try:
                    return self.submit(plan, params, sink)
                except CacheCapacityError:  # a learned layout's chunks each start a block: the next may still fit
                    pass
            last = plans[-1]
            return self.submit(last if isinstance(last, PromptPlan) else last(), params, sink)

    def plan_plain_chat(self, messages: list[Message], namespace: str = "",
                        remedies: RequestRemedies = RequestRemedies()) -> list[PromptPlan | Callable[[], PromptPlan]] | None:
        """The plans :meth:`submit_chat` tries, in order, for ``messages`` that place no
        document (no :class:`~lazyattn_rag.types.messages.DocumentRef`; no inline documents
        are passed with them), or ``None`` for messages that do. The last, the plain layout,
        may be a function that plans it: the passage learner chose a learned layout without
        it, and it is planned (tokenized) only if that layout does not fit the cache.

        Safe to call from any thread while the engine steps, so that tokenizing a long pasted
        prompt (most of planning it) does not hold up the step loop (vLLM tokenizes in its API
        process for the same reason): it reads the tokenizer, the chunk cache's entries by key
        (only to choose the cheaper layout; every layout is correct whatever the cache holds
        when it runs) and the passage learner's history, under the learner's lock.

        Raises:
            what :meth:`PromptPlanner.plan_messages` raises.
        """
        if any(isinstance(part, DocumentRef) for m in messages for part in m.parts()):
            return None
        return self._chat_plans(messages, namespace, remedies)

    def _chat_plans(self, messages: list[Message], namespace: str,
                    remedies: RequestRemedies) -> list[PromptPlan | Callable[[], PromptPlan]]:
        """The layout the passage learner prefers (if it is not the plain one), then the plain one;
        the plain one behind a function when the learner chose without it (planned only if the
        learned layout does not fit the cache)."""
        plain = functools.cache(functools.partial(self.planner.plan_messages, messages, namespace, remedies))
        learned = self.passages.choose(messages, plain, namespace, remedies) if self.passages is not None else plain()
        for keys in (learned.prefix_block_keys, learned.head_prefix_keys):  # the layout queued first: hashed
            if isinstance(keys, PrefixKeys):  # here, off the steps
                keys.hash_all()
        return [learned, plain] if any(c.learned for c in learned.chunks) else [learned]

    def submit_prompt(self, prompt: str | list[int] | list[str | DocumentRef], params: SamplingParams, sink: Sink,
                      documents: list[tuple[str, str]] = (), namespace: str = "",
                      remedies: RequestRemedies = RequestRemedies()) -> Request:
        """Queue a raw prompt (the caller's own template): text or token ids, computed whole
        (:meth:`PromptPlanner.plan_prompt`), or text and :class:`DocumentRef` parts placing
        documents registered in ``namespace`` or given inline in ``documents`` (registered first,
        all or none, only if the request is accepted: :meth:`PromptPlanner.plan_raw`)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, DocumentRef)) for p in prompt):
            with self.documents.inline(list(documents), namespace):
                return self.submit(self.planner.plan_raw(prompt, namespace, remedies), params, sink)
        return self.submit(self.planner.plan_prompt(prompt, namespace), params, sink)

    def submit_warm(self, doc_ids: list[str], sink: Sink, namespace: str = "") -> Request:
        """Queue a warm-up: encode the documents' chunks (no question). Raises ``UnknownDocumentError``."""
        return self.submit(self.planner.plan_warm(doc_ids, namespace), SamplingParams(max_tokens=1), sink,
                           warm_only=True)

    def submit(self, plan: PromptPlan, params: SamplingParams, sink: Sink, warm_only: bool = False) -> Request:
        """Queue a planned request; deltas (or an exception) go to ``sink`` from :meth:`step`.
        With ``params.n > 1`` the other answers (ids ``<id>-1`` ...) wait to fork from its
        prompt (``engine/scheduling/forks.py``); their deltas carry their ``index``.

        Raises:
            CacheCapacityError: the prompt plus ``max_tokens`` could never fit the KV cache.
            ValueError: ``params.structured_output`` does not compile (or xgrammar is missing).
        """
        rid = uuid.uuid4().hex[:16]
        request = self._request(rid, plan, params, warm_only)
        check_capacity(request, self.scheduler.budget, self.max_model_len)
        state = self._output_state(params, sink)
        for i in range(1, params.n):
            child_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else (params.seed + i) % 2**63)
            state.forks.append((self._request(f"{rid}-{i}", plan, child_params),
                                self._output_state(child_params, indexed_sink(sink, i))))
        self.outputs.add(request, state)
        self.scheduler.add(request)
        return request

    def _request(self, rid: str, plan: PromptPlan, params: SamplingParams, warm_only: bool = False) -> Request:
        stats = RequestStats(rid, num_prompt_tokens=plan.num_prompt_tokens, arrival_time=time.time())
        stats.num_computed_tokens = len(plan.query_token_ids) + plan.num_text_tokens
        stats.num_recomputed_tokens, stats.remedy = plan.num_head_recompute_tokens, plan.remedy
        return Request(rid, plan, params, stats, warm_only=warm_only)

    def _output_state(self, params: SamplingParams, sink: Sink) -> OutputState:
        gen = torch.Generator(device=self.runner.device).manual_seed(params.seed) if params.seed is not None else self.generator
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.loop_guard_ngram,
                                             params.skip_special_tokens)
        grammar = self.grammars.matcher(params.structured_output) if params.structured_output else None
        return OutputState(sink, detokenizer, gen, stop_ids, grammar=grammar)

    def answers(self, request: Request) -> list[Request]:
        """``request`` and the other answers waiting to fork from it (``SamplingParams.n``:
        ``<id>-1`` ...; none once they forked)."""
        state = self.outputs.states.get(request.request_id)
        return [request] + [child for child, _ in (state.forks if state is not None else ())]

    def abort(self, request_id: str) -> bool:
        """Cancel a request and its other answers (``SamplingParams.n``); frees everything they
        hold. Returns ``False`` if all had finished."""
        family = [r for rid, r in self.outputs.requests.items() if rid == request_id or rid.startswith(request_id + "-")]
        for request in family:
            self.outputs.abort(request)
        return bool(family)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def fail_all(self, error: Exception) -> None:
        """Fail every unfinished request with ``error`` and release what it holds.

        Every request's sink gets the error even if releasing one of them raises (this is the
        loop's last resort after a broken step: no caller may be left waiting).
        """
        for request in list(self.outputs.requests.values()):
            try:
                self.scheduler.remove(request)
            except Exception:  # noqa: BLE001 - logged; the caller must still hear of its failure
                logger.exception("releasing request %s failed", request.request_id)
            self.outputs.fail(request, error, release=False)
        self.scheduler.drop_chunk_prefills()

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Schedule, run one forward pass, process its outputs. ``False`` if there was nothing to do."""
        if self.cpu_threads is not None:
            self.cpu_threads.maybe_fit()
        if not self.step_listeners:
            return self._step() is not None
        self._synchronize()
        start = time.perf_counter()
        ran = self._step()
        self._synchronize()
        if ran is not None and ran[1] is not None:
            self._notify(StepResult(ran[0], ran[1], time.perf_counter() - start))
        return ran is not None

    def _notify(self, result: StepResult) -> None:
        """Call each step listener; one that raises is logged and removed (a broken diagnostic
        costs only itself, never the requests)."""
        for listener in list(self.step_listeners):
            try:
                listener(result)
            except Exception:  # noqa: BLE001 - logged; the step and its requests are unaffected
                logger.exception("step listener %r raised; removed", listener)
                if listener in self.step_listeners:
                    self.step_listeners.remove(listener)

    def _step(self) -> tuple[SchedulerOutput, torch.Tensor | None] | None:
        """One step: what was scheduled and the logits of its compute jobs (``None`` when no
        forward pass ran); ``None`` when there was nothing to do."""
        out = self.scheduler.schedule()
        self.runner.inputs.release(out.released_ids)  # before any of this step's inputs are prepared
        for request, error in out.failed:
            self.outputs.fail(request, error)
        for request in out.warmed:
            self.outputs.finish(request, "warm")
        if out.is_empty:
            return (out, None) if out.failed or out.warmed or out.released_ids else None
        self.counters.num_steps += 1
        measure = self.tiers is not None and bool(out.chunk_prefills)
        if measure:
            self._synchronize()
            start = time.perf_counter()
        try:
            logits = self.runner.execute_step(out)
        except Exception as error:  # a broken step fails its requests, never the cache
            for request in self.scheduler.abandon(out):
                self.outputs.fail(request, error, release=False)
            return out, None
        self.scheduler.update_from_output(out)
        self.outputs.process(out.computes, logits)
        if measure:  # prefill speed, against which loading from a tier is weighed
            self._synchronize()
            self.tiers.costs.record_prefill(out.num_batched_tokens, time.perf_counter() - start)
        if self.tiers is not None and self.tiers.persistent and (out.chunk_prefills or out.head_seeds):
            self.tier_writes.persist(out)
        return out, logits

    def _synchronize(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def close(self) -> None:
        """Fail what is unfinished and free the KV cache and CUDA graphs (on the engine thread)."""
        self.fail_all(RuntimeError("the engine was closed"))
        if self.tiers is not None:
            self.tiers.close()  # the queued writes finish first
        self.runner.close()

    # --- introspection --------------------------------------------------------------------
    def stats(self) -> dict:
        """Engine-wide stats (:func:`~lazyattn_rag.engine.engine_stats.engine_stats`)."""
        return engine_stats(self)
