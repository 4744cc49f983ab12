"""Storage tiers (issue 17): per document, the time to load its chunk from each tier vs the time
to recompute it, measured side by side in one run on one engine.

For each repeat a fresh random document of ``--doc-tokens`` tokens is encoded alone (the
engine's chunk prefill: a forward pass over the chunk after the anchor, which is what a miss
costs) and its K/V read off the pool and encoded (``engine/tiers/chunk_format.py``). Then, per tier:

* ``read``: copying the gathered K/V to the CPU (what the writer does before encoding for disk
  and Redis); the engine thread only gathers them on the device;
* ``store``: what the writer spends: for ``host``, copying them into the pages of a pinned
  arena (``engine/tiers/host_arena.py``) with their checksum taken on the device; for the others,
  ``read`` + encoding + write;
* ``load``: read + decode + checks (format, model, key, tokens, checksum: XXH3 on the host for
  disk and Redis, ``kv_checksum`` on the device after the copy for host memory) + writing the K/V
  into fresh blocks of the pool (host -> device on a GPU), the device synchronized: exactly
  what a miss served by the tier costs instead of the recompute.

Tiers: ``host`` (process memory), ``disk`` (a directory: ``--disk-dir``, default a temporary
one; the page cache is dropped for the file when ``--cold-disk`` so the read comes from the
device) and ``redis`` (``--redis-url``). The JSON (``benchmarks/results/<out>.json``) holds every
repeat and the medians, the chunk's bytes, and what the engine's load-or-recompute rule
(``LoadCosts``) decides from these speeds.

    python benchmarks/tiers.py --arch smollm2-135m --device cpu --dtype float32 --out tiers_cpu
    python benchmarks/tiers.py --arch llama-3.1-8b --device cuda --dtype bfloat16 --redis-url redis://127.0.0.1:6379
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving_results import command_line, environment, write  # noqa: E402
from benchmarks.serving_setup import ARCHS, Bench, make_engine, release  # noqa: E402
from benchmarks.serving_workload import random_text  # noqa: E402
from lazyattn_rag.engine.tiers.chunk_format import ChunkKV, encode_chunk  # noqa: E402
from lazyattn_rag.engine.tiers.chunk_store import HostMemoryStore  # noqa: E402
from lazyattn_rag.engine.tiers.disk_store import DiskStore  # noqa: E402
from lazyattn_rag.engine.tiers.chunk_tiers import ChunkTiers, LoadCosts  # noqa: E402
from lazyattn_rag.engine.tiers.host_arena import HostArena, copy_to_host, gather_event  # noqa: E402
from lazyattn_rag.engine.scheduling.scheduler_output import ChunkPrefillJob, SchedulerOutput  # noqa: E402

app = typer.Typer(add_completion=False, help=__doc__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device):
    _sync(device)
    start = time.perf_counter()
    value = fn()
    _sync(device)
    return value, time.perf_counter() - start


def _drop_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def measure_document(engine, tiers: ChunkTiers, token_ids: tuple[int, ...], cold_disk: bool) -> dict:
    """One document on the engine thread: recompute, then store and load through each tier."""
    device, runner, cache = engine.runner.device, engine.runner, engine.cache
    blocks = cache.allocate(-(-len(token_ids) // cache.block_size))
    context = engine.scheduler.anchor_context
    job = ChunkPrefillJob("bench", token_ids, len(engine.planner.anchor_ids), blocks, context)
    _, recompute_s = _timed(lambda: runner.execute_step(SchedulerOutput(chunk_prefills=[job])), device)
    keys, values = runner.kv_pool.gather(blocks, len(token_ids))  # as write-back does, on the engine thread
    key = f"bench{time.perf_counter_ns()}"
    chunk = ChunkKV(key, engine.model_digest, token_ids, job.local_start, keys, values)
    host_chunk, read_s = _timed(lambda: copy_to_host(chunk, gather_event(device)), device)
    row = {"recompute_ms": recompute_s * 1e3, "chunk_bytes": len(encode_chunk(host_chunk)), "read_ms": read_s * 1e3}
    for tier in tiers.tiers:  # as the engine's writer stores (chunk_tiers.ChunkTiers._write_loop)
        store = (lambda: tier.put_kv(chunk, gather_event(device))) if tier.name == "host" \
            else (lambda: tier.put(key, encode_chunk(copy_to_host(chunk, gather_event(device)))))
        ok, store_s = _timed(store, device)
        if not ok:
            raise RuntimeError(f"the {tier.name} tier refused a {row['chunk_bytes']}-byte chunk")
        if tier.name == "disk" and cold_disk:
            _drop_page_cache(tier.directory / f"{key}.lakv")
        only = ChunkTiers([tier], engine.model_digest, tiers.costs.bytes_per_token, device=device)
        hit, load_s = _timed(lambda: (h := only.find(key, token_ids)) and runner.kv_pool.write(
            blocks, h.chunk.keys, h.chunk.values) is None and h, device)
        only.close(close_tiers=False)
        if not hit or not torch.equal(runner.kv_pool.read(blocks, len(token_ids))[0], host_chunk.keys):
            raise RuntimeError(f"the {tier.name} tier did not give the chunk back bit-identical")
        tier.delete(key)
        row[f"{tier.name}_store_ms"], row[f"{tier.name}_load_ms"] = store_s * 1e3, load_s * 1e3
    cache.pool.decref(blocks)
    return row


@app.command()
def main(arch: str = "smollm2-135m", device: str = "cpu", dtype: str = "float32", doc_tokens: int = 512,
         repeats: int = 5, num_layers: int = 0, disk_dir: str = "", cold_disk: bool = False, redis_url: str = "",
         out: str = "") -> None:
    """Time recompute vs load per tier for ``repeats`` fresh documents (``--num-layers N`` keeps the
    first N layers of ``--arch``: load and recompute both scale with the layer count)."""
    if num_layers:
        ARCHS[arch] = (ARCHS[arch][0], {**ARCHS[arch][1], "num_hidden_layers": num_layers})
    bench = Bench.build(arch, device, dtype)
    llm = make_engine(bench, "lazy", 4 << 30 if device.startswith("cuda") else 1 << 30, device, 16384, 16)
    directory = Path(disk_dir or tempfile.mkdtemp(prefix="lazyattn-tiers-"))
    arena = HostArena(4 << 30, llm.block_bytes // 2, pin=device.startswith("cuda"))  # as engine/factory.py
    stores = [HostMemoryStore(arena.capacity_bytes, arena=arena), DiskStore(directory, 1 << 40)]
    if redis_url:
        from lazyattn_rag.engine.tiers.redis_store import RedisStore

        stores.append(RedisStore(redis_url, socket_timeout_s=30.0))
    bytes_per_token = llm.block_bytes // llm.engine.block_size
    tiers = ChunkTiers(stores, llm.engine.model_digest, bytes_per_token)
    rng = np.random.default_rng(0)
    rows = []
    for r in range(repeats + 1):  # the first is a warm-up (allocations, kernels), not recorded
        ids = tuple(llm.tokenizer(random_text(rng, doc_tokens), add_special_tokens=False).input_ids)
        row = llm.client.call(lambda engine: measure_document(engine, tiers, ids, cold_disk))
        print(row, flush=True)
        if r:
            rows.append(row)
    tiers.close()
    release(llm)
    medians = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    costs = LoadCosts(bytes_per_token)
    costs.record_prefill(doc_tokens, medians["recompute_ms"] / 1e3)
    decisions = {}
    for tier in stores:
        costs.record_load(tier.name, medians["chunk_bytes"], medians[f"{tier.name}_load_ms"] / 1e3)
        decisions[tier.name] = {"load_over_recompute": medians[f"{tier.name}_load_ms"] / medians["recompute_ms"],
                                "engine_loads": costs.worth_loading(tier.name, doc_tokens),
                                "load_gb_per_s": medians["chunk_bytes"] / medians[f"{tier.name}_load_ms"] / 1e6}
    write(out or f"tiers_{arch}_{device}", {
        "environment": environment(), "command": command_line(), "arch": arch, "num_layers": bench.model.config.num_layers,
        "dtype": dtype, "doc_tokens": doc_tokens, "cold_disk": cold_disk, "medians": medians, "decisions": decisions,
        "runs": rows})


if __name__ == "__main__":
    app()
