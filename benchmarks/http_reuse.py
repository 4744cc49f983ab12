"""Reuse for unchanged OpenAI clients (issue 36): the serving benchmark's Zipf RAG trace through
``lazyattn serve`` with the retrieved documents pasted into the message text, as every app that
talks to an OpenAI-compatible server sends them, against the same trace by id.

Arms, each a fresh Serve application on the same trace (one replica of a random-weight model of
``--arch``'s shapes, ``lazy`` mode, ``--budget-gb`` of KV cache, exact-prefix caching on):

* ``plain_learning_off``: nothing registered, documents pasted, passage learning off (what an
  unchanged client got before: exact prefixes only, as vLLM's automatic prefix caching);
* ``plain_learning_on``: nothing registered, documents pasted, passages learned from traffic;
* ``plain_registered``: the documents registered once, pasted (the server finds them);
* ``by_id``: the documents registered once and named by id (the ``documents`` field).

The trace is driven closed-loop (``--concurrency`` streams in flight) with the ``openai``
package's async client; TTFT is the first content chunk, as a client sees it. Per arm: request
throughput, TTFT median and p99, computed prompt tokens per request (median), the hit ratio of
the documents and passages placed, and how each placement came about (id, matched, learned).

Separately, on this process's CPU (``--overhead-docs`` registered documents, default 10,000):
what the ingress adds per request for a plain prompt (finding registered texts in it and hashing
its passages for the router), what the engine's passage learner adds (splitting, sightings,
weighing the layouts), and planning a prompt whole (tokenizing and the learner) alone and beside
a thread that keeps the GIL busy, each a median and p99 over the trace's prompts.

    python benchmarks/http_reuse.py --arch llama-3.1-8b --device cuda --budget-gb 10 --out http_reuse_h200
    python benchmarks/http_reuse.py --overhead-only --num-requests 400 --out http_reuse_overhead_cpu   # CPU costs alone
    python benchmarks/http_reuse.py --arch tiny --device cpu --dtype float32 --budget-gb 0.05 --num-requests 80 \\
        --doc-tokens 128 --query-tokens 16 --output-tokens 8 --concurrency 8 --out http_reuse_cpu_tiny

``--num-requests`` defaults to 800, as the recorded GPU runs: how much of a trace is first
sightings of passages (computed in their prompt, then encoded) moves the learning arm's ratios
(on an H100, 1.21x the by-id TTFT on 800 requests, 1.55-1.95x on 400).

JSON: ``benchmarks/results/<out>.json``; write-up: docs/benchmarks.md ("Plain prompts over HTTP").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving_results import command_line, environment, write  # noqa: E402
from benchmarks.serving_workload import Workload  # noqa: E402

app = typer.Typer(add_completion=False, help=__doc__)
ARMS = ("plain_learning_off", "plain_learning_on", "plain_registered", "by_id")


def pasted(texts: list[str], question: str) -> str:
    """The user message a RAG app sends: its retrieved texts joined by blank lines (LangChain's
    ``format_docs``), between a label and the question."""
    return "Documents:\n\n" + "\n\n".join(texts) + "\n\nQuestion: " + question


def replica_engine(arch: str, device: str, dtype: str, budget_bytes: int, max_batched: int, max_seqs: int,
                   learn_passages: bool, trace_path: str = ""):
    """Runs in a replica: its engine over a random-weight model of ``arch`` (the serving benchmark's);
    ``trace_path``: where ``benchmarks/replica_trace.py`` records the replica's timings (``""``: not)."""
    from benchmarks.serving_setup import Bench, make_engine

    if trace_path:
        from benchmarks.replica_trace import install

        install(trace_path)

    bench = Bench.build(arch, device, dtype, hash_weights=False)
    return make_engine(bench, "lazy", budget_bytes, device, max_batched, max_seqs,
                       cache_fields={"learn_passages": learn_passages})


async def one_request(client, model: str, body: dict, output_tokens: int) -> dict:
    start, first, final, timings = time.time(), None, None, {}
    stream = await client.chat.completions.create(model=model, max_tokens=output_tokens, temperature=0, stream=True,
                                                  **body)
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.time()
        extension = (chunk.model_extra or {}).get("lazyattn")
        if extension:
            final, timings = extension["stats"], extension.get("timings", {})
    end = time.time()
    return {"ttft_ms": ((first or end) - start) * 1e3, "e2e_ms": (end - start) * 1e3,
            "stages_ms": submission_split(ttft_stages(start, first or end, timings | {"engine_arrival": final.get(
                "arrival_time")}, final["ttft_ms"]), final),
            "num_prompt_tokens": final["num_prompt_tokens"], "num_computed_tokens": final["num_computed_tokens"],
            "num_output_tokens": final["num_output_tokens"], "docs_hit": final["docs_hit"],
            "docs_missed": final["docs_missed"], "doc_sources": final["doc_sources"],
            "engine_ttft_ms": final["ttft_ms"], "queue_ms": final["queue_ms"]}


def ttft_stages(start: float, first: float, timings: dict[str, float], engine_ttft_ms: float) -> dict[str, float]:
    """Where one request's TTFT went, in ms, from the server's wall-clock ``timings`` (the
    ``lazyattn`` extension) and the client's own ``start`` and first content (same machine)."""
    t = timings
    if not {"ingress_received", "ingress_sent", "ingress_first_event", "replica_received",
            "replica_first_event"} <= t.keys():
        return {}
    submitted = t["replica_first_event"] - engine_ttft_ms / 1e3  # the engine's TTFT counts from its submission
    accepted = t.get("engine_arrival") or submitted  # the engine's own wall-clock stamp (stats.arrival_time)
    marks = [("to_ingress", start, t["ingress_received"]), ("ingress", t["ingress_received"], t["ingress_sent"]),
             ("to_replica", t["ingress_sent"], t["replica_received"]),
             ("replica_to_submission", t["replica_received"], submitted),
             ("replica_parsing", t["replica_received"], t.get("replica_submitting", t["replica_received"])),
             ("submitting_to_engine", t.get("replica_submitting", t["replica_received"]), accepted),
             ("first_token_to_replica_event", accepted + engine_ttft_ms / 1e3, t["replica_first_event"]),
             ("engine", submitted, t["replica_first_event"]),
             ("back_to_ingress", t["replica_first_event"], t["ingress_first_event"]),
             ("back_to_client", t["ingress_first_event"], first)]
    return {name: (b - a) * 1e3 for name, a, b in marks}


def submission_split(stages: dict[str, float], stats: dict) -> dict[str, float]:
    """``stages`` with its ``submitting_to_engine`` split by the engine's stats (ms): waiting
    for a planning thread, planning, waiting for the engine thread between steps, and the rest
    (thread hand-offs, planning on the engine thread)."""
    if not stages:
        return stages
    parts = {"planning_queue": stats.get("planning_queue_ms") or 0.0, "planning": stats.get("planning_ms") or 0.0,
             "submission_wait": stats.get("submission_wait_ms") or 0.0}
    return stages | parts | {"submission_rest": stages["submitting_to_engine"] - sum(parts.values())}


async def drive(base_url: str, bodies: list[dict], output_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600,
                         http_client=httpx.AsyncClient(limits=limits, timeout=600))
    model = (await client.models.list()).data[0].id
    queue = list(enumerate(bodies))
    results: list[dict | None] = [None] * len(bodies)

    async def worker():
        while queue:
            i, body = queue.pop(0)
            results[i] = await one_request(client, model, body, output_tokens)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return results, wall


def bodies_of(arm: str, docs: dict[str, str], requests: list[tuple[str, list[str]]]) -> list[dict]:
    """The arm's request bodies for ``requests`` (question, document ids) over ``docs``."""
    if arm == "by_id":
        return [{"messages": [{"role": "user", "content": q}], "extra_body": {"documents": ids, "ignore_eos": True}}
                for q, ids in requests]
    return [{"messages": [{"role": "user", "content": pasted([docs[i] for i in ids], q)}],
             "extra_body": {"ignore_eos": True}} for q, ids in requests]


def warm_up_set(workload: Workload, concurrency: int) -> tuple[dict[str, str], list[tuple[str, list[str]]]]:
    """``docs_per_request`` documents outside the trace and ``2 * concurrency`` requests placing
    all of them, each in another rotated order, run in the arm's own form at the arm's
    concurrency and output length before the clock starts: prompts of the trace's length in
    batches of its size run every kernel the arm runs (plain prefill, chunk encodes, chunk reads
    after a passage is learned, decode at the batch's split counts), so no arm pays a kernel's
    first compilation inside its measurement. (Two documents over six requests at concurrency 2
    left the first arm of a run a p99 of 2.0-2.5 s on the H100, its later arms 0.3-0.5 s: most
    likely kernels compiled mid-trace, not verified.)"""
    from benchmarks.serving_workload import random_text
    import numpy as np

    rng = np.random.default_rng(workload.seed + 99)
    ids = [f"warm{i}" for i in range(workload.docs_per_request)]
    docs = {i: random_text(rng, workload.doc_tokens) for i in ids}
    orders = [ids[k % len(ids):] + ids[:k % len(ids)] for k in range(2 * concurrency)]
    return docs, [(random_text(rng, workload.query_tokens), order) for order in orders]


def summarize(results: list[dict], wall_s: float) -> dict:
    ttfts = sorted(r["ttft_ms"] for r in results)
    hits = sum(len(r["docs_hit"]) for r in results)
    placements = hits + sum(len(r["docs_missed"]) for r in results)
    sources: dict[str, int] = {}
    for r in results:
        for source in r["doc_sources"].values():
            sources[source] = sources.get(source, 0) + 1
    later = results[len(results) // 2:]  # the trace's second half: past the first sightings
    return {"num_requests": len(results), "wall_s": wall_s, "request_throughput_per_s": len(results) / wall_s,
            "ttft_ms_median": statistics.median(ttfts), "ttft_ms_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "second_half_ttft_ms_median": statistics.median(r["ttft_ms"] for r in later),
            "computed_tokens_total": sum(r["num_computed_tokens"] for r in results),
            "computed_tokens_median": statistics.median(r["num_computed_tokens"] for r in results),
            "prompt_tokens_median": statistics.median(r["num_prompt_tokens"] for r in results),
            # from the engine's submission: what the engine adds; the rest of TTFT is before it (HTTP,
            # ingress, planning) and after it (the stream back)
            "engine_ttft_ms_median": statistics.median(r["engine_ttft_ms"] for r in results),
            "engine_queue_ms_median": statistics.median(r["queue_ms"] for r in results),
            "ttft_stages_ms_median": {k: statistics.median(r["stages_ms"][k] for r in results if r["stages_ms"])
                                      for k in (results[0]["stages_ms"] or {})},
            "placement_hit_ratio": hits / max(1, placements), "placements_by_source": sources,
            "per_request": {"ttft_ms": [round(r["ttft_ms"], 1) for r in results],
                            "computed_tokens": [r["num_computed_tokens"] for r in results],
                            "engine_ttft_ms": [round(r["engine_ttft_ms"], 1) for r in results]}}


def run_arm(arm: str, args: dict, workload: Workload, port: int) -> dict:
    import httpx
    from ray import serve

    from lazyattn_rag.serve import ServeConfig, build_app

    gpus = 1.0 if args["device"].startswith("cuda") else 0.0
    trace_path = str(Path(args["trace_replica"]).resolve() / f"{arm}.jsonl") if args["trace_replica"] else ""
    if trace_path:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        Path(trace_path).unlink(missing_ok=True)
    build = functools.partial(replica_engine, args["arch"], args["device"], args["dtype"],
                              int(args["budget_gb"] * 2**30), args["max_batched_tokens"], args["concurrency"],
                              arm != "plain_learning_off", trace_path)
    config = ServeConfig(num_replicas=1, num_gpus_per_replica=gpus, num_cpus_per_replica=0,
                         max_ongoing_requests=args["concurrency"], port=port, max_body_bytes=64 << 20,
                         registry="memory", switch_interval_ms=args["switch_interval_ms"])
    start = time.perf_counter()
    serve.run(build_app(None, config, build), name="bench", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    warm_docs, warm_requests = warm_up_set(workload, args["concurrency"])
    if arm in ("plain_registered", "by_id"):
        items = list(workload.documents().items()) + list(warm_docs.items())
        with httpx.Client(base_url=base, timeout=600) as http:
            for i in range(0, len(items), 50):
                response = http.post("/v1/documents", json={"documents": [{"id": k, "text": v}
                                                                          for k, v in items[i:i + 50]]})
                response.raise_for_status()
    setup_s = time.perf_counter() - start
    asyncio.run(drive(base, bodies_of(arm, warm_docs, warm_requests), workload.output_tokens, args["concurrency"]))
    trace = bodies_of(arm, workload.documents(), workload.requests())
    results, wall = asyncio.run(drive(base, trace, workload.output_tokens, args["concurrency"]))
    engine = engine_counters(base)
    if trace_path:
        time.sleep(1.5)  # the replica writes its records once a second
        from benchmarks.replica_trace import summarize as summarize_trace

        engine["replica_trace"] = summarize_trace(trace_path)
    serve.delete("bench")
    row = {"arm": arm, "setup_s": setup_s, **summarize(results, wall), "engine": engine}
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "per_request"}, flush=True)
    return row


def engine_counters(base: str) -> dict:
    """The replica's counters from ``/metrics`` (as of its last finished request): preemptions,
    evictions, prompt tokens by how they were served."""
    import httpx

    names = ("preemptions", "chunk_evictions", "exact_prefix_tokens", "shifted_tokens", "computed_prompt_tokens",
             "recomputed_tokens", "prompt_tokens")
    out = {}
    for line in httpx.get(base + "/metrics", timeout=60).text.splitlines():
        for name in names:
            if line.startswith(f"lazyattn_{name}_total{{"):
                out[name] = out.get(name, 0) + float(line.split()[-1])
    return out


def overhead(workload: Workload, num_docs: int, doc_tokens: int) -> dict:
    """Per-request CPU cost of the ingress's matching and passage keys, and of the engine's
    passage learner, over ``num_docs`` registered documents (see the module docstring)."""
    import numpy as np

    from benchmarks.serving_setup import make_engine, Bench
    from benchmarks.serving_workload import random_text
    from lazyattn_rag.engine.planning.passage_learning import eligible_pieces
    from lazyattn_rag.serve.payload import match_messages
    from lazyattn_rag.serve.registry import DocumentStore
    from lazyattn_rag.types.messages import as_message

    rng = np.random.default_rng(workload.seed + 7)
    docs = workload.documents()
    store = DocumentStore()
    store.put("", list(docs.items()) + [(f"extra{i}", random_text(rng, doc_tokens))
                                         for i in range(max(0, num_docs - len(docs)))])
    prompts = [[{"role": "user", "content": pasted([docs[i] for i in ids], q)}] for q, ids in workload.requests()]
    ingress_ms = []
    for messages in prompts:
        start = time.perf_counter()
        _, found = match_messages(messages, store, "")
        # the router's passage keys, as the ingress hashes them for a prompt whose text matched
        # nothing (an upper bound: here every pasted text matched, and matched text is not hashed)
        keys = [k for _, _, k in eligible_pieces([as_message(m) for m in messages], "", 16)]
        ingress_ms.append((time.perf_counter() - start) * 1e3)
        assert len(found) == workload.docs_per_request and len(keys) >= workload.docs_per_request, \
            "every pasted document is found, and every passage hashed"
    # tiny-32k: every word of the trace known to its tokenizer, as for the GPU arms' 8B shape
    llm = make_engine(Bench.build("tiny-32k", "cpu", "float32", hash_weights=False), "lazy", 64 << 20, "cpu", 2048, 16)
    learner_ms = []

    def time_choice(engine, messages):
        plain = engine.planner.plan_messages(messages)
        start = time.perf_counter()
        engine.passages.choose(messages, plain)
        return (time.perf_counter() - start) * 1e3

    for messages in prompts:
        learner_ms.append(llm.client.call(time_choice, [as_message(m) for m in messages]))
    planning = planning_ms(llm.engine, [[as_message(m) for m in messages] for messages in prompts])
    planning |= burst_planning_ms(llm.engine, [[as_message(m) for m in messages] for messages in prompts])
    llm.close()

    def stats(xs):
        xs = sorted(xs)
        return {"median_ms": statistics.median(xs), "p99_ms": xs[min(len(xs) - 1, int(0.99 * len(xs)))],
                "max_ms": xs[-1]}

    return {"num_registered_documents": len(store.texts), "num_prompts": len(prompts),
            "prompt_chars_median": statistics.median(len(m[0]["content"]) for m in prompts),
            "ingress_matching_and_passage_keys": stats(ingress_ms),
            "engine_passage_learner": stats(learner_ms),
            **{f"planning_{k}": stats(v) for k, v in planning.items()}}


@contextlib.contextmanager
def busy_thread():
    """Another Python thread that keeps the GIL busy while the block runs (as a replica's engine
    thread does between GPU waits)."""
    import threading

    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def burst_planning_ms(engine, prompts: list, burst: int = 16) -> dict[str, list[float]]:
    """Bursts of ``burst`` prompts planned at once beside a thread that keeps the GIL busy (a
    closed loop's requests end together, and their successors arrive together): each prompt's
    latency from its burst's start, ms, by switch interval (``switch_5ms``: Python's default,
    ``switch_0.5ms``: ``lazyattn serve``'s replicas), planning threads (1, or the client's
    ``PLANNING_THREADS``) and, at 0.5 ms with several threads, with long texts tokenized
    holding the GIL (``_gil_kept``) for comparison. Every prompt is planned once per setting (a
    trace shorter than ``burst`` is one burst)."""
    from concurrent.futures import ThreadPoolExecutor

    from lazyattn_rag.client import PLANNING_THREADS
    from lazyattn_rag.engine.planning import token_ids

    settings = [(0.005, 1, True), (0.005, PLANNING_THREADS, True), (0.0005, 1, True),
                (0.0005, PLANNING_THREADS, True), (0.0005, PLANNING_THREADS, False)]
    before, min_chars, out = sys.getswitchinterval(), token_ids.RELEASE_GIL_MIN_CHARS, {}
    try:
        for interval, threads, release in settings:
            sys.setswitchinterval(interval)
            token_ids.RELEASE_GIL_MIN_CHARS = min_chars if release else 1 << 62
            latencies: list[float] = []
            with busy_thread(), ThreadPoolExecutor(threads) as pool:
                for i in range(0, len(prompts), burst):  # the last burst may be smaller: every prompt counts
                    start = time.perf_counter()

                    def plan(messages, start=start):
                        engine.plan_plain_chat(messages)
                        return (time.perf_counter() - start) * 1e3

                    latencies += list(pool.map(plan, prompts[i:i + burst]))
            name = f"burst_switch_{interval * 1e3:g}ms_{threads}_threads" + ("" if release else "_gil_kept")
            out[name] = latencies
    finally:
        sys.setswitchinterval(before)
        token_ids.RELEASE_GIL_MIN_CHARS = min_chars
    return out


def planning_ms(engine, prompts: list) -> dict[str, list[float]]:
    """Planning each prompt (``LLMEngine.plan_plain_chat``: tokenizing, the passage learner's
    choice) in this thread, ms, ``alone`` and ``beside_busy_thread`` (another Python thread
    keeps the GIL busy, as a replica's engine thread does between GPU waits); each as the
    planner tokenizes (its encoders' private Rust backends, which keep the GIL) and, for
    comparison in the same run, through the tokenizer's own call (``tokenizer_call_*``)."""
    template = engine.planner.template
    encoders = {template.parsing, template.literal, template.raw}
    backends = {e: e.backend for e in encoders}

    def run() -> list[float]:
        times = []
        for messages in prompts:
            start = time.perf_counter()
            engine.plan_plain_chat(messages)
            times.append((time.perf_counter() - start) * 1e3)
        return times

    out = {}
    for prefix, use_backend in (("", True), ("tokenizer_call_", False)):
        for e in encoders:
            e.backend = backends[e] if use_backend else None  # None: the encoder calls the tokenizer
        out[prefix + "alone"] = run()
        with busy_thread():
            out[prefix + "beside_busy_thread"] = run()
    for e in encoders:
        e.backend = backends[e]
    return out


@app.command()
def main(arch: str = "llama-3.1-8b", device: str = "cuda", dtype: str = "bfloat16", budget_gb: float = 10.0,
         arms: list[str] = typer.Option(list(ARMS)), num_docs: int = 200, doc_tokens: int = 512,
         docs_per_request: int = 5, alpha: float = 2.1, query_tokens: int = 64, output_tokens: int = 32,
         num_requests: int = 800, concurrency: int = 16, max_batched_tokens: int = 16384, seed: int = 0,
         overhead_docs: int = 10_000, overhead_only: bool = False, out: str = "",
         switch_interval_ms: float = typer.Option(0.5, help="ServeConfig.switch_interval_ms of the replica"),
         trace_replica: str = typer.Option("", help="a folder: the replica records its steps, engine commands "
                                           "and loop lags there (benchmarks/replica_trace.py), summed up per arm")
         ) -> None:
    """Run the arms on one trace, measure the per-request overhead, write the JSON."""
    for arm in arms:
        if arm not in ARMS:
            raise typer.BadParameter(f"unknown arm {arm!r}: one of {', '.join(ARMS)}")
    args = dict(arch=arch, device=device, dtype=dtype, budget_gb=budget_gb, max_batched_tokens=max_batched_tokens,
                concurrency=concurrency, trace_replica=trace_replica,
                switch_interval_ms=switch_interval_ms)
    workload = Workload(num_docs, doc_tokens, docs_per_request, alpha, query_tokens, output_tokens, num_requests, seed)
    cost = overhead(workload, overhead_docs, doc_tokens) if overhead_docs else {}
    print({"overhead": cost}, flush=True)
    if overhead_only:
        report(out or f"http_reuse_overhead_{device}", args, workload, cost, [])
        return
    import ray
    from ray import serve

    from tests.redis_server import free_port

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # replicas import benchmarks
    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    for arm in arms:  # the file is written after each arm: a run cut short keeps what it measured
        rows.append(run_arm(arm, args, workload, port))
        report(out or f"http_reuse_{arch}_{device}", args, workload, cost, rows)
    serve.shutdown()
    ray.shutdown()


def report(out: str, args: dict, workload: Workload, cost: dict, rows: list[dict]) -> None:
    """Write the JSON: the environment, the setting, the overhead, the arms and their ratios. An
    arm run more than once (``--arms`` repeated, e.g. interleaved) is summed up by the median of
    its runs' median TTFTs (``ttft_ms_median_by_arm``, each run's in ``ttft_ms_medians_by_arm``)."""
    medians: dict[str, list[float]] = {}
    for r in rows:
        medians.setdefault(r["arm"], []).append(r["ttft_ms_median"])
    ttft = {arm: statistics.median(values) for arm, values in medians.items()}
    ratios = {}
    if "by_id" in ttft:
        ratios = {f"{a}_ttft_vs_by_id": ttft[a] / ttft["by_id"] for a in ttft if a != "by_id"}
    if {"plain_learning_on", "plain_learning_off"} <= set(ttft):
        ratios["learning_off_vs_on_ttft"] = ttft["plain_learning_off"] / ttft["plain_learning_on"]
    print(ratios, flush=True)
    write(out, {"environment": environment(), "command": command_line(), "setting": {**args, **workload.__dict__},
                "overhead": cost, "runs": rows, "ttft_ms_medians_by_arm": medians, "ttft_ms_median_by_arm": ttft,
                "ratios": ratios})


if __name__ == "__main__":
    app()
