"""Shared pieces of the integration tests: a tiny engine, a tiny corpus, a stream spy, a plan spy."""

from __future__ import annotations

import asyncio
import functools

import pytest

from lazyattn_rag import Document, SamplingParams
from lazyattn_rag.engine.engine import StepResult
from lazyattn_rag.llm import LazyAttention
from tests.tiny import tiny_llm, words

SMOLLM2_ENGINE_KWARGS = {"device": "cpu", "attention_backend": "torch", "cache": {"num_blocks": 512}}
"""The session's ``smollm2`` engine settings: wrappers built with ``engine_kwargs=`` these share it."""
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)

# English for the embedder, distinct w-words for the word-level tokenizer of the tiny model
CORPUS = {
    "cats": "Cats purr when they are content and relaxed. " + words(24, 0),
    "dogs": "Dogs bark to warn their owners about strangers. " + words(30, 40),
    "rivers": "Rivers flow downhill until they reach the sea. " + words(20, 80),
    "stars": "Stars shine because nuclear fusion burns in their cores. " + words(26, 120),
}


def corpus_documents() -> list[Document]:
    return [Document(k, v) for k, v in CORPUS.items()]


@functools.cache
def embedder():
    """One all-MiniLM-L6-v2 per test process (loading it is the slow part)."""
    from lazyattn_rag.integrations.embeddings import SentenceEmbedder

    return SentenceEmbedder()


def tiny_engine(num_blocks: int = 256, max_model_len: int | None = None, **config) -> LazyAttention:
    """A random 2-layer Llama with the word-level tokenizer (no chat template), the library's
    default anchor (``bos``); ``config`` as ``tests/tiny.py: tiny_config``."""
    return tiny_llm(num_blocks=num_blocks, max_model_len=max_model_len, **config)


class StreamSpy:
    """Records every ``LazyAttention.stream`` and ``stream_chat`` call: the document ids placed,
    their offsets, the stats.

    Installed on one engine instance; ``calls[i]`` is ``{"question", "doc_ids", "offsets",
    "stats", "namespace"}`` (``"messages"`` instead of ``"question"`` for a chat) where ``offsets`` maps each
    document id to its global start in the prompt.
    """

    def __init__(self, engine: LazyAttention):
        self.engine = engine
        self.calls: list[dict] = []
        self._stream, self._stream_chat = engine.stream, engine.stream_chat
        engine.stream, engine.stream_chat = self._spy, self._spy_chat

    def _spy(self, question, doc_ids=(), documents=(), sampling=None, namespace="", *, remedies=None):
        documents = list(documents)
        ids = list(doc_ids) + [d.id for d in documents]
        call = {"question": question, "doc_ids": ids, "offsets": {}, "stats": None, "namespace": namespace}
        self.calls.append(call)
        inner = self._stream(question, doc_ids, documents, sampling, namespace, remedies=remedies)
        call["offsets"] = self._offsets(self.engine.plan(question, ids, namespace))
        return self._record(inner, call)

    def _spy_chat(self, messages, documents=(), sampling=None, namespace="", *, remedies=None):
        from lazyattn_rag.types.messages import as_message

        messages = [as_message(m) for m in messages]
        call = {"messages": messages, "doc_ids": [d for m in messages for d in m.document_ids()], "offsets": {},
                "stats": None, "namespace": namespace}
        self.calls.append(call)
        inner = self._stream_chat(messages, documents, sampling, namespace, remedies=remedies)
        call["offsets"] = self._offsets(self.engine.plan_chat(messages, namespace))
        return self._record(inner, call)

    @staticmethod
    def _offsets(plan) -> dict:
        return {c.doc_id: c.global_start for c in plan.chunks if c.doc_id is not None}

    @staticmethod
    def _record(inner, call):
        try:
            for delta in inner:
                if delta.finished:
                    call["stats"] = delta.stats
                yield delta
        finally:
            inner.close()

    @property
    def last(self) -> dict:
        return self.calls[-1]


class PlanSpy:
    """Records every request one engine computes, on every path (sync, async, id, chat), through
    a step listener: ``calls[i]`` is ``{"plan", "doc_ids", "stats"}`` in the order the requests
    first computed (warm-ups aside; ``stats`` once the request finished)."""

    def __init__(self, engine: LazyAttention):
        self.engine = engine
        self._calls: list[dict] = []
        self._requests: list = []  # the engine's requests, as calls
        self.remove = engine.add_step_listener(self._record)

    def _record(self, step: StepResult) -> None:
        known = {id(r) for r in self._requests}
        for job in step.output.computes:
            r = job.request
            if id(r) not in known and not r.warm_only:
                known.add(id(r))
                self._requests.append(r)
                self._calls.append({"plan": r.plan, "doc_ids": [c.doc_id for c in r.plan.chunks if c.doc_id is not None],
                                    "stats": None})
        self._fill_stats()

    def _fill_stats(self) -> None:
        for call, r in zip(self._calls, self._requests):
            if call["stats"] is None and r.stats.e2e_ms is not None:  # finished (aborts too), not failed
                call["stats"] = r.stats

    @property
    def calls(self) -> list[dict]:
        """The calls so far (read on the engine thread between steps, so every step's listener ran)."""
        try:
            self.engine.loop.call(self._fill_stats)  # a request aborted between steps finished there
        except RuntimeError:  # shut down: its last steps' listeners ran
            pass
        return self._calls

    @property
    def last(self) -> dict:
        return self.calls[-1]


def loop_ticks_during(consume) -> tuple[int, int]:
    """``(ticks, items)``: how often a 1 ms ticker task ran on the event loop while
    ``consume()`` (an async function returning how many items it read) ran, and that count. A
    stream that blocks the loop leaves the ticker still."""
    ticks = []

    async def ticker(done: asyncio.Event):
        while not done.is_set():
            ticks.append(1)
            await asyncio.sleep(0.001)

    async def run():
        done = asyncio.Event()
        task = asyncio.create_task(ticker(done))
        await asyncio.sleep(0)
        before = len(ticks)
        count = await consume()
        done.set()
        await task
        return len(ticks) - before, count

    return asyncio.run(run())


# --- the fixtures both wrappers' test modules use (imported there: module scope is per module) ---
@pytest.fixture(scope="module")
def engine():
    """A tiny engine for one test module."""
    return tiny_engine()


@pytest.fixture(scope="module")
def spy(engine):
    """A :class:`StreamSpy` on the module's engine."""
    return StreamSpy(engine)


@pytest.fixture
def store(engine):
    """A FAISS store of :func:`corpus_documents` on the module's engine; its documents are
    removed from the engine after the test."""
    from lazyattn_rag.integrations.faiss_store import FaissDocumentStore

    s = FaissDocumentStore(embedder(), engine=engine)
    s.upsert(corpus_documents())
    yield s
    for d in list(s.documents()):
        if engine.has_document(d.id):
            engine.remove_document(d.id)


def bow_vector(text: str, dim: int = 64) -> list[float]:
    """A unit bag-of-words vector (md5 of each word into ``dim`` buckets): retrieval by shared words,
    no model to load."""
    import hashlib

    import numpy as np

    v = np.zeros(dim, dtype=np.float32)
    for w in text.split():
        v[int(hashlib.md5(w.encode()).hexdigest(), 16) % dim] += 1.0
    n = np.linalg.norm(v)
    return (v / n if n else v).tolist()


def bow_llamaindex_embedding():
    """:func:`bow_vector` as a LlamaIndex embedding model."""
    from llama_index.core.embeddings import BaseEmbedding

    class Bow(BaseEmbedding):
        def _get_text_embedding(self, text):
            return bow_vector(text)

        def _get_query_embedding(self, query):
            return bow_vector(query)

        async def _aget_query_embedding(self, query):
            return bow_vector(query)

    return Bow()


def bow_langchain_embeddings():
    """:func:`bow_vector` as LangChain ``Embeddings``."""
    from langchain_core.embeddings import Embeddings

    class Bow(Embeddings):
        def embed_documents(self, texts):
            return [bow_vector(t) for t in texts]

        def embed_query(self, text):
            return bow_vector(text)

    return Bow()


class ChatSuiteSettings:
    """What LangChain's standard chat-model suite is told about this project's chat models (in
    process and through ``ChatOpenAI`` against ``lazyattn serve``): no tool calling (refused by
    name), structured output by JSON schema (a token mask), and no JSON mode: it works, but leaves
    the keys to the model, and SmolLM2-135M drops the test prompt's second key ('punchline')."""

    has_tool_calling = False
    has_structured_output = True
    # room for the structured output tests' two-sentence JSON jokes, whose strings the small model
    # repeats a phrase in until max_tokens cuts the JSON off without a frequency penalty (the other
    # tests keep the models' short max_tokens); at 1.5 the cat joke closes after 43 tokens, at 0.5
    # after 64 (CPU, 2026-12-06), which is most of these tests' time
    structured_output_kwargs = {"method": "json_schema", "max_tokens": 160, "frequency_penalty": 1.5}
    supports_json_mode = False

