"""``AsyncLazyAttention``: the asyncio front over the same background engine loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

from lazyattn_rag.client import MakeRequest, PlannedRequest, chat_request, prompt_request, question_request
from lazyattn_rag.llm import LazyAttention, collect
from lazyattn_rag.types.config import RequestRemedies
from lazyattn_rag.types.documents import Document, RemovedDocument
from lazyattn_rag.types.messages import DocumentRef, Message
from lazyattn_rag.types.outputs import Completion, FidelityReport, StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams


class AsyncLazyAttention:
    """Asyncio API: many tasks submit concurrently and share the engine's batches.

    Nothing here blocks the event loop: submissions are planned in the client's planning
    threads or on the engine thread and awaited as futures (no worker thread waits on them: on
    an H100 replica that hand-off took 16 ms median for pasted prompts, docs/benchmarks.md), and deltas
    come back through an ``asyncio.Queue`` fed thread-safely.
    Cancelling a task that iterates a stream aborts its request and frees its blocks.

    Args:
        llm: the :class:`LazyAttention` whose engine to share (the sync API keeps working).

    Example::

        allm = AsyncLazyAttention(LazyAttention())
        await allm.add_document("eiffel", "The Eiffel Tower ... completed in 1889.")
        answer = await allm.generate("When was it completed?", doc_ids=["eiffel"])
    """

    def __init__(self, llm: LazyAttention):
        self.llm = llm

    async def add_document(self, doc_id: str, text: str, namespace: str = "") -> bool:
        return await asyncio.to_thread(self.llm.add_document, doc_id, text, namespace)

    async def remove_document(self, doc_id: str, namespace: str = "") -> RemovedDocument:
        return await asyncio.to_thread(self.llm.remove_document, doc_id, namespace)

    async def warm(self, doc_ids: Iterable[str], namespace: str = "") -> list[str]:
        return await asyncio.to_thread(self.llm.warm, list(doc_ids), namespace)

    async def stats(self) -> dict:
        return await asyncio.to_thread(self.llm.stats)

    async def _submit(self, make: MakeRequest | PlannedRequest) -> AsyncIterator[StreamDelta]:
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()

        def sink(item):  # called on the engine thread
            loop.call_soon_threadsafe(deltas.put_nowait, item)

        client = self.llm.client
        submission = asyncio.wrap_future(client.submit_soon(make, sink))  # no thread of ours waits on it
        try:
            request_id = await asyncio.shield(submission)
        except asyncio.CancelledError:  # the submission may still land: abort what it makes
            submission.add_done_callback(self._abort_when_submitted)
            raise
        finished, num_open = False, getattr(make, "num_outputs", 1)  # answers not finished yet (SamplingParams.n)
        try:
            while True:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                num_open -= item.finished
                finished = num_open == 0
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await asyncio.shield(asyncio.to_thread(client.abort, request_id))

    def _abort_when_submitted(self, submission: asyncio.Future) -> None:
        """Done-callback of a submission whose caller was cancelled while it waited."""
        if not submission.cancelled() and submission.exception() is None:
            self.llm.client.abort_soon(submission.result())

    def stream(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
               sampling: SamplingParams | None = None, namespace: str = "", *,
               remedies: RequestRemedies | None = None) -> AsyncIterator[StreamDelta]:
        """Async version of :meth:`LazyAttention.stream` (argument errors raise here, engine errors
        on the first ``__anext__``)."""
        return self._submit(question_request(question, doc_ids, documents, sampling or self.llm.default_sampling,
                                             namespace, remedies or RequestRemedies()))

    def stream_chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
                    sampling: SamplingParams | None = None, namespace: str = "", *,
                    remedies: RequestRemedies | None = None) -> AsyncIterator[StreamDelta]:
        """Async version of :meth:`LazyAttention.stream_chat` (errors as :meth:`stream`)."""
        return self._submit(chat_request(messages, documents, sampling or self.llm.default_sampling, namespace,
                                         remedies or RequestRemedies()))

    async def chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
                   sampling: SamplingParams | None = None, namespace: str = "", *,
                   remedies: RequestRemedies | None = None) -> Completion:
        return await _collect(self.stream_chat(messages, documents, sampling, namespace, remedies=remedies))

    def stream_prompt(self, prompt: str | list[int] | list[str | DocumentRef], sampling: SamplingParams | None = None,
                      documents: Iterable[Document] = (), namespace: str = "", *,
                      remedies: RequestRemedies | None = None) -> AsyncIterator[StreamDelta]:
        """Async version of :meth:`LazyAttention.stream_prompt`."""
        return self._submit(prompt_request(prompt, sampling or self.llm.default_sampling, documents, namespace,
                                           remedies or RequestRemedies()))

    async def generate(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
                       sampling: SamplingParams | None = None, namespace: str = "", *,
                       remedies: RequestRemedies | None = None) -> Completion:
        return await _collect(self.stream(question, doc_ids, documents, sampling, namespace, remedies=remedies))

    async def complete(self, prompt: str | list[int] | list[str | DocumentRef], sampling: SamplingParams | None = None,
                       documents: Iterable[Document] = (), namespace: str = "", *,
                       remedies: RequestRemedies | None = None) -> Completion:
        return await _collect(self.stream_prompt(prompt, sampling, documents, namespace, remedies=remedies))

    async def check_fidelity(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
                             sampling: SamplingParams | None = None, namespace: str = "", *,
                             remedies: RequestRemedies | None = None) -> FidelityReport:
        """Async version of :meth:`LazyAttention.check_fidelity` (its four requests run in a
        worker thread; the event loop stays free)."""
        return await asyncio.to_thread(self.llm.check_fidelity, question, list(doc_ids), list(documents), sampling,
                                       namespace, remedies=remedies)


async def _collect(deltas: AsyncIterator[StreamDelta]) -> Completion:
    return collect([delta async for delta in deltas])
