"""What a request returns: text, token ids, finish reason and per-request cache stats."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestStats:
    """Per-request accounting.

    Attributes:
        request_id: the engine's id for the request.
        num_prompt_tokens: prompt length (head + documents + query tail).
        num_cached_tokens: prompt tokens whose K/V came from the cache:
            ``num_exact_prefix_tokens + num_shifted_tokens``.
        num_exact_prefix_tokens: of ``num_cached_tokens``, those reused at the very positions
            they were computed at, after the very same tokens: the prompt head (the text before
            the first document, cached by the first request and shared by every prompt that
            starts with it) and exact-prefix blocks (``CacheConfig.prefix_caching``: a plain
            prompt's opening, a chat's earlier turns, a repeated tail).
        num_shifted_tokens: of ``num_cached_tokens``, those of documents and learned passages
            read from their position-agnostic chunks at this prompt's offsets (each encoded
            alone, RoPE applied at attention time).
        num_computed_tokens: prompt tokens whose K/V this request computed (documents encoded on
            a miss, text between documents, the query tail); includes ``num_recomputed_tokens``.
        num_recomputed_tokens: of ``num_computed_tokens``, document tokens a fidelity remedy
            computed in the request although their chunk is cached (chunk-head recompute,
            selective recompute).
        num_output_tokens: tokens generated.
        docs_hit: document ids served from the cache, in prompt order (a learned passage's id is
            ``passage:<hash>``).
        docs_missed: document ids encoded for this request, in prompt order.
        doc_sources: how each placed document came to be placed: ``"id"`` (named by id: a
            ``documents`` list, a document part, ``doc_ids=``), ``"matched"`` (its registered text
            was found in the prompt's plain text: ``lazyattn serve``'s matcher, the framework
            wrappers') or ``"learned"`` (a passage of plain text seen in earlier requests).
        doc_tiers: where each document's K/V came from: ``"kv"`` (already in the KV pool),
            ``"host"``, ``"disk"`` or ``"redis"`` (loaded from that storage tier: a hit, not
            computed) or ``"computed"`` (a miss; ``block_attention`` mode's re-rotated copies too).
        ttft_ms: time to first token, from submission, in milliseconds.
        tpot_ms: mean time per output token after the first, in milliseconds.
        e2e_ms: submission to finish, in milliseconds.
        queue_ms: submission to first scheduling, in milliseconds.
        remedy: the answer-fidelity remedy the request ran with (docs/quality.md):
            ``"chunk_head_recompute"``, ``"selective_recompute"``, ``"chunk_attention_scaling"``,
            or ``None`` (plain reuse).
        arrival_time: when the engine accepted the request (its submission), Unix time in
            seconds (``time.time()``), as vLLM's ``RequestMetrics.arrival_time``: lines the
            engine's own figures up with a caller's clock.
        planning_queue_ms: a chat prompt of plain text (planned in the client's planning threads,
            off the engine thread): from its submission to a planning thread taking it up, in
            milliseconds; ``None`` for a request planned on the engine thread.
        planning_ms: such a prompt's planning (tokenizing, the passage learner's choice), in
            milliseconds; ``None`` as ``planning_queue_ms``.
        submission_wait_ms: from the request being ready to queue (planned, or submitted where
            it is planned on the engine thread) to the engine thread taking it up between two
            steps, in milliseconds. With the two above and ``arrival_time`` it says where the
            time before the engine accepted the request went.
        num_preemptions: times the request's blocks were taken back and it was recomputed.
        loop_stopped: the loop guard ended the answer (``SamplingParams.loop_guard_ngram``): it
            began repeating a run of tokens it had produced; the text ends before the repeat.
    """

    request_id: str
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_exact_prefix_tokens: int = 0
    num_shifted_tokens: int = 0
    num_computed_tokens: int = 0
    num_recomputed_tokens: int = 0
    num_output_tokens: int = 0
    docs_hit: list[str] = field(default_factory=list)
    docs_missed: list[str] = field(default_factory=list)
    doc_tiers: dict[str, str] = field(default_factory=dict)
    doc_sources: dict[str, str] = field(default_factory=dict)
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    queue_ms: float | None = None
    remedy: str | None = None
    arrival_time: float | None = None
    planning_queue_ms: float | None = None
    planning_ms: float | None = None
    submission_wait_ms: float | None = None
    num_preemptions: int = 0
    loop_stopped: bool = False

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def summary(self, no_documents: str = "no documents") -> str:
        """One console line, as ``lazyattn ask`` and ``lazyattn chat`` print it, e.g.
        ``[docs hit 1, missed 1 | prompt 600 tokens: 533 cached (500 shifted, 33 exact prefix),
        67 computed | TTFT 5 ms | 2 output tokens]``; ``no_documents`` replaces the document
        counts when the request named none. Learned passages are counted apart from documents
        (``passages hit 2``), recomputed tokens are named with their remedy (``67 computed (16
        recomputed: chunk heads)``), attention scaling too (``(documents' attention scaled)``), an
        answer the loop guard ended says so (``12 output tokens, repeat cut``)."""
        from lazyattn_rag.utils.progress import plural

        ttft = f"{self.ttft_ms:.0f} ms" if self.ttft_ms is not None else "n/a"
        return (f"[{self._documents_label(no_documents)} | prompt {self.num_prompt_tokens} tokens: "
                f"{self._cached_label()}, {self.num_computed_tokens} computed{self._remedy_label()} | TTFT {ttft} | "
                f"{plural(self.num_output_tokens, 'output token')}{', repeat cut' if self.loop_stopped else ''}]")

    def _documents_label(self, no_documents: str) -> str:
        """``"docs hit 2 (1 from disk), missed 1; passages hit 3"``."""
        learned = {d for d, source in self.doc_sources.items() if source == "learned"}
        parts = []
        for what, keep in (("docs", lambda d: d not in learned), ("passages", lambda d: d in learned)):
            hit, missed = [d for d in self.docs_hit if keep(d)], [d for d in self.docs_missed if keep(d)]
            if hit or missed:
                tiers = self._tiers_label() if what == "docs" else ""
                parts.append(f"{what} hit {len(hit)}{tiers}, missed {len(missed)}")
        return "; ".join(parts) or no_documents

    def _tiers_label(self) -> str:
        """``" (1 from disk)"``: hits loaded from storage tiers below the KV pool, by tier."""
        counts: dict[str, int] = {}
        for tier in self.doc_tiers.values():
            if tier not in ("kv", "computed"):
                counts[tier] = counts.get(tier, 0) + 1
        return f" ({', '.join(f'{n} from {t}' for t, n in counts.items())})" if counts else ""

    def _remedy_label(self) -> str:
        """``" (16 recomputed: chunk heads)"``, ``" (documents' attention scaled)"`` or ``""``."""
        if self.num_recomputed_tokens:
            how = _REMEDY_LABELS.get(self.remedy)
            return f" ({self.num_recomputed_tokens} recomputed{f': {how}' if how else ''})"
        return " (documents' attention scaled)" if self.remedy == "chunk_attention_scaling" else ""

    def _cached_label(self) -> str:
        """``"33 cached (exact prefix)"``, ``"533 cached (500 shifted, 33 exact prefix)"``: tokens
        of documents and passages placed at new offsets, and tokens reused where they were
        computed (the prompt head, exact-prefix blocks)."""
        cached, exact = self.num_cached_tokens, min(self.num_exact_prefix_tokens, self.num_cached_tokens)
        if not exact:
            return f"{cached} cached" if not cached else f"{cached} cached (shifted)"
        if exact == cached:
            return f"{cached} cached (exact prefix)"
        return f"{cached} cached ({cached - exact} shifted, {exact} exact prefix)"


_REMEDY_LABELS = {"chunk_head_recompute": "chunk heads", "selective_recompute": "selective"}


class VocabLogprobs(Mapping):
    """``{token_id: log-probability}`` over the whole vocabulary (``SamplingParams.logprobs=-1``),
    read-only, backed by one ``[vocab_size]`` float32 CPU tensor (``.tensor``) instead of a dict
    of every id."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any):
        self.tensor = tensor

    def __getitem__(self, token_id: int) -> float:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < len(self.tensor):
            raise KeyError(token_id)
        return float(self.tensor[token_id])

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.tensor)))

    def __len__(self) -> int:
        return len(self.tensor)

    def values(self):  # noqa: D102 - Mapping's, in id order, without a lookup per id
        return self.tensor.tolist()


@dataclass
class StreamDelta:
    """One piece of a streamed answer.

    Attributes:
        text: new text (may be empty when a token completes no character yet).
        token_id: the token that produced it, or ``None`` for the final flush.
        finished: this is the last delta.
        finish_reason: ``"stop"`` (EOS, stop string or stop token), ``"length"`` (max_tokens or
            the context limit), ``"abort"`` (cancelled) or ``"warm"`` (a warm-up) once finished.
        stats: the request's stats once finished.
        logprobs: with ``SamplingParams.logprobs``, ``{token_id: log-probability}`` of the most
            likely tokens and of ``token_id`` at this step (a :class:`VocabLogprobs` for ``-1``);
            on the final delta of a request that ended on a stop token or EOS, that token's step
            (the token itself is not output); ``None`` otherwise.
        index: which of the request's ``SamplingParams.n`` answers this delta belongs to (0 for
            the only one); each answer ends with its own ``finished`` delta.
    """

    text: str
    token_id: int | None = None
    finished: bool = False
    finish_reason: str | None = None
    stats: RequestStats | None = None
    logprobs: dict[int, float] | None = None
    index: int = 0


@dataclass
class Completion:
    """A finished answer.

    Attributes:
        text: the generated text (stop strings cut off).
        token_ids: generated token ids (stop tokens and EOS excluded).
        finish_reason: ``"stop"`` or ``"length"``.
        stats: :class:`RequestStats`.
        logprobs: with ``SamplingParams.logprobs``, one ``{token_id: log-probability}`` per
            generated token, and one more for the stop token or EOS the request ended on (see
            :class:`StreamDelta`); ``None`` otherwise.
        alternatives: with ``SamplingParams.n > 1``, the other answers (indices 1 to n - 1, in
            order) sampled from the same prompt, which was computed once; empty otherwise.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    logprobs: list[dict[int, float]] | None = None
    alternatives: list["Completion"] = field(default_factory=list)


@dataclass
class FidelityReport:
    """One question served with chunk reuse against the same prompt under full attention
    (``LazyAttention.check_fidelity``; the metrics of ``benchmarks/quality.py``, per request).

    Attributes:
        answer: the answer as served (documents from their cached chunks, the request's remedy).
        full_answer: the answer of the same prompt tokens computed whole (no reuse).
        first_token_kl: KL(full || reused) of the first answer token's distributions, in nats
            (0 when they are equal).
        first_token_top1_agrees: both put their highest probability on the same first token.
        same_answer: the two answers' token ids are equal.
        num_prompt_tokens: tokens of the prompt both sides ran.
    """

    answer: Completion
    full_answer: Completion
    first_token_kl: float
    first_token_top1_agrees: bool
    same_answer: bool
    num_prompt_tokens: int
