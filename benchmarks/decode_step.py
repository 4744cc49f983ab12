"""Decode steps and full prefill against the hardware limit, eager vs ``torch_compile`` (issue 19).

Side by side in one run, on random weights of a real shape:

* **limits**, measured here: copy bandwidth (a 2 GiB device-to-device copy, bytes read +
  written over time), bf16 matrix-product FLOP/s (the MLP's up product over 8192 rows) and
  cuDNN's causal attention FLOP/s at the prefill length (SDPA, K/V expanded to all heads);
* **decode step** at each ``BxL`` (B sequences of L context tokens, one new token each) for
  each mode: the runner's step as the engine calls it (host input preparation + CUDA-graph
  replay, waited for), and the graph replay alone (device time). The bytes a step must move:
  every weight but the input embedding (the lm_head reads its own) + the K/V of the context;
  limit = bytes / copy bandwidth;
* **full prefill** of ``--prefill-tokens`` tokens (one sequence, logits of the last token).
  FLOPs: 2 x tokens x the layers' linear weights + 2 x the lm_head (one row) + causal attention
  (2 products x 2 x heads x head_dim x L(L+1)/2 per layer); limit = matrix FLOPs / measured
  matrix FLOP/s + attention FLOPs / cuDNN's FLOP/s;
* **profiles** (``--profile``): device ms by part (matrix products, attention, other kernels) of
  batch-1 decode steps at ``--profile-context`` and of one full prefill, each mode;
* **engine decode** (``--engine``): one request of ``L`` prompt tokens through the whole
  engine (scheduling, sampling, detokenizing), median decode step over 64 output tokens.

    python benchmarks/decode_step.py --arch llama-3.1-8b --out decode_step_h200

Writes ``benchmarks/results/<out>.json``; write-up in docs/benchmarks.md ("GPU: decode steps and
prefill against the hardware limit"). ``--device cpu --arch tiny`` checks the plumbing only.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import typer

from benchmarks.serving_results import command_line, environment, write
from benchmarks.serving_setup import ARCHS, Bench, make_engine, random_model, release, word_tokenizer
from benchmarks.serving_timing import StepTally, top_device_kernels
from benchmarks.serving_workload import random_text
from lazyattn_rag import SamplingParams
from lazyattn_rag.engine.worker.attention import SequenceInput
from lazyattn_rag.engine.factory import _make_backend
from lazyattn_rag.engine.kv.kv_layout import KVLayout
from lazyattn_rag.engine.worker.runner import ModelRunner
from lazyattn_rag.kernels.block_table import pack_entries

app = typer.Typer(add_completion=False, help=__doc__)
BLOCK = 16
MODES = {"eager": False, "compiled": True}


def timed_ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall ms of ``fn()`` waited for on ``device`` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_ms(fn) -> float:
    """Median device ms of ``fn`` (``triton.testing.do_bench``: L2 flushed between calls)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def limits(model, device: torch.device, prefill_tokens: int) -> dict:
    """Copy GB/s, bf16 matrix-product TFLOP/s and cuDNN causal attention TFLOP/s, measured here."""
    if device.type != "cuda":
        return {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg, dtype = model.config, model.lm_head.weight.dtype
    a = torch.empty(1024**2, 1024, device=device, dtype=dtype).normal_()  # 2 GiB of bf16
    b = torch.empty_like(a)
    copy_ms = device_ms(lambda: b.copy_(a))
    copy_gbps = 2 * a.numel() * a.element_size() / copy_ms / 1e6
    del a, b
    x = torch.randn(8192, cfg.hidden_size, device=device, dtype=dtype)
    w = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size, device=device, dtype=dtype)
    mm_ms = device_ms(lambda: x @ w.T)
    mm_tflops = 2 * x.shape[0] * w.numel() / mm_ms / 1e9
    q = torch.randn(1, cfg.num_heads, prefill_tokens, cfg.head_dim, device=device, dtype=dtype)
    k, v = torch.randn_like(q), torch.randn_like(q)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        attn_ms = device_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    return {"copy_GBps": copy_gbps, "mm_TFLOPs": mm_tflops, "mm_shape": [8192, cfg.hidden_size, w.shape[0]],
            "cudnn_attention_TFLOPs": attention_flops(cfg, prefill_tokens) / cfg.num_layers / attn_ms / 1e9}


def attention_flops(cfg, tokens: int) -> float:
    """Causal attention FLOPs of a full prefill over all layers (QK^T and PV)."""
    return cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2


def weight_bytes(model) -> tuple[int, int]:
    """(bytes a decode step reads: every weight but the input embedding, unless tied; the layers'
    linear weights' element count)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if embed is not model.lm_head.weight:
        total -= embed.numel() * embed.element_size()
    linear = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2)
    return total, linear


def runner_for(model, device, num_tokens: int, compiled: bool) -> ModelRunner:
    layout = KVLayout.for_model(model.config, BLOCK, model.lm_head.weight.dtype)
    runner = ModelRunner(model, _make_backend("auto", device, model), layout, -(-num_tokens // BLOCK) + 1, device)
    for key_cache, value_cache in runner.kv_pool.layers:  # random context K/V (values do not change the time)
        key_cache.normal_()
        value_cache.normal_()
    if compiled:
        runner.enable_torch_compile()
    return runner


def decode_seqs(batch: int, context: int) -> list[SequenceInput]:
    """``batch`` sequences of ``context`` tokens, the last one new, in consecutive blocks."""
    nb, seqs = -(-context // BLOCK), []
    for i in range(batch):
        entries = [(i * nb + j, 0, min(BLOCK, context - j * BLOCK)) for j in range(nb)]
        last = entries[-1]
        seqs.append(SequenceInput([7], [context - 1], pack_entries(entries), context,
                                  [last[0] * BLOCK + last[2] - 1]))
    return seqs


def bench_decode(model, device, batch: int, context: int, compiled: bool, repeats: int, kv_elem: int) -> dict:
    runner = runner_for(model, device, batch * context, compiled)
    seqs = decode_seqs(batch, context)
    cfg = model.config
    t0 = time.perf_counter()
    if device.type == "cuda":
        runner.enable_cuda_graphs([batch], -(-context // BLOCK) + 1)
    row = {"batch": batch, "context": context, "capture_s": time.perf_counter() - t0,
           "step_ms": timed_ms(lambda: runner.execute(seqs), device, repeats)}
    if device.type == "cuda":
        row["graph_replay_ms"] = device_ms(runner.graphs.graphs[batch].replay)
    row["kv_bytes"] = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_elem
    runner.close()
    return row


def prefill_seq(model, tokens: int) -> SequenceInput:
    """One sequence of ``tokens`` random ids computed whole, in blocks ``0 .. tokens / 16``."""
    nb = -(-tokens // BLOCK)
    entries = [(j, 0, min(BLOCK, tokens - j * BLOCK)) for j in range(nb)]
    ids = np.random.default_rng(0).integers(10, min(30000, model.config.vocab_size), tokens).tolist()
    return SequenceInput(ids, list(range(tokens)), pack_entries(entries), tokens, list(range(tokens)))


def bench_prefill(model, device, tokens: int, compiled: bool, repeats: int) -> dict:
    runner = runner_for(model, device, tokens, compiled)
    seq = prefill_seq(model, tokens)
    t0 = time.perf_counter()
    runner.execute([seq])  # compiles (compiled mode)
    sync(device)
    row = {"tokens": tokens, "first_call_s": time.perf_counter() - t0,
           "ms": timed_ms(lambda: runner.execute([seq]), device, repeats)}
    runner.close()
    return row


def profile_decode(model, device, batch: int, context: int, compiled: bool) -> dict:
    """Kernels of 3 eager (not graph-replayed) decode steps: count per step, the top 12 ops by device
    time, and every kernel name with its launches per step and mean device microseconds."""
    from torch.profiler import ProfilerActivity, profile

    runner = runner_for(model, device, batch * context, compiled)
    seqs = decode_seqs(batch, context)
    runner.execute(seqs)
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            runner.execute(seqs)
        sync(device)
    runner.close()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    top, _ = top_device_kernels(prof, 12)
    busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3  # kernels only: an op's self time repeats its kernels'
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    launches = {name: {"per_step": len(us) / 3, "us_each": sum(us) / len(us)}
                for name, us in sorted(by_name.items(), key=lambda kv: -len(kv[1]))}
    return {"batch": batch, "context": context, "kernels_per_step": len(kernels) / 3,
            "device_busy_ms_per_step": busy_ms / 3, "ms_per_step_by_part": kernel_parts(kernels, 3), "top": top,
            "kernels": launches}


def kernel_parts(kernels, num_calls: int) -> dict:
    """Device ms per call of each part: ``matrix`` (cuBLAS / CUTLASS products and the one-row
    ``gemv_kernel``, which ``decode_step_ab_gemv_h200.json`` still counts under ``other``), ``attention``
    (the paged kernels and their split reduction), ``other`` (everything else: the elementwise,
    norm and copy kernels), by kernel name."""
    parts = {"matrix": 0.0, "attention": 0.0, "other": 0.0}
    for e in kernels:
        name = e.name.lower()
        part = ("attention" if name.startswith(("prefill_kernel", "decode_kernel", "decode_reduce_kernel")) else
                "matrix" if any(k in name for k in ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas")) else "other")
        parts[part] += e.time_range.elapsed_us() / 1e3 / num_calls
    return parts


def profile_prefill(model, device, tokens: int, compiled: bool) -> dict:
    """Kernels of one full prefill of ``tokens`` tokens (after a warm-up call): device ms by part."""
    from torch.profiler import ProfilerActivity, profile

    runner = runner_for(model, device, tokens, compiled)
    seq = prefill_seq(model, tokens)
    runner.execute([seq])
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.execute([seq])
        sync(device)
    runner.close()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    top, _ = top_device_kernels(prof, 12)
    return {"tokens": tokens, "num_kernels": len(kernels), "ms_by_part": kernel_parts(kernels, 1),
            "device_busy_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3, "top": top}


def bench_engine(bench: Bench, device: str, context: int, compiled: bool) -> dict:
    """Median decode step (and TTFT) of one request of ``context`` prompt tokens through the engine."""
    budget = 2 * (context + 128) * bench.model.config.num_layers * 2 * bench.model.config.num_kv_heads \
        * bench.model.config.head_dim * bench.model.lm_head.weight.element_size()
    t0 = time.perf_counter()
    llm = make_engine(bench, "full", budget, device, 16384, 8, torch_compile=compiled)
    setup_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=65, ignore_eos=True)
    llm.generate(random_text(rng, 512), [], sampling=SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    tally = StepTally()
    remove = llm.add_step_listener(tally)
    res = llm.generate(random_text(rng, context - 8), [], sampling=params)
    remove()
    host = engine_host_profile(llm, random_text(rng, context - 8), params)
    release(llm)
    return {"context": context, "setup_s": setup_s, "ttft_ms": res.stats.ttft_ms, "tpot_ms": res.stats.tpot_ms,
            "decode_step_ms_median": tally.summary()["decode"]["median_ms"], "host_profile": host}


def engine_host_profile(llm, prompt: str, params: SamplingParams, top: int = 25) -> dict:
    """cProfile of the engine thread over one request's decode steps (after its first token):
    the functions with the most own time, per decode step (cProfile slows Python-heavy code, so
    these are shares, not the timed figures)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    tokens = iter(llm.stream(prompt, [], sampling=params))
    next(tokens)  # the prefill step is not profiled
    llm.loop.call(prof.enable)
    num_steps = sum(1 for _ in tokens)
    llm.loop.call(prof.disable)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    total_s = sum(v[2] for v in stats.values())
    return {"num_steps": num_steps, "profiled_ms_per_step": 1e3 * total_s / max(num_steps, 1),
            "top_own_time": [{"function": f"{f.rsplit('/', 2)[-1]}:{line}({name})", "calls": v[0],
                              "own_ms_per_step": 1e3 * v[2] / max(num_steps, 1),
                              "cum_ms_per_step": 1e3 * v[3] / max(num_steps, 1)}
                             for (f, line, name), v in rows]}


@app.command()
def main(arch: str = "llama-3.1-8b", device: str = "cuda", dtype: str = "bfloat16",
         shapes: list[str] = typer.Option(["1x20480", "32x8192"], help="decode shapes BxL"),
         prefill_tokens: int = 20480, repeats: int = 20, engine: bool = True, profile: bool = True,
         profile_context: int = typer.Option(2048, help="context of the profiled batch-1 decode steps"),
         modes: list[str] = typer.Option(list(MODES), help="eager and/or compiled"),
         prefill: bool = typer.Option(True, help="time (and profile) the full prefill too"),
         out: str = "decode_step") -> None:
    """Decode steps and full prefill, eager vs compiled, against limits measured in the same run."""
    if arch not in ARCHS:
        raise typer.BadParameter(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if not modes or set(modes) - set(MODES):
        raise typer.BadParameter(f"--modes takes {' and/or '.join(MODES)}, got {modes}")
    run_modes = {m: c for m, c in MODES.items() if m in modes}
    model = random_model(arch, torch.device(device), getattr(torch, dtype))
    # a fixed fingerprint instead of hashing the weights (the engine runs compute; nothing is shared)
    bench, dev = Bench(model, word_tokenizer(model.config.vocab_size), f"random-{arch}-{dtype}"), torch.device(device)
    results = {"environment": environment(), "command": command_line(), "arch": arch, "dtype": dtype}
    results["limits"] = lims = limits(model, dev, prefill_tokens)
    wbytes, linear = weight_bytes(model)
    elem = model.lm_head.weight.element_size()
    results["weight_bytes"] = wbytes
    flops = {"matrix": 2 * prefill_tokens * linear + 2 * model.config.hidden_size * model.config.vocab_size,
             "attention": attention_flops(model.config, prefill_tokens)}
    results["prefill_flops"] = flops
    rows = []
    for shape in shapes:
        batch, context = (int(v) for v in shape.split("x"))
        for mode, compiled in run_modes.items():
            row = {"mode": mode, **bench_decode(model, dev, batch, context, compiled, repeats, elem)}
            if lims:
                row["limit_ms"] = (wbytes + row["kv_bytes"]) / lims["copy_GBps"] / 1e6
                row["step_over_limit"] = row["step_ms"] / row["limit_ms"]
                row["replay_over_limit"] = row["graph_replay_ms"] / row["limit_ms"]
            rows.append(row)
            print(row, flush=True)
    results["decode"] = rows
    results["prefill"] = []
    for mode, compiled in run_modes.items() if prefill else ():
        row = {"mode": mode, **bench_prefill(model, dev, prefill_tokens, compiled, max(3, repeats // 5))}
        if lims:
            row["limit_ms"] = flops["matrix"] / lims["mm_TFLOPs"] / 1e9 + flops["attention"] / \
                lims["cudnn_attention_TFLOPs"] / 1e9
            row["over_limit"] = row["ms"] / row["limit_ms"]
        results["prefill"].append(row)
        print(row, flush=True)
    if profile:
        results["profile"] = {mode: profile_decode(model, dev, 1, profile_context, compiled)
                              for mode, compiled in run_modes.items()}
        results["prefill_profile"] = {mode: profile_prefill(model, dev, prefill_tokens, compiled)
                                      for mode, compiled in run_modes.items() if prefill}
        print({"decode": {m: p["ms_per_step_by_part"] for m, p in results["profile"].items()},
               "prefill": {m: p["ms_by_part"] for m, p in results["prefill_profile"].items()}}, flush=True)
    if engine:
        results["engine"] = [{"mode": mode, **bench_engine(bench, device, prefill_tokens, compiled)}
                             for mode, compiled in run_modes.items()]
        print([{k: v for k, v in row.items() if k != "host_profile"} for row in results["engine"]], flush=True)
    write(out, results)


if __name__ == "__main__":
    app()
