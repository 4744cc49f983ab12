"""The one client of the engine loop that :class:`LazyAttention` and :class:`AsyncLazyAttention` share.

Every call reaches the engine on its own thread (``engine/loop.py``): submissions, aborts,
document changes and reads of its state. Chat messages that place no document are planned
(tokenized, their learned passages chosen) in the client's planning threads first. The public classes differ only in how a request's
deltas come back (a ``queue.SimpleQueue`` or an ``asyncio.Queue``) and in blocking or awaiting.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from lazyattn_rag.engine.engine import LLMEngine
from lazyattn_rag.engine.loop import EngineLoop
from lazyattn_rag.engine.scheduling.request import Request
from lazyattn_rag.types.config import RequestRemedies
from lazyattn_rag.types.documents import Document
from lazyattn_rag.types.messages import DocumentRef, Message, as_message
from lazyattn_rag.types.outputs import Completion, StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams

T = TypeVar("T")
Sink = Callable[[StreamDelta | BaseException], None]
PLANNING_THREADS = 4  # threads planning plain chat prompts (EngineClient.planning)
MakeRequest = Callable[[LLMEngine, Sink], Request]


@dataclass(frozen=True)
class PlannedRequest:
    """A request planned off the engine thread, then queued on it.

    Attributes:
        plan: ``plan(engine)``, run in one of the client's planning threads while the engine keeps stepping
            (only what the engine documents as safe there, e.g. :meth:`LLMEngine.plan_plain_chat`).
        submit: ``submit(engine, sink, planned)`` on the engine thread, given ``plan``'s result.
        num_outputs: the answers its stream carries (``SamplingParams.n``), each ending with its
            own finished delta.
        structured_output: its constraint, compiled before it is planned in the client's
            grammar threads (``SamplingParams.structured_output``), or ``None``.
    """

    plan: Callable[[LLMEngine], Any]
    submit: Callable[[LLMEngine, Sink, Any], Request]
    num_outputs: int = 1
    structured_output: Any = None


class EngineClient:
    """Submit, abort and call into one engine over its loop.

    Args:
        loop: the :class:`EngineLoop` running the engine.
    """

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        # Plain chat prompts are planned here, off the engine thread (vLLM's API server
        # tokenizes off its engine too), by a few threads: where the switch interval is short
        # (lazyattn serve's replicas) their long texts are tokenized without the GIL, so a
        # burst of pasted prompts (a closed loop's requests end together) is tokenized at
        # once; the passage learner's lock keeps its choices one at a time
        # (engine/planning/token_ids.py has the measurements). A thread per caller, with the
        # GIL given up at every tokenizer call at Python's 5 ms, cost about 100 ms before
        # submission on the H200 (benchmarks/results/http_reuse_h200_diag.json).
        self.planning = ThreadPoolExecutor(max_workers=PLANNING_THREADS, thread_name_prefix="lazyattn-plan")
        # Structured output's grammars compile in threads of their own (xgrammar releases the GIL):
        # a schema that takes seconds delays only its own request, not every request's planning.
        self.compiling = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lazyattn-grammar")

    def close(self) -> None:
        """Stop the planning and grammar threads (the engine's loop is stopped by its owner)."""
        self.planning.shutdown(wait=False)
        self.compiling.shutdown(wait=False)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(engine, *args)`` on the engine thread; its result, or its exception raised here."""
        return self.loop.call(fn, self.loop.engine, *args)

    def submit(self, make: MakeRequest | PlannedRequest, sink: Sink) -> str:
        """Plan and queue a request (a :class:`PlannedRequest` is planned in :attr:`planning`'s
        thread, the rest on the engine thread; errors raise here); its id. Where the time
        before the engine took it up went is stamped on its stats (``planning_queue_ms``,
        ``planning_ms``, ``submission_wait_ms``)."""
        if isinstance(make, PlannedRequest):
            if make.structured_output is not None:  # compiled once, found in the compiler's cache from here on
                self.compiling.submit(self.loop.engine.grammars.compile, make.structured_output).result()
            planned, timing = self.planning.submit(_timed_plan, make.plan, self.loop.engine,
                                                   time.perf_counter()).result()
            return self.call(_stamped, lambda engine: make.submit(engine, sink, planned), timing).request_id
        return self.call(_stamped, lambda engine: make(engine, sink), _SubmissionTiming(time.perf_counter())).request_id

    def submit_soon(self, make: MakeRequest | PlannedRequest, sink: Sink) -> Future:
        """:meth:`submit` without blocking the caller: a :class:`~concurrent.futures.Future` of
        the request's id, or of the error :meth:`submit` raises. The request is queued on the
        engine thread without a thread of the caller's waiting on it (an event loop awaits the
        future): a :class:`PlannedRequest` goes from the planning threads (its grammar compiled
        in the grammar threads first) straight to the engine's command queue. Not from the
        engine thread (its commands run between steps: :meth:`submit` runs there inline)."""
        result: Future = Future()
        result.set_running_or_notify_cancel()  # not cancellable: a request it queues always reaches its caller
        if not isinstance(make, PlannedRequest):
            self._queue(lambda engine: make(engine, sink), _SubmissionTiming(time.perf_counter()), result)
        elif make.structured_output is None:
            _chain(self.planning, result, self._plan_and_queue, make, sink, time.perf_counter(), result)
        else:  # compiled once, found in the compiler's cache from here on; planning waits from then, as submit's
            compiling = _chain(self.compiling, result, self.loop.engine.grammars.compile, make.structured_output)
            if compiling is not None:
                compiling.add_done_callback(lambda done: result.done() or _chain(
                    self.planning, result, self._plan_and_queue, make, sink, time.perf_counter(), result))
        return result

    def _plan_and_queue(self, make: PlannedRequest, sink: Sink, submitted: float, result: Future) -> None:
        """In a planning thread: plan ``make``, then queue it on the engine thread (``result``
        gets its id or the error)."""
        planned, timing = _timed_plan(make.plan, self.loop.engine, submitted)
        self._queue(lambda engine: make.submit(engine, sink, planned), timing, result)

    def _queue(self, submit: Callable[[LLMEngine], Request], timing: _SubmissionTiming, result: Future) -> None:
        """``submit(engine)`` as an engine command; ``result`` gets the request's id or the error."""
        def done(queued: Future) -> None:
            error = queued.exception()
            if error is not None:
                result.set_exception(error)
            else:
                result.set_result(queued.result().request_id)

        self.loop.post(_stamped, self.loop.engine, submit, timing).add_done_callback(done)

    def abort(self, request_id: str) -> None:
        """Cancel a request (a no-op once it finished, or once the engine is shut down). On the
        engine thread (a stream garbage-collected during a step) it runs after the step."""
        try:
            self.run_on_engine(lambda engine: engine.abort(request_id))
        except RuntimeError:  # the engine is shut down: nothing is left to free
            pass

    def run_on_engine(self, fn: Callable[[LLMEngine], Any]) -> None:
        """``fn(engine)`` now, or right after the current step when called from inside one."""
        if self.loop.on_engine_thread():
            self.loop.post(fn, self.loop.engine)
        else:
            self.call(fn)

    def abort_soon(self, request_id: str) -> None:
        """Cancel a request without waiting (from a callback that must not block)."""
        self.loop.post(LLMEngine.abort, self.loop.engine, request_id)


@dataclass(frozen=True)
class _SubmissionTiming:
    """When a request was ready to queue on the engine thread (``time.perf_counter()``), and,
    if it was planned in a planning thread, how long it waited for one and how long planning
    took (ms)."""

    ready: float
    planning_queue_ms: float | None = None
    planning_ms: float | None = None


def _timed_plan(plan: Callable[[LLMEngine], Any], engine: LLMEngine, submitted: float) -> tuple[Any, _SubmissionTiming]:
    """``plan(engine)`` in a planning thread, with its timing (``submitted``: when the caller asked,
    ``time.perf_counter()``). A plan of ``None`` planned nothing here (the engine thread plans the
    request): no planning times then."""
    start = time.perf_counter()
    planned = plan(engine)
    end = time.perf_counter()
    if planned is None:
        return planned, _SubmissionTiming(end)
    return planned, _SubmissionTiming(end, (start - submitted) * 1e3, (end - start) * 1e3)


def _chain(pool: ThreadPoolExecutor, result: Future, fn: Callable[..., Any], *args: Any) -> Future | None:
    """``fn(*args)`` in ``pool``; what it raises (or the pool's refusal once shut down) goes to
    ``result``. Its future, or ``None`` where the pool refused it."""
    def run():
        try:
            return fn(*args)
        except BaseException as error:  # handed to the caller
            result.set_exception(error)

    try:
        return pool.submit(run)
    except RuntimeError as error:  # the pool is shut down
        result.set_exception(error)
        return None


def _stamped(engine: LLMEngine, submit: Callable[[LLMEngine], Request], timing: _SubmissionTiming) -> Request:
    """``submit(engine)`` on the engine thread; the stats of the request and of its other
    answers (``SamplingParams.n``) get ``timing``."""
    taken = time.perf_counter()
    request = submit(engine)
    for answer in engine.answers(request):
        stats = answer.stats
        stats.planning_queue_ms, stats.planning_ms = timing.planning_queue_ms, timing.planning_ms
        stats.submission_wait_ms = (taken - timing.ready) * 1e3
    return request


class RequestStream(Iterator[StreamDelta]):
    """The deltas of one submitted request (the request runs from submission on).

    Iterate it for :class:`StreamDelta` pieces; the last has ``finished=True`` (with
    ``SamplingParams.n > 1``, each answer's last, told apart by ``index``). ``close()`` (or
    leaving a ``with`` block, or dropping the last reference) cancels a request that has not
    finished and frees its KV blocks, also when it was never iterated.

    Attributes:
        request_id: the engine's id of the request.
    """

    def __init__(self, client: EngineClient, request_id: str, deltas: queue.SimpleQueue, num_outputs: int = 1):
        self._client, self.request_id, self._deltas = client, request_id, deltas
        self._done = False
        self._num_open = num_outputs  # answers not finished yet (SamplingParams.n)

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> StreamDelta:
        if self._done:
            raise StopIteration
        item = self._deltas.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._num_open -= item.finished
        self._done = self._num_open == 0
        return item

    def close(self) -> None:
        """Cancel the request if it has not finished (idempotent)."""
        if self._done:
            return
        self._done = True
        self._client.abort(self.request_id)

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


# --- requests: what each public method submits (run on the engine thread) ------------------
def question_request(question: str, doc_ids: Iterable[str], documents: Iterable[Document | tuple[str, str]],
                     params: SamplingParams, namespace: str = "",
                     remedies: RequestRemedies = RequestRemedies()) -> MakeRequest:
    ids, docs = document_ids(doc_ids), document_pairs(documents)
    return _compiling(params, lambda engine, sink: engine.submit_question(question, ids, docs, params, sink,
                                                                           namespace, remedies))


def chat_request(messages: Iterable[Message | dict | tuple], documents: Iterable[Document | tuple[str, str]],
                 params: SamplingParams, namespace: str = "",
                 remedies: RequestRemedies = RequestRemedies()) -> MakeRequest | PlannedRequest:
    """Messages that place no document (plain text, e.g. pasted retrieved texts) are tokenized
    and laid out in one of the client's planning threads (:meth:`LLMEngine.plan_plain_chat`)."""
    msgs, docs = [as_message(m) for m in messages], document_pairs(documents)
    if docs:
        return _compiling(params, lambda engine, sink: engine.submit_chat(msgs, docs, params, sink, namespace,
                                                                           remedies))
    return _compiling(params, PlannedRequest(
        lambda engine: engine.plan_plain_chat(msgs, namespace, remedies),
        lambda engine, sink, plans: engine.submit_chat(msgs, [], params, sink, namespace, remedies, plans)))


def prompt_request(prompt: str | list[int] | list[str | DocumentRef], params: SamplingParams,
                   documents: Iterable[Document | tuple[str, str]] = (), namespace: str = "",
                   remedies: RequestRemedies = RequestRemedies()) -> MakeRequest:
    prompt, docs = list(prompt) if isinstance(prompt, (tuple, list)) else prompt, document_pairs(documents)
    return _compiling(params, lambda engine, sink: engine.submit_prompt(prompt, params, sink, docs, namespace,
                                                                         remedies))


def _compiling(params: SamplingParams, make: MakeRequest | PlannedRequest) -> MakeRequest | PlannedRequest:
    """``make`` as a :class:`PlannedRequest` that carries its structured output's constraint (its
    grammar compiled off the engine thread first: a new JSON schema never holds up a step) and
    its number of answers (``params.n``, for its stream)."""
    if params.structured_output is None and params.n == 1:
        return make
    if isinstance(make, PlannedRequest):
        return PlannedRequest(make.plan, make.submit, params.n, params.structured_output)
    return PlannedRequest(lambda engine: None, lambda engine, sink, _: make(engine, sink), params.n,
                          params.structured_output)


def warm_request(doc_ids: Iterable[str], namespace: str = "") -> MakeRequest:
    ids = document_ids(doc_ids)
    return lambda engine, sink: engine.submit_warm(ids, sink, namespace)


# --- arguments ----------------------------------------------------------------------------
def document_ids(doc_ids: Iterable[str]) -> list[str]:
    """``doc_ids`` as a list. Raises ``ValueError`` for a bare string (a common slip)."""
    if isinstance(doc_ids, str):
        raise ValueError(f"doc_ids must be a list of document ids, not the string {doc_ids!r}")
    return list(doc_ids)


def document_pairs(documents: Iterable[Document | tuple[str, str]]) -> list[tuple[str, str]]:
    """``(id, text)`` pairs from :class:`Document` objects or ``(id, text)`` tuples.

    Raises:
        ValueError: an item that is neither (named).
    """
    pairs = []
    for d in documents:
        if isinstance(d, Document):
            pairs.append((d.id, d.text))
        elif isinstance(d, (tuple, list)) and len(d) == 2:
            pairs.append((d[0], d[1]))
        else:
            raise ValueError(f"documents must be Document objects or (id, text) pairs, got {d!r}")
    return pairs


def collect(deltas: Iterable[StreamDelta]) -> Completion:
    """The :class:`Completion` of a finished stream's deltas (text, token ids, logprobs, the last's
    stats), per answer index: index 0's, with the others as ``alternatives``."""
    parts: dict[int, tuple[list, list, list, list]] = {}
    for delta in deltas:
        text, token_ids, logprobs, last = parts.setdefault(delta.index, ([], [], [], [None]))
        text.append(delta.text)
        if delta.token_id is not None:
            token_ids.append(delta.token_id)
        if delta.logprobs is not None:
            logprobs.append(delta.logprobs)
        last[0] = delta
    answers = [Completion("".join(text), token_ids, last.finish_reason, last.stats, logprobs or None)
               for _, (text, token_ids, logprobs, (last,)) in sorted(parts.items())]
    answers[0].alternatives = answers[1:]
    return answers[0]
