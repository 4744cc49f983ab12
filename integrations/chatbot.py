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

import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from lazyattn_rag.types.config import EngineConfig
from lazyattn_rag.utils.progress import directory_bytes, format_bytes, plural, stage
from lazyattn_rag.integrations.corpus import (
    SPECIAL_TOKENS,
    Source,
    chunk_sources,
    embedder_token_counter,
    folder_sources,
    pydoc_sources,
)
from lazyattn_rag.integrations.embeddings import embedding_model_name, embedding_tokenizer, llamaindex_embedding
from lazyattn_rag.integrations.hybrid_retrieval import RETRIEVAL_MODES, chat_retriever
from lazyattn_rag.types.outputs import RequestStats
from lazyattn_rag.types.sampling_params import CHAT_LOOP_GUARD_NGRAM, SamplingParams

if TYPE_CHECKING:
    from llama_index.core.base.embeddings.base import BaseEmbedding

    from lazyattn_rag.integrations.llamaindex_store import FaissVectorStore
    from lazyattn_rag.llm import LazyAttention

# Two questions whose retrievals share chunks (break#0 and while#0 of the three, in another order):
# the second shows cache hits at new offsets.
DEMO_QUESTIONS = ("What does the break statement do?", "How does a while loop work?")
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
        retrieval: ``"hybrid"`` (BM25 and embeddings fused by reciprocal rank,
            ``integrations/hybrid_retrieval.py``) or ``"vector"`` (embeddings alone).
        chunk_overlap: embedder tokens shared by consecutive chunks.
        index_dir: where the FAISS index lives; ``None`` = ``<cache dir>/indexes/<corpus hash>``.
        rebuild: re-embed even when a saved index exists.
        sampling_overrides: :class:`SamplingParams` fields set by the user; the others are the
            model's recommended sampling (``LazyAttention.default_sampling``, from its generation
            config), with answers of at most 128 tokens that end at the template's end of turn or
            before they repeat a run of ``CHAT_LOOP_GUARD_NGRAM`` tokens (``loop_guard_ngram``).
        sampling: the whole sampling instead (overrides are then ignored).
        engine: :class:`EngineConfig` of the LLM.
    """

    questions: tuple[str, ...] = ()
    docs: Path | None = None
    top_k: int = 3
    retrieval: str = "hybrid"
    chunk_overlap: int = 16
    index_dir: Path | None = None
    rebuild: bool = False
    sampling_overrides: dict = field(default_factory=lambda: {"max_tokens": 128,
                                                              "loop_guard_ngram": CHAT_LOOP_GUARD_NGRAM})
    sampling: SamplingParams | None = None
    engine: EngineConfig = EngineConfig()

    def __post_init__(self):
        if self.retrieval not in RETRIEVAL_MODES:
            raise ValueError(f"retrieval must be one of {', '.join(RETRIEVAL_MODES)}, got {self.retrieval!r}")
        for i, question in enumerate(self.questions):
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"question {i + 1} is empty: ask something")


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
    with stage(f"Splitting {plural(len(sources), 'text')} into chunks of at most {embed_model.max_length} embedder tokens",
               file=log):
        docs = chunk_sources(sources, embedder_token_counter(embedding_tokenizer()),
                             embed_model.max_length - SPECIAL_TOKENS, overlap)
        seen: set[str] = set()  # pydoc repeats text (e.g. "else" == "if"): one copy, so top-k stays diverse
        docs = [d for d in docs if not (d.text in seen or seen.add(d.text))]
    name = embedding_model_name(embed_model.model_name)
    print(f"Embedding {len(docs)} chunks with {name} and building the FAISS index (first run only):", file=log,
          flush=True)
    store = FaissVectorStore(embed_model_name=name)
    nodes = [node_from_document(d) for d in docs]
    embed_nodes(nodes, embed_model, log)
    VectorStoreIndex(nodes, embed_model=embed_model, storage_context=StorageContext.from_defaults(vector_store=store))
    store.persist(str(index_dir))
    print(f"Indexed {len(docs)} chunks in {time.perf_counter() - t0:.0f} s; the index takes "
          f"{format_bytes(directory_bytes(index_dir))} in {index_dir}", file=log)
    return store


def embed_nodes(nodes: list, embed_model: "BaseEmbedding", log: TextIO, batch_size: int = 64) -> None:
    """Set each node's embedding (the text LlamaIndex itself embeds: ``MetadataMode.EMBED``), under
    one progress bar for the whole corpus (LlamaIndex's own restarts from 0 for every insert batch)."""
    from llama_index.core.schema import MetadataMode
    from tqdm import tqdm

    texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]
    with tqdm(total=len(nodes), desc="Embedding", unit="chunk", file=log) as bar:
        for i in range(0, len(nodes), batch_size):
            for node, vector in zip(nodes[i:i + batch_size],
                                    embed_model.get_text_embedding_batch(texts[i:i + batch_size])):
                node.embedding = vector
            bar.update(len(texts[i:i + batch_size]))


def better_model_hint(candidates: list[Path] | None = None) -> str:
    """What to say when the chat runs the small default model: the local models ``--model`` could
    load instead (:func:`~lazyattn_rag.engine.model.model_loading.local_model_candidates`), or how to give one."""
    from lazyattn_rag.engine.model.model_loading import local_model_candidates

    candidates = local_model_candidates() if candidates is None else candidates
    hint = ("SmolLM2-135M is a very small model: it answers from the passages but often gets details wrong. "
            "For better answers pass --model with a local Hugging Face directory (Llama, Mistral, Qwen2, "
            "Qwen3) or a .gguf file")
    if not candidates:
        return hint + "."
    return hint + "; found on this machine:\n" + "\n".join(f"  --model {p}" for p in candidates)


def _score_name(options: ChatOptions) -> str:
    """What the retriever's score is, as the sources line names it."""
    return "fused rank score" if options.retrieval == "hybrid" else "similarity"


def answer(query_engine, question: str, out: TextIO, score: str = "score") -> dict:
    """Stream the answer to ``out``, then the sources (with their retrieval ``score``, so named)
    and the cache stats; returns the stats."""
    print(f"\nQ: {question}\nA: ", end="", file=out, flush=True)
    response = query_engine.query(question)
    started = False
    try:
        for piece in response.response_gen:
            if not started:  # the model sometimes opens with a newline
                piece = piece.lstrip()
                started = bool(piece)
            print(piece, end="", file=out, flush=True)
    except KeyboardInterrupt:  # Ctrl-C: closing the stream aborts the request (the engine stops computing it)
        close = getattr(response.response_gen, "close", None)
        if close is not None:
            close()
        raise
    print(file=out)
    for n in response.source_nodes:
        first_line = n.node.get_content().strip().splitlines()[0][:60]
        print(f"   source {n.node.node_id} ({score} {n.score:.3f}): {first_line}", file=out)
    stats = response.metadata["lazyattn"]["stats"]
    print("   " + RequestStats(**stats).summary(), file=out, flush=True)
    return stats


def interactive_input(stdin: TextIO | None) -> TextIO:
    """``stdin`` checked for the interactive loop, before anything slow loads.

    A terminal is returned as it is. A pipe or file is read up to its first question now (the
    lines read are replayed), so input with no question is refused at once.

    Raises:
        ValueError: ``stdin`` is closed (``None``), or not a terminal and holds no question
            (``chat < /dev/null``); the message says what to do instead.
    """
    if stdin is None or stdin.closed:
        raise ValueError("standard input is closed: pass questions with -q/--question, or run the chat in a terminal")
    if stdin.isatty():
        return stdin
    lines = []
    while not lines or not lines[-1].strip():
        line = stdin.readline()
        if not line:
            raise ValueError("standard input is not a terminal and holds no question (e.g. chat < /dev/null): pass "
                             "questions with -q/--question, or pipe them in, one a line")
        lines.append(line)
    return _Replayed(lines, stdin)


class _Replayed:
    """``readline`` of ``lines``, then of ``rest``."""

    def __init__(self, lines: list[str], rest: TextIO):
        self._lines, self._rest = list(lines), rest

    def readline(self) -> str:
        return self._lines.pop(0) if self._lines else self._rest.readline()


def run_chat(options: ChatOptions, out: TextIO | None = None, log: TextIO | None = None,
             stdin: TextIO | None = None, engine: "LazyAttention | None" = None) -> list[dict]:
    """Build or load the index and the LLM, then answer ``options.questions``, or read questions
    from ``stdin`` until ``exit``, ``quit`` or end of input. ``out`` / ``log`` / ``stdin`` default
    to ``sys.stdout`` / ``sys.stderr`` / ``sys.stdin`` as they are at the call.

    Interactive: empty lines are ignored; Ctrl-C (``KeyboardInterrupt``) during an answer stops it
    (its request is aborted) and asks for the next question; Ctrl-C at the prompt leaves.
    ``engine`` reuses a loaded :class:`LazyAttention` (``options.engine`` is then ignored).

    Returns:
        the stats dict of every finished answer, in order.
    Raises:
        FileNotFoundError, ValueError: a bad ``--docs`` path, no text in it, or an interactive
        ``stdin`` that is closed or empty (checked first, before anything loads);
        ModuleNotFoundError: an extra is missing (the message names it).
    """
    out, log = sys.stdout if out is None else out, sys.stderr if log is None else log
    if not options.questions:
        stdin = interactive_input(sys.stdin if stdin is None else stdin)
    from llama_index.core import VectorStoreIndex

    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM, as_query_engine

    store, embed_model, engine = open_corpus(options, log, engine)
    sampling = options.sampling or dataclasses.replace(engine.default_sampling, **options.sampling_overrides)
    llm = LazyAttentionLLM(engine, sampling)
    index = VectorStoreIndex.from_vector_store(store, embed_model=embed_model)
    retriever = chat_retriever(index, store.client.documents(), options.top_k, options.retrieval, llm)
    query_engine = as_query_engine(retriever, llm, streaming=True)
    if options.questions:
        return [answer(query_engine, q, out, _score_name(options)) for q in options.questions]
    return _interactive(options, query_engine, stdin, out, log)


def open_corpus(options: ChatOptions, log: TextIO, engine: "LazyAttention | None" = None
                ) -> tuple["FaissVectorStore", "BaseEmbedding", "LazyAttention"]:
    """Read the corpus, load or build its FAISS index, load the LLM (unless ``engine`` is given)
    and register every chunk with it. Errors as :func:`run_chat`."""
    from lazyattn_rag.llm import LazyAttention

    skipped: list[Path] = []

    def skip(path: Path, reason: str) -> None:
        skipped.append(path)
        print(f"warning: skipped {path}: {reason}", file=log)

    sources = folder_sources(options.docs, on_skip=skip) if options.docs is not None else pydoc_sources()
    if skipped:
        them = "it" if len(skipped) == 1 else "them"
        print(f"warning: {plural(len(skipped), 'file')} skipped (not UTF-8 text); to include {them}, convert {them} "
              "to UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > NEW_FILE)", file=log)
    name = str(options.docs) if options.docs is not None else "Python's language reference (pydoc_data.topics)"
    print(f"Corpus: {name}, {plural(len(sources), 'text')}", file=log)
    embed_model = llamaindex_embedding()
    index_dir = options.index_dir or (options.engine.resolved_cache_dir() / "indexes" /
                                      corpus_fingerprint(sources, embed_model, options.chunk_overlap))
    store = load_or_build_store(sources, embed_model, Path(index_dir), options.chunk_overlap, options.rebuild, log)
    t0 = time.perf_counter()
    engine = engine or LazyAttention(options.engine)
    print(f"Loaded {engine.model_name} on {engine.device} in {time.perf_counter() - t0:.1f} s", file=log)
    if options.engine.model is None:
        print(better_model_hint(), file=log)
    store.client.attach_engine(engine)  # every chunk registered; updates and deletions reach the KV cache too
    return store, embed_model, engine


def warm_corpus(options: ChatOptions, log: TextIO | None = None, batch_size: int = 8) -> dict:
    """``lazyattn cache warm``: compute every chunk of the chatbot's corpus (the same chunks, so the
    same cache keys, as :func:`run_chat` places) into the engine's persistent tiers (disk, Redis),
    with a progress bar. Chunks a tier already holds are loaded, not computed.

    Returns:
        ``{"num_chunks", "num_computed", "num_stored_before", "tiers"}`` (``tiers``: each persistent
        tier's stats after the writes landed).
    Raises:
        ValueError: the engine has no persistent tier to warm; errors of :func:`run_chat`.
    """
    from tqdm import tqdm

    log = sys.stderr if log is None else log
    if not (options.engine.cache.disk_dir or options.engine.cache.redis_url):
        raise ValueError("nothing to warm: no disk cache or Redis server is configured")
    store, _, engine = open_corpus(options, log)
    ids = engine.document_ids()
    computed = 0
    with tqdm(total=len(ids), desc="Warming chunks", unit="chunk", file=log) as bar:
        for i in range(0, len(ids), batch_size):
            computed += len(engine.warm(ids[i:i + batch_size]))
            bar.update(len(ids[i:i + batch_size]))
    engine.client.call(lambda e: e.tiers.flush())
    tiers = {k: v for k, v in engine.stats()["tiers"].items() if k != "host"}
    engine.close()
    return {"num_chunks": len(ids), "num_computed": computed, "num_stored_before": len(ids) - computed,
            "tiers": tiers}


def _interactive(options: ChatOptions, query_engine, stdin: TextIO, out: TextIO, log: TextIO) -> list[dict]:
    """Answer questions read from ``stdin`` (see :func:`run_chat`)."""
    topic = "Python" if options.docs is None else f"the documents in {options.docs}"
    print(f"Ask about {topic}: type a question and press Enter; exit, quit or Ctrl-D leaves; Ctrl-C stops an "
          "answer.", file=log)
    results = []
    while True:
        print("\n> ", end="", file=out, flush=True)
        try:
            line = stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: leave
            print(file=out)
            return results
        question = line.strip()
        if not line or question.lower() in ("exit", "quit"):
            if not line:  # end of input: end the prompt's line
                print(file=out)
            return results
        if not question:
            continue
        try:
            results.append(answer(query_engine, question, out, _score_name(options)))
        except KeyboardInterrupt:
            print("\n[stopped: the answer was cancelled. Ask another question, or press Ctrl-C again to leave]",
                  file=out, flush=True)
