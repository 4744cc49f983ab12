"""Sampling parameters: how a request picks its output tokens (the sampler is engine/output/sampler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from lazyattn_rag.types.structured_output import StructuredOutputParams


GREEDY_TEMPERATURE = 1e-5


MAX_N = 128  # most answers per request (SamplingParams.n)

CHAT_LOOP_GUARD_NGRAM = 8  # the loop guard of lazyattn chat/ask and the chatbot (benchmarks/chat_quality.py: 8, 12 and 16 all end every looping answer; 8 also the shorter phrase loops)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens (the vLLM meaning of each field).

    Attributes:
        n: answers to sample from the prompt, 1 to ``MAX_N`` (vLLM's ``n``): the prompt is
            computed once and forked after its first token's logits (each answer then holds its
            own copy of the prompt's last, partly filled KV block); answer ``i`` samples with
            ``seed + i`` when ``seed`` is set. Deltas carry their answer's ``index``.
        max_tokens: most tokens to generate (>= 1).
        strict_max_tokens: refuse a request whose prompt plus ``max_tokens`` exceeds the context
            limit (``PromptTooLongError`` naming both counts, before it runs), as OpenAI's and
            vLLM's servers refuse an explicit ``max_tokens``; ``False`` (the default): the answer
            stops at the limit (``finish_reason="length"``).
        temperature: 0 (or below 1e-5) for greedy; otherwise divides the logits.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: in [0, 1]; after temperature, top-k and top-p, drop the tokens whose probability is
            below ``min_p`` times the most likely one's (Nguyen et al. 2024, "min-p sampling"); 0
            disables, 1 keeps only the most likely.
        stop: strings that end generation; the output is cut before the first match.
        stop_token_ids: token ids that end generation (not included in the output).
        ignore_eos: keep going past the model's end-of-sequence token.
        seed: per-request seed (same seed and prompt give the same sample); ``None`` uses the
            engine's generator.
        repetition_penalty: > 0; tokens already in the prompt or the output have positive logits
            divided and negative logits multiplied by it (CTRL, Keskar et al. 2019); 1 disables.
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it was generated.
        presence_penalty: in [-2, 2]; subtracted from the logit of every token generated at least once.
        logprobs: ``None``, or return with each generated token the natural-log probabilities of
            the model's ``logprobs`` most likely tokens and of the token picked (vLLM's field;
            ``-1``: every token of the vocabulary, a diagnostic, e.g. the first-token KL
            divergence of ``benchmarks/quality.py``). They are the model's own distribution
            (``log_softmax`` of its float32 logits), before penalties, temperature, top-k/top-p.
        loop_guard_ngram: ``None`` (the default: off), or end the answer once its last ``n``
            tokens repeat a run of ``n`` it already produced; the text ends before the repeat
            (``finish_reason="stop"``, ``stats.loop_stopped``) and a stream never shows it
            (``engine/output/loop_guard.py``). Nothing is banned from sampling, so an answer that does
            not loop is unchanged; ``lazyattn chat``/``ask`` and the chatbot use 8.
        structured_output: ``None``, or a :class:`StructuredOutputParams` the answer must match
            (a JSON schema, any JSON object, a regex, one of a list of strings, an EBNF
            grammar): tokens that cannot continue a match are masked before sampling
            (xgrammar; ``engine/output/grammar.py``), and the answer ends once the match is
            complete. ``logprobs`` stay the model's own, before the mask.
        skip_special_tokens: leave the tokenizer's special tokens (``<|im_start|>`` ...) out of
            the text (vLLM's field and default, ``True``); ``False`` writes them as the tokenizer
            spells them. Token ids, logprobs and stop tokens are unchanged; a stop token is never
            part of the text either way.
    Raises:
        ValueError: at construction, for any value outside its range (the field is named).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    n: int = 1
    strict_max_tokens: bool = False
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    loop_guard_ngram: int | None = None
    structured_output: StructuredOutputParams | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        _check_types(self)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if not self.repetition_penalty > 0 or self.repetition_penalty == float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or self.logprobs < -1):
            raise ValueError(f"logprobs must be None, -1 (the whole vocabulary) or an integer >= 0, "
                             f"got {self.logprobs!r}")
        if self.loop_guard_ngram is not None and (not isinstance(self.loop_guard_ngram, int)
                                                  or isinstance(self.loop_guard_ngram, bool)
                                                  or self.loop_guard_ngram < 2):
            raise ValueError(f"loop_guard_ngram must be None or an integer >= 2, got {self.loop_guard_ngram!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputParams):
            raise ValueError(f"structured_output must be None or a StructuredOutputParams, got {self.structured_output!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (dividing by them overflows float32)."""
        return self.temperature < GREEDY_TEMPERATURE


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_types(p: "SamplingParams") -> None:
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        if not _is_number(getattr(p, name)):
            raise ValueError(f"{name} must be a number, got {getattr(p, name)!r}")
    for name in ("ignore_eos", "strict_max_tokens", "skip_special_tokens"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(p, name)!r}")
    if p.seed is not None and (not isinstance(p.seed, int) or isinstance(p.seed, bool) or not 0 <= p.seed < 2**63):
        raise ValueError(f"seed must be None or an integer in [0, 2**63), got {p.seed!r}")
    stop = p.stop
    if stop is None or not (isinstance(stop, str) or all(isinstance(x, str) for x in stop)):
        raise ValueError(f"stop must be a string or a sequence of strings, got {stop!r}")
    if p.stop_token_ids is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids must be a sequence of integers, got {p.stop_token_ids!r}")
