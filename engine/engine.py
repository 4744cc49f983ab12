"""The engine: documents, prompt plans, chunk encoding on a miss, prefill and decode.

Request lifecycle (``docs/architecture.md`` has the picture):

1. ``plan``: the head, each document's chunk and the query tail as token segments; each
   chunk gets its content key and its global start ``g``.
2. ``acquire``: pin the anchor, the head and every document chunk that is cached (hits);
   encode the misses in one batched forward pass, each alone after the anchor (local
   positions ``l .. l+L-1``), insert and pin them. Hits are pinned *before* any block is
   allocated, so encoding a miss can never evict a chunk this request is about to read.
3. ``prefill``: the request's block table is its chunks' blocks (each with ``delta = g - l``)
   followed by private blocks for the query tail; one forward computes only the tail.
4. ``decode``: one token per step into the private blocks until a stop condition.
5. ``release``: free the private blocks, unpin the chunks (always, also on error or when the
   caller stops iterating).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lazyattn_rag.config import EngineConfig
from lazyattn_rag.detokenizer import IncrementalDetokenizer
from lazyattn_rag.engine.attention import SequenceInput
from lazyattn_rag.engine.block_pool import NoFreeBlocksError
from lazyattn_rag.engine.chunk_cache import ChunkCache, ChunkEntry
from lazyattn_rag.engine.runner import ModelRunner
from lazyattn_rag.errors import (
    CacheCapacityError,
    DocumentTooLongError,
    EmptyInputError,
    PromptTooLongError,
    UnknownDocumentError,
)
from lazyattn_rag.fingerprint import anchor_fingerprint, chunk_key
from lazyattn_rag.outputs import RequestStats, StreamDelta
from lazyattn_rag.prompt import ChunkSegment, PromptPlan, PromptTemplate
from lazyattn_rag.sampling import SamplingParams, sample

_NO_ANCHOR = anchor_fingerprint("none", [])


@dataclass
class _Document:
    text: str
    token_ids: tuple[int, ...]
    key: str


class LLMEngine:
    """Position-agnostic chunk reuse over a paged KV cache (one request at a time).

    Args:
        runner: the model runner (model, backend, KV tensors).
        cache: the chunk cache over the runner's block pool.
        tokenizer: the model's tokenizer.
        model_digest: :meth:`ModelFingerprint.digest` of the loaded model.
        config: engine configuration (anchor mode, prompt, limits).
        max_model_len: context limit in tokens.
        eos_token_ids: end-of-sequence ids besides the tokenizer's own (e.g. from
            ``generation_config.json``).
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
        self.anchor_ids = self._anchor_token_ids()
        self.anchor_fp = anchor_fingerprint(config.cache.anchor, list(self.anchor_ids))
        self.head_key = chunk_key(model_digest, _NO_ANCHOR, list(self.head_ids))
        self.anchor_key = chunk_key(model_digest, _NO_ANCHOR, list(self.anchor_ids)) if self.anchor_ids else None
        self.documents: dict[str, _Document] = {}
        self.eos_token_ids = set(eos_token_ids or ())
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.generator = torch.Generator().manual_seed(config.seed)

    def _anchor_token_ids(self) -> tuple[int, ...]:
        mode = self.config.cache.anchor
        if mode == "none":
            return ()
        if mode == "head":
            return self.head_ids
        bos = self.tokenizer.bos_token_id
        if bos is None:
            raise ValueError("anchor='bos' needs a tokenizer with a BOS token")
        return (bos,)

    # --- documents ------------------------------------------------------------------------
    def add_document(self, doc_id: str, text: str) -> bool:
        """Register (or update) a document; returns ``True`` if its content key changed.

        Raises:
            EmptyInputError: empty id or text.
            DocumentTooLongError: the document plus the head and a one-token question exceeds
                the context limit (the limit and the counts are in the message).
        """
        if not isinstance(doc_id, str) or not doc_id:
            raise EmptyInputError(f"document id must be a non-empty string, got {doc_id!r}")
        if not text or not text.strip():
            raise EmptyInputError(f"document {doc_id!r} is empty")
        ids = tuple(self.template.document_token_ids(text))
        local_start = len(self.anchor_ids)
        budget = self.max_model_len - len(self.head_ids) - 2
        if len(ids) > budget or local_start + len(ids) > self.max_model_len:
            raise DocumentTooLongError(
                f"document {doc_id!r} has {len(ids)} tokens; with the {len(self.head_ids)}-token prompt head "
                f"at most {budget} fit the context limit of {self.max_model_len} tokens"
            )
        key = chunk_key(self.model_digest, self.anchor_fp, list(ids))
        old = self.documents.get(doc_id)
        self.documents[doc_id] = _Document(text, ids, key)
        self.cache.bind_document(doc_id, key)
        return old is None or old.key != key

    def remove_document(self, doc_id: str) -> None:
        """Forget a document and drop its cached K/V once no running request reads it.

        Raises:
            UnknownDocumentError: the id is not registered.
        """
        if doc_id not in self.documents:
            raise UnknownDocumentError(f"unknown document id {doc_id!r}")
        del self.documents[doc_id]
        self.cache.unbind_document(doc_id)

    def warm(self, doc_ids: list[str]) -> list[str]:
        """Encode the given documents' K/V now; returns the ids that were encoded (misses).

        Raises:
            UnknownDocumentError: an id that is not registered.
        """
        for d in doc_ids:
            if d not in self.documents:
                raise UnknownDocumentError(f"unknown document id {d!r}: register it first (add_document)")
        local = len(self.anchor_ids)
        chunks = [ChunkSegment(self.head_key, self.head_ids, 0, 0, None)]
        chunks += [ChunkSegment(self.documents[d].key, self.documents[d].token_ids, local, local, d) for d in doc_ids]
        plan = PromptPlan(tuple(chunks), ())
        pinned, missed, _ = self._acquire(plan)
        self._release(pinned, [])
        return missed

    # --- planning -------------------------------------------------------------------------
    def plan(self, question: str, doc_ids: list[str]) -> PromptPlan:
        """Build the prompt plan of a question over registered documents.

        Raises:
            EmptyInputError: empty question.
            UnknownDocumentError: an id that is not registered (the first one is named).
            PromptTooLongError: the prompt reaches ``max_model_len``.
        """
        if not isinstance(question, str) or not question.strip():
            raise EmptyInputError("the question is empty")
        for d in doc_ids:
            if d not in self.documents:
                raise UnknownDocumentError(f"unknown document id {d!r}: register it first (add_document)")
        chunks = [ChunkSegment(self.head_key, self.head_ids, 0, 0, None)]
        pos = len(self.head_ids)
        local = len(self.anchor_ids)
        for d in doc_ids:
            doc = self.documents[d]
            chunks.append(ChunkSegment(doc.key, doc.token_ids, local, pos, d))
            pos += len(doc.token_ids)
        tail = tuple(self.template.tail_token_ids(question))
        plan = PromptPlan(tuple(chunks), tail)
        if plan.num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {plan.num_prompt_tokens} tokens ({len(doc_ids)} documents); the context limit "
                f"is {self.max_model_len} tokens and at least one must remain for the answer"
            )
        return plan

    def plan_plain(self, prompt_ids: list[int]) -> PromptPlan:
        """A plan without cached chunks: the whole prompt is computed (a standard prefill).

        Raises:
            EmptyInputError: empty prompt.
            PromptTooLongError: the prompt reaches ``max_model_len``.
        """
        if not prompt_ids:
            raise EmptyInputError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens; the context limit is {self.max_model_len} tokens and at "
                "least one must remain for the answer"
            )
        return PromptPlan((), tuple(int(t) for t in prompt_ids))

    def generate_plan(self, plan: PromptPlan, params: SamplingParams) -> Iterator[StreamDelta]:
        """Run a prepared plan (from :meth:`plan` or :meth:`plan_plain`), streaming."""
        stats = RequestStats(uuid.uuid4().hex[:12], num_prompt_tokens=plan.num_prompt_tokens)
        return self._generate(plan, params, stats, time.perf_counter())

    # --- cache acquisition ----------------------------------------------------------------
    def _acquire(self, plan: PromptPlan) -> tuple[list[str], list[str]]:
        """Pin every chunk of ``plan``, encoding misses.

        Returns:
            (pinned keys, missed document ids in prompt order, keys encoded for this plan).
        """
        pinned: list[str] = []
        if not plan.chunks:
            return pinned, [], set()
        try:
            if self.anchor_key is not None:
                self._ensure([(self.anchor_key, self.anchor_ids, 0)], [], pinned)
            todo: dict[str, tuple[tuple[int, ...], int]] = {}
            for c in plan.chunks:
                if c.key in todo or c.key in pinned:
                    continue
                if self.cache.lookup(c.key) is not None:
                    self.cache.pin(c.key)
                    pinned.append(c.key)
                else:
                    todo[c.key] = (c.token_ids, c.local_start)
            head = [(k, ids, l) for k, (ids, l) in todo.items() if k == self.head_key]
            docs = [(k, ids, l) for k, (ids, l) in todo.items() if k != self.head_key]
            anchor_entry = self.cache.lookup(self.anchor_key) if self.anchor_key else None
            self._ensure(head, [], pinned)
            self._ensure(docs, self._entries_of(anchor_entry, 0), pinned)
        except BaseException:
            self._release(pinned, [])
            raise
        missed = [c.doc_id for c in plan.chunks if c.doc_id is not None and c.key in todo]
        return pinned, missed, set(todo)

    def _ensure(self, chunks: list[tuple[str, tuple[int, ...], int]],
                anchor_entries: list[tuple[int, int, int]], pinned: list[str]) -> None:
        """Encode and pin chunks that are not cached (one batched forward)."""
        need = [(k, ids, l) for k, ids, l in chunks if self.cache.lookup(k) is None]
        for k, ids, l in chunks:
            if self.cache.lookup(k) is not None and k not in pinned:
                self.cache.pin(k)
                pinned.append(k)
        if not need:
            return
        seqs, allocated = [], []
        try:
            for key, ids, local_start in need:
                blocks = self._allocate(-(-len(ids) // self.block_size))
                allocated.append((key, blocks, ids, local_start))
                seqs.append(self._sequence(ids, local_start, anchor_entries, blocks, 0))
            self.runner.execute(seqs)
        except BaseException:
            for _, blocks, _, _ in allocated:
                self.cache.pool.decref(blocks)
            raise
        for key, blocks, ids, local_start in allocated:
            entry = self.cache.insert(key, blocks, len(ids), local_start)
            self.cache.attach_documents(entry)
            self.cache.pin(key)
            pinned.append(key)

    def _allocate(self, num_blocks: int) -> list[int]:
        try:
            return self.cache.allocate(num_blocks)
        except NoFreeBlocksError as e:
            raise CacheCapacityError(str(e)) from e

    def _release(self, pinned: list[str], private_blocks: list[int]) -> None:
        if private_blocks:
            self.cache.pool.decref(private_blocks)
        for key in pinned:
            self.cache.unpin(key)

    def _entries_of(self, entry: ChunkEntry | None, delta: int) -> list[tuple[int, int, int]]:
        """Block-table entries ``(block id, delta, valid)`` of a cached chunk placed with ``delta``."""
        if entry is None:
            return []
        out, left = [], entry.num_tokens
        for b in entry.block_ids:
            out.append((b, delta, min(left, self.block_size)))
            left -= self.block_size
        return out

    def _sequence(self, token_ids, first_pos, context, own_blocks, own_filled) -> SequenceInput:
        """New tokens appended after ``own_filled`` slots of ``own_blocks`` (delta 0), after ``context``."""
        n, bs = len(token_ids), self.block_size
        total = own_filled + n
        own = [(b, 0, min(bs, total - i * bs)) for i, b in enumerate(own_blocks) if total - i * bs > 0]
        slots = [own_blocks[(own_filled + i) // bs] * bs + (own_filled + i) % bs for i in range(n)]
        positions = list(range(first_pos, first_pos + n))
        return SequenceInput(list(token_ids), positions, list(context) + own, slots)

    # --- generation -----------------------------------------------------------------------
    def generate(self, question: str, doc_ids: list[str], params: SamplingParams) -> Iterator[StreamDelta]:
        """Answer ``question`` over the documents ``doc_ids`` (in prompt order), streaming.

        Raises (before the first delta): see :meth:`plan`; :class:`CacheCapacityError` when the
        KV cache cannot hold the request even after evicting every unpinned chunk.
        """
        t0 = time.perf_counter()
        plan = self.plan(question, doc_ids)
        stats = RequestStats(uuid.uuid4().hex[:12], num_prompt_tokens=plan.num_prompt_tokens)
        return self._generate(plan, params, stats, t0)

    def _generate(self, plan: PromptPlan, params: SamplingParams, stats: RequestStats, t0: float):
        pinned, missed, encoded = self._acquire(plan)
        private: list[int] = []
        try:
            missed_set = set(missed)
            for c in plan.chunks[1:]:
                (stats.docs_missed if c.doc_id in missed_set else stats.docs_hit).append(c.doc_id)
            encoded_tokens = sum(len(c.token_ids) for c in {c.key: c for c in plan.chunks if c.key in encoded}.values())
            stats.num_computed_tokens = encoded_tokens + len(plan.query_token_ids)
            stats.num_cached_tokens = plan.num_prompt_tokens - stats.num_computed_tokens
            yield from self._decode_loop(plan, params, stats, t0, private)
        finally:
            self._release(pinned, private)

    def _decode_loop(self, plan, params, stats, t0, private):
        context = []
        for c in plan.chunks:
            context += self._entries_of(self.cache.lookup(c.key), c.delta)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else self.generator
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        pos = plan.num_cached_prompt_tokens
        new_ids, filled = list(plan.query_token_ids), 0
        t_first, reason, out_ids = None, None, []
        while True:
            need = -(-(filled + len(new_ids)) // self.block_size) - len(private)
            if need > 0:
                private += self._allocate(need)
            seq = self._sequence(new_ids, pos, context, private, filled)
            logits = self.runner.execute([seq])[0]
            filled += len(new_ids)
            pos += len(new_ids)
            token = sample(logits, params, gen)
            if t_first is None:
                t_first = time.perf_counter()
                stats.ttft_ms = (t_first - t0) * 1e3
            if token in stop_ids:
                reason = "stop"
            else:
                out_ids.append(token)
                delta = detok.add(token)
                if detok.stopped:
                    reason = "stop"
                elif len(out_ids) >= params.max_tokens or pos + 1 >= self.max_model_len:
                    reason = "length"
                yield StreamDelta(delta, token)  # one delta per token, text possibly empty
            if reason is not None:
                break
            new_ids = [token]
        now = time.perf_counter()
        stats.num_output_tokens = len(out_ids)
        stats.e2e_ms = (now - t0) * 1e3
        if len(out_ids) > 1:
            stats.tpot_ms = (now - t_first) * 1e3 / (len(out_ids) - 1)
        yield StreamDelta(detok.flush(), None, True, reason, stats)
