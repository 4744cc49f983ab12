"""The FAISS chatbot: Python's language reference (or your documents), LlamaIndex, LazyAttention.

Retrieval is a LlamaIndex ``VectorStoreIndex`` over chunks of the corpus: the vector store is
the project's FAISS store (:class:`~lazyattn_rag.integrations.llamaindex_store.FaissVectorStore`),
the embed model LlamaIndex's ``HuggingFaceEmbedding`` over the offline all-MiniLM-L6-v2; the
index is persisted under the cache dir (built once, reloaded after). Answers come from
LlamaIndex's query engine with :class:`~lazyattn_rag.integrations.llamaindex.LazyAttentionLLM`:
the retrieved chunks reach the engine by id, so a chunk retrieved again is served from the KV
cache at whatever position it lands. ``lazyattn chat`` and ``examples/chatbot.py`` run
:func:`run_chat`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from lazyattn_rag.config import EngineConfig
from lazyattn_rag.integrations.corpus import (
    SPECIAL_TOKENS,
    Source,
    chunk_sources,
    embedder_token_counter,
    folder_sources,
    pydoc_sources,
)
from lazyattn_rag.integrations.embeddings import embedding_model_name, embedding_tokenizer, llamaindex_embedding
from lazyattn_rag.sampling import SamplingParams

if TYPE_CHECKING:
    from llama_index.core.base.embeddings.base import BaseEmbedding

    from lazyattn_rag.integrations.llamaindex_store import FaissVectorStore
    from lazyattn_rag.llm import LazyAttention

# Two questions whose retrievals share chunks: the second shows cache hits at new offsets.
DEMO_QUESTIONS = ("What does the break statement do?", "What does the continue statement do?")
INDEX_FORMAT = 2


def follow_up_question(question: str) -> str:
    """A follow-up on the same topic: it retrieves (mostly) the same chunks, now from the cache."""
    return f"{question.strip()} Answer in one sentence."


@dataclass(frozen=True)
class ChatOptions:
    """What :func:`run_chat` does.

    Attributes:
        questions: asked in order; empty means interactive (read questions from ``stdin``).
        docs: a folder / ``.txt`` / ``.md`` / ``.jsonl`` path; ``None`` = Python's language reference.
        top_k: chunks retrieved per question.
        chunk_overlap: embedder tokens shared by consecutive chunks.
        index_dir: where the FAISS index lives; ``None`` = ``<cache dir>/indexes/<corpus hash>``.
        rebuild: re-embed even when a saved index exists.
        sampling: answer sampling (greedy, at most 128 tokens, stop at a blank line by default).
        engine: :class:`EngineConfig` of the LLM.
    """

    questions: tuple[str, ...] = ()
    docs: Path | None = None
    top_k: int = 3
    chunk_overlap: int = 16
    index_dir: Path | None = None
    rebuild: bool = False
    sampling: SamplingParams = SamplingParams(max_tokens=128, stop=("\n\n",))
    engine: EngineConfig = EngineConfig()


def corpus_fingerprint(sources: list[Source], embed_model: "BaseEmbedding", overlap: int) -> str:
    """A digest of everything the index depends on (texts, ids, chunking, embedding model: its
    :func:`embedding_model_name` and ``max_length``); the same as before the chatbot embedded
    through LlamaIndex, so an index saved then is found and reused."""
    name = embedding_model_name(embed_model.model_name)
    h = hashlib.sha256(json.dumps([INDEX_FORMAT, name, embed_model.max_length, overlap]).encode())
    for s in sources:
        h.update(json.dumps([s.id, s.text]).encode())
    return h.hexdigest()[:16]


def load_or_build_store(sources: list[Source], embed_model: "BaseEmbedding", index_dir: Path, overlap: int,
                        rebuild: bool, log: TextIO) -> "FaissVectorStore":
    """Reload the vector store in ``index_dir``, or chunk, embed (through a ``VectorStoreIndex``)
    and save it there. Chunks hold at most ``embed_model.max_length`` embedder tokens."""
    from llama_index.core import StorageContext, VectorStoreIndex

    from lazyattn_rag.integrations.llamaindex_store import FaissVectorStore, node_from_document

    if not rebuild and (index_dir / "meta.json").is_file():
        store = FaissVectorStore.from_persist_path(index_dir)
        print(f"Loaded the FAISS index ({len(store.client)} chunks) from {index_dir}", file=log)
        return store
    t0 = time.perf_counter()
    docs = chunk_sources(sources, embedder_token_counter(embedding_tokenizer()),
                         embed_model.max_length - SPECIAL_TOKENS, overlap)
    seen: set[str] = set()  # pydoc repeats text (e.g. "else" == "if"): one copy, so top-k stays diverse
    docs = [d for d in docs if not (d.text in seen or seen.add(d.text))]
    name = embedding_model_name(embed_model.model_name)
    print(f"Embedding {len(docs)} chunks of {len(sources)} texts with {name} (first run only)...", file=log,
          flush=True)
    store = FaissVectorStore(embed_model_name=name)
    VectorStoreIndex([node_from_document(d) for d in docs], embed_model=embed_model,
                     storage_context=StorageContext.from_defaults(vector_store=store))
    store.persist(str(index_dir))
    print(f"Indexed {len(docs)} chunks in {time.perf_counter() - t0:.0f} s; saved to {index_dir}", file=log)
    return store


def format_stats(stats: dict) -> str:
    """One line of per-request cache stats."""
    ttft = f"{stats['ttft_ms']:.0f} ms" if stats.get("ttft_ms") is not None else "n/a"
    return (f"[cache: {len(stats['docs_hit'])} docs hit, {len(stats['docs_missed'])} missed | prompt "
            f"{stats['num_prompt_tokens']} tokens: {stats['num_cached_tokens']} cached, "
            f"{stats['num_computed_tokens']} computed | TTFT {ttft} | {stats['num_output_tokens']} tokens]")


def answer(query_engine, question: str, out: TextIO) -> dict:
    """Stream the answer to ``out``, then the sources and the cache stats; returns the stats."""
    print(f"\nQ: {question}\nA: ", end="", file=out, flush=True)
    response = query_engine.query(question)
    started = False
    for piece in response.response_gen:
        if not started:  # the model sometimes opens with a newline
            piece = piece.lstrip()
            started = bool(piece)
        print(piece, end="", file=out, flush=True)
    print(file=out)
    for n in response.source_nodes:
        first_line = n.node.get_content().strip().splitlines()[0][:60]
        print(f"   source {n.node.node_id} (score {n.score:.2f}): {first_line}", file=out)
    stats = response.metadata["lazyattn"]["stats"]
    print("   " + format_stats(stats), file=out, flush=True)
    return stats


def run_chat(options: ChatOptions, out: TextIO = sys.stdout, log: TextIO = sys.stderr,
             stdin: TextIO = sys.stdin, engine: "LazyAttention | None" = None) -> list[dict]:
    """Build or load the index and the LLM, then answer ``options.questions`` (or read questions
    interactively until an empty line, ``exit`` or end of input).

    ``engine`` reuses a loaded :class:`LazyAttention` (``options.engine`` is then ignored).

    Returns:
        the stats dict of every answer, in order.
    Raises:
        FileNotFoundError, ValueError: a bad ``--docs`` path or file; ModuleNotFoundError: an
        extra is missing (the message names it).
    """
    from llama_index.core import VectorStoreIndex

    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM, as_query_engine
    from lazyattn_rag.llm import LazyAttention

    sources = folder_sources(options.docs) if options.docs is not None else pydoc_sources()
    name = str(options.docs) if options.docs is not None else "Python's language reference (pydoc_data.topics)"
    print(f"Corpus: {name}, {len(sources)} texts", file=log)
    embed_model = llamaindex_embedding()
    index_dir = options.index_dir or (options.engine.resolved_cache_dir() / "indexes" /
                                      corpus_fingerprint(sources, embed_model, options.chunk_overlap))
    store = load_or_build_store(sources, embed_model, Path(index_dir), options.chunk_overlap, options.rebuild, log)
    t0 = time.perf_counter()
    engine = engine or LazyAttention(options.engine)
    print(f"Loaded {engine.model_name} on {engine.device} in {time.perf_counter() - t0:.1f} s", file=log)
    store.client.attach_engine(engine)  # every chunk registered; updates and deletions reach the KV cache too
    llm = LazyAttentionLLM(engine, options.sampling)
    index = VectorStoreIndex.from_vector_store(store, embed_model=embed_model)
    query_engine = as_query_engine(index, llm, similarity_top_k=options.top_k, streaming=True)
    if options.questions:
        return [answer(query_engine, q, out) for q in options.questions]
    print("Ask about Python (empty line or 'exit' to quit).", file=log)
    results = []
    while True:
        print("\n> ", end="", file=out, flush=True)
        line = stdin.readline()
        question = line.strip()
        if not line or not question or question.lower() in ("exit", "quit"):
            return results
        results.append(answer(query_engine, question, out))
