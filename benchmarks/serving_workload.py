"""The serving benchmark's workload: documents and questions of random word tokens
(``t10 .. t29999``, see ``serving_setup.word_tokenizer``) and a RAG request trace whose
documents follow a Zipf popularity."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def random_text(rng: np.random.Generator, num_tokens: int) -> str:
    """``num_tokens`` random word tokens, one per whitespace-separated word."""
    return " ".join(f"t{x}" for x in rng.integers(10, 30000, num_tokens))


@dataclass(frozen=True)
class Workload:
    """A RAG request trace.

    Attributes:
        num_docs, doc_tokens: document pool (every document ``doc_tokens`` long).
        docs_per_request: documents per prompt, in retrieved order.
        alpha: Zipf exponent of document popularity (0 = uniform).
        query_tokens, output_tokens: question length and generated tokens per request.
        num_requests: requests in the trace.
        seed: RNG seed.
    """

    num_docs: int = 200
    doc_tokens: int = 512
    docs_per_request: int = 5
    alpha: float = 2.1
    query_tokens: int = 64
    output_tokens: int = 32
    num_requests: int = 200
    seed: int = 0

    def documents(self) -> dict[str, str]:
        rng = np.random.default_rng(self.seed)
        return {f"doc{i}": random_text(rng, self.doc_tokens) for i in range(self.num_docs)}

    def requests(self) -> list[tuple[str, list[str]]]:
        """``(question, document ids)`` per request."""
        rng = np.random.default_rng(self.seed + 1)
        weights = 1.0 / np.arange(1, self.num_docs + 1) ** self.alpha
        weights /= weights.sum()
        out = []
        for _ in range(self.num_requests):
            docs = rng.choice(self.num_docs, size=self.docs_per_request, replace=False, p=weights)
            out.append((random_text(rng, self.query_tokens), [f"doc{d}" for d in docs]))
        return out
