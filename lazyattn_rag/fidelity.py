"""How far one request's answer under chunk reuse is from full attention's (issue 20).

:func:`check_fidelity` (``LazyAttention.check_fidelity``) runs a question twice on the same
engine: as it is served (documents placed from their cached chunks, with whatever remedy the
request asks for) and as a plain prompt computed whole (full attention over the very same
tokens, no reuse). It reports the first answer token's KL divergence and top-1 agreement, and
whether the two answers are the same: the metrics of ``benchmarks/quality.py``, for one request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from lazyattn_rag.client import document_pairs
from lazyattn_rag.types.config import RequestRemedies
from lazyattn_rag.types.documents import Document
from lazyattn_rag.types.outputs import FidelityReport
from lazyattn_rag.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lazyattn_rag.llm import LazyAttention

FIRST_TOKEN = SamplingParams(max_tokens=1, logprobs=-1)  # the whole first-token distribution


def kl_divergence(reference_logprobs: Sequence[float], logprobs: Sequence[float]) -> float:
    """KL(P || Q) in nats of two distributions over one vocabulary, from their log-probabilities.

    Args:
        reference_logprobs: ``log P`` (e.g. full attention's first answer token), one per token id.
        logprobs: ``log Q`` (the mode compared), same length.
    Returns:
        ``sum_i P_i (log P_i - log Q_i)`` (>= 0; 0 for equal distributions; inf when Q puts no
        mass where P does).
    Raises:
        ValueError: the lengths differ.
    """
    p, q = np.asarray(reference_logprobs, dtype=np.float64), np.asarray(logprobs, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"distributions over {p.shape} and {q.shape} tokens")
    mass = np.exp(p)
    keep = mass > 0
    return float(max(0.0, np.sum(mass[keep] * (p[keep] - q[keep]))))


def check_fidelity(llm: LazyAttention, question: str, doc_ids: Iterable[str] = (),
                   documents: Iterable[Document] = (), sampling: SamplingParams | None = None,
                   namespace: str = "", remedies: RequestRemedies | None = None) -> FidelityReport:
    """The question served with reuse (``remedies``: this request's, as ``LazyAttention.generate``)
    and computed whole, compared.

    Four requests run one after the other: the answer as served under ``sampling`` (default
    greedy, the engine's ``max_tokens``; a seed makes a sampled comparison repeatable), which is
    where bad input and a ``max_tokens`` the cache cannot hold are refused; its first-token
    distribution (``max_tokens=1``, the whole vocabulary); then the same two computed whole. The full side
    is a plain prompt of the same token ids (``LazyAttention.plan(...).token_ids()``), so it is
    prefilled in full twice; nothing of it is cached as chunks.

    Raises:
        what ``LazyAttention.generate`` raises, at the first request, before anything else runs
        (inline ``documents`` are registered by it, as there).
    """
    doc_ids, documents = list(doc_ids), list(documents)
    params = sampling or SamplingParams(max_tokens=llm.default_sampling.max_tokens)
    answer = llm.generate(question, doc_ids, documents, params, namespace, remedies=remedies)  # checks all first
    inline = [doc_id for doc_id, _ in document_pairs(documents)]
    reused_first = llm.generate(question, doc_ids + inline, (), FIRST_TOKEN, namespace, remedies=remedies)
    prompt = llm.plan(question, doc_ids + inline, namespace).token_ids()
    full_answer = llm.complete(prompt, params)
    full_first = llm.complete(prompt, FIRST_TOKEN)
    p = np.asarray(full_first.logprobs[0].values())
    q = np.asarray(reused_first.logprobs[0].values())
    return FidelityReport(answer=answer, full_answer=full_answer, first_token_kl=kl_divergence(p, q),
                          first_token_top1_agrees=bool(np.argmax(p) == np.argmax(q)),
                          same_answer=answer.token_ids == full_answer.token_ids,
                          num_prompt_tokens=len(prompt))


__all__ = ["FIRST_TOKEN", "check_fidelity", "kl_divergence"]
