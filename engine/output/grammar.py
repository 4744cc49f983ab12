"""Structured output as a token mask: xgrammar compiles a request's constraint once, a matcher
per request tracks it, and the sampler sees only tokens that can continue a match.

xgrammar (Dong et al. 2024) precomputes, for each grammar state, which vocabulary entries are
allowed regardless of context, so filling the mask costs microseconds per step for most
states. The compiled grammar is cached by the compiler (one JSON schema asked by many requests
compiles once); compiling happens before a request reaches the engine thread
(:meth:`GrammarCompiler.compile` from the client's planning thread), so a new schema never
holds up a step.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable

import torch

from lazyattn_rag.types.structured_output import StructuredOutputParams

_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:
        raise ValueError("structured output needs xgrammar: pip install 'lazyattn-rag[structured]'") from error
    return xgrammar


class GrammarCompiler:
    """Compiles :class:`StructuredOutputParams` for one tokenizer (built on first use).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (logits) size, ``>= len(tokenizer)``.
        stop_token_ids: the ids that end an answer (EOS); the mask allows them once a match is
            complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, params: StructuredOutputParams):
        """The compiled grammar of ``params`` (cached by the compiler).

        Raises:
            ValueError: xgrammar is not installed, or the schema, regex or grammar does not
                compile (xgrammar's message, naming the field).
        """
        compiler = self._get()
        try:
            if params.kind == "json":
                return compiler.compile_json_schema(params.json, any_whitespace=False)
            if params.kind == "json_object":  # an object, as OpenAI's json_object (the builtin grammar takes any value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if params.kind == "regex":
                return compiler.compile_regex(params.regex)
            if params.kind == "choice":
                # ensure_ascii=False: an escaped astral character (\ud83d\ude00) would read as two lone surrogates
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                         for c in params.choice))
            return compiler.compile_grammar(params.grammar)
        except RuntimeError as error:
            message = _XGRAMMAR_LOG_PREFIX.sub("", str(error).strip()).splitlines()[0]
            raise ValueError(f"structured output {params.kind} does not compile: {message}") from None

    def matcher(self, params: StructuredOutputParams) -> "GrammarState":
        """A fresh :class:`GrammarState` for one request. Raises like :meth:`compile`."""
        return GrammarState(_xgrammar(), self.compile(params), self.vocab_size)


class GrammarState:
    """One request's progress through its grammar.

    Args:
        xgr: the xgrammar module.
        compiled: the compiled grammar.
        vocab_size: the logits' size.
    """

    def __init__(self, xgr, compiled, vocab_size: int):
        self.xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens that can continue the match into ``bitmask[row]`` (``[num_rows,
        ceil(vocab_size / 32)]`` int32 on the CPU, xgrammar's layout: bit set = allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id`` (a token the mask allowed).

        Raises:
            RuntimeError: the grammar refuses it (a bug: the mask allowed it).
        """
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"structured output: token {token_id} was sampled but the grammar refuses it")

    @property
    def is_terminated(self) -> bool:
        """Whether the match is complete and a stop token was accepted."""
        return self._matcher.is_terminated()


def mask_rows(logits: torch.Tensor, grammars: dict[int, GrammarState],
              on_error: Callable[[int, Exception], None] | None = None) -> torch.Tensor:
    """``logits`` with each row ``i`` of ``grammars`` masked by its grammar: every token that
    cannot continue that request's match set to ``-inf``. One bitmask for the step, one copy to
    the device and one masking launch, however many rows are constrained.

    Args:
        logits: ``[num_rows, vocab_size]`` float32, any device (left unchanged).
        grammars: row index -> that row's :class:`GrammarState`.
        on_error: called with a row and the exception its grammar raised filling its mask (that
            row is then left unmasked: its request is the caller's to fail); ``None``: raise.
    Returns:
        A new ``[num_rows, vocab_size]`` tensor, or ``logits`` itself when ``grammars`` is empty.
    """
    if not grammars:
        return logits
    first = next(iter(grammars.values()))
    bitmask = first.xgr.allocate_token_bitmask(logits.shape[0], first.vocab_size)  # all allowed: -1 words
    for row, grammar in grammars.items():
        try:
            grammar.fill(bitmask, row)
        except Exception as error:  # noqa: BLE001 - handed to on_error: one request's grammar, not the step
            if on_error is None:
                raise
            on_error(row, error)
    masked = logits.clone()
    first.xgr.apply_token_bitmask_inplace(masked, bitmask.to(logits.device, non_blocking=True))
    return masked
