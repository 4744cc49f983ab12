"""Token ids from a fast tokenizer's Rust backend, giving up the GIL only where that pays.

A transformers fast tokenizer's ``__call__`` runs its Rust backend's ``encode_batch``, which
releases the GIL while it works. Beside a thread that keeps the GIL busy (a replica plans pasted
prompts beside its engine thread) that is a cost, not a gain: each release can cost up to the
interpreter's switch interval (5 ms) to win the GIL back. Beside a busy thread, one
17k-character prompt took 6.7 ms through ``__call__`` against 1.5 ms through the backend's
``encode``, which holds the GIL (CPU, tokenizers 0.23; 1.5 ms either way with no other thread).

Where the switch interval is short (``lazyattn serve``'s replicas set 0.5 ms,
``ServeConfig.switch_interval_ms``) the wait to win the GIL back is short too, and giving it up
lets several planning threads tokenize a burst of long prompts at once: a long text
(:data:`RELEASE_GIL_MIN_CHARS` characters or more) is then tokenized through ``encode_batch``,
which works without the GIL. Sixteen pasted 17k-character prompts planned at once beside a
thread that keeps the GIL busy, 2-core CPU (``benchmarks/results/http_reuse_overhead_cpu.json``,
docs/benchmarks.md): median latency from the burst's start 109 ms with one thread at 5 ms (as
before), 60 ms with one thread at 0.5 ms, 52 ms with four threads giving the GIL up at 0.5 ms
(79 ms with four threads keeping it). At Python's 5 ms the GIL is kept, as before.

:class:`TokenEncoder` holds a private copy of the backend (the shared one's flags are written
by ``__call__`` itself, e.g. ``encode_special_tokens``; a copy nothing else touches is safe to
read from any thread), with truncation and padding off, and gives the same ids and offsets as
the tokenizer's ``__call__`` with the same arguments (``tests/test_token_ids.py``). A slow
tokenizer has no backend: its ``__call__`` is used.
"""

from __future__ import annotations

import sys
from typing import Any

RELEASE_GIL_MIN_CHARS = 4096  # texts this long are tokenized without the GIL where switches are quick
RELEASE_GIL_MAX_SWITCH_INTERVAL_S = 0.001  # ...that is, where sys.getswitchinterval() is at most this


class TokenEncoder:
    """Encode text as ``tokenizer(text, add_special_tokens=..., split_special_tokens=...)`` does.

    Args:
        tokenizer: a transformers tokenizer (fast or slow).
        split_special_tokens: special-token text in the input stays ordinary text (a literal
            encoder), as ``__call__``'s ``split_special_tokens=True``.
    """

    def __init__(self, tokenizer: Any, split_special_tokens: bool = False, _serialized: str | None = None):
        self.tokenizer, self.split_special_tokens = tokenizer, split_special_tokens
        self.backend = _private_backend(tokenizer, split_special_tokens, _serialized)

    @classmethod
    def pair(cls, tokenizer: Any) -> tuple["TokenEncoder", "TokenEncoder"]:
        """``(parsing, literal)``: encoders with ``split_special_tokens`` off and on, the backend
        serialized once for both (a large vocabulary takes tens of ms)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        serialized = backend.to_str() if backend is not None and getattr(tokenizer, "is_fast", False) else None
        return cls(tokenizer, False, serialized), cls(tokenizer, True, serialized)

    def ids(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens``: the ones the tokenizer adds, e.g. BOS)."""
        if self.backend is not None:
            return self._encode(text, add_special_tokens).ids
        return list(self._call(text, add_special_tokens)["input_ids"])

    def ids_and_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` (no special tokens added) and each one's ``(start, end)``
        character span in it.

        Raises:
            NotImplementedError: a slow tokenizer, which has no offsets.
        """
        if self.backend is None:
            encoded = self._call(text, False, return_offsets_mapping=True)
            return list(encoded["input_ids"]), list(encoded["offset_mapping"])
        encoding = self._encode(text, False)
        return encoding.ids, encoding.offsets

    def _encode(self, text: str, add_special_tokens: bool) -> Any:
        """The backend's encoding of ``text``: without the GIL for a long text where the switch
        interval is short (see the module docstring), else holding it."""
        if len(text) >= RELEASE_GIL_MIN_CHARS and sys.getswitchinterval() <= RELEASE_GIL_MAX_SWITCH_INTERVAL_S:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return self.backend.encode(text, add_special_tokens=add_special_tokens)

    def _call(self, text: str, add_special_tokens: bool, **kwargs) -> Any:
        if self.split_special_tokens:
            kwargs["split_special_tokens"] = True
        return self.tokenizer(text, add_special_tokens=add_special_tokens, **kwargs)


def _private_backend(tokenizer: Any, split_special_tokens: bool, serialized: str | None = None) -> Any | None:
    """A copy of ``tokenizer``'s Rust backend (from ``serialized``, its ``to_str()``, if given)
    set up as its ``__call__`` would run it, or ``None`` for a tokenizer without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    from tokenizers import Tokenizer

    private = Tokenizer.from_str(serialized if serialized is not None else backend.to_str())
    private.no_truncation()
    private.no_padding()
    private.encode_special_tokens = split_special_tokens
    return private
