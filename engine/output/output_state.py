"""What the output processor keeps per request, apart from its scheduling state (``Request``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lazyattn_rag.engine.output.detokenizer import IncrementalDetokenizer
from lazyattn_rag.engine.output.grammar import GrammarState
from lazyattn_rag.types.outputs import StreamDelta

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
    """

    sink: Sink
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    stop_token_ids: frozenset[int] = frozenset()
    first_token_time: float | None = None
    finish_reason: str | None = None
    grammar: GrammarState | None = None
