"""``LazyAttention``: the public facade (load a model, register documents, ask questions)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from lazyattn_rag.types.config import EngineConfig
from lazyattn_rag.types.documents import Document
from lazyattn_rag.engine.attention import get_backend_class
from lazyattn_rag.engine.block_pool import BlockPool
from lazyattn_rag.engine.chunk_cache import ChunkCache
from lazyattn_rag.engine.cuda_graphs import graph_batch_sizes, graph_block_table_width
from lazyattn_rag.engine.engine import LLMEngine
from lazyattn_rag.engine.eviction import make_policy
from lazyattn_rag.engine.loop import EngineLoop
from lazyattn_rag.engine.model import CausalLM, ModelArchConfig
from lazyattn_rag.engine.runner import ModelRunner, kv_bytes_per_block
from lazyattn_rag.engine.fingerprint import ModelFingerprint, tensors_sha256
from lazyattn_rag.kernels.rope import RotaryEmbedding
from lazyattn_rag.types.messages import Message, as_message
from lazyattn_rag.types.outputs import Completion, StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams
from lazyattn_rag.engine.self_check import run_self_check

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_DEFAULT_KV_BYTES = 512 * 2**20
_SHARED: dict[EngineConfig, "LazyAttention"] = {}  # LazyAttention.shared(): one engine per configuration
_SHARED_LOCK = threading.Lock()


def _tokenizer_sha256(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, getattr(tokenizer, "chat_template", None)])
    return hashlib.sha256((text + extra).encode()).hexdigest()


def _config_eos_ids(hf_config: Any) -> set[int]:
    """``eos_token_id`` of an in-memory transformers config (an int, a list, or absent)."""
    from lazyattn_rag.engine.model_loading import token_ids_of

    return token_ids_of(getattr(hf_config, "eos_token_id", None))


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@contextlib.contextmanager
def _collect_once():
    """Pause the cyclic garbage collector while an engine builds, then collect once.

    Building imports transformers and loads the model and tokenizer: tens of thousands of new
    long-lived objects (140k on a first start), for which CPython runs two to four full
    collections of the whole heap (~0.07-0.1 s each on 2 cores). One collection at the end frees
    the same garbage and resets the collector's count, so the next full one is not due in the
    first request. The collector's state is restored (it stays off if it was off).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect()


class _Stopwatch:
    """Milliseconds of the named parts of an engine's start-up, lap by lap."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.parts: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = round((now - self.last) * 1e3, 1)
        self.last = now

    def summary(self, self_check: str) -> dict:
        return {"startup_ms": round((time.perf_counter() - self.start) * 1e3, 1),
                "startup_parts_ms": dict(self.parts), "self_check": self_check}


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
    """

    default_sampling = SamplingParams()
    """Sampling when a call passes none: the model's recommended settings (its
    ``generation_config.json``; :func:`~lazyattn_rag.engine.model_loading.generation_defaults`) under
    ``EngineConfig.generation_config="auto"``, else greedy (:class:`SamplingParams` defaults)."""

    def __init__(self, config: EngineConfig | None = None):
        config = config or EngineConfig()

        def load(clock: _Stopwatch) -> tuple[LLMEngine, str]:
            import transformers  # noqa: F401  (its top level only, timed on its own)

            from lazyattn_rag.engine.model_loading import (
                declared_eos_token_ids,
                generation_defaults,
                load_config_and_tokenizer,
                load_state_dict,
                resolve_model,
            )

            clock.lap("import_transformers")
            source = resolve_model(config.model, config.resolved_cache_dir())
            clock.lap("resolve_model")
            if config.generation_config == "auto":
                self.default_sampling = SamplingParams(**generation_defaults(source.path))
            hf_config, tokenizer = load_config_and_tokenizer(source.path, config.resolved_cache_dir())
            clock.lap("config_tokenizer")
            model = CausalLM.from_hf_state_dict(ModelArchConfig.from_hf_config(hf_config),
                                                RotaryEmbedding.from_hf_config(hf_config), load_state_dict(source.path))
            clock.lap("weights")
            eos = declared_eos_token_ids(source.path)
            engine = self._build(model, tokenizer, config, source.weights_sha256, source.name, eos, hf_config, clock)
            check = run_self_check(engine, hf_config, config, source.path)  # refuses a model with wrong positions
            clock.lap("self_check")
            return engine, check

        self._start(load)

    def _start(self, load: Callable[[_Stopwatch], tuple[LLMEngine, str]]) -> None:
        """Start the engine thread and build the engine on it with ``load`` (every torch op of the
        engine runs on that thread), timing its parts for :meth:`stats`. ``load`` returns the
        engine and what its self-check did."""
        clock = _Stopwatch()

        def build() -> LLMEngine:
            with _collect_once():
                engine, check = load(clock)
            clock.lap("collect_garbage")
            self._startup = clock.summary(self_check=check)
            return engine

        self.loop = EngineLoop(build)
        self.engine = self.loop.engine

    @classmethod
    def shared(cls, config: EngineConfig | None = None) -> "LazyAttention":
        """The process's one engine for ``config`` (built on first use, then shared).

        Framework wrappers constructed from configuration (``LazyAttentionLLM(model=...)``,
        ``ChatLazyAttention(model=...)``) share it, so two LLM objects over the same model hold
        one copy of the weights and one KV cache. :meth:`shutdown` of a shared engine removes
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
        """Wrap an already-built :class:`CausalLM` (tests, custom loading).

        The weights' hash goes into the model fingerprint that keys the cached K/V. It is
        computed from ``model.state_dict()`` unless ``weights_sha256`` (a hex digest from
        :func:`lazyattn_rag.engine.fingerprint.tensors_sha256`) is given: an 8B model's 16 GB are copied
        to the host and hashed (SHA-256 runs at ~1.8 GB/s on one CPU core), so pass it when
        wrapping the same model more than once.
        """
        self = cls.__new__(cls)
        config = config or EngineConfig()

        def load(clock: _Stopwatch) -> tuple[LLMEngine, str]:
            digest = weights_sha256 or tensors_sha256(model.state_dict())
            clock.lap("weights_hash")
            engine = self._build(model, tokenizer, config, digest, name, _config_eos_ids(hf_config), hf_config, clock)
            check = run_self_check(engine, hf_config, config)  # rotary part only: no directory
            clock.lap("self_check")
            return engine, check

        self._start(load)
        return self

    def _build(self, model, tokenizer, config, weights_sha256, name, eos_ids, hf_config,
               clock: _Stopwatch) -> LLMEngine:
        """Move the model to its device and build the engine (runs on the engine thread); ``clock``
        times the parts ``kv_cache`` (model moved to its device, KV tensors) and ``engine_init``
        (fingerprint, prompt template, the anchor's encode: the first forward pass).

        CPU note: PyTorch's OpenMP intra-op pool runs small matrix products ~40 % slower on a
        thread once another thread has its own pool (libgomp throttles its spinning when its
        threads outnumber the cores), so model loading and every forward pass run on one thread.
        """
        self.config = config
        self.device = _resolve_device(config.device)
        dtype_name = config.dtype if config.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = _DTYPES[dtype_name]
        backend_name = config.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if self.device.type == "cuda" else "torch"
        self.model_name = name
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.tokenizer = tokenizer
        arch = model.config
        window = getattr(hf_config, "sliding_window", None) if hf_config is not None else None
        limit = arch.max_position_embeddings if not window else min(window, arch.max_position_embeddings)
        self.max_model_len = min(config.max_model_len or limit, limit)
        block_size = config.cache.block_size
        backend = _make_backend(backend_name, config.attention_backend == "auto", model)
        self.block_bytes = kv_bytes_per_block(model, block_size, self.dtype)
        num_blocks = config.cache.num_blocks or max(1, self._kv_budget() // self.block_bytes)
        runner = ModelRunner(self.model, backend, num_blocks, block_size, self.device, self.dtype)
        clock.lap("kv_cache")
        if config.cuda_graphs and self.device.type == "cuda" and backend.supports_cuda_graphs:
            runner.enable_cuda_graphs(graph_batch_sizes(config.scheduler.max_num_seqs),
                                      graph_block_table_width(self.max_model_len, block_size))
            clock.lap("cuda_graphs")
        self.fingerprint = ModelFingerprint(weights_sha256, dtype_name, json.dumps(model.rotary.fingerprint(),
                                            sort_keys=True), _tokenizer_sha256(tokenizer), block_size)
        cache = ChunkCache(BlockPool(num_blocks), block_size, make_policy(config.cache.eviction_policy))
        engine = LLMEngine(runner, cache, tokenizer, self.fingerprint.digest(), config, self.max_model_len, eos_ids)
        self.max_model_len = engine.max_model_len  # lowered to what the KV cache holds, if needed
        clock.lap("engine_init")
        return engine

    def _kv_budget(self) -> int:
        if self.config.cache.kv_cache_bytes is not None:
            return self.config.cache.kv_cache_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * (self.config.cache.kv_cache_fraction or 0.4))
        return CPU_DEFAULT_KV_BYTES

    # --- documents ------------------------------------------------------------------------
    def add_document(self, doc_id: str, text: str) -> bool:
        """Register or update a document (K/V is encoded on first use or by :meth:`warm`).

        Returns:
            ``True`` if the document is new or its text changed.
        Raises:
            EmptyInputError, DocumentTooLongError: see :meth:`LLMEngine.add_document`.
        """
        return self.loop.call(self.engine.add_document, doc_id, text)

    def add_documents(self, documents: Iterable[Document | tuple[str, str]]) -> int:
        """Register many documents; returns how many were new or changed."""
        pairs = _pairs(documents)
        return self.loop.call(self.engine.add_documents, pairs)

    def remove_document(self, doc_id: str) -> None:
        """Forget a document and its cached K/V. Raises ``UnknownDocumentError``."""
        self.loop.call(self.engine.remove_document, doc_id)

    def has_document(self, doc_id: str) -> bool:
        return doc_id in self.engine.documents

    def document_ids(self) -> list[str]:
        return self.loop.call(lambda: list(self.engine.documents))

    @property
    def documents_version(self) -> int:
        """A number that grows whenever a document is added, changed or removed (cheap to read)."""
        return self.engine.documents_version

    def document_texts(self, doc_ids: Iterable[str] | None = None) -> dict[str, str]:
        """Registered documents as ``{id: text}`` (a snapshot); with ``doc_ids``, only those of
        them that are registered (no copy of the whole registry)."""
        if doc_ids is None:
            return self.loop.call(lambda: {d: doc.text for d, doc in self.engine.documents.items()})
        ids = _ids(doc_ids)
        documents = self.engine.documents
        return self.loop.call(lambda: {d: documents[d].text for d in ids if d in documents})

    def warm(self, doc_ids: Iterable[str]) -> list[str]:
        """Encode documents' K/V ahead of queries (blocking); returns the ids encoded now (misses).

        Raises:
            UnknownDocumentError: an id that is not registered.
        """
        ids = _ids(doc_ids)
        final = _collect_deltas(self._submit(lambda sink: self.engine.submit_warm(ids, sink)))
        return final.stats.docs_missed

    # --- generation -----------------------------------------------------------------------
    def _submit(self, make_request) -> "RequestStream":
        """Submit on the engine thread (errors raise here) and return the delta stream."""
        deltas: queue.SimpleQueue = queue.SimpleQueue()
        request = self.loop.call(make_request, deltas.put)
        return RequestStream(self.loop, self.engine, request.request_id, deltas)

    def stream(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
               sampling: SamplingParams | None = None) -> RequestStream:
        """Stream the answer to ``question`` over documents, in the order given.

        Args:
            question: the user's question (non-empty).
            doc_ids: ids of registered documents.
            documents: inline documents, registered (or updated) first and placed after ``doc_ids``.
            sampling: :class:`SamplingParams`; ``None`` uses :attr:`default_sampling` (the model's own).
        Returns:
            A :class:`RequestStream` of :class:`StreamDelta` pieces, one per generated token (text
            may be empty while a character is incomplete); the last has ``finished=True`` and the
            stats. The request runs from this call on; ``close()`` the stream to cancel it.
        Raises:
            UnknownDocumentError, EmptyInputError, PromptTooLongError, DocumentTooLongError:
            at the call, before anything is queued or registered. CacheCapacityError: at the call, when the
            prompt plus ``max_tokens`` could never fit the KV cache. Other requests are unaffected.
        """
        params = sampling or self.default_sampling
        ids, docs = _ids(doc_ids), _pairs(documents)

        def make(sink):
            return self.engine.submit(self.engine.plan_with_documents(question, ids, docs), params, sink)

        return self._submit(make)

    def generate(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
                 sampling: SamplingParams | None = None) -> Completion:
        """Answer ``question``; same arguments and errors as :meth:`stream`."""
        return _collect(self.stream(question, doc_ids, documents, sampling))

    def stream_chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
                    sampling: SamplingParams | None = None) -> RequestStream:
        """Stream the answer to chat ``messages`` whose content places documents by id.

        This is how a RAG framework's own prompt keeps reuse: the template's text (instructions,
        separators, the question, a chat history) is computed as the request's own tokens and
        every :class:`~lazyattn_rag.types.messages.DocumentRef` is placed from the document's cached
        K/V (see :meth:`LLMEngine.plan_messages`).

        Args:
            messages: :class:`~lazyattn_rag.types.messages.Message` s, ``(role, content)`` pairs or
                OpenAI-style dicts; content is text or a list of text and document parts.
            documents: inline documents, registered (or updated) first, all or none.
            sampling: :class:`SamplingParams`.
        Returns:
            A :class:`RequestStream`, as :meth:`stream`.
        Raises:
            ValueError: a malformed message (named). UnknownDocumentError, EmptyInputError,
            PromptTooLongError, DocumentTooLongError: at the call, before anything is queued
            or registered.
        """
        msgs = [as_message(m) for m in messages]
        params, docs = sampling or self.default_sampling, _pairs(documents)
        return self._submit(lambda sink: self.engine.submit(
            self.engine.plan_messages_with_documents(msgs, docs), params, sink))

    def chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
             sampling: SamplingParams | None = None) -> Completion:
        """Answer chat ``messages``; same arguments and errors as :meth:`stream_chat`."""
        return _collect(self.stream_chat(messages, documents, sampling))

    def plan_chat(self, messages: Iterable[Message | dict | tuple]):
        """The prompt plan chat ``messages`` would run (for inspection; registered documents only)."""
        msgs = [as_message(m) for m in messages]
        return self.loop.call(self.engine.plan_messages, msgs)

    def stream_prompt(self, prompt: str | list[int], sampling: SamplingParams | None = None) -> RequestStream:
        """Stream a completion of a plain prompt, with no chunk reuse (a standard full prefill).

        Args:
            prompt: text or token ids. This is the raw-prompt path (as vLLM's ``generate`` of a
                string): the text is the caller's own template, so the tokenizer adds its
                special tokens (e.g. BOS) and parses special-token text in it (``<|im_end|>``
                becomes the marker). User text belongs in :meth:`chat` or :meth:`generate`,
                which tokenize it literally.
            sampling: :class:`SamplingParams`.
        Raises:
            EmptyInputError, PromptTooLongError: at the call.
        """
        ids = _prompt_ids(self.tokenizer, prompt)
        params = sampling or self.default_sampling
        return self._submit(lambda sink: self.engine.submit(self.engine.plan_plain(ids), params, sink))

    def complete(self, prompt: str | list[int], sampling: SamplingParams | None = None) -> Completion:
        """Complete a plain prompt (no chunk reuse); see :meth:`stream_prompt`."""
        return _collect(self.stream_prompt(prompt, sampling))

    def plan(self, question: str, doc_ids: Iterable[str]):
        """The prompt plan a question over registered documents would run (for inspection)."""
        return self.loop.call(self.engine.plan, question, _ids(doc_ids))

    def stats(self) -> dict:
        """Engine-wide stats (see :meth:`LLMEngine.stats`, which includes ``first_request_ttft_ms``)
        and the engine's start-up:

        * ``startup_ms``: from the constructor's call to a ready engine;
        * ``startup_parts_ms``: its parts, in order: ``import_transformers`` (its top level),
          ``resolve_model`` (find the model, convert the default one on first use),
          ``config_tokenizer`` (transformers' config and tokenizer: see
          :func:`~lazyattn_rag.engine.model_loading.load_config_and_tokenizer`), ``weights``
          (safetensors to the model),
          ``kv_cache`` (device move, KV tensors), ``cuda_graphs`` (when captured),
          ``engine_init`` (prompt template, the anchor's encode: the first forward pass),
          ``self_check``, ``collect_garbage`` (one collection for the whole build); :meth:`from_model`
          has ``weights_hash`` instead of the first four;
        * ``self_check``: ``"ran"`` (the first start of this model and version: both parts ran),
          ``"cached"`` (its verdict was read), ``"rotary"`` or ``"off"`` (see
          :func:`~lazyattn_rag.engine.self_check.run_self_check`).
        """
        return {**self.loop.call(self.engine.stats), **self._startup}

    def shutdown(self) -> None:
        """Stop the engine thread (a shared engine stops being shared)."""
        with _SHARED_LOCK:
            for key in [k for k, v in _SHARED.items() if v is self]:
                del _SHARED[key]
        self.loop.shutdown()

    def info(self) -> dict:
        """Model, backend and cache configuration as a JSON-able dict."""
        return self.loop.call(self._info)

    def _info(self) -> dict:
        cache = self.engine.cache
        return {
            "model": self.model_name,
            "model_type": self.model.config.model_type,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.engine.runner.backend.name,
            "max_model_len": self.max_model_len,
            "default_sampling": {k: v for k, v in dataclasses.asdict(self.default_sampling).items()
                                 if v != getattr(SamplingParams(), k)},
            "block_size": cache.block_size,
            "num_blocks": cache.pool.num_blocks,
            "kv_cache_bytes": cache.pool.num_blocks * self.block_bytes,
            "anchor": self.config.cache.anchor,
            "eviction_policy": self.config.cache.eviction_policy,
            "max_num_batched_tokens": self.config.scheduler.max_num_batched_tokens,
            "max_num_seqs": self.config.scheduler.max_num_seqs,
            "num_documents": len(self.engine.documents),
            "num_cached_chunks": cache.num_entries,
            "num_free_blocks": cache.pool.num_free,
            "num_evictions": cache.num_evictions,
        }


class RequestStream(Iterator[StreamDelta]):
    """The deltas of one submitted request (the request runs from submission on).

    Iterate it for :class:`StreamDelta` pieces; the last has ``finished=True``. ``close()`` (or
    leaving a ``with`` block, or dropping the last reference) cancels a request that has not
    finished and frees its KV blocks, also when it was never iterated.

    Attributes:
        request_id: the engine's id of the request.
    """

    def __init__(self, loop: EngineLoop, engine: LLMEngine, request_id: str, deltas: queue.SimpleQueue):
        self._loop, self._engine, self.request_id, self._deltas = loop, engine, request_id, deltas
        self._done = False

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> StreamDelta:
        if self._done:
            raise StopIteration
        item = self._deltas.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def close(self) -> None:
        """Cancel the request if it has not finished (idempotent)."""
        if self._done:
            return
        self._done = True
        try:
            self._loop.call(self._engine.abort, self.request_id)
        except RuntimeError:  # the engine is shut down: nothing is left to free
            pass

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _ids(doc_ids: Iterable[str]) -> list[str]:
    if isinstance(doc_ids, str):
        raise ValueError(f"doc_ids must be a list of document ids, not the string {doc_ids!r}")
    return list(doc_ids)


def _pairs(documents: Iterable[Document | tuple[str, str]]) -> list[tuple[str, str]]:
    """``(id, text)`` pairs from :class:`Document` objects or ``(id, text)`` tuples."""
    pairs = []
    for d in documents:
        if isinstance(d, Document):
            pairs.append((d.id, d.text))
        elif isinstance(d, (tuple, list)) and len(d) == 2:
            pairs.append((d[0], d[1]))
        else:
            raise ValueError(f"documents must be Document objects or (id, text) pairs, got {d!r}")
    return pairs


def _prompt_ids(tokenizer: Any, prompt: str | list[int] | tuple[int, ...]) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def _make_backend(name: str, auto: bool, model: CausalLM):
    """The attention backend; ``auto`` falls back to ``torch`` for head layouts the kernels do not cover."""
    arch = model.config
    args = (model.rotary, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5)
    try:
        return get_backend_class(name)(*args)
    except NotImplementedError:
        if not auto:
            raise
        logger.warning("the triton kernels do not cover head_dim %d / rotary_dim %d: using the torch backend",
                       arch.head_dim, model.rotary.rotary_dim)
        return get_backend_class("torch")(*args)


def _collect_deltas(deltas: Iterator[StreamDelta]) -> StreamDelta:
    last = None
    for last in deltas:
        pass
    return last


def _collect(deltas: Iterator[StreamDelta]) -> Completion:
    text, token_ids, last = [], [], None
    for delta in deltas:
        text.append(delta.text)
        if delta.token_id is not None:
            token_ids.append(delta.token_id)
        last = delta
    return Completion("".join(text), token_ids, last.finish_reason, last.stats)
