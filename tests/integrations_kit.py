"""Shared pieces of the integration tests: a tiny engine, a tiny corpus, a stream spy."""

from __future__ import annotations

import functools

from lazyattn_rag import CacheConfig, Document, EngineConfig, PromptConfig, SamplingParams
from lazyattn_rag.llm import LazyAttention
from tests.tiny import hf_and_ours, hf_config, word_tokenizer, words

SMOLLM2_ENGINE_KWARGS = {"device": "cpu", "attention_backend": "torch", "cache": {"num_blocks": 512}}
"""The session's ``smollm2`` engine settings: wrappers built with ``engine_kwargs=`` these share it."""
PROMPT = PromptConfig(instruction="w190 w191 w192 ", document_separator=" ", question_prefix="Question : ")
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


def tiny_engine(num_blocks: int = 256, max_model_len: int | None = None) -> LazyAttention:
    """A random 2-layer Llama with the word-level tokenizer (no chat template)."""
    _, ours = hf_and_ours(hf_config())
    config = EngineConfig(device="cpu", dtype="float32", attention_backend="torch", max_model_len=max_model_len,
                          cache=CacheConfig(num_blocks=num_blocks, block_size=16), prompt=PROMPT)
    return LazyAttention.from_model(ours, word_tokenizer(), config)


class StreamSpy:
    """Records every ``LazyAttention.stream`` and ``stream_chat`` call: the document ids placed,
    their offsets, the stats.

    Installed on one engine instance; ``calls[i]`` is ``{"question", "doc_ids", "offsets",
    "stats"}`` (``"messages"`` instead of ``"question"`` for a chat) where ``offsets`` maps each
    document id to its global start in the prompt.
    """

    def __init__(self, engine: LazyAttention):
        self.engine = engine
        self.calls: list[dict] = []
        self._stream, self._stream_chat = engine.stream, engine.stream_chat
        engine.stream, engine.stream_chat = self._spy, self._spy_chat

    def _spy(self, question, doc_ids=(), documents=(), sampling=None):
        documents = list(documents)
        ids = list(doc_ids) + [d.id for d in documents]
        call = {"question": question, "doc_ids": ids, "offsets": {}, "stats": None}
        self.calls.append(call)
        inner = self._stream(question, doc_ids, documents, sampling)
        call["offsets"] = self._offsets(self.engine.plan(question, ids))
        return self._record(inner, call)

    def _spy_chat(self, messages, documents=(), sampling=None):
        from lazyattn_rag.types.messages import as_message

        messages = [as_message(m) for m in messages]
        call = {"messages": messages, "doc_ids": [d for m in messages for d in m.document_ids()], "offsets": {},
                "stats": None}
        self.calls.append(call)
        inner = self._stream_chat(messages, documents, sampling)
        call["offsets"] = self._offsets(self.engine.plan_chat(messages))
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
    """Records every request submitted to one engine, on every path (sync, async, id, chat):
    ``calls[i]`` is ``{"plan", "doc_ids", "stats"}`` (stats once the request finished)."""

    def __init__(self, engine: LazyAttention):
        self.calls: list[dict] = []
        inner = engine.engine.submit

        def submit(plan, params, sink, warm_only=False):
            call = {"plan": plan, "doc_ids": [c.doc_id for c in plan.chunks if c.doc_id is not None],
                    "stats": None}

            def recording_sink(item):
                if getattr(item, "finished", False):
                    call["stats"] = item.stats
                sink(item)

            request = inner(plan, params, recording_sink, warm_only)
            if not warm_only:
                self.calls.append(call)
            return request

        engine.engine.submit = submit

    @property
    def last(self) -> dict:
        return self.calls[-1]


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
