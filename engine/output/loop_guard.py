"""A guard against answers that loop: the output repeating a run of tokens it already produced
(issue 38.2).

Small models often answer right in their first sentence and then say it again to the token cap.
:class:`LoopGuard` watches the output's token ids: once its last ``ngram`` tokens occur earlier
in the output, the answer is looping and ends *before* those tokens (``finish_reason="stop"``).
Meanwhile the detokenizer holds back the text of the output's tail that matches an earlier run
(it may become the repeat), exactly as it holds back the tail that may become a stop string, so
a streamed answer never shows the start of a repeat it then cuts. Shorter repeats (a word, a
name, a phrase under ``ngram`` tokens) pass. Unlike transformers' ``no_repeat_ngram_size``,
nothing is banned from being sampled: an answer that never loops is unchanged token for token.

Cost per token: ``ngram`` tuple lookups in sets of the output's earlier runs.
"""

from __future__ import annotations


class LoopGuard:
    """Tracks the longest run at the output's end that occurred earlier (see the module).

    Args:
        ngram: the run length (tokens) that counts as a loop (>= 2).
    """

    def __init__(self, ngram: int):
        if ngram < 2:
            raise ValueError(f"loop guard n-gram must be >= 2, got {ngram}")
        self.ngram = ngram
        self._ids: list[int] = []
        self._seen: list[set[tuple[int, ...]]] = [set() for _ in range(ngram + 1)]  # [k]: k-grams ended earlier
        self.match_len = 0  # tokens at the end that repeat an earlier run (< ngram unless looping)

    @property
    def looping(self) -> bool:
        return self.match_len >= self.ngram

    def add(self, token_id: int) -> int:
        """Append a token; the length of the longest run ending here that also ended at an
        earlier position (capped at ``ngram``)."""
        ids = self._ids
        ids.append(token_id)
        n = len(ids)
        for k in range(1, min(self.ngram, n - 1) + 1):  # the runs ending at the previous token are earlier now
            self._seen[k].add(tuple(ids[n - 1 - k:n - 1]))
        match = 0
        for k in range(1, min(self.ngram, n - 1) + 1):
            if tuple(ids[n - k:]) not in self._seen[k]:
                break  # a longer run ending here needs this shorter one to have occurred too
            match = k
        self.match_len = match
        return match
