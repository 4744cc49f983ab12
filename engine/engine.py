"""The engine: documents, prompt plans, and ``step()`` = schedule -> run -> postprocess.

Request lifecycle (``docs/architecture.md`` has the picture):

1. ``submit``: the prompt plan (head, document chunks with content keys and global starts,
   query tail) is built and validated at once; bad input raises here, touching nothing.
2. ``step``: the :class:`~lazyattn_rag.engine.scheduler.Scheduler` picks encodes of missing
   chunks, query prefills and decodes under a token budget; the runner computes them in one
   forward pass; encoded chunks are marked ready; sampled tokens are detokenized and handed
   to each request's sink as :class:`~lazyattn_rag.types.outputs.StreamDelta`.
3. ``finish`` / ``abort``: private blocks are freed and pins dropped; the chunks stay cached.

The engine is single-threaded: :mod:`lazyattn_rag.engine.loop` drives it from one thread
and serializes every call into it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lazyattn_rag.types.config import EngineConfig
from lazyattn_rag.engine.detokenizer import IncrementalDetokenizer
from lazyattn_rag.engine.attention import SequenceInput
from lazyattn_rag.engine.chunk_cache import ChunkCache, block_table_entries
from lazyattn_rag.engine.request import Request, RequestStatus
from lazyattn_rag.engine.runner import ModelRunner
from lazyattn_rag.engine.scheduler import ComputeJob, EncodeJob, Scheduler, SchedulerOutput
from lazyattn_rag.types.errors import (CacheCapacityError, DocumentTooLongError, EmptyInputError, PromptTooLongError,
                                 UnknownDocumentError)
from lazyattn_rag.engine.fingerprint import anchor_fingerprint, chunk_key
from lazyattn_rag.types.outputs import RequestStats, StreamDelta
from lazyattn_rag.types.messages import DocumentRef, Message
from lazyattn_rag.engine.prompt import ChunkSegment, PromptPlan, PromptTemplate, PromptText, TextSegment
from lazyattn_rag.engine.sampler import apply_penalties, sample
from lazyattn_rag.types.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
Sink = Callable[[StreamDelta | BaseException], None]


@dataclass
class _Document:
    text: str
    token_ids: tuple[int, ...]
    key: str


@dataclass
class EngineCounters:
    """Engine-wide counters since start (prompt tokens and documents of finished acquisitions)."""

    num_requests_finished: int = 0
    num_requests_failed: int = 0
    num_requests_aborted: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_doc_lookups: int = 0
    num_doc_hits: int = 0
    num_output_tokens: int = 0
    num_steps: int = 0
    first_request_ttft_ms: float | None = None  # of the first request that produced a token


class LLMEngine:
    """Position-agnostic chunk reuse over a paged KV cache with continuous batching.

    Args:
        runner: the model runner (model, backend, KV tensors).
        cache: the chunk cache over the runner's block pool.
        tokenizer: the model's tokenizer.
        model_digest: :meth:`ModelFingerprint.digest` of the loaded model.
        config: engine configuration (anchor mode, prompt, scheduler limits).
        max_model_len: context limit in tokens.
        eos_token_ids: end-of-sequence ids besides the tokenizer's own.
    """

    def __init__(self, runner: ModelRunner, cache: ChunkCache, tokenizer, model_digest: str,
                 config: EngineConfig, max_model_len: int, eos_token_ids: set[int] | None = None):
        self.runner, self.cache, self.tokenizer = runner, cache, tokenizer
        self.model_digest = model_digest
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = cache.block_size
        self.template = PromptTemplate(tokenizer, config.prompt)
        self.head_ids = tuple(self.template.head_token_ids())
        self.min_tail_tokens = len(self.template.tail_token_ids("?"))
        self.anchor_ids = self._anchor_token_ids()
        self.anchor_fp = anchor_fingerprint(config.cache.anchor, list(self.anchor_ids))
        # The head and the anchor get keys of their own kind ("prompt"; with anchor="head" they are
        # one entry): a document with the same tokens must not share (and, when removed, kill) them.
        self.head_key = chunk_key(model_digest, "prompt", list(self.head_ids))
        self.anchor_key = chunk_key(model_digest, "prompt", list(self.anchor_ids)) if self.anchor_ids else None
        self.documents: dict[str, _Document] = {}
        self.documents_version = 0  # grows whenever a document is added, changed or removed
        self.eos_token_ids = set(eos_token_ids or ())
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.generator = torch.Generator(device=runner.device).manual_seed(config.seed)  # sampling on device
        self.counters = EngineCounters()
        self.requests: dict[str, Request] = {}
        self.scheduler = Scheduler(cache, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
                                   self._encode_anchor(), self.anchor_key, config.scheduler.prefill_with_encodes)
        self.max_model_len = self._fit_max_model_len(max_model_len)
        # Called after each step that ran a forward pass with (scheduler output, seconds); when any is
        # registered the step synchronizes the device so the time is the step's own (benchmarks).
        self.step_listeners: list[Callable[[SchedulerOutput, float], None]] = []

    def _anchor_token_ids(self) -> tuple[int, ...]:
        mode = self.config.cache.anchor
        if mode == "none":
            return ()
        if mode == "head":
            return self.head_ids
        bos = self.tokenizer.bos_token_id
        if bos is None:  # e.g. Qwen: the chat template's first token is the sink every prompt starts with
            if not self.head_ids:
                raise ValueError("anchor='bos' needs a tokenizer with a BOS token or a non-empty prompt head")
            bos = self.head_ids[0]
        return (bos,)

    def _fit_max_model_len(self, max_model_len: int) -> int:
        """The context limit the KV cache can hold for one request (start-up check).

        One request of ``max_model_len`` tokens needs its blocks plus one for the boundary
        between its cached head and its private tail. A limit the configuration set explicitly
        (``EngineConfig.max_model_len``) that does not fit raises; one taken from the model is
        lowered to what fits, with a log line.

        Raises:
            CacheCapacityError: the explicit limit does not fit, or not even two tokens do.
        """
        bs = self.block_size
        fits = (self.scheduler.num_usable_blocks - 1) * bs
        if max_model_len <= fits:
            return max_model_len
        advice = ("give the cache more memory (CacheConfig.kv_cache_bytes or num_blocks) or lower "
                  f"max_model_len to at most {fits}" if fits >= 2 else
                  "it holds no request at all: give the cache more memory (CacheConfig.kv_cache_bytes or num_blocks)")
        if fits < 2 or self.config.max_model_len is not None:
            raise CacheCapacityError(
                f"max_model_len={max_model_len} needs {-(-max_model_len // bs) + 1} KV blocks for one request but "
                f"the cache has {self.scheduler.describe_capacity()}: {advice}")
        logger.info("the model's context of %d tokens does not fit the KV cache (%s); serving up to %d tokens "
                    "per request", max_model_len, self.scheduler.describe_capacity(), fits)
        return fits

    def _encode_anchor(self) -> list[tuple[int, int, int]]:
        """Encode the anchor once and pin it for the engine's lifetime; its block-table entries."""
        if self.anchor_key is None:
            return []
        n = len(self.anchor_ids)
        blocks = self.cache.allocate(-(-n // self.block_size))
        entry = self.cache.insert_pending(self.anchor_key, blocks, n, 0, token_ids=self.anchor_ids)
        self.runner.execute([self._encode_sequence(EncodeJob(self.anchor_key, self.anchor_ids, 0, blocks, []))])
        self.cache.mark_ready(self.anchor_key)
        return block_table_entries(entry.block_ids, n, 0, self.block_size)

    # --- documents ------------------------------------------------------------------------
    def add_document(self, doc_id: str, text: str) -> bool:
        """Register (or update) a document; returns ``True`` if its content key changed.

        Raises:
            EmptyInputError: empty id or text (or not strings).
            DocumentTooLongError: the document plus the head and the shortest question exceeds
                the context limit (the limit and the counts are in the message).
        """
        return self.add_documents([(doc_id, text)]) == 1

    def add_documents(self, documents: list[tuple[str, str]]) -> int:
        """Register several documents, all or none: every one is validated before any is bound.

        Returns:
            How many were new or changed.
        Raises:
            see :meth:`add_document` (naming the first bad document); nothing is registered then.
        """
        return self._bind(self._prepare_all(documents))

    def _prepare_all(self, documents: list[tuple[str, str]]) -> list[tuple[str, _Document]]:
        return [(doc_id, self._prepare_document(doc_id, text)) for doc_id, text in documents]

    def _bind(self, prepared: list[tuple[str, _Document]]) -> int:
        """Bind prepared documents to their ids (registry and cache); how many were new or changed."""
        changed = 0
        for doc_id, doc in prepared:
            old = self.documents.get(doc_id)
            self.documents[doc_id] = doc
            self.cache.bind_document(doc_id, doc.key)
            changed += old is None or old.key != doc.key
        self.documents_version += bool(changed)
        return changed

    def _prepare_document(self, doc_id: str, text: str) -> _Document:
        if not isinstance(doc_id, str) or not doc_id:
            raise EmptyInputError(f"document id must be a non-empty string, got {doc_id!r}")
        if not isinstance(text, str) or not text.strip():
            raise EmptyInputError(f"document {doc_id!r} is empty or not a string")
        ids = tuple(self.template.document_token_ids(text))
        if not ids:
            raise EmptyInputError(f"document {doc_id!r} has no tokens (its text tokenizes to nothing)")
        budget = self.max_model_len - len(self.head_ids) - self.min_tail_tokens - 1
        if len(ids) > budget or len(self.anchor_ids) + len(ids) > self.max_model_len:
            raise DocumentTooLongError(
                f"document {doc_id!r} has {len(ids)} tokens; with the {len(self.head_ids)}-token prompt head and "
                f"a question, at most {budget} fit the context limit of {self.max_model_len} tokens"
            )
        self._check_document_blocks(doc_id, len(ids))
        return _Document(text, ids, chunk_key(self.model_digest, self.anchor_fp, list(ids)))

    def _check_document_blocks(self, doc_id: str, num_tokens: int) -> None:
        """A document must fit the KV cache in one request with the head and the shortest question
        (a chunk starts a block of its own, so tokens under the context limit are not enough).

        Raises:
            DocumentTooLongError: naming the blocks needed and the cache's.
        """
        blocks = self.scheduler.blocks_for
        head = 0 if self.head_key == self.anchor_key else blocks(len(self.head_ids))
        need = head + blocks(num_tokens) + blocks(self.min_tail_tokens + 1)
        if need > self.scheduler.num_usable_blocks:
            raise DocumentTooLongError(
                f"document {doc_id!r} has {num_tokens} tokens; with the prompt head and a question one request "
                f"needs {need} KV blocks, but the cache has {self.scheduler.describe_capacity()}")

    def remove_document(self, doc_id: str) -> None:
        """Forget a document and drop its cached K/V once no running request reads it.

        Raises:
            UnknownDocumentError: the id is not registered.
        """
        if doc_id not in self.documents:
            raise UnknownDocumentError(f"unknown document id {doc_id!r}")
        del self.documents[doc_id]
        self.documents_version += 1
        self.cache.unbind_document(doc_id)

    # --- planning -------------------------------------------------------------------------
    def plan_with_documents(self, question: str, doc_ids: list[str], documents: list[tuple[str, str]]) -> PromptPlan:
        """Register inline ``documents`` and plan ``question`` over ``doc_ids`` then them, all or none.

        Raises:
            what :meth:`add_documents` and :meth:`plan` raise; the documents' previous
            registrations (or their absence) are restored first.
        """
        return self._with_inline(documents, lambda: self.plan(question, doc_ids + [d for d, _ in documents]))

    def plan_messages_with_documents(self, messages: list[Message], documents: list[tuple[str, str]]) -> PromptPlan:
        """Register inline ``documents``, then :meth:`plan_messages`, all or none (as :meth:`plan_with_documents`)."""
        return self._with_inline(documents, lambda: self.plan_messages(messages))

    def _with_inline(self, documents: list[tuple[str, str]], make_plan: Callable[[], PromptPlan]) -> PromptPlan:
        """Plan with inline ``documents`` in the registry, binding them only once the plan stands:
        a refused plan leaves the registry and the cache as they were (cached K/V included)."""
        prepared = self._prepare_all(documents)
        before = {doc_id: self.documents.get(doc_id) for doc_id, _ in prepared}
        self.documents.update(prepared)  # the plan reads the registry; nothing is bound yet
        try:
            plan = make_plan()
        finally:  # back as it was: refused, nothing changed; planned, _bind compares with it
            for doc_id, old in before.items():
                if old is None:
                    del self.documents[doc_id]
                else:
                    self.documents[doc_id] = old
        self._bind(prepared)
        return plan

    def _check_ids(self, doc_ids: list[str]) -> None:
        for d in doc_ids:
            if d not in self.documents:
                raise UnknownDocumentError(f"unknown document id {d!r}: register it first (add_document)")

    def _chunks(self, doc_ids: list[str]) -> list[ChunkSegment]:
        chunks = [ChunkSegment(self.head_key, self.head_ids, 0, 0, None)] if self.head_ids else []
        pos, local = len(self.head_ids), len(self.anchor_ids)
        for d in doc_ids:
            doc = self.documents[d]
            chunks.append(ChunkSegment(doc.key, doc.token_ids, local, pos, d))
            pos += len(doc.token_ids)
        return chunks

    def plan(self, question: str, doc_ids: list[str]) -> PromptPlan:
        """Build the prompt plan of a question over registered documents (per ``CacheConfig.mode``).

        Raises:
            EmptyInputError: empty question.
            UnknownDocumentError: an id that is not registered (the first one is named).
            PromptTooLongError: the prompt reaches ``max_model_len``.
        """
        if not isinstance(question, str) or not question.strip():
            raise EmptyInputError("the question is empty")
        self._check_ids(doc_ids)
        plan = PromptPlan(tuple(self._chunks(doc_ids)), tuple(self.template.tail_token_ids(question)))
        self._check_length(plan, f"{len(doc_ids)} documents")
        return self._for_mode(plan)

    def plan_messages(self, messages: list[Message]) -> PromptPlan:
        """Plan chat ``messages`` whose content places registered documents (:class:`DocumentRef`).

        The messages are rendered in the chat template (:meth:`PromptTemplate.render_messages`).
        Text before the first document becomes the prompt head, a chunk cached like an exact
        prefix (position 0, ``delta = 0``: its K/V equal a full prefill's); each document is
        its cached chunk at its offset; text between documents becomes private text segments
        and text after the last one the query tail, computed by the request (they attend to
        everything before them). With no document the messages are a plain prompt.

        Raises:
            UnknownDocumentError: a document id that is not registered (the first one is named).
            EmptyInputError: no messages, or nothing after the last document to answer from.
            PromptTooLongError: the prompt reaches ``max_model_len``.
            ValueError: the chat template drops a message.
        """
        if not messages:
            raise EmptyInputError("no messages")
        pieces = self.template.render_messages(messages)
        doc_ids = [p.id for p in pieces if isinstance(p, DocumentRef)]
        self._check_ids(doc_ids)
        lead = self.template.leading_special_ids()
        if not doc_ids:
            return self.plan_plain(lead + self.template.encode_runs(pieces[0].runs if pieces else ()))
        if isinstance(pieces[-1], DocumentRef):
            raise EmptyInputError("the messages end with a document: nothing follows it to answer from")
        if isinstance(pieces[0], DocumentRef):
            pieces = [PromptText(()), *pieces]
        chunks, texts, pos = [], [], 0
        for i, piece in enumerate(pieces[:-1]):
            if isinstance(piece, DocumentRef):
                doc = self.documents[piece.id]
                chunks.append(ChunkSegment(doc.key, doc.token_ids, len(self.anchor_ids), pos, piece.id))
                pos += len(doc.token_ids)
                continue
            ids = (lead if i == 0 else []) + self.template.encode_runs(piece.runs)
            if i == 0 and ids:  # the head: an exact prefix, shared by every prompt that starts with it
                chunks.append(ChunkSegment(chunk_key(self.model_digest, "prompt", ids), tuple(ids), 0, 0, None))
            elif ids:
                texts.append(TextSegment(tuple(ids), pos))
            pos += len(ids)
        tail = self.template.encode_runs(pieces[-1].runs)
        plan = PromptPlan(tuple(chunks), tuple(tail), texts=tuple(texts))
        self._check_length(plan, f"{len(messages)} messages, {len(doc_ids)} documents")
        return self._for_mode(plan)

    def _for_mode(self, plan: PromptPlan) -> PromptPlan:
        """The plan as ``CacheConfig.mode`` runs it (the comparison modes of the benchmarks)."""
        mode = self.config.cache.mode
        if mode == "full":
            return PromptPlan((), tuple(plan.token_ids()))
        if mode == "prefix":
            return PromptPlan((), tuple(plan.token_ids()), self._prefix_keys(plan.token_ids()))
        if mode == "block_attention":
            return PromptPlan(tuple(self._positioned(c) for c in plan.chunks), plan.query_token_ids,
                              texts=plan.texts)
        return plan

    def _positioned(self, chunk: ChunkSegment) -> ChunkSegment:
        """block_attention mode: a document's copy at its offset (encoded alone at ``g``, delta 0)."""
        if chunk.doc_id is None:
            return chunk
        key = chunk_key(chunk.key, f"at:{chunk.global_start}", [])
        return ChunkSegment(key, chunk.token_ids, chunk.global_start, chunk.global_start, chunk.doc_id, chunk.key)

    def _prefix_keys(self, token_ids: list[int]) -> tuple[str, ...]:
        keys, parent = [], self.model_digest
        for i in range(len(token_ids) // self.block_size):
            parent = chunk_key(parent, "prefix", token_ids[i * self.block_size: (i + 1) * self.block_size])
            keys.append(parent)
        return tuple(keys)

    def plan_plain(self, prompt_ids: list[int]) -> PromptPlan:
        """A plan without cached chunks: the whole prompt is computed (a standard prefill).

        Raises:
            EmptyInputError: empty prompt.
            PromptTooLongError: the prompt reaches ``max_model_len``.
        """
        if not prompt_ids:
            raise EmptyInputError("the prompt is empty")
        vocab = self.runner.model.config.vocab_size
        for t in prompt_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        plan = PromptPlan((), tuple(prompt_ids))
        self._check_length(plan, "plain prompt")
        return plan

    def _check_length(self, plan: PromptPlan, what: str) -> None:
        if plan.num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {plan.num_prompt_tokens} tokens ({what}); the context limit is {self.max_model_len} "
                "tokens and at least one must remain for the answer"
            )

    # --- submission -----------------------------------------------------------------------
    def submit(self, plan: PromptPlan, params: SamplingParams, sink: Sink, warm_only: bool = False) -> Request:
        """Queue a planned request; deltas (or an exception) go to ``sink`` from :meth:`step`.

        Raises:
            CacheCapacityError: the prompt plus ``max_tokens`` could never fit the KV cache.
        """
        rid = uuid.uuid4().hex[:16]
        stats = RequestStats(rid, num_prompt_tokens=plan.num_prompt_tokens)
        stats.num_computed_tokens = len(plan.query_token_ids) + plan.num_text_tokens
        gen = torch.Generator(device=self.runner.device).manual_seed(params.seed) if params.seed is not None else self.generator
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        request = Request(rid, plan, params, sink, stats, IncrementalDetokenizer(self.tokenizer, params.stop), gen,
                          stop_token_ids=stop_ids, warm_only=warm_only)
        self._check_capacity(request)
        self.requests[rid] = request
        self.scheduler.add(request)
        return request

    def _check_capacity(self, request: Request) -> None:
        """Admission rule: refuse a request whose prompt and ``max_tokens`` could never fit the
        KV cache, even alone, before it runs (never part-way through its stream).

        Raises:
            CacheCapacityError: naming the blocks needed, prompt tokens, max_tokens and the cache.
        """
        plan, params = request.plan, request.params
        num_outputs = 0 if request.warm_only else min(params.max_tokens, self.max_model_len - plan.num_prompt_tokens)
        need = self.scheduler.num_blocks_needed(request, len(request.private_token_ids) + num_outputs)
        if need > self.scheduler.num_usable_blocks:
            raise CacheCapacityError(
                f"request needs {need} KV blocks for {plan.num_prompt_tokens} prompt tokens "
                f"({sum(c.doc_id is not None for c in plan.chunks)} documents) and up to {num_outputs} output tokens (max_tokens={params.max_tokens}), but the cache has "
                f"{self.scheduler.describe_capacity()}: lower max_tokens, place fewer documents, or give the cache "
                "more memory")

    def submit_warm(self, doc_ids: list[str], sink: Sink) -> Request:
        """Queue a warm-up: encode the documents' chunks (no question). Raises ``UnknownDocumentError``."""
        self._check_ids(doc_ids)
        chunks = self._chunks(doc_ids)
        plan = PromptPlan(tuple(chunks), ())
        return self.submit(plan, SamplingParams(max_tokens=1), sink, warm_only=True)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; frees everything it holds. Returns ``False`` if it already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.scheduler.remove(request)
        self.counters.num_requests_aborted += 1
        self._finish(request, "abort", release=False)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def fail_all(self, error: Exception) -> None:
        """Fail every unfinished request with ``error`` and release what it holds.

        Every request's sink gets the error even if releasing one of them raises (this is the
        loop's last resort after a broken step: no caller may be left waiting).
        """
        for request in list(self.requests.values()):
            try:
                self.scheduler.remove(request)
            except Exception:  # noqa: BLE001 - logged; the caller must still hear of its failure
                logger.exception("releasing request %s failed", request.request_id)
            self._fail(request, error, release=False)
        self.scheduler.drop_encodes()

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Schedule, run one forward pass, postprocess. Returns ``False`` if there was nothing to do."""
        if not self.step_listeners:
            return self._step() is not None
        self._synchronize()
        start = time.perf_counter()
        out = self._step()
        self._synchronize()
        if out is not None and not out.is_empty:
            for listener in self.step_listeners:
                listener(out, time.perf_counter() - start)
        return out is not None

    def _synchronize(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    def _step(self) -> SchedulerOutput | None:
        """One step; returns what was scheduled, or ``None`` when there was nothing to do."""
        out = self.scheduler.schedule()
        for request, error in out.failed:
            self._fail(request, error)
        for request in out.warmed:
            self._finish(request, "warm")
        if out.is_empty:
            return out if out.failed or out.warmed else None
        self.counters.num_steps += 1
        num_copied = 0
        try:
            for copy in out.copies:
                self.runner.copy_rotated(copy.src_blocks, copy.dst_blocks, copy.num_tokens, copy.delta)
                self.cache.mark_ready(copy.dst_key)
                self.cache.unpin(copy.dst_key)  # the writer's pin (insert_pending)
                self.cache.unpin(copy.src_key)
                num_copied += 1
            if not (out.encodes or out.computes):
                return out
            seqs = [self._encode_sequence(j) for j in out.encodes]
            last_rows = []  # each compute job's last sequence: its sampled row
            for job in out.computes:
                seqs += self._compute_sequences(job)
                last_rows.append(len(seqs) - 1)
            logits = self.runner.execute(seqs)
        except Exception as error:  # a broken step fails its requests, never the cache
            self._abandon_step(out, out.copies[num_copied:], error)
            return out
        for job in out.encodes:
            if job.final:  # the chunk's last piece: readable from now on; the encoder lets go
                self.cache.mark_ready(job.key)
                self.cache.unpin(job.key)
        rows = logits[last_rows]
        greedy = rows.argmax(dim=-1).tolist()  # one device sync for every greedy request of the step
        for job, row, token in zip(out.computes, rows, greedy):
            try:
                self._postprocess(job, row, token)
            except Exception as error:  # e.g. sampling failed: this request fails, the others go on
                if job.request.status is not RequestStatus.FINISHED:
                    self._fail(job.request, error)
        return out

    def _encode_sequence(self, job: EncodeJob) -> SequenceInput:
        return self._build(job.token_ids, job.local_start + job.start, job.context, job.block_ids, job.start)

    def _compute_sequences(self, job: ComputeJob) -> list[SequenceInput]:
        """One sequence per private run the job's tokens fall in: a text segment's tokens attend
        the entries before it and its own blocks; the tail's attend all of the context."""
        r, bs = job.request, self.block_size
        seqs, index, end = [], job.start, job.start + job.num_tokens
        for run in r.private_runs(bs):
            run_end = end if run.length is None else min(end, run.start + run.length)
            if index >= run_end:
                continue
            ids = r.private_token_ids[index:run_end]
            offset = index - run.start
            own = r.private_blocks[run.first_block:]
            if run.length is None:
                seq = self._build(ids, run.global_start + offset, [], own, offset)
                seq.context_words, seq.context_len = r.context_words, r.context_len
            else:
                before = r.context_entries[:self._entries_before(r, run.global_start)]
                seq = self._build(ids, run.global_start + offset, before, own[: -(-run.length // bs)], offset)
            seqs.append(seq)
            index = run_end
        return seqs

    @staticmethod
    def _entries_before(r: Request, position: int) -> int:
        """How many of ``r.context_entries`` hold the keys at positions ``< position``."""
        count, keys = 0, 0
        while keys < position:
            keys += r.context_entries[count][2]
            count += 1
        return count

    def _build(self, token_ids, first_pos, context, own_blocks, own_filled) -> SequenceInput:
        """New tokens after ``own_filled`` slots of ``own_blocks`` (delta 0), after ``context``."""
        n, bs = len(token_ids), self.block_size
        own = block_table_entries(own_blocks, own_filled + n, 0, bs)
        slots = [own_blocks[(own_filled + i) // bs] * bs + (own_filled + i) % bs for i in range(n)]
        return SequenceInput(list(token_ids), list(range(first_pos, first_pos + n)), list(context) + own, slots)

    def _abandon_step(self, out: SchedulerOutput, unfinished_copies: list, error: Exception) -> None:
        """A copy or the forward pass raised: fail the step's requests and every request holding a
        chunk the step was writing (admitted or running); drop those chunks' pending entries and
        the source pins of the copies that did not run."""
        pending = {job.key for job in out.encodes} | {c.dst_key for c in unfinished_copies}
        for copy in unfinished_copies:
            self.cache.unpin(copy.src_key)
        victims = {id(j.request): j.request for j in out.computes}
        victims.update({id(r): r for r in self.scheduler.acquired + self.scheduler.running
                        if pending.intersection(r.pinned)})
        for r in victims.values():
            self.scheduler.remove(r)
        self.scheduler.drop_encodes(pending)  # chunks whose encoding had more pieces to go
        for key in pending:
            if self.cache.lookup(key, touch=False, include_dead=True) is not None:
                self.cache.discard_pending(key)
        for r in victims.values():
            self._fail(r, error, release=False)

    # --- postprocessing -------------------------------------------------------------------
    def _postprocess(self, job: ComputeJob, logits: torch.Tensor, greedy_token: int) -> None:
        r = job.request
        r.num_computed += job.num_tokens
        if r.plan.prefix_block_keys:
            self._register_prefix_blocks(r)
        if not job.sample:
            return
        if r.params.has_penalties:
            logits = apply_penalties(logits, r.params, r.prompt_token_ids, r.output_ids)
            greedy_token = int(torch.argmax(logits))
        token = greedy_token if r.params.greedy else sample(logits, r.params, r.generator)
        now = time.perf_counter()
        if r.first_token_time is None:
            r.first_token_time = now
            r.stats.ttft_ms = (now - r.arrival_time) * 1e3
            if self.counters.first_request_ttft_ms is None:
                self.counters.first_request_ttft_ms = r.stats.ttft_ms
        if token in r.stop_token_ids:
            self._finish(r, "stop")
            return
        r.output_ids.append(token)
        text = r.detokenizer.add(token)
        reason = None
        if r.detokenizer.stopped:
            reason = "stop"
        elif len(r.output_ids) >= r.params.max_tokens or (
                r.plan.num_prompt_tokens + len(r.output_ids) >= self.max_model_len):
            reason = "length"
        if not self._emit(r, StreamDelta(text, token)):  # nobody listens any more: drop the request
            self.scheduler.remove(r)
            self.counters.num_requests_aborted += 1
            self._finish(r, "abort", release=False)
        elif reason is not None:
            self._finish(r, reason)

    def _register_prefix_blocks(self, r: Request) -> None:
        """Prefix mode: hand the request's newly completed full prompt blocks to the cache."""
        bs = self.block_size
        hit_blocks = r.num_prefix_tokens // bs
        prompt_done = min(r.num_computed, len(r.plan.query_token_ids) - r.num_prefix_tokens)
        full = (r.num_prefix_tokens + prompt_done) // bs
        for j in range(hit_blocks + r.num_prefix_registered, min(full, len(r.plan.prefix_block_keys))):
            key = r.plan.prefix_block_keys[j]
            if self.cache.lookup(key, touch=False) is None:
                block = r.private_blocks[j - hit_blocks]
                self.cache.pool.incref([block])
                self.cache.insert(key, [block], bs, j * bs, tuple(r.plan.query_token_ids[j * bs:(j + 1) * bs]))
                # Pinned while the request also holds the block: evicting the entry now would not
                # free it, so it must not count as evictable room.
                self.cache.pin(key)
                r.pinned.append(key)
            r.num_prefix_registered += 1

    def _finish(self, r: Request, reason: str, release: bool = True) -> None:
        if release:
            self.scheduler.remove(r)
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        self.requests.pop(r.request_id, None)
        now = time.perf_counter()
        s = r.stats
        s.num_output_tokens = len(r.output_ids)
        s.e2e_ms = (now - r.arrival_time) * 1e3
        s.queue_ms = ((r.first_scheduled_time or now) - r.arrival_time) * 1e3
        s.num_preemptions = r.num_preemptions
        if r.first_token_time is not None and len(r.output_ids) > 1:
            s.tpot_ms = (now - r.first_token_time) * 1e3 / (len(r.output_ids) - 1)
        s.num_cached_tokens = max(0, s.num_prompt_tokens - s.num_computed_tokens)
        if reason != "abort":
            c = self.counters
            c.num_requests_finished += 1
            c.num_prompt_tokens += s.num_prompt_tokens
            c.num_cached_prompt_tokens += s.num_cached_tokens
            c.num_doc_lookups += len(s.docs_hit) + len(s.docs_missed)
            c.num_doc_hits += len(s.docs_hit)
            c.num_output_tokens += s.num_output_tokens
        self._emit(r, StreamDelta(r.detokenizer.flush(), None, True, reason, s))

    def _emit(self, r: Request, item: StreamDelta | BaseException) -> bool:
        """Hand ``item`` to the request's sink; ``False`` if the sink raised (e.g. its asyncio
        loop is closed). A broken consumer costs only its own request, never the step."""
        try:
            r.sink(item)
            return True
        except Exception:  # noqa: BLE001 - logged; the other requests of the step go on
            logger.warning("request %s: its consumer raised; dropping it", r.request_id, exc_info=True)
            return False

    def _fail(self, r: Request, error: Exception, release: bool = True) -> None:
        if release:
            self.scheduler.remove(r)
        r.status = RequestStatus.FINISHED
        self.requests.pop(r.request_id, None)
        self.counters.num_requests_failed += 1
        self._emit(r, error)

    # --- introspection --------------------------------------------------------------------
    def stats(self) -> dict:
        """Engine-wide stats: hit ratios (tokens, documents), blocks, evictions, preemptions, queues,
        and ``first_request_ttft_ms`` (the first request to produce a token; ``None`` before)."""
        c, cache, pool = self.counters, self.cache, self.cache.pool
        cached_blocks = cache.num_cached_blocks
        return {
            "num_requests_finished": c.num_requests_finished,
            "num_requests_failed": c.num_requests_failed,
            "num_requests_aborted": c.num_requests_aborted,
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_requests_running": len(self.scheduler.running) + len(self.scheduler.acquired),
            "token_hit_ratio": c.num_cached_prompt_tokens / c.num_prompt_tokens if c.num_prompt_tokens else 0.0,
            "doc_hit_ratio": c.num_doc_hits / c.num_doc_lookups if c.num_doc_lookups else 0.0,
            "num_prompt_tokens": c.num_prompt_tokens,
            "num_cached_prompt_tokens": c.num_cached_prompt_tokens,
            "num_output_tokens": c.num_output_tokens,
            "num_blocks_total": pool.num_blocks,
            "num_blocks_free": pool.num_free,
            "num_blocks_cached": cached_blocks,
            "num_blocks_in_use": pool.num_blocks - pool.num_free - cached_blocks,
            "num_blocks_evictable": cache.num_evictable_blocks,
            "num_cached_chunks": cache.num_entries,
            "num_documents": len(self.documents),
            "num_evictions": cache.num_evictions,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": c.num_steps,
            "first_request_ttft_ms": c.first_request_ttft_ms,
        }
