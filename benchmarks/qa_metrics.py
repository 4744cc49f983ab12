"""Open-domain QA metrics: SQuAD answer normalisation, exact match, answer-contains-gold
(the "best subspan EM" of the long-context QA papers), token F1, and bootstrap intervals.

Every scoring function takes the model's prediction and the list of accepted gold answers
(aliases) and returns the best score over the aliases, as the SQuAD and lost-in-the-middle
evaluation scripts do.

    >>> normalize_answer("The  Eiffel-Tower!")
    'eiffeltower'
    >>> answer_contains_gold("It was finished in 1889.", ["1889"])
    1.0
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower case, drop punctuation, drop articles, collapse whitespace.

    Args:
        text: any string.
    Returns:
        the normalised string (possibly empty).
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def scored_answer(generation: str) -> str:
    """The part of a generation that is scored: its first non-empty line, stripped.

    A first line that ends with a colon is a lead-in ("The answer is:") and is joined with the
    next non-empty line. Scoring a short span, not the whole generation, keeps a model from
    scoring by copying its context (which contains the gold answer), as in Liu et al. (2023).

        >>> scored_answer("The answer is:\nParis.\nIt is the capital.")
        'The answer is: Paris.'
    """
    lines = [line.strip() for line in generation.splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def scored_answer_complete(generation: str) -> bool:
    """Whether a partial generation already holds its whole :func:`scored_answer`.

    Generation can stop there: nothing generated after it changes the scored answer.
    """
    finished_lines = [line.strip() for line in generation.split("\n")[:-1] if line.strip()]
    if not finished_lines:
        return False
    return not finished_lines[0].endswith(":") or len(finished_lines) >= 2


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def answer_contains_gold(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if any normalised gold answer is a substring of the normalised prediction, else 0.0.

    This is the "best subspan exact match" of Liu et al. (lost in the middle, 2023) that the
    LazyAttention and Block-Attention papers report. Gold answers that normalise to the empty
    string never match.
    """
    pred = normalize_answer(prediction)
    return float(any((g := normalize_answer(gold)) and g in pred for gold in golds))


def token_f1(prediction: str, golds: Sequence[str]) -> float:
    """Best SQuAD token F1 in [0, 1] between the prediction and any gold answer.

    Tokens are the whitespace-separated words after :func:`normalize_answer`; the overlap is a
    multiset intersection. Two empty strings score 1.0, one empty string 0.0.
    """
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        gold_tokens = normalize_answer(gold).split()
        if not pred_tokens or not gold_tokens:
            best = max(best, float(pred_tokens == gold_tokens))
            continue
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common == 0:
            continue
        precision, recall = common / len(pred_tokens), common / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def same_answer(a: str, b: str) -> float:
    """1.0 if two predictions are equal after :func:`normalize_answer`, else 0.0."""
    return float(normalize_answer(a) == normalize_answer(b))


def bootstrap_ci(values: Sequence[float], num_resamples: int = 2000, confidence: float = 0.95,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-question scores.

    For a paired comparison of two modes on the same questions, pass the per-question
    differences.

    Args:
        values: per-question scores (at least one).
        num_resamples: bootstrap resamples (>= 1).
        confidence: interval mass in (0, 1), e.g. 0.95.
        seed: seed of the resampling generator (the interval is deterministic given it).
    Returns:
        (low, high) bounds of the mean, in the units of ``values``.
    Raises:
        ValueError: empty ``values``, ``num_resamples < 1`` or ``confidence`` outside (0, 1).
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(num_resamples, x.size))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def summarize(values: Sequence[float], num_resamples: int = 2000, seed: int = 0) -> dict:
    """``{"mean", "ci95": [low, high], "n"}`` of per-question scores, in percent (x100)."""
    low, high = bootstrap_ci(values, num_resamples, 0.95, seed)
    return {"mean": 100 * float(np.mean(values)), "ci95": [100 * low, 100 * high], "n": len(values)}


def summarize_raw(values: Sequence[float], num_resamples: int = 2000, seed: int = 0) -> dict:
    """:func:`summarize` in the values' own units (e.g. nats of KL divergence), not percent."""
    low, high = bootstrap_ci(values, num_resamples, 0.95, seed)
    return {"mean": float(np.mean(values)), "ci95": [low, high], "n": len(values)}

