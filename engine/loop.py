"""One background thread that drives the engine; every other thread talks to it through here.

All calls into :class:`~lazyattn_rag.engine.engine.LLMEngine` (submitting, aborting,
registering documents, reading stats) are queued as commands and run *on the engine
thread* between steps, so the engine stays single-threaded and no caller can starve. Requests from many threads, or many asyncio
tasks, land in the same scheduler and share batches.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from concurrent.futures import Future
from collections.abc import Callable
from typing import Any, TypeVar

from lazyattn_rag.engine.engine import LLMEngine

T = TypeVar("T")
logger = logging.getLogger(__name__)
_LIVE_LOOPS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_live_loops() -> None:
    """Stop every engine thread before the interpreter tears down: a thread still inside torch
    while C++ statics are destroyed aborts the process ("terminate called without an active
    exception", exit code 134)."""
    for loop in list(_LIVE_LOOPS):
        loop.shutdown()


class EngineLoop:
    """Runs ``engine.step()`` on a daemon thread while there is work.

    Args:
        build: makes the engine, called on the loop's own thread (so model loading and every
            forward pass share one thread and one intra-op pool). Its exception is raised here.
    """

    def __init__(self, build: Callable[[], LLMEngine]):
        self._build = build
        self._ready: Future = Future()
        self.engine: LLMEngine | None = None
        self._cond = threading.Condition()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._in_step = False
        self._thread = threading.Thread(target=self._run, name="lazyattn-engine", daemon=True)
        _LIVE_LOOPS.add(self)
        self._thread.start()
        self._ready.result()  # the builder's exception, if any, surfaces in the caller

    @property
    def stopped(self) -> bool:
        """The loop was shut down (or its thread ended)."""
        return self._stopped or not self._thread.is_alive()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the engine thread between steps; return its result.

        Raises:
            whatever ``fn`` raises; ``RuntimeError`` once the loop is shut down, or when called
            from inside a step on the engine thread (where no answer can be given; see :meth:`post`).
        """
        if self.on_engine_thread():
            if not self._in_step:
                return fn(*args, **kwargs)
            raise RuntimeError(
                "called into the engine from inside a step (a step listener, or a stream consumer on the engine "
                "thread): it cannot answer there; read what you need from the step's result, or call after the "
                "step (post() queues a call without waiting for it)")
        future: Future = Future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("the engine loop is shut down")
            self._commands.put((fn, args, kwargs, future))
            self._cond.notify_all()
        return future.result()

    def on_engine_thread(self) -> bool:
        """The caller runs on the engine thread (inside a step, a step listener or a sink)."""
        return threading.current_thread() is self._thread

    def post(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)`` to run on the engine thread between steps without waiting for it
        (e.g. from an asyncio callback). Returns its :class:`Future`; after shutdown, a failed one."""
        future: Future = Future()
        with self._cond:
            if self._stopped:
                future.set_exception(RuntimeError("the engine loop is shut down"))
                return future
            self._commands.put((fn, args, {}, future))
            self._cond.notify_all()
        return future

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, args, kwargs, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

    def _run(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as error:
            self._stopped = True
            self._ready.set_exception(error)
            return
        self._ready.set_result(None)
        while True:
            with self._cond:
                while not self._stopped and self._commands.empty() and not self.engine.has_unfinished():
                    self._cond.wait()
                stopped = self._stopped
            self._drain_commands()
            if stopped:
                self._fail_everything()
                return
            if self.engine.has_unfinished():
                self._in_step = True
                try:
                    self.engine.step()
                except Exception as error:  # the engine fails requests itself; this is a last resort
                    logger.exception("engine step failed")
                    self.engine.fail_all(error)
                finally:
                    self._in_step = False

    def _fail_everything(self) -> None:
        error = RuntimeError("the engine was shut down")
        self.engine.fail_all(error)
        try:
            self.engine.close()  # frees the KV cache and CUDA graphs
        except Exception:  # noqa: BLE001 - logged; the waiting callers must still be answered
            logger.exception("closing the engine failed")
        while True:
            try:
                *_, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(error)

    def shutdown(self) -> None:
        """Stop the thread after the current step; requests in flight fail with ``RuntimeError``
        and the engine's KV cache and CUDA graphs are freed (:meth:`LLMEngine.close`)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=60)
