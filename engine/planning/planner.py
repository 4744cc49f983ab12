"""Prompt planning: a question, chat messages or a plain prompt -> a :class:`PromptPlan`.

The plan lays the prompt out as DESIGN.md's "prompt plan" (``docs/architecture.md``): the
head (the template's text before the documents, cached like an exact prefix), each
document's cached chunk at its global offset, private text segments, and the query tail.
Every check on the input (unknown ids, empty text, lengths against the context limit)
happens here, before a request exists, so bad input raises at the call and touches nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from lazyattn_rag.engine.planning.fingerprint import anchor_fingerprint, chunk_key
from lazyattn_rag.engine.planning.prompt import PromptTemplate, PromptText
from lazyattn_rag.engine.planning.plan_transforms import positioned_copy, with_head_recompute
from lazyattn_rag.engine.planning.prompt_plan import ChunkSegment, PrefixKeys, PromptPlan, TextSegment
from lazyattn_rag.engine.planning.registry import DocumentRegistry, RegisteredDocument
from lazyattn_rag.types.config import (
    EngineConfig,
    RequestRemedies,
    check_chunk_attention_scaling,
    check_selective_ratio,
)
from lazyattn_rag.types.errors import DocumentTooLongError, EmptyInputError, PromptTooLongError
from lazyattn_rag.types.messages import DocumentRef, Message

# Tokens left off the end of a prompt prefix tokenized alone (plain_prefix_keys): a cut through the
# text may tokenize its last few characters otherwise than the whole prompt does
PREFIX_CUT_MARGIN_TOKENS = 8


class PromptPlanner:
    """Plans prompts over registered documents for one model and :class:`EngineConfig`.

    Args:
        tokenizer: the model's tokenizer.
        config: the engine configuration (prompt template, anchor, ``CacheConfig.mode``).
        model_digest: the model fingerprint's digest (every chunk key starts from it).
        block_size: KV slots per block (``prefix`` mode keys whole blocks).
        vocab_size: the model's vocabulary (plain prompts' ids are checked against it).
        max_model_len: the context limit in tokens (the engine lowers it to what its KV cache
            holds before the first plan).
        documents: the registered documents that plans place.

    Attributes:
        template: the :class:`PromptTemplate`.
        head_ids, head_key: the prompt head's tokens and chunk key.
        anchor_ids, anchor_key: the anchor's tokens (per ``CacheConfig.anchor``) and key
            (``None`` without an anchor); documents are encoded after it.
    """

    def __init__(self, tokenizer: Any, config: EngineConfig, model_digest: str, block_size: int, vocab_size: int,
                 max_model_len: int, documents: DocumentRegistry):
        self.tokenizer, self.config, self.model_digest = tokenizer, config, model_digest
        self.block_size, self.vocab_size, self.max_model_len = block_size, vocab_size, max_model_len
        self.documents = documents
        self.template = PromptTemplate(tokenizer, config.prompt)
        self.head_ids = tuple(self.template.head_token_ids())
        self.min_tail_tokens = len(self.template.tail_token_ids("?"))
        self.anchor_ids = self._anchor_token_ids()
        self.anchor_fp = anchor_fingerprint(config.cache.anchor, list(self.anchor_ids))
        # The head and the anchor get keys of their own kind ("prompt"; with anchor="head" they are
        # one entry): a document with the same tokens must not share (and, when removed, kill) them.
        self.head_key = chunk_key(model_digest, "prompt", list(self.head_ids))
        self.anchor_key = chunk_key(model_digest, "prompt", list(self.anchor_ids)) if self.anchor_ids else None

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

    # --- documents ------------------------------------------------------------------------
    def prepare_document(self, doc_id: str, text: str, namespace: str = "") -> RegisteredDocument:
        """Validate and tokenize one document (nothing is registered here); its content key
        includes ``namespace`` (a non-empty one keys its chunks apart from every other).

        Raises:
            EmptyInputError: empty id or text (or not strings), or text with no tokens.
            ValueError: an id containing a NUL character.
            DocumentTooLongError: the document plus the head and the shortest question exceeds
                the context limit (the counts and the limit are in the message).
        """
        if not isinstance(doc_id, str) or not doc_id:
            raise EmptyInputError(f"document id must be a non-empty string, got {doc_id!r}")
        if "\x00" in doc_id:
            raise ValueError(f"document id {doc_id!r} contains a NUL character")
        if not isinstance(text, str) or not text.strip():
            raise EmptyInputError(f"document {doc_id!r} is empty or not a string")
        ids = tuple(self.template.document_token_ids(text))
        if not ids:
            raise EmptyInputError(f"document {doc_id!r} has no tokens (its text tokenizes to nothing)")
        budget = self.max_model_len - len(self.head_ids) - self.min_tail_tokens - 1
        if len(ids) > budget or len(self.anchor_ids) + len(ids) > self.max_model_len:
            raise DocumentTooLongError(
                f"document {doc_id!r} has {len(ids)} tokens; with the {len(self.head_ids)}-token prompt head and "
                f"a question, at most {budget} fit the context limit of {self.max_model_len} tokens")
        return RegisteredDocument(text, ids, self.document_key(ids, namespace))

    def document_key(self, token_ids: tuple[int, ...], namespace: str = "") -> str:
        """The content key of a document chunk of ``token_ids`` (model, anchor, namespace, tokens)."""
        anchor = self.anchor_fp if not namespace else f"{self.anchor_fp}|namespace:{namespace}"
        return chunk_key(self.model_digest, anchor, list(token_ids))

    def prepare_passage(self, text: str, namespace: str = "") -> RegisteredDocument:
        """A passage of plain prompt text as a chunk (``CacheConfig.learn_passages``): tokenized
        and keyed exactly as a document registered with ``text`` in ``namespace`` would be, so
        the two share one cached chunk."""
        ids = tuple(self.template.document_token_ids(text))
        return RegisteredDocument(text, ids, self.document_key(ids, namespace))

    def chunks(self, doc_ids: list[str], namespace: str = "") -> list[ChunkSegment]:
        """The head and the documents' chunks at their offsets, in order (ids must be registered
        in ``namespace``)."""
        chunks = [ChunkSegment(self.head_key, self.head_ids, 0, 0, None)] if self.head_ids else []
        pos, local = len(self.head_ids), len(self.anchor_ids)
        for d in doc_ids:
            doc = self.documents.get(d, namespace)
            chunks.append(ChunkSegment(doc.key, doc.token_ids, local, pos, d))
            pos += len(doc.token_ids)
        return chunks

    # --- plans ----------------------------------------------------------------------------
    def plan(self, question: str, doc_ids: list[str], namespace: str = "",
             remedies: RequestRemedies = RequestRemedies()) -> PromptPlan:
        """The plan of a question over documents registered in ``namespace`` (per ``CacheConfig.mode``;
        ``remedies``: this request's chunk-head recompute, selective recompute or chunk attention
        scaling, each ``None`` = the config's; asking for one turns the unset others off).

        Raises:
            ValueError: a negative ``recompute_chunk_head_tokens``, a ratio outside ``[0, 1]``, a
                remedy in a mode other than ``lazy``, two remedies asked together, chunk attention
                scaling with temperature and weight 1.
            EmptyInputError: empty question.
            UnknownDocumentError: an id that is not registered (the first one is named).
            PromptTooLongError: the prompt reaches ``max_model_len``.
        """
        if not isinstance(question, str) or not question.strip():
            raise EmptyInputError("the question is empty")
        self.documents.check_ids(doc_ids, namespace)
        remedy = self._remedies(remedies)
        plan = PromptPlan(tuple(self.chunks(doc_ids, namespace)), tuple(self.template.tail_token_ids(question)))
        self._check_length(plan, f"{len(doc_ids)} documents")
        return self._for_mode(plan, *remedy, namespace=namespace)

    def plan_messages(self, messages: list[Message], namespace: str = "",
                      remedies: RequestRemedies = RequestRemedies(),
                      passages: Mapping[str, RegisteredDocument] | None = None) -> PromptPlan:
        """The plan of chat ``messages`` whose content places documents registered in
        ``namespace`` (:class:`DocumentRef`), or learned passages (``passages``: id -> the
        passage, as :meth:`prepare_passage` gives it).

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
            ValueError: the chat template drops a message; ``remedies`` as :meth:`plan` (which
                they mean here too).
        """
        remedy = self._remedies(remedies)
        if not messages:
            raise EmptyInputError("no messages")
        pieces = self.template.render_messages(messages)
        return self._plan_pieces(pieces, namespace, remedy, passages or {}, f"{len(messages)} messages")

    def plan_raw(self, parts: list[str | DocumentRef], namespace: str = "",
                 remedies: RequestRemedies = RequestRemedies()) -> PromptPlan:
        """A raw prompt (``/v1/completions``: the caller's own template, no chat template applied)
        whose text places registered documents at :class:`DocumentRef` parts: laid out as
        :meth:`plan_messages` lays out rendered messages (the text before the first document is
        the head, the documents their cached chunks, the text after the last the query tail),
        its text tokenized as the tokenizer parses a raw prompt (BOS added where the tokenizer
        adds one, special-token text parsed). With no document it is :meth:`plan_prompt`'s plan
        of the joined text, its exact prefix cached per namespace.

        Raises:
            as :meth:`plan_messages`.
        """
        remedy = self._remedies(remedies)
        if not any(isinstance(p, DocumentRef) for p in parts):
            text = "".join(parts)
            return self.plan_plain(self.template.raw.ids(text, add_special_tokens=True) if text else [], namespace,
                                   from_tokenizer=True)
        pieces = self.template.render_raw(parts)
        return self._plan_pieces(pieces, namespace, remedy, {}, "raw prompt", lead=list(self.template.tokenizer_leading_ids))

    def _plan_pieces(self, pieces: list, namespace: str, remedy: tuple, passages: dict, what: str,
                     lead: list[int] | None = None) -> PromptPlan:
        """The plan of rendered ``pieces`` (:class:`PromptText` and :class:`DocumentRef`); ``lead``:
        ids before the first text (default: the template's leading special ids)."""
        doc_ids = [p.id for p in pieces if isinstance(p, DocumentRef)]
        self.documents.check_ids([d for d in doc_ids if d not in passages], namespace)
        lead = self.template.leading_special_ids() if lead is None else lead
        if not doc_ids:
            return self.plan_plain(lead + self.template.encode_runs(pieces[0].runs if pieces else ()), namespace,
                                   from_tokenizer=True)
        if isinstance(pieces[-1], DocumentRef):
            raise EmptyInputError("the prompt ends with a document: nothing follows it to answer from")
        if isinstance(pieces[0], DocumentRef):
            pieces = [PromptText(()), *pieces]
        chunks, texts, pos = [], [], 0
        for i, piece in enumerate(pieces[:-1]):
            if isinstance(piece, DocumentRef):
                learned = piece.id in passages
                doc = passages[piece.id] if learned else self.documents.get(piece.id, namespace)
                source = "learned" if learned else "matched" if piece.matched else "id"
                chunks.append(ChunkSegment(doc.key, doc.token_ids, len(self.anchor_ids), pos, piece.id,
                                           source=source))
                pos += len(doc.token_ids)
                continue
            ids = (lead if i == 0 else []) + self.template.encode_runs(piece.runs)
            if i == 0 and ids:  # the head: an exact prefix, shared by every prompt of the namespace that starts with it
                kind = f"prompt|namespace:{namespace}" if namespace else "prompt"
                chunks.append(ChunkSegment(chunk_key(self.model_digest, kind, ids), tuple(ids), 0, 0, None))
            elif ids:
                texts.append(TextSegment(tuple(ids), pos))
            pos += len(ids)
        tail = self.template.encode_runs(pieces[-1].runs)
        head = chunks[0].token_ids if chunks and chunks[0].doc_id is None else ()
        head_keys = self.prefix_keys(head, self._plain_seed(namespace)) if head and self.caches_prefixes else ()
        plan = PromptPlan(tuple(chunks), tuple(tail), texts=tuple(texts), head_prefix_keys=head_keys)
        self._check_length(plan, f"{what}, {len(doc_ids)} documents")
        return self._for_mode(plan, *remedy, namespace=namespace)

    def plan_prompt(self, prompt: str | list[int] | tuple[int, ...], namespace: str = "") -> PromptPlan:
        """A raw prompt (text in the caller's own template, or token ids), computed whole (its
        exact prefix cached per ``namespace``).

        Text is tokenized as the tokenizer does by default: its special tokens (e.g. BOS) are
        added and special-token text in it is parsed (this is vLLM's ``generate`` of a string).

        Raises:
            ValueError: not a string or a list of token ids. EmptyInputError, PromptTooLongError:
            see :meth:`plan_plain`.
        """
        if isinstance(prompt, str):
            return self.plan_plain(self.template.raw.ids(prompt, add_special_tokens=True), namespace,
                                   from_tokenizer=True)
        if isinstance(prompt, (list, tuple)):
            return self.plan_plain(list(prompt), namespace)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def plan_plain(self, prompt_ids: list[int], namespace: str = "", from_tokenizer: bool = False) -> PromptPlan:
        """A plan without cached chunks: the whole prompt is computed (a standard prefill), its
        full blocks reused from an earlier prompt of ``namespace`` that starts the same
        (:attr:`caches_prefixes`); ``from_tokenizer``: the ids come from the tokenizer (integers,
        only their range is checked).

        Raises:
            EmptyInputError: empty prompt.
            ValueError: an id outside the vocabulary.
            PromptTooLongError: the prompt reaches ``max_model_len``.
        """
        if not prompt_ids:
            raise EmptyInputError("the prompt is empty")
        # the tokenizer's own ids are integers: only their range is checked (at C speed)
        for t in ([t for t in (min(prompt_ids), max(prompt_ids)) if not 0 <= t < self.vocab_size]
                  if from_tokenizer else prompt_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}")
        plan = PromptPlan((), tuple(prompt_ids))
        self._check_length(plan, "plain prompt")
        return self._with_prefix_keys(plan, namespace) if self.caches_prefixes else plan

    def plain_prefix_keys(self, messages: list[Message], texts: Sequence[str],
                          namespace: str = "") -> PrefixKeys | None:
        """The exact-prefix block keys the plain plan of text-only ``messages`` starts with, as
        far as the end of the last of ``texts`` (pieces of their content, found in this order in
        the rendered prompt) less :data:`PREFIX_CUT_MARGIN_TOKENS` (the tokens at the cut may
        merge otherwise in the whole prompt): only that prefix is tokenized. ``None`` when the
        texts are not found in order, or exact prefixes are not cached."""
        if not self.caches_prefixes:
            return None
        pieces = self.template.render_messages(messages)
        if len(pieces) != 1 or isinstance(pieces[0], DocumentRef):
            return None
        runs, cut = pieces[0].runs, 0
        joined = "".join(t for t, _ in runs)
        for text in texts:
            found = joined.find(text, cut)
            if found < 0:
                return None
            cut = found + len(text)
        kept, length = [], 0
        for text, is_markup in runs:
            if length >= cut:
                break
            kept.append((text[:cut - length], is_markup))
            length += len(text)
        ids = self.template.leading_special_ids() + self.template.encode_runs(kept)
        return self.prefix_keys(ids[:max(0, len(ids) - PREFIX_CUT_MARGIN_TOKENS)], self._plain_seed(namespace))

    def plan_warm(self, doc_ids: list[str], namespace: str = "") -> PromptPlan:
        """A warm-up's plan: the documents' chunks, no question. Raises ``UnknownDocumentError``."""
        self.documents.check_ids(doc_ids, namespace)
        return PromptPlan(tuple(self.chunks(doc_ids, namespace)), ())

    def _check_length(self, plan: PromptPlan, what: str) -> None:
        if plan.num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {plan.num_prompt_tokens} tokens ({what}); the context limit is {self.max_model_len} "
                "tokens and at least one must remain for the answer")

    # --- comparison modes (CacheConfig.mode) ------------------------------------------------
    def _head_tokens(self, requested: int | None) -> int:
        """A request's chunk-head recompute (``None``: ``CacheConfig.recompute_chunk_head_tokens``).

        Raises:
            ValueError: not an integer >= 0, or > 0 in a mode other than ``lazy``.
        """
        if requested is None:
            return self.config.cache.recompute_chunk_head_tokens
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
            raise ValueError(f"recompute_chunk_head_tokens must be an integer >= 0, got {requested!r}")
        if requested and self.config.cache.mode != "lazy":
            raise ValueError(f"recompute_chunk_head_tokens needs CacheConfig.mode 'lazy', the engine runs "
                             f"{self.config.cache.mode!r}")
        return requested

    def _remedies(self, asked: RequestRemedies) -> tuple[int, float, bool]:
        """A request's chunk-head recompute ``k``, selective recompute ratio and chunk attention
        scaling. ``None`` takes the config's, except that a request asking for one remedy (> 0,
        True) turns the others it leaves unset off.

        Raises:
            ValueError: as :meth:`_head_tokens`,
                :func:`~lazyattn_rag.types.config.check_selective_ratio` and
                :func:`~lazyattn_rag.types.config.check_chunk_attention_scaling`.
        """
        cache, asks = self.config.cache, asked.asks_any()
        head_k = self._head_tokens(asked.recompute_chunk_head_tokens)
        ratio, scaling = asked.recompute_selective_ratio, asked.chunk_attention_scaling
        if ratio is not None:
            check_selective_ratio(ratio, cache.mode, asked.recompute_chunk_head_tokens or 0)
        if scaling is not None and not isinstance(scaling, bool):
            raise ValueError(f"chunk_attention_scaling must be True, False or None, got {scaling!r}")
        if scaling:
            check_chunk_attention_scaling(cache, asked.recompute_chunk_head_tokens or 0, ratio or 0.0)
        if asks and asked.recompute_chunk_head_tokens is None:
            head_k = 0
        if ratio is None:
            ratio = 0.0 if asks else cache.recompute_selective_ratio
        if scaling is None:
            scaling = False if asks else cache.chunk_attention_scaling
        return head_k, ratio, scaling

    def _for_mode(self, plan: PromptPlan, head_tokens: int = 0, selective_ratio: float = 0.0,
                  chunk_scaling: bool = False, namespace: str = "") -> PromptPlan:
        """The plan as ``CacheConfig.mode`` runs it (the comparison modes of the benchmarks), with
        ``head_tokens`` of every document recomputed, a ``selective_ratio`` of its tokens, or its
        documents read with chunk attention scaling (``lazy`` mode)."""
        mode = self.config.cache.mode
        if mode == "full":
            return PromptPlan((), tuple(plan.token_ids()))
        if mode == "prefix":
            return self._with_prefix_keys(PromptPlan((), tuple(plan.token_ids())), namespace)
        if mode == "block_attention":
            return PromptPlan(tuple(positioned_copy(c) for c in plan.chunks), plan.query_token_ids,
                              texts=plan.texts)
        plan = with_head_recompute(plan, head_tokens, self.config.cache.recompute_first_chunk_head)
        if chunk_scaling and any(c.doc_id is not None for c in plan.chunks):
            plan = dataclasses.replace(plan, chunk_scaling=True,
                                       chunk_scaling_blocks=int(self.config.cache.chunk_attention_scope == "head"))
        elif selective_ratio and plan.chunks:
            plan = dataclasses.replace(plan, selective_ratio=selective_ratio)
        return self._with_prefix_keys(plan, namespace) if self.caches_prefixes else plan

    # --- exact-prefix caching (CacheConfig.prefix_caching, mode="prefix") ----------------------
    @property
    def caches_prefixes(self) -> bool:
        """Whether plans carry prefix block keys for their tails."""
        cache = self.config.cache
        return cache.mode == "prefix" or (cache.mode == "lazy" and cache.prefix_caching)

    def _with_prefix_keys(self, plan: PromptPlan, namespace: str = "") -> PromptPlan:
        """``plan`` with the chained keys of its tail's full blocks (``PromptPlan.prefix_block_keys``).

        The chain starts from the model's digest and ``namespace`` for a prompt with nothing
        before its tail (a plain prompt: vLLM's automatic prefix caching, one tenant's prefixes
        never another's), else from a digest of everything the tail attends to as well: each
        chunk's key, offset and skipped head, each text segment's tokens and position, and the
        request's remedies, so a block is reused only after the same context at the same
        positions."""
        return dataclasses.replace(plan, prefix_block_keys=self.prefix_keys(plan.query_token_ids,
                                                                             self._context_seed(plan, namespace)))

    def _plain_seed(self, namespace: str) -> str:
        """Where the prefix-key chain of a prompt with nothing placed starts: the model's digest,
        and ``namespace`` (one tenant's prefixes are never another's)."""
        return chunk_key(self.model_digest, f"namespace:{namespace}", []) if namespace else self.model_digest

    def _context_seed(self, plan: PromptPlan, namespace: str) -> str:
        if not plan.chunks and not plan.texts:
            return self._plain_seed(namespace)
        context = {"namespace": namespace, "chunks": [[c.key, c.global_start, c.num_skipped] for c in plan.chunks],
                   "texts": [[t.global_start, list(t.token_ids)] for t in plan.texts],
                   "selective_ratio": plan.selective_ratio, "chunk_scaling": plan.chunk_scaling,
                   "chunk_scaling_blocks": plan.chunk_scaling_blocks}
        return chunk_key(self.model_digest, "context:" + json.dumps(context, separators=(",", ":")), [])

    def prefix_keys(self, token_ids: tuple[int, ...] | list[int], seed: str | None = None) -> PrefixKeys:
        """The chained key of each full block of ``token_ids`` from ``seed`` (the model's digest
        by default): block ``j``'s key names every token up to its end (hashed when read)."""
        return PrefixKeys(token_ids, seed or self.model_digest, self.block_size)
