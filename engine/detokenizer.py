"""Incremental, UTF-8-safe detokenization with stop strings.

Byte-level BPE tokens can split a multi-byte character; decoding such a prefix yields
U+FFFD. Text is released only up to the last complete character, and (when stop strings
are set) the tail that could still become a stop string is held back, so the streamed
pieces always concatenate to exactly the final text.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Args:
        tokenizer: a transformers tokenizer (``decode``).
        stop: stop strings; the text ends before the first occurrence of any.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # final text so far (complete characters, stop-cut)
        self._emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; return the newly releasable text (may be empty)."""
        self.token_ids.append(token_id)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if full.endswith(REPLACEMENT):  # an incomplete character: wait for more bytes
            return ""
        for s in self.stop:
            idx = full.find(s)
            if idx != -1:
                full = full[:idx]
                self.stopped = True
        self.text = full
        if self.stopped:
            return self.flush()
        safe_end = max(self._emitted, len(full) - self._holdback)
        delta, self._emitted = full[self._emitted : safe_end], safe_end
        return delta

    def flush(self) -> str:
        """Release everything held back (call once generation ended)."""
        delta, self._emitted = self.text[self._emitted :], len(self.text)
        return delta
