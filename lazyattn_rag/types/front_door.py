"""The front door: what every way into an engine offers (issue 39).

:class:`FrontDoor` is satisfied by :class:`~lazyattn_rag.llm.LazyAttention` (an engine in this
process) and :class:`~lazyattn_rag.remote.RemoteLazyAttention` (a ``lazyattn serve`` server);
:class:`AsyncFrontDoor` by their ``aio()``: :class:`~lazyattn_rag.async_llm.AsyncLazyAttention`
and :class:`~lazyattn_rag.remote.AsyncRemoteLazyAttention`. The framework wrappers
(``integrations/``) are written against these, so one engine or a cluster runs the same
idioms; ``tests/test_front_door.py`` holds the four classes to these signatures, so they cannot
drift apart again.

Every generation call takes the request's answer-fidelity remedies as one keyword,
``remedies`` (:class:`~lazyattn_rag.types.config.RequestRemedies`; ``None``: the engine's
``CacheConfig``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Protocol, runtime_checkable

from lazyattn_rag.types.config import RequestRemedies
from lazyattn_rag.types.documents import Document, RemovedDocument
from lazyattn_rag.types.messages import Message
from lazyattn_rag.types.outputs import Completion, StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams

ChatMessages = Iterable[Message | dict | tuple]


@runtime_checkable
class AsyncFrontDoor(Protocol):
    """Generation for asyncio (a stream's errors raise on its first ``__anext__``)."""

    def stream(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
               sampling: SamplingParams | None = None, namespace: str = "", *,
               remedies: RequestRemedies | None = None) -> AsyncIterator[StreamDelta]: ...

    def stream_chat(self, messages: ChatMessages, documents: Iterable[Document] = (),
                    sampling: SamplingParams | None = None, namespace: str = "", *,
                    remedies: RequestRemedies | None = None) -> AsyncIterator[StreamDelta]: ...

    async def generate(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
                       sampling: SamplingParams | None = None, namespace: str = "", *,
                       remedies: RequestRemedies | None = None) -> Completion: ...

    async def chat(self, messages: ChatMessages, documents: Iterable[Document] = (),
                   sampling: SamplingParams | None = None, namespace: str = "", *,
                   remedies: RequestRemedies | None = None) -> Completion: ...


@runtime_checkable
class FrontDoor(Protocol):
    """Documents and generation, blocking (see the module docstring).

    Attributes:
        model_name: the served model's name.
        max_model_len: the longest prompt plus answer, in tokens.
        default_sampling: the sampling a call without ``sampling`` gets (``None`` on a server:
            the server model's own).
    """

    model_name: str
    max_model_len: int
    default_sampling: SamplingParams | None

    def add_document(self, doc_id: str, text: str, namespace: str = "") -> bool: ...

    def add_documents(self, documents: Iterable[Document | tuple[str, str]], namespace: str = "") -> int: ...

    def remove_document(self, doc_id: str, namespace: str = "") -> RemovedDocument: ...

    def has_document(self, doc_id: str, namespace: str = "") -> bool: ...

    def document_ids(self, namespace: str = "") -> list[str]: ...

    def document_texts(self, doc_ids: Iterable[str] | None = None, namespace: str = "") -> dict[str, str]: ...

    def warm(self, doc_ids: Iterable[str], namespace: str = "") -> list[str]: ...

    def stream(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
               sampling: SamplingParams | None = None, namespace: str = "", *,
               remedies: RequestRemedies | None = None) -> Iterator[StreamDelta]: ...

    def generate(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
                 sampling: SamplingParams | None = None, namespace: str = "", *,
                 remedies: RequestRemedies | None = None) -> Completion: ...

    def stream_chat(self, messages: ChatMessages, documents: Iterable[Document] = (),
                    sampling: SamplingParams | None = None, namespace: str = "", *,
                    remedies: RequestRemedies | None = None) -> Iterator[StreamDelta]: ...

    def chat(self, messages: ChatMessages, documents: Iterable[Document] = (),
             sampling: SamplingParams | None = None, namespace: str = "", *,
             remedies: RequestRemedies | None = None) -> Completion: ...

    def aio(self) -> AsyncFrontDoor: ...

    def close(self) -> None: ...
