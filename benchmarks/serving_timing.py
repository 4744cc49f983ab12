"""The serving benchmark's timed runs: a fresh warmed-up engine per run, a request trace driven
through it (closed loop or Poisson arrivals), its summary metrics, and the engine's steps
classified and tallied by kind; the micro-benchmark's single request timed step by step."""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np

from benchmarks.serving_setup import Bench, make_engine
from benchmarks.serving_workload import Workload, random_text
from lazyattn_rag import AsyncLazyAttention, SamplingParams
from lazyattn_rag.llm import LazyAttention


async def drive(llm: LazyAttention, requests, params: SamplingParams, concurrency: int | None, rate: float | None,
                seed: int) -> tuple[list, float]:
    """Run the trace: closed loop with ``concurrency`` in flight, or Poisson arrivals at ``rate`` req/s."""
    allm = AsyncLazyAttention(llm)
    results = [None] * len(requests)
    rng = np.random.default_rng(seed)

    async def one(i):
        q, ids = requests[i]
        results[i] = await allm.generate(q, ids, sampling=params)

    start = time.perf_counter()
    if rate is None:
        sem = asyncio.Semaphore(concurrency)

        async def gated(i):
            async with sem:
                await one(i)

        await asyncio.gather(*(gated(i) for i in range(len(requests))))
    else:
        tasks = []
        for i in range(len(requests)):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def summarize(results, wall_s: float, before: dict, after: dict, block_bytes: int) -> dict:
    """A run's latency, throughput, cache hits and KV use from its results and the engine's
    ``stats()`` ``before`` and ``after`` it."""
    ttft = [r.stats.ttft_ms for r in results]
    tpot = [r.stats.tpot_ms for r in results if r.stats.tpot_ms is not None]
    out_tokens = sum(r.stats.num_output_tokens for r in results)
    prompt_tokens = sum(r.stats.num_prompt_tokens for r in results)
    lookups = sum(len(r.stats.docs_hit) + len(r.stats.docs_missed) for r in results)
    return {
        "num_requests": len(results),
        "wall_s": wall_s,
        "ttft_ms_median": statistics.median(ttft),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "tpot_ms_median": statistics.median(tpot) if tpot else None,
        "request_throughput_per_s": len(results) / wall_s,
        "output_token_throughput_per_s": out_tokens / wall_s,
        "total_token_throughput_per_s": (out_tokens + prompt_tokens) / wall_s,
        "doc_hit_ratio": sum(len(r.stats.docs_hit) for r in results) / max(1, lookups),
        "token_hit_ratio": sum(r.stats.num_cached_tokens for r in results) / max(1, prompt_tokens),
        "kv_cached_bytes": after["num_blocks_cached"] * block_bytes,
        "kv_budget_bytes": after["num_blocks_total"] * block_bytes,
        "num_evictions": after["num_evictions"] - before["num_evictions"],
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
    }


def warm_up(llm: LazyAttention, workload: Workload) -> None:
    """Compile kernels on throwaway documents (removed afterwards so the cache starts cold)."""
    rng = np.random.default_rng(123)
    ids = []
    for i in range(3):
        ids.append(f"warm{i}")
        llm.add_document(ids[-1], random_text(rng, workload.doc_tokens))
    q = " ".join(["t5"] * workload.query_tokens)
    for n in (1, 3):
        llm.generate(q, ids[:n], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    asyncio.run(drive(llm, [(q, ids[:2])] * 8, SamplingParams(max_tokens=4, ignore_eos=True), 8, None, 0))
    for d in ids:
        llm.remove_document(d)


def ready_engine(bench: Bench, mode: str, budget_bytes: int, device: str, max_batched: int, max_seqs: int,
                 workload: Workload, docs: dict[str, str], cuda_graphs: bool = True,
                 prefill_with_encodes: bool = True, host_memory_bytes: int = 0,
                 torch_compile: bool = False) -> tuple[LazyAttention, dict]:
    """A fresh engine for one timed run: built, warmed up, the trace's documents registered
    (not encoded: the cache starts cold). Returns it and its set-up time in seconds, in parts
    (``engine_s``: build incl. KV allocation and CUDA-graph capture; ``warm_up_s``)."""
    t0 = time.perf_counter()
    llm = make_engine(bench, mode, budget_bytes, device, max_batched, max_seqs, cuda_graphs=cuda_graphs,
                      prefill_with_encodes=prefill_with_encodes, host_memory_bytes=host_memory_bytes,
                      torch_compile=torch_compile)
    t1 = time.perf_counter()
    warm_up(llm, workload)
    t2 = time.perf_counter()
    llm.add_documents(list(docs.items()))
    return llm, {"setup_s": time.perf_counter() - t0, "engine_s": t1 - t0, "warm_up_s": t2 - t1}


def timed_run(llm: LazyAttention, requests, params: SamplingParams, concurrency: int | None, rate: float | None,
              seed: int) -> dict:
    """Drive the trace through ``llm`` and summarize it, with the engine's steps tallied by kind."""
    before, tally = llm.stats(), StepTally()
    remove = llm.add_step_listener(tally)
    results, wall = asyncio.run(drive(llm, requests, params, concurrency, rate, seed))
    remove()
    after = llm.stats()
    row = {**summarize(results, wall, before, after, llm.block_bytes), "steps": tally.summary()}
    if after["tiers"]:  # what the storage tiers did (cumulative since the engine started: the warm-up too)
        counts = ("num_hits", "num_misses", "num_puts", "num_evictions", "num_errors", "num_corrupt")
        row["tiers"] = {name: {k: t[k] for k in counts} for name, t in after["tiers"].items()}
        row["num_tier_writes_dropped"] = after["num_tier_writes_dropped"]
    return row


def _classify(step) -> tuple[str, float, int]:
    """Name a step (a ``StepResult``) by what it computed: encode/copy (document processing),
    encode+prefill (both in one step), prefill or decode."""
    out, seconds = step.output, step.seconds
    if out.chunk_prefills and any(c.num_tokens > 1 for c in out.computes):
        return "encode+prefill", seconds, sum(len(e.token_ids) for e in out.chunk_prefills) + sum(
            c.num_tokens for c in out.computes)
    if out.chunk_prefills:
        return "encode", seconds, sum(len(e.token_ids) for e in out.chunk_prefills)
    if out.copies and not out.computes:
        return "copy", seconds, sum(c.num_tokens for c in out.copies)
    tokens = sum(c.num_tokens for c in out.computes)
    return ("decode" if all(c.num_tokens == 1 for c in out.computes) else "prefill"), seconds, tokens


class StepTally:
    """Engine step listener: how many steps of each kind (see :func:`_classify`) ran, their total,
    median and longest time, and the tokens they computed; where a run's time went."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = {}
        self.tokens: dict[str, int] = {}

    def __call__(self, step) -> None:
        kind, seconds, tokens = _classify(step)
        self.seconds.setdefault(kind, []).append(seconds)
        self.tokens[kind] = self.tokens.get(kind, 0) + tokens

    def summary(self) -> dict:
        return {kind: {"num_steps": len(s), "total_s": sum(s), "median_ms": 1e3 * statistics.median(s),
                       "max_ms": 1e3 * max(s), "num_tokens": self.tokens[kind]}
                for kind, s in sorted(self.seconds.items())}


def three_hot(llm: LazyAttention, ids: list[str], text, doc_tokens: int, query_tokens: int) -> None:
    """Add fresh documents ``ids`` and make the first 3 hot (cached by a request at the same offsets);
    ``text(n)`` gives ``n`` tokens of text."""
    llm.add_documents([(d, text(doc_tokens)) for d in ids])
    llm.generate(text(query_tokens), ids[:3], sampling=SamplingParams(max_tokens=1))


def micro_request(llm: LazyAttention, ids: list[str], text, doc_tokens: int, query_tokens: int, output_tokens: int):
    """Add 5 fresh documents, make the first 3 hot, then time a request over all 5 step by step.
    Returns its result and its steps as ``(kind, seconds, tokens)``."""
    three_hot(llm, ids, text, doc_tokens, query_tokens)
    steps = []
    remove = llm.add_step_listener(lambda step: steps.append(_classify(step)))
    res = llm.generate(text(query_tokens), ids, sampling=SamplingParams(max_tokens=output_tokens, ignore_eos=True))
    remove()  # waits for the last step's listeners, which run after its token was streamed
    return res, steps


def micro_times(res, steps: list[tuple[str, float, int]], merged: bool) -> dict:
    """The micro request's times from its result and steps: on an engine that encodes and
    prefills in one step (``merged``: ``ttft_ms``, decode time), else with document processing
    and query prefill apart (``doc_processing_ms``, ``query_prefill_ms``); and its first 6 steps."""
    def ms(*kinds: str) -> float:
        return 1e3 * sum(s for kind, s, _ in steps if kind in kinds)

    first_steps = [(k, round(1e3 * s, 3), n) for k, s, n in steps[:6]]
    if merged:
        decode = [s for kind, s, _ in steps if kind == "decode"]
        return {"ttft_ms": res.stats.ttft_ms, "computed_prompt_tokens": res.stats.num_computed_tokens,
                "decode_ms_per_token": 1e3 * statistics.median(decode) if decode else None,
                "steps_merged": first_steps}
    return {"ttft_two_steps_ms": res.stats.ttft_ms, "doc_processing_ms": ms("encode", "copy"),
            "query_prefill_ms": ms("prefill"), "steps_two_steps": first_steps}


def top_device_kernels(prof, top: int) -> tuple[list[dict], float]:
    """torch.profiler's ``top`` events by device time, and the device's busy time (all self times) in ms."""
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    rows = [{"name": e.key[:120], "calls": e.count, "device_ms": e.device_time_total / 1e3,
             "self_device_ms": e.self_device_time_total / 1e3} for e in events[:top]]
    return rows, sum(e.self_device_time_total for e in events) / 1e3
