"""What the output processor keeps per request, apart from its scheduling state (``Request``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lazyattn_rag.engine.output.detokenizer import IncrementalDetokenizer
from lazyattn_rag.engine.output.grammar import GrammarState
from lazyattn_rag.types.outputs import StreamDelta

if TYPE_CHECKING:
    from lazyattn_rag.engine.scheduling.request import Request

Sink = Callable[[StreamDelta | BaseException], None]


@dataclass(eq=False)
class OutputState:
    """One request's output side: where its deltas go and how its tokens become text.

    The scheduler never reads it; the request's generated token ids stay on ``Request``
    (``output_ids``) because they are the next steps' model input.

    Attributes:
        sink: called with each :class:`StreamDelta` (from the engine thread), or with an
            exception that ends the request.
        detokenizer: token ids -> text, with stop strings and the loop guard.
        generator: the sampling RNG (the request's own when it has a seed, else the engine's).
        stop_token_ids: ids that end generation (the request's own and, unless ``ignore_eos``, EOS).
        first_token_time: ``time.perf_counter()`` when its first token was sampled (TTFT).
        finish_reason: ``stop``, ``length``, ``warm`` or ``abort`` once it finished.
        grammar: its structured output's matcher (``SamplingParams.structured_output``), or ``None``.
        forks: with ``SamplingParams.n > 1``, the other answers' requests and states, waiting for
            this one's first token (then forked from its prompt); empty after.
    """

    sink: Sink
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    stop_token_ids: frozenset[int] = frozenset()
    first_token_time: float | None = None
    finish_reason: str | None = None
    grammar: GrammarState | None = None
    forks: list[tuple["Request", "OutputState"]] = field(default_factory=list)


def indexed_sink(sink: Sink, index: int) -> Sink:
    """``sink``, with every :class:`StreamDelta` it receives tagged as answer ``index``."""
    return lambda item: sink(dataclasses.replace(item, index=index) if isinstance(item, StreamDelta) else item)
