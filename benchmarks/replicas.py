"""Replicas on Ray Serve (issue 18): the serving benchmark's Zipf RAG trace through ``lazyattn
serve``'s HTTP API, one replica against two replicas with Ray Serve's default router and with
document affinity, at one KV budget per replica.

Each configuration is a fresh Serve application (replicas of a random-weight model of
``--arch``'s shapes, one GPU each on a GPU machine, ``lazy`` mode, the KV budget ``--budget-gb``
per replica). The documents are registered, a warm-up request runs on every replica, then the
trace is driven closed-loop (``--concurrency`` requests in flight) with streamed answers: TTFT is
the first content chunk, as a client sees it. Per configuration: request and output-token
throughput, TTFT median and p99, each replica's document hit ratio (placements it served from
cache over its placements), and duplicate copies (documents computed on more than one replica:
each extra computation is a copy that the KV budget holds twice).

    python benchmarks/replicas.py --arch llama-3.1-8b --device cuda --budget-gb 10 --out replicas_h200x2
    python benchmarks/replicas.py --arch tiny --device cpu --dtype float32 --budget-gb 0.01 --num-requests 60 \\
        --doc-tokens 64 --query-tokens 8 --output-tokens 8 --out replicas_cpu_tiny   # plumbing check, not a speed

JSON: ``benchmarks/results/<out>.json``; write-up: docs/benchmarks.md ("Replicas on Ray Serve").
"""

from __future__ import annotations

import asyncio
import functools
import json
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


def replica_engine(arch: str, device: str, dtype: str, budget_bytes: int, max_batched: int, max_seqs: int):
    """Runs in a replica: its engine over a random-weight model of ``arch`` (the serving benchmark's)."""
    from benchmarks.serving_setup import Bench, make_engine

    return make_engine(Bench.build(arch, device, dtype), "lazy", budget_bytes, device, max_batched, max_seqs)


async def one_request(http, question: str, doc_ids: list[str], output_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "documents": doc_ids, "max_tokens": output_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    start, first, final = time.perf_counter(), None, None
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            if first is None and delta.get("content"):
                first = time.perf_counter()
            if "lazyattn" in chunk:
                final = chunk["lazyattn"]
    end = time.perf_counter()
    return {"ttft_ms": ((first or end) - start) * 1e3, "e2e_ms": (end - start) * 1e3, "replica": final["replica"],
            "docs_hit": final["stats"]["docs_hit"], "docs_missed": final["stats"]["docs_missed"],
            "num_output_tokens": final["stats"]["num_output_tokens"]}


async def drive(base_url: str, requests, output_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    import httpx

    queue = list(enumerate(requests))
    results: list[dict | None] = [None] * len(requests)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=concurrency)) \
            as http:
        async def worker():
            while queue:
                i, (question, doc_ids) = queue.pop(0)
                results[i] = await one_request(http, question, doc_ids, output_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def summarize(results: list[dict], wall_s: float) -> dict:
    ttfts = sorted(r["ttft_ms"] for r in results)
    per_replica: dict[str, dict] = {}
    computed_on: dict[str, set] = {}
    for r in results:
        rep = per_replica.setdefault(r["replica"], {"num_requests": 0, "docs_hit": 0, "docs_missed": 0})
        rep["num_requests"] += 1
        rep["docs_hit"] += len(r["docs_hit"])
        rep["docs_missed"] += len(r["docs_missed"])
        for d in r["docs_missed"]:
            computed_on.setdefault(d, set()).add(r["replica"])
    for rep in per_replica.values():
        rep["doc_hit_ratio"] = rep["docs_hit"] / max(1, rep["docs_hit"] + rep["docs_missed"])
    hits = sum(r["docs_hit"] for r in per_replica.values())
    placements = hits + sum(r["docs_missed"] for r in per_replica.values())
    return {"num_requests": len(results), "wall_s": wall_s, "request_throughput_per_s": len(results) / wall_s,
            "output_token_throughput_per_s": sum(r["num_output_tokens"] for r in results) / wall_s,
            "ttft_ms_median": statistics.median(ttfts), "ttft_ms_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "doc_hit_ratio": hits / max(1, placements), "per_replica": per_replica,
            "docs_computed": len(computed_on), "duplicate_copies": sum(len(s) - 1 for s in computed_on.values())}


def run_config(num_replicas: int, router: str, args: dict, workload: Workload, port: int) -> dict:
    import httpx
    from ray import serve

    from lazyattn_rag.serve import ServeConfig, build_app

    gpus = 1.0 if args["device"].startswith("cuda") else 0.0
    build = functools.partial(replica_engine, args["arch"], args["device"], args["dtype"],
                              int(args["budget_gb"] * 2**30), args["max_batched_tokens"], args["concurrency"])
    config = ServeConfig(num_replicas=num_replicas, num_gpus_per_replica=gpus, num_cpus_per_replica=0, router=router,
                         imbalanced_threshold=args["imbalanced_threshold"], max_ongoing_requests=args["concurrency"],
                         port=port, max_body_bytes=64 << 20)
    start = time.perf_counter()
    serve.run(build_app(None, config, build), name="bench", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    docs = workload.documents()
    with httpx.Client(base_url=base, timeout=600) as http:
        items = list(docs.items())
        for i in range(0, len(items), 50):
            response = http.post("/v1/documents", json={"documents": [{"id": k, "text": v} for k, v in items[i:i + 50]]})
            response.raise_for_status()
    setup_s = time.perf_counter() - start
    warm = [(q, []) for q, _ in workload.requests()[: 2 * num_replicas]]  # no documents: every replica warms up
    asyncio.run(drive(base, warm, 2, num_replicas))
    results, wall = asyncio.run(drive(base, workload.requests(), workload.output_tokens, args["concurrency"]))
    serve.delete("bench")
    row = {"num_replicas": num_replicas, "router": router, "setup_s": setup_s, **summarize(results, wall)}
    print(json.dumps({k: v for k, v in row.items() if k != "per_replica"}), flush=True)
    return row


@app.command()
def main(arch: str = "llama-3.1-8b", device: str = "cuda", dtype: str = "bfloat16", budget_gb: float = 10.0,
         configs: list[str] = typer.Option(["1:affinity", "2:default", "2:affinity"]),
         num_docs: int = 200, doc_tokens: int = 512, docs_per_request: int = 5, alpha: float = 2.1,
         query_tokens: int = 64, output_tokens: int = 32, num_requests: int = 400, concurrency: int = 32,
         max_batched_tokens: int = 16384, imbalanced_threshold: int = 8, seed: int = 0, out: str = "") -> None:
    """Run each ``--configs`` entry (``REPLICAS:ROUTER``) on the same trace and write the JSON."""
    import ray
    from ray import serve

    from tests.redis_server import free_port

    args = dict(arch=arch, device=device, dtype=dtype, budget_gb=budget_gb, max_batched_tokens=max_batched_tokens,
                concurrency=concurrency, imbalanced_threshold=imbalanced_threshold)
    workload = Workload(num_docs, doc_tokens, docs_per_request, alpha, query_tokens, output_tokens, num_requests, seed)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # replicas import benchmarks
    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    for spec in configs:
        replicas, router = spec.split(":")
        rows.append(run_config(int(replicas), router, args, workload, port))
    serve.shutdown()
    ray.shutdown()
    base = rows[0]
    for row in rows:
        row["throughput_vs_first"] = row["request_throughput_per_s"] / base["request_throughput_per_s"]
    write(out or f"replicas_{arch}_{device}", {
        "environment": environment(), "command": command_line(), "setting": {**args, **workload.__dict__},
        "runs": rows})


if __name__ == "__main__":
    app()
