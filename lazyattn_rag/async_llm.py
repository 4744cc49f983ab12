"""``AsyncLazyAttention``: the asyncio front over the same background engine loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

from lazyattn_rag.types.documents import Document
from lazyattn_rag.llm import LazyAttention, _ids, _pairs, _prompt_ids
from lazyattn_rag.types.messages import Message, as_message
from lazyattn_rag.types.outputs import Completion, StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams


class AsyncLazyAttention:
    """Asyncio API: many tasks submit concurrently and share the engine's batches.

    Nothing here blocks the event loop: submissions run on the engine thread (awaited through
    a worker thread), and deltas come back through an ``asyncio.Queue`` fed thread-safely.
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

    async def add_document(self, doc_id: str, text: str) -> bool:
        return await asyncio.to_thread(self.llm.add_document, doc_id, text)

    async def remove_document(self, doc_id: str) -> None:
        await asyncio.to_thread(self.llm.remove_document, doc_id)

    async def warm(self, doc_ids: Iterable[str]) -> list[str]:
        return await asyncio.to_thread(self.llm.warm, list(doc_ids))

    async def stats(self) -> dict:
        return await asyncio.to_thread(self.llm.stats)

    async def _submit(self, make_request) -> AsyncIterator[StreamDelta]:
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()

        def sink(item):  # called on the engine thread
            loop.call_soon_threadsafe(deltas.put_nowait, item)

        engine, call = self.llm.engine, self.llm.loop.call
        submission = asyncio.ensure_future(asyncio.to_thread(call, make_request, sink))
        try:
            request = await asyncio.shield(submission)
        except asyncio.CancelledError:  # the submission may still land: abort what it makes
            submission.add_done_callback(self._abort_when_submitted)
            raise
        finished = False
        try:
            while True:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                try:
                    await asyncio.shield(asyncio.to_thread(call, engine.abort, request.request_id))
                except RuntimeError:  # the engine was shut down: the request is gone already
                    pass

    def _abort_when_submitted(self, submission: asyncio.Future) -> None:
        """Done-callback of a submission whose caller was cancelled while it waited."""
        if not submission.cancelled() and submission.exception() is None:
            self.llm.loop.post(self.llm.engine.abort, submission.result().request_id)

    def stream(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
               sampling: SamplingParams | None = None) -> AsyncIterator[StreamDelta]:
        """Async version of :meth:`LazyAttention.stream` (errors raise on the first ``__anext__``)."""
        params = sampling or self.llm.default_sampling
        ids, docs = _ids(doc_ids), _pairs(documents)
        engine = self.llm.engine

        def make(sink):
            return engine.submit(engine.plan_with_documents(question, ids, docs), params, sink)

        return self._submit(make)

    def stream_chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
                    sampling: SamplingParams | None = None) -> AsyncIterator[StreamDelta]:
        """Async version of :meth:`LazyAttention.stream_chat` (errors raise on the first ``__anext__``)."""
        msgs = [as_message(m) for m in messages]
        params, docs = sampling or self.llm.default_sampling, _pairs(documents)
        engine = self.llm.engine
        return self._submit(lambda sink: engine.submit(engine.plan_messages_with_documents(msgs, docs), params, sink))

    async def chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
                   sampling: SamplingParams | None = None) -> Completion:
        return await _collect(self.stream_chat(messages, documents, sampling))

    def stream_prompt(self, prompt: str | list[int], sampling: SamplingParams | None = None
                      ) -> AsyncIterator[StreamDelta]:
        """Async version of :meth:`LazyAttention.stream_prompt` (no chunk reuse)."""
        ids = _prompt_ids(self.llm.tokenizer, prompt)
        params = sampling or self.llm.default_sampling
        engine = self.llm.engine
        return self._submit(lambda sink: engine.submit(engine.plan_plain(ids), params, sink))

    async def generate(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
                       sampling: SamplingParams | None = None) -> Completion:
        return await _collect(self.stream(question, doc_ids, documents, sampling))

    async def complete(self, prompt: str | list[int], sampling: SamplingParams | None = None) -> Completion:
        return await _collect(self.stream_prompt(prompt, sampling))


async def _collect(deltas: AsyncIterator[StreamDelta]) -> Completion:
    text, token_ids, last = [], [], None
    async for delta in deltas:
        text.append(delta.text)
        if delta.token_id is not None:
            token_ids.append(delta.token_id)
        last = delta
    return Completion("".join(text), token_ids, last.finish_reason, last.stats)
