"""Token ids worked out before planning, in another process (issue 36).

A plain chat prompt's text (an unchanged OpenAI client pastes its retrieved documents into the
message: ~17k characters for five 512-token documents) is most of what planning it costs, and
a replica plans in threads that share one GIL with the engine's step loop: sixteen such prompts
arriving together waited ~50 ms each for their turn (``benchmarks/results/http_reuse_*.json``,
the ``submitting_to_engine`` stage). So ``lazyattn serve``'s ingress, a process of its own,
tokenizes the rendered text with the replicas' own tokenizer, as vLLM's API process tokenizes
beside its engine core, and sends the ids with the request (:func:`pretokenize`); the replica's
planner looks them up (:func:`active`, :func:`lookup`) instead of tokenizing.

An entry maps the exact rendered runs (``(text, is_markup)`` pairs,
:meth:`PromptTemplate.encode_runs`' input) to the ids that method gives for them, so a hit is
exactly what the replica would have computed: a replica whose tokenizer differs (another digest,
:func:`tokenizer_digest`) or whose template renders other runs simply finds nothing and
tokenizes as before. Nothing else of planning moves: the passage learner, the cache lookups and
every check stay in the replica.
"""

from __future__ import annotations

import array
import contextlib
import contextvars
import hashlib
import importlib.metadata
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)
PRETOKENIZE_MIN_CHARS = 1024  # shorter texts are tokenized by the replica (sending ids would not pay)


@dataclass(frozen=True)
class Pretokenized:
    """Token ids of rendered prompt text, by :func:`runs_digest`.

    Attributes:
        tokenizer_digest: :func:`tokenizer_digest` of the tokenizer that made the ids.
        ids_by_runs: ``runs_digest(runs) -> ids`` (the ids ``encode_runs(runs)`` gives).
    """

    tokenizer_digest: str
    ids_by_runs: Mapping[str, tuple[int, ...]]

    def as_body(self) -> dict[str, Any]:
        """The form a payload carries (plain lists, no pickle needed)."""
        return {"tokenizer": self.tokenizer_digest, "runs": [[k, list(v)] for k, v in self.ids_by_runs.items()]}

    @classmethod
    def from_body(cls, body: Any) -> Pretokenized | None:
        """The inverse of :meth:`as_body`; ``None`` for ``None`` and for a body of another
        shape (a string digest and lists of non-negative integers): the ids only spare work,
        so a request whose ids do not parse is planned by tokenizing, as without them (logged)."""
        if body is None:
            return None
        try:
            digest, entries = body["tokenizer"], body["runs"]
            if not isinstance(digest, str) or not isinstance(entries, list):
                raise TypeError("not a digest and a list of entries")
            out = {}
            for key, ids in entries:
                if not isinstance(key, str) or not isinstance(ids, list):
                    raise TypeError("an entry that is not [digest, [ids]]")
                checked = array.array("q", ids)  # integers only, at C speed
                if checked and min(checked) < 0:
                    raise ValueError("a negative id")
                out[key] = tuple(checked)
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            logger.warning("token ids sent with a request are ignored (%s: %s); the replica tokenizes",
                           type(error).__name__, error)
            return None
        return cls(digest, out)


def runs_digest(runs: Sequence[tuple[str, bool]]) -> str:
    """A digest of ``(text, is_markup)`` runs: each run's kind and length, then its text."""
    h = hashlib.blake2b(digest_size=16)
    for text, is_markup in runs:
        data = text.encode("utf-8", "surrogatepass")
        h.update(b"M" if is_markup else b"L")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def tokenizer_digest(backend: Any) -> str | None:
    """A digest of what a fast tokenizer's ids depend on: ``backend``, a private copy of its
    Rust backend with padding and truncation off (``TokenEncoder.backend``: the shared
    tokenizer's JSON also holds those settings, which its own calls change), serialized whole
    (vocabulary, merges, normalizer, pre-tokenizer, added tokens and their flags), and the
    versions of ``tokenizers`` and of this package's planning code; ``None`` without a backend
    (a slow tokenizer, whose ids are never taken from elsewhere). Tens of ms for a large
    vocabulary: :attr:`PromptTemplate.tokenizer_digest` works it out once."""
    if backend is None:
        return None
    import tokenizers

    h = hashlib.sha256(backend.to_str().encode("utf-8", "surrogatepass"))
    h.update(f"|tokenizers {tokenizers.__version__}|lazyattn-rag {_package_version()}".encode())
    return h.hexdigest()


def _package_version() -> str:
    try:
        return importlib.metadata.version("lazyattn-rag")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "source"


_ACTIVE: contextvars.ContextVar[Pretokenized | None] = contextvars.ContextVar("lazyattn_pretokenized", default=None)


@contextlib.contextmanager
def active(pretokenized: Pretokenized | None, digest: str | None) -> Iterator[bool]:
    """Make ``pretokenized``'s ids visible to :func:`lookup` in this thread while the block
    runs, if they were made by the tokenizer with ``digest`` (the planner's); yields whether
    they were taken (the engine counts both outcomes)."""
    usable = pretokenized is not None and digest is not None and pretokenized.tokenizer_digest == digest
    token = _ACTIVE.set(pretokenized if usable else None)
    try:
        yield usable
    finally:
        _ACTIVE.reset(token)


def lookup(runs: Sequence[tuple[str, bool]]) -> list[int] | None:
    """The ids of ``runs`` from the active :class:`Pretokenized` (``None``: none active, or
    these runs are not in it)."""
    pretokenized = _ACTIVE.get()
    if pretokenized is None or sum(len(text) for text, _ in runs) < PRETOKENIZE_MIN_CHARS:
        return None
    ids = pretokenized.ids_by_runs.get(runs_digest(runs))
    return None if ids is None else list(ids)


def pretokenize(template: Any, messages: Sequence[Any]) -> Pretokenized | None:
    """What the ingress sends for plain chat ``messages``: the ids of each long text piece as
    ``template`` (a :class:`~lazyattn_rag.engine.planning.prompt.PromptTemplate` over the
    replicas' tokenizer and prompt settings) renders and tokenizes it; ``None`` for messages
    that place documents, have no long text, or that the template refuses (the replica then
    raises its own error)."""
    digest = template.tokenizer_digest
    if digest is None:
        return None
    try:
        pieces = template.render_messages(list(messages))
    except Exception:  # noqa: BLE001 - e.g. jinja2's TemplateError ("roles must alternate"): the replica's to raise
        return None
    texts = [p for p in pieces if hasattr(p, "runs")]
    if len(texts) != len(pieces):  # a document part: planned by the replica around its chunk
        return None
    entries = {runs_digest(p.runs): tuple(template.encode_runs(p.runs)) for p in texts
               if len(p.text) >= PRETOKENIZE_MIN_CHARS}
    return Pretokenized(digest, entries) if entries else None

