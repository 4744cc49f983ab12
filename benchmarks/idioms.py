"""Reuse in the frameworks' own idioms: what the second query computes, and what finding documents costs.

Two measurements, side by side in one run on the offline default model (SmolLM2-135M, CPU):

* ``tokens``: each idiom as its documentation writes it (LlamaIndex ``as_query_engine`` in
  four response modes, both chat engines, the second question a second turn of the same chat;
  LangChain LCEL with ``format_docs``), a fresh engine each, over five topics of Python's
  language reference. For the second question (a rewording: the same retrieval, the documents
  at new offsets) its last LLM call's prompt, cached and computed tokens and TTFT, next to the
  id path (documents by id, the engine's own prompt) and a full prefill of the same prompt (no
  reuse) for the same question and documents.
* ``overhead``: the host cost of the mechanism: the prompt matcher per call against 100 to
  10,000 registered documents, and the retrieval handlers per retrieval (LlamaIndex
  instrumentation, LangChain callbacks) measured with them on and off, interleaved.

    python benchmarks/idioms.py                  # both; writes benchmarks/results/idioms_cpu.json

Token counts do not depend on the hardware; the CPU times say where the host time goes, not what
a GPU would take.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from contextvars import copy_context
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import typer

RESULTS = Path(__file__).resolve().parent / "results"
TOPICS = ("break", "continue", "for", "while", "pass")
QUESTIONS = ("What does the break statement do?", "What does the break statement do in a loop?")
app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


def _engine(smollm2):
    from lazyattn_rag import CacheConfig, EngineConfig
    from lazyattn_rag.llm import LazyAttention

    config = EngineConfig(device="cpu", attention_backend="torch", cache=CacheConfig(num_blocks=2048))
    return LazyAttention.from_model(smollm2.model, smollm2.tokenizer, config, name="SmolLM2-135M-Instruct",
                                    weights_sha256=smollm2.fingerprint.weights_sha256)


def _corpus() -> dict[str, str]:
    from lazyattn_rag.integrations.corpus import pydoc_sources

    return {s.id: s.text[:1200] for s in pydoc_sources() if s.metadata["topic"] in TOPICS}


def _recorder(engine) -> list:
    """Each request the engine runs from now on, as ``{"plan", "stats"}`` in order of its first
    step (its stats are final once it finished)."""
    calls, seen = [], set()

    def record(step) -> None:
        for job in step.output.computes:
            if job.request.request_id not in seen:
                seen.add(job.request.request_id)
                calls.append({"plan": job.request.plan, "stats": job.request.stats})

    engine.add_step_listener(record)
    return calls


def _llamaindex_runner(mode: str, corpus: dict, embed):
    def run(engine, question: str):
        from llama_index.core import Document, VectorStoreIndex

        from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

        if not hasattr(run, "index"):
            run.index = VectorStoreIndex.from_documents([Document(text=t, id_=k) for k, t in corpus.items()],
                                                        embed_model=embed)
        llm = LazyAttentionLLM(engine, max_tokens=8)
        if mode in ("context", "condense_plus_context"):  # one chat session per engine: the second turn has history
            if getattr(run, "chat_engine", (None, None))[0] is not engine:
                run.chat_engine = engine, run.index.as_chat_engine(chat_mode=mode, llm=llm, similarity_top_k=3)
            return run.chat_engine[1].chat(question)
        return run.index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=3).query(question)

    return run


def _lcel_runner(corpus: dict, embeddings):
    def run(engine, question: str):
        from langchain_core.prompts import ChatPromptTemplate
        from langchain_core.runnables import RunnablePassthrough
        from langchain_core.vectorstores import InMemoryVectorStore

        from lazyattn_rag.integrations.langchain import ChatLazyAttention

        if not hasattr(run, "store"):
            run.store = InMemoryVectorStore(embeddings)
            run.store.add_texts(list(corpus.values()), ids=list(corpus))
        prompt = ChatPromptTemplate.from_template("Use the following context to answer.\n\nContext:\n{context}\n\n"
                                                  "Question: {question}\nAnswer:")
        chain = ({"context": run.store.as_retriever(search_kwargs={"k": 3})
                  | (lambda docs: "\n\n".join(d.page_content for d in docs)), "question": RunnablePassthrough()}
                 | prompt | ChatLazyAttention(engine=engine, max_tokens=8))
        return chain.invoke(question)

    return run


def _measure_idiom(smollm2, run) -> dict:
    from lazyattn_rag import SamplingParams

    engine = _engine(smollm2)
    calls = _recorder(engine)
    run(engine, QUESTIONS[0])
    since = len(calls)
    run(engine, QUESTIONS[1])
    num_calls = len(calls) - since
    plan, stats = calls[-1]["plan"], calls[-1]["stats"]
    doc_ids = [c.doc_id for c in plan.chunks if c.doc_id is not None and not c.learned]  # ids the id path knows
    new_doc_tokens = sum(len(c.token_ids) for c in plan.chunks if c.doc_id in stats.docs_missed)
    greedy = SamplingParams(max_tokens=1)
    engine.generate(QUESTIONS[0], doc_ids, sampling=greedy)  # the engine's own prompt head, cached once
    by_id = engine.generate(QUESTIONS[1], doc_ids, sampling=greedy).stats  # head and documents cached
    full = engine.complete(plan.token_ids(), greedy).stats  # the same prompt, no reuse
    engine.shutdown()
    return {"num_llm_calls": num_calls, "docs_placed": len(doc_ids), "docs_hit": len(stats.docs_hit),
            "passages_learned": sum(c.learned for c in plan.chunks),
            "num_prompt_tokens": stats.num_prompt_tokens, "num_cached_tokens": stats.num_cached_tokens,
            "num_computed_tokens": stats.num_computed_tokens, "new_document_tokens": new_doc_tokens,
            "text_tokens": plan.num_text_tokens + len(plan.query_token_ids), "ttft_ms": stats.ttft_ms,
            "id_path_computed_tokens": by_id.num_computed_tokens, "id_path_ttft_ms": by_id.ttft_ms,
            "full_prefill_tokens": full.num_computed_tokens, "full_prefill_ttft_ms": full.ttft_ms}


@app.command()
def tokens(out: str = "idioms_cpu", repeats: int = typer.Option(3, min=1)) -> dict:
    """Second-query tokens and TTFT per idiom, next to the id path and a full prefill."""
    from langchain_huggingface import HuggingFaceEmbeddings
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from lazyattn_rag import EngineConfig
    from lazyattn_rag.integrations.embeddings import default_embedding_model_path
    from lazyattn_rag.llm import LazyAttention

    path = str(default_embedding_model_path())
    embed = HuggingFaceEmbedding(model_name=path, device="cpu")
    embeddings = HuggingFaceEmbeddings(model_name=path, model_kwargs={"device": "cpu", "local_files_only": True},
                                       encode_kwargs={"normalize_embeddings": True})
    smollm2 = LazyAttention.shared(EngineConfig(device="cpu", attention_backend="torch"))
    corpus = _corpus()
    idioms = {f"llamaindex {m}": _llamaindex_runner(m, corpus, embed)
              for m in ("compact", "refine", "tree_summarize", "simple_summarize", "context", "condense_plus_context")}
    idioms["langchain lcel format_docs"] = _lcel_runner(corpus, embeddings)
    rows = {}
    for name, run in idioms.items():
        runs = [_measure_idiom(smollm2, run) for _ in range(repeats)]
        rows[name] = {k: (statistics.median(r[k] for r in runs) if k.endswith("_ms") else runs[0][k]) for k in runs[0]}
        print(f"{name:32s} {rows[name]}")
    return _write(out, "tokens", {"repeats": repeats, "questions": QUESTIONS, "topics": TOPICS, "rows": rows})


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


@app.command()
def overhead(out: str = "idioms_cpu", calls: int = typer.Option(200, min=10)) -> dict:
    """Matcher time vs registered documents; retrieval handlers on and off."""
    from lazyattn_rag.engine.planning.prompt_match import Candidate, DocumentMatcher, resolve

    result = {"matcher_us": {}}
    for n in (100, 1000, 10000):
        docs = {f"d{i}": " ".join(f"doc{i}word{j}" for j in range(80)) for i in range(n)}  # ~800 characters each
        start = time.perf_counter()
        matcher = DocumentMatcher(Candidate(k, v) for k, v in docs.items())  # once per change of the registry
        build_ms = (time.perf_counter() - start) * 1e3
        prompt = "Context information is below.\n---\n" + "\n\n".join(docs[f"d{i}"] for i in (3, n // 2, n - 1))
        prompt += "\n---\nQuery: what?\nAnswer: "
        assert [m[2].doc_id for m in resolve(matcher.occurrences(prompt)[0])] == ["d3", f"d{n // 2}", f"d{n - 1}"]
        result["matcher_us"][n] = {"prompt_chars": len(prompt), "build_ms": build_ms,
                                   "median_us": _median_us(lambda: matcher.occurrences(prompt), 30)}
        print(f"matcher, {n} documents, {len(prompt)}-char prompt: {result['matcher_us'][n]['median_us']:.0f} us "
              f"(index built in {build_ms:.1f} ms)")
    result["llamaindex_retrieve_us"] = _llamaindex_handlers(calls)
    result["langchain_retrieve_us"] = _langchain_handlers(calls)
    print("handlers:", result["llamaindex_retrieve_us"], result["langchain_retrieve_us"])
    return _write(out, "overhead", result)


def _llamaindex_handlers(calls: int) -> dict:
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.instrumentation import get_dispatcher

    from lazyattn_rag.integrations import llamaindex_events

    llamaindex_events.install()
    root = get_dispatcher()
    ours = [h for h in root.span_handlers + root.event_handlers if "LazyAttention" in h.class_name()]
    retriever = VectorStoreIndex.from_documents([Document(text=f"text {i}") for i in range(50)],
                                                embed_model=MockEmbedding(embed_dim=8)).as_retriever()
    on, off = [], []
    for _ in range(5):  # interleaved rounds
        on.append(_median_us(lambda: retriever.retrieve("q"), calls // 5))
        for h in ours:
            (root.span_handlers if h in root.span_handlers else root.event_handlers).remove(h)
        off.append(_median_us(lambda: retriever.retrieve("q"), calls // 5))
        for h in ours:
            (root.add_span_handler if "Span" in h.class_name() else root.add_event_handler)(h)
    return {"with_handlers": statistics.median(on), "without": statistics.median(off)}


def _langchain_handlers(calls: int) -> dict:
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.vectorstores import InMemoryVectorStore

    from lazyattn_rag.integrations import langchain_callbacks

    langchain_callbacks.install()
    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
    store.add_texts([f"text {i}" for i in range(50)])
    retriever = store.as_retriever()

    def without():
        langchain_callbacks._HOOK.set(None)  # noqa: SLF001 - this context only
        retriever.invoke("q")

    on, off = [], []
    for _ in range(5):
        on.append(_median_us(lambda: retriever.invoke("q"), calls // 5))
        off.append(_median_us(lambda: copy_context().run(without), calls // 5))
    return {"with_handler": statistics.median(on), "without": statistics.median(off)}


def _write(out: str, key: str, value: dict) -> dict:
    path = RESULTS / (out if out.endswith(".json") else out + ".json")
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = {**value, "command": "python benchmarks/idioms.py " + " ".join(sys.argv[1:] or [key]),
                 "when": time.strftime("%Y-%m-%d %H:%M"),
                 "hardware": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}}
    data.pop("hardware", None), data.pop("command", None)  # (older files kept them at the top level)
    path.write_text(json.dumps(data, indent=1))
    return data


@app.callback(invoke_without_command=True)
def main(ctx: typer.Context) -> None:
    """Both measurements when no command is given."""
    if ctx.invoked_subcommand is None:
        overhead(out="idioms_cpu", calls=200)
        tokens(out="idioms_cpu", repeats=3)


if __name__ == "__main__":
    app()
