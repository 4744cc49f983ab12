"""``LazyAttention``: the public class (load a model, register documents, ask questions).

It is a thin front over :class:`~lazyattn_rag.client.EngineClient`: the engine is built by
:mod:`lazyattn_rag.engine.factory` on the engine thread, and every call runs there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from lazyattn_rag.client import (
    EngineClient,
    MakeRequest,
    PlannedRequest,
    RequestStream,
    chat_request,
    collect,
    document_ids,
    document_pairs,
    prompt_request,
    question_request,
    warm_request,
)
from lazyattn_rag.engine.document_removal import remove_document
from lazyattn_rag.engine.engine import LLMEngine, StepResult
from lazyattn_rag.engine.factory import build_engine, build_engine_from_model, describe
from lazyattn_rag.engine.loop import EngineLoop
from lazyattn_rag.engine.model.transformer import CausalLM
from lazyattn_rag.fidelity import check_fidelity
from lazyattn_rag.types.config import EngineConfig, RequestRemedies
from lazyattn_rag.types.documents import Document, RemovedDocument
from lazyattn_rag.types.messages import DocumentRef, Message, as_message
from lazyattn_rag.types.outputs import Completion, FidelityReport
from lazyattn_rag.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lazyattn_rag.async_llm import AsyncLazyAttention

_SHARED: dict[EngineConfig, "LazyAttention"] = {}  # LazyAttention.shared(): one engine per configuration
_SHARED_LOCK = threading.Lock()


class LazyAttention:
    """Retrieval-augmented generation with position-agnostic KV reuse of documents.

    Each registered document's K/V is computed once, stored position-agnostic in the chunk
    cache, and placed at any offset of any later prompt with its RoPE applied at attention
    time (LazyAttention, ICML 2026, arXiv 2606.04302).

    Args:
        config: :class:`EngineConfig`; ``None`` loads the offline default SmolLM2 on the CPU
            (or CUDA when available).

    Example::

        llm = LazyAttention()
        llm.add_document("py-for", "The for statement iterates over the items of a sequence...")
        out = llm.generate("What does a for loop iterate over?", doc_ids=["py-for"])
        print(out.text, out.stats.docs_hit, out.stats.ttft_ms)

    Thread safety: every public method may be called from several threads; one background
    engine thread batches all their requests (continuous batching). See
    :class:`lazyattn_rag.AsyncLazyAttention` for asyncio.

    Attributes:
        config: the :class:`EngineConfig`.
        model, tokenizer: the loaded :class:`~lazyattn_rag.engine.model.transformer.CausalLM` (on its
            device; another engine may share it through :meth:`from_model`) and its tokenizer.
        model_name, fingerprint, device: the model's name, its
            :class:`~lazyattn_rag.engine.planning.fingerprint.ModelFingerprint` (what keys cached K/V)
            and its ``torch.device``.
        max_model_len: the context limit in tokens (what the KV cache holds for one request).
        block_bytes: K/V bytes of one block over all layers.
        loop, engine: the :class:`~lazyattn_rag.engine.loop.EngineLoop` and its engine (for
            tools and tests; call into the engine only through ``loop.call``).
    """

    default_sampling = SamplingParams()
    """Sampling when a call passes none: the model's recommended settings (its
    ``generation_config.json``; :func:`~lazyattn_rag.engine.model.model_loading.generation_defaults`) under
    ``EngineConfig.generation_config="auto"``, else greedy (:class:`SamplingParams` defaults)."""

    def __init__(self, config: EngineConfig | None = None):
        config = config or EngineConfig()
        self._start(lambda: build_engine(config))

    def _start(self, build) -> None:
        """Start the engine thread, build the engine on it, and read its fixed facts once."""
        self.loop = EngineLoop(build)
        self.engine: LLMEngine = self.loop.engine
        self.client = EngineClient(self.loop)
        facts = self.client.call(lambda engine: (engine.config, engine.tokenizer, engine.max_model_len,
                                                 engine.default_sampling, dict(engine.info), engine.runner.model,
                                                 engine.fingerprint, engine.runner.device))
        self.config, self.tokenizer, self.max_model_len, self.default_sampling, info = facts[:5]
        self.model, self.fingerprint, self.device = facts[5:]
        self.model_name, self.block_bytes = info["model"], info["block_bytes"]

    @classmethod
    def shared(cls, config: EngineConfig | None = None) -> "LazyAttention":
        """The process's one engine for ``config`` (built on first use, then shared).

        Framework wrappers constructed from configuration (``LazyAttentionLLM(model=...)``,
        ``ChatLazyAttention(model=...)``) share it, so two LLM objects over the same model hold
        one copy of the weights and one KV cache. :meth:`close` of a shared engine removes
        it, and the next call builds a new one.
        """
        config = config or EngineConfig()
        with _SHARED_LOCK:
            llm = _SHARED.get(config)
            if llm is None or llm.loop.stopped:
                llm = _SHARED[config] = cls(config)
            return llm

    @classmethod
    def from_model(cls, model: CausalLM, tokenizer: Any, config: EngineConfig | None = None,
                   name: str = "in-memory", hf_config: Any = None,
                   weights_sha256: str | None = None) -> "LazyAttention":
        """Wrap an already-built :class:`CausalLM` (tests, custom loading); see
        :func:`~lazyattn_rag.engine.factory.build_engine_from_model` (pass ``weights_sha256``
        when wrapping the same large model more than once: hashing it copies every weight)."""
        self = cls.__new__(cls)
        config = config or EngineConfig()
        self._start(lambda: build_engine_from_model(model, tokenizer, config, name, hf_config, weights_sha256))
        return self

    # --- documents ------------------------------------------------------------------------
    def add_document(self, doc_id: str, text: str, namespace: str = "") -> bool:
        """Register or update a document (K/V is encoded on first use or by :meth:`warm`).

        ``namespace`` (every document method takes it; ``""``, the default, is shared) keeps a
        tenant's documents apart: ids resolve within their namespace only and the namespace is
        part of the chunk's cache key, so no tenant is served another's document or cached K/V,
        in the KV pool or any storage tier, even for identical text.

        Returns:
            ``True`` if the document is new or its text changed.
        Raises:
            EmptyInputError, DocumentTooLongError: naming the document (nothing is registered).
        """
        return self.add_documents([(doc_id, text)], namespace) == 1

    def add_documents(self, documents: Iterable[Document | tuple[str, str]], namespace: str = "") -> int:
        """Register many documents, all or none; returns how many were new or changed.

        Raises:
            ValueError: an item that is neither a :class:`Document` nor an ``(id, text)`` pair,
                or a malformed ``namespace``.
            EmptyInputError, DocumentTooLongError: naming the first bad document.
        """
        pairs = document_pairs(documents)
        return self.client.call(lambda engine: engine.documents.add(pairs, namespace))

    def remove_document(self, doc_id: str, namespace: str = "") -> RemovedDocument:
        """Forget a document and delete its K/V from the KV pool and from every storage tier
        (host memory, disk, Redis); requests running over it finish with its old text, and its
        blocks are freed when they do. Another registered document with the same text keeps
        the K/V (``shared``).

        Returns:
            what was removed (:class:`~lazyattn_rag.types.documents.RemovedDocument`).
        Raises:
            UnknownDocumentError: the id is not registered in ``namespace``.
        """
        return self.client.call(lambda engine: remove_document(engine, doc_id, namespace))

    def has_document(self, doc_id: str, namespace: str = "") -> bool:
        return self.client.call(lambda engine: engine.documents.contains(doc_id, namespace))

    def document_ids(self, namespace: str = "") -> list[str]:
        return self.client.call(lambda engine: engine.documents.ids(namespace))

    @property
    def documents_version(self) -> int:
        """A number that grows whenever a document is added, changed or removed."""
        return self.client.call(lambda engine: engine.documents.version)

    def document_texts(self, doc_ids: Iterable[str] | None = None, namespace: str = "") -> dict[str, str]:
        """Registered documents as ``{id: text}`` (a snapshot); with ``doc_ids``, only those of
        them that are registered (no copy of the whole registry)."""
        ids = None if doc_ids is None else document_ids(doc_ids)
        return self.client.call(lambda engine: engine.documents.texts(ids, namespace))

    def warm(self, doc_ids: Iterable[str], namespace: str = "") -> list[str]:
        """Encode documents' K/V ahead of queries (blocking); returns the ids encoded now (misses).

        Raises:
            UnknownDocumentError: an id that is not registered.
        """
        final = None
        for final in self._submit(warm_request(doc_ids, namespace)):
            pass
        return final.stats.docs_missed

    # --- generation -----------------------------------------------------------------------
    def _submit(self, make: MakeRequest | PlannedRequest) -> "RequestStream":
        """Submit on the engine thread (errors raise here) and return the delta stream."""
        deltas: queue.SimpleQueue = queue.SimpleQueue()
        return RequestStream(self.client, self.client.submit(make, deltas.put), deltas,
                             getattr(make, "num_outputs", 1))

    def stream(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
               sampling: SamplingParams | None = None, namespace: str = "", *,
               remedies: RequestRemedies | None = None) -> "RequestStream":
        """Stream the answer to ``question`` over documents, in the order given.

        Args:
            question: the user's question (non-empty).
            doc_ids: ids of registered documents.
            documents: inline documents, registered (or updated) first and placed after ``doc_ids``.
            sampling: :class:`SamplingParams`; ``None`` uses :attr:`default_sampling` (the model's own).
            namespace: the documents' namespace (see :meth:`add_document`).
            remedies: this request's answer-fidelity remedies (:class:`RequestRemedies`:
                chunk-head recompute's ``k`` tokens of each document computed in the request,
                selective recompute's ratio ``r`` in ``[0, 1]`` (CacheBlend), chunk attention
                scaling (APE); see :class:`~lazyattn_rag.types.config.CacheConfig`); ``None``, or a
                field left ``None``: the engine's. Asking for one remedy turns the others off.
        Returns:
            A :class:`RequestStream` of :class:`StreamDelta` pieces, one per generated token (text
            may be empty while a character is incomplete); the last has ``finished=True`` and the
            stats. The request runs from this call on; ``close()`` the stream to cancel it.
        Raises:
            UnknownDocumentError, EmptyInputError, PromptTooLongError, DocumentTooLongError:
            at the call, before anything is queued or registered. CacheCapacityError: at the call, when the
            prompt plus ``max_tokens`` could never fit the KV cache. ValueError: a negative
            chunk-head ``k``, a ratio outside ``[0, 1]``, a remedy on an engine not
            in ``lazy`` mode, two remedies asked together, or chunk attention scaling on an engine
            whose temperature and weight are 1. Other requests are unaffected.
        """
        return self._submit(question_request(question, doc_ids, documents, sampling or self.default_sampling,
                                             namespace, remedies or RequestRemedies()))

    def generate(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
                 sampling: SamplingParams | None = None, namespace: str = "", *,
                 remedies: RequestRemedies | None = None) -> Completion:
        """Answer ``question``; same arguments and errors as :meth:`stream`."""
        return collect(self.stream(question, doc_ids, documents, sampling, namespace, remedies=remedies))

    def stream_chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
                    sampling: SamplingParams | None = None, namespace: str = "", *,
                    remedies: RequestRemedies | None = None) -> "RequestStream":
        """Stream the answer to chat ``messages`` whose content places documents by id.

        This is how a RAG framework's own prompt keeps reuse: the template's text (instructions,
        separators, the question, a chat history) is computed as the request's own tokens and
        every :class:`~lazyattn_rag.types.messages.DocumentRef` is placed from the document's cached
        K/V (see :meth:`~lazyattn_rag.engine.planning.planner.PromptPlanner.plan_messages`).

        Args:
            messages: :class:`~lazyattn_rag.types.messages.Message` s, ``(role, content)`` pairs or
                OpenAI-style dicts; content is text or a list of text and document parts.
            documents: inline documents, registered (or updated) first, all or none.
            sampling: :class:`SamplingParams`.
            namespace: the documents' namespace (see :meth:`add_document`).
            remedies: as :meth:`stream`.
        Returns:
            A :class:`RequestStream`, as :meth:`stream`.
        Raises:
            ValueError: a malformed message (named). UnknownDocumentError, EmptyInputError,
            PromptTooLongError, DocumentTooLongError: at the call, before anything is queued
            or registered.
        """
        return self._submit(chat_request(messages, documents, sampling or self.default_sampling, namespace,
                                         remedies or RequestRemedies()))

    def chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
             sampling: SamplingParams | None = None, namespace: str = "", *,
             remedies: RequestRemedies | None = None) -> Completion:
        """Answer chat ``messages``; same arguments and errors as :meth:`stream_chat`."""
        return collect(self.stream_chat(messages, documents, sampling, namespace, remedies=remedies))

    def aio(self) -> "AsyncLazyAttention":
        """The asyncio twin of this engine (:class:`~lazyattn_rag.async_llm.AsyncLazyAttention`),
        as :meth:`RemoteLazyAttention.aio <lazyattn_rag.remote.RemoteLazyAttention.aio>` gives a
        server's: code written against the front door (``lazyattn_rag/types/front_door.py``)
        runs on either."""
        from lazyattn_rag.async_llm import AsyncLazyAttention

        return AsyncLazyAttention(self)

    def plan_chat(self, messages: Iterable[Message | dict | tuple], namespace: str = ""):
        """The prompt plan chat ``messages`` would run (for inspection; registered documents only)."""
        msgs = [as_message(m) for m in messages]
        return self.client.call(lambda engine: engine.planner.plan_messages(msgs, namespace))

    def stream_prompt(self, prompt: str | list[int] | list[str | DocumentRef], sampling: SamplingParams | None = None,
                      documents: Iterable[Document] = (), namespace: str = "", *,
                      remedies: RequestRemedies | None = None) -> "RequestStream":
        """Stream a completion of a raw prompt (vLLM's ``generate`` of a string; ``/v1/completions``).

        Args:
            prompt: text or token ids, computed whole (its exact prefix reused from an earlier
                prompt of ``namespace``), or text and :class:`DocumentRef` parts: each document
                (registered in ``namespace`` or inline in ``documents``) is read from its cached
                chunk, the text around it computed. Text is the caller's own template: the
                tokenizer adds its special tokens (BOS) and parses special-token text in it.
            sampling, remedies: as :meth:`generate`.
        Raises:
            ValueError: neither text nor token ids nor parts. EmptyInputError, PromptTooLongError,
            UnknownDocumentError: at the call.
        """
        return self._submit(prompt_request(prompt, sampling or self.default_sampling, documents, namespace,
                                           remedies or RequestRemedies()))

    def complete(self, prompt: str | list[int] | list[str | DocumentRef], sampling: SamplingParams | None = None,
                 documents: Iterable[Document] = (), namespace: str = "", *,
                 remedies: RequestRemedies | None = None) -> Completion:
        """Complete a raw prompt; see :meth:`stream_prompt`."""
        return collect(self.stream_prompt(prompt, sampling, documents, namespace, remedies=remedies))

    def check_fidelity(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
                       sampling: SamplingParams | None = None, namespace: str = "", *,
                       remedies: RequestRemedies | None = None) -> FidelityReport:
        """A diagnostic: ``question`` answered as served (chunk reuse, this request's remedy) and
        as the same prompt computed whole (full attention), with the first answer token's KL
        divergence and top-1 agreement and whether the answers are equal
        (:class:`~lazyattn_rag.types.outputs.FidelityReport`; ``lazyattn_rag/fidelity.py``).
        ``sampling`` defaults to greedy. Four requests run (two full prefills of the prompt);
        arguments and errors as :meth:`generate`.
        """
        return check_fidelity(self, question, doc_ids, documents, sampling, namespace,
                              remedies=remedies)

    def plan(self, question: str, doc_ids: Iterable[str], namespace: str = ""):
        """The prompt plan a question over registered documents would run (for inspection)."""
        ids = document_ids(doc_ids)
        return self.client.call(lambda engine: engine.planner.plan(question, ids, namespace))

    def stats(self) -> dict:
        """Engine-wide stats (see :meth:`LLMEngine.stats`, which includes ``first_request_ttft_ms``)
        and the engine's start-up:

        * ``startup_ms``: from the start of the build to a ready engine;
        * ``startup_parts_ms``: its parts, in order: ``import_transformers`` (its top level),
          ``resolve_model`` (find the model, convert the default one on first use),
          ``config_tokenizer`` (transformers' config and tokenizer: see
          :func:`~lazyattn_rag.engine.model.model_config.load_config_and_tokenizer`), ``weights``
          (safetensors to the model),
          ``kv_cache`` (device move, KV tensors), ``cuda_graphs`` (when captured),
          ``engine_init`` (prompt template, the anchor's encode: the first forward pass),
          ``self_check``, ``collect_garbage`` (one collection for the whole build); :meth:`from_model`
          has ``weights_hash`` instead of the first four;
        * ``self_check``: ``"ran"`` (the first start of this model and version: both parts ran),
          ``"cached"`` (its verdict was read), ``"rotary"`` or ``"off"`` (see
          :func:`~lazyattn_rag.engine.self_check.checks.run_self_check`).
        """
        return self.client.call(lambda engine: {**engine.stats(), **engine.startup})

    def add_step_listener(self, listener: Callable[[StepResult], None]) -> Callable[[], None]:
        """Call ``listener`` with a :class:`~lazyattn_rag.engine.engine.StepResult` (the step's
        scheduler output, its compute jobs' logits, its wall time) after every engine step that
        runs jobs, on the engine thread; it must be quick and must not call back into this
        object (that raises ``RuntimeError``). A listener that raises is logged and removed; the
        requests go on. While any listener is registered each step synchronizes the device, so
        the time is the step's own (benchmarks, diagnostics).

        Returns:
            a function that removes the listener (idempotent; from another thread it returns once
            the listener will not be called again, from inside a listener it takes effect after
            the step).
        """
        self.client.run_on_engine(lambda engine: engine.step_listeners.append(listener))

        def remove() -> None:
            self.client.run_on_engine(lambda engine: listener in engine.step_listeners
                                      and engine.step_listeners.remove(listener))

        return remove

    def info(self) -> dict:
        """Model, backend and cache configuration as a JSON-able dict."""
        return self.client.call(describe)

    def close(self) -> None:
        """Stop the engine thread and free the KV cache and CUDA graphs; requests in flight fail
        with ``RuntimeError``. A shared engine stops being shared. Idempotent."""
        with _SHARED_LOCK:
            for key in [k for k, v in _SHARED.items() if v is self]:
                del _SHARED[key]
        self.loop.shutdown()
        self.client.close()

    shutdown = close  # the name vLLM uses

    def __enter__(self) -> "LazyAttention":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
