"""Errors raised for bad input. Each names the offending id or limit; none corrupts the cache."""

from __future__ import annotations


class LazyAttentionError(ValueError):
    """Base class of the errors below."""


class UnknownDocumentError(LazyAttentionError, KeyError):
    """A document id was never registered (or was removed)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0] if self.args else ""


class DocumentTooLongError(LazyAttentionError):
    """A document cannot fit the model's context together with the prompt head and a question."""


class PromptTooLongError(LazyAttentionError):
    """A request's prompt reaches the context limit."""


class EmptyInputError(LazyAttentionError):
    """An empty question or document."""


class CacheCapacityError(LazyAttentionError):
    """A request needs more KV blocks than the cache can ever free for it."""


class SelfCheckError(LazyAttentionError):
    """The start-up self-check found positions that differ from transformers' (see
    ``EngineConfig.self_check`` and ``engine/self_check/checks.py``).

    The message names the part that failed (rotary tables or the logits of a probe request
    with a cached chunk at a non-zero offset), the positions, the largest error, the model's
    RoPE configuration and how to proceed.

    Attributes:
        report: the check's JSON-able report (per-position errors, tolerances), or ``None``.
    """

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


class ServerError(RuntimeError):
    """The server could not be reached, or failed (5xx); ``status`` is ``None`` when unreached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class DocumentChanged(ValueError):
    """409: a document this client sent was registered since with another text."""
