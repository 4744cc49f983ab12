"""Async over the synchronous facade, without blocking the event loop.

The only place where the integrations bridge threads and asyncio; an ``AsyncLazyAttention``
front with its own engine loop can replace it later without touching the adapters.

The facade's stream holds the engine lock from its first to its last item, and an ``RLock``
must be released by the thread that took it, so a stream is created, iterated and closed in
one worker thread; items cross to the event loop through an :class:`asyncio.Queue`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


async def run_sync(fn: Callable[[], T]) -> T:
    """Run ``fn()`` in a worker thread and await its result (exceptions propagate)."""
    return await asyncio.to_thread(fn)


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """Yield the items of ``make_iterator()``, which runs entirely in one worker thread.

    Args:
        make_iterator: called in the worker thread; returns the (blocking) iterator.
    Yields:
        its items, in order, as they are produced.
    Raises:
        whatever ``make_iterator`` or the iterator raises, at the point it was raised.

    If the consumer stops early (``aclose``, cancellation), the worker stops before its next
    item and closes the iterator in its own thread, so the engine lock is released.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop closed under us: nobody is listening any more
            stop.set()

    def work() -> None:
        iterator = None
        try:
            iterator = make_iterator()
            for item in iterator:
                if stop.is_set():
                    break
                put((item, None))
        except BaseException as e:  # handed to the consumer, re-raised there
            put((_DONE, e))
            return
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        put((_DONE, None))

    thread = threading.Thread(target=work, name="lazyattn-stream", daemon=True)
    thread.start()
    try:
        while True:
            item, error = await queue.get()
            if item is _DONE:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
