"""Serving benchmark: lazy (ours) vs block_attention, prefix and full recompute, in one engine.

Every mode runs on the same model weights, the same request trace and the same KV budget;
only ``CacheConfig.mode`` differs (see ``lazyattn_rag/types/config.py``). Models are random-weight
configs of real shapes (speed does not depend on weight values). Before any timing the
``check`` step verifies that modes computing the same function agree on a fixed set of
requests (first-token logits within the bf16 tolerance of the kernel tests): ``lazy`` with
``block_attention``, ``prefix`` with ``full``; a disagreement aborts the run.

Commands (each writes JSON to benchmarks/results/<name>.json, replacing a file of that name;
``--out NAME`` picks the name, ``--out PATH.json`` any file):

    python benchmarks/serving.py micro --arch llama-3.1-8b        # 5 docs x 4096 + 64-token query, 3 hot
    python benchmarks/serving.py sweep --arch llama-3.1-8b --alpha 2.1 --budget-gb 1 --budget-gb 10 --budget-gb 50
    python benchmarks/serving.py rates --arch llama-3.1-8b --rate 1 --rate 2 --rate 4 --rate 8 --rate 16
    python benchmarks/serving.py profile --arch llama-3.1-8b       # where one micro request's time goes
    python benchmarks/serving.py cpu                               # SmolLM2 on the CPU vs transformers

The parts: model and engines in ``serving_setup``, the trace in ``serving_workload``, the
equivalence gate in ``serving_equivalence``, timed runs in ``serving_timing``, the JSON files in
``serving_results``; figures and their conditions in docs/benchmarks.md ("Serving").
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks.*`` (and ``tests.kernel_tolerances``) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
import typer

from benchmarks.serving_equivalence import check_equivalence
from benchmarks.serving_results import cell_medians, command_line, environment, resumed, write, write_runs
from benchmarks.serving_setup import MODES, Bench, make_engine, mode_cache_settings, release
from benchmarks.serving_timing import (micro_request, micro_times, ready_engine, three_hot, timed_run,
                                       top_device_kernels, warm_up)
from benchmarks.serving_workload import Workload, random_text
from lazyattn_rag import CacheConfig, EngineConfig, SamplingParams
from lazyattn_rag.llm import LazyAttention

app = typer.Typer(add_completion=False, help=__doc__)


def _log(event: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {event}", flush=True)


def check_modes(modes: list[str]) -> None:
    """Refuse a bad ``--modes`` value before anything runs (``typer.BadParameter``, named)."""
    for mode in modes:
        try:
            mode_cache_settings(mode)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--modes") from None


@app.command()
def sweep(arch: str = "llama-3.1-8b", device: str = "cuda", dtype: str = "bfloat16",
          budget_gb: list[float] = typer.Option([10.0]), alpha: list[float] = typer.Option([2.1]),
          modes: list[str] = typer.Option(list(MODES)), num_docs: int = 200, doc_tokens: int = 512,
          docs_per_request: int = 5, query_tokens: int = 64, output_tokens: int = 32, num_requests: int = 200,
          concurrency: int = 16, max_batched_tokens: int = 16384, check: bool = True, seed: int = 0,
          cuda_graphs: bool = True, prefill_with_encodes: bool = True, repeats: int = 1, resume: bool = False,
          host_memory_gb: float = 16.0, torch_compile: bool = False, out: str = "") -> None:
    """Closed-loop runs of every mode at each (alpha, budget): TTFT, throughput, hit ratio, KV used.

    ``--torch-compile`` builds every engine with ``EngineConfig.torch_compile`` (the layers
    compiled by inductor, issue 19); the equivalence checks still run the default engines.

    ``--repeats R`` runs every (alpha, budget) cell R times, the modes in a rotated order each
    time so that no mode always runs first; ``summary`` in the JSON holds each metric's median
    over the repeats. ``--resume`` keeps the runs already in the output file and runs only the
    missing (mode, alpha, budget, repeat) runs, so one sweep can span several time-limited calls.
    Mode ``lazy+host`` is ``lazy`` with a host-memory tier of ``--host-memory-gb`` below the KV
    budget (chunks the pool evicts are written back there and loaded on their next miss); mode
    ``lazy+head<k>`` (e.g. ``lazy+head16``) is ``lazy`` recomputing the first ``k`` tokens of every
    document in each request (chunk-head recompute, issue 20); mode ``lazy+sel<r>`` (e.g.
    ``lazy+sel15``) is ``lazy`` recomputing ``r`` % of every document's tokens, those whose K/V
    the context changes most (selective recompute, issue 20); mode ``lazy+ape<T>[w<W>]`` (e.g.
    ``lazy+ape80``) is ``lazy`` reading every document with chunk attention scaling at
    temperature ``T`` % and weight ``W`` % (APE, issue 20)."""
    check_modes(modes)
    name = out or f"serving_sweep_{arch}_{device}"
    setting = {"arch": arch, "dtype": dtype, "num_docs": num_docs, "doc_tokens": doc_tokens,
               "docs_per_request": docs_per_request, "query_tokens": query_tokens, "output_tokens": output_tokens,
               "num_requests": num_requests, "concurrency": concurrency, "max_batched_tokens": max_batched_tokens,
               "seed": seed, "cuda_graphs": cuda_graphs, "prefill_with_encodes": prefill_with_encodes,
               **({"torch_compile": True} if torch_compile else {})}
    start = resumed(name, setting, resume)
    runs, commands, report = start["runs"], start["commands"], start.get("equivalence", {})
    done = {(r["mode"], r["alpha"], r["budget_gb"], r.get("repeat", 0)) for r in runs}
    bench = Bench.build(arch, device, dtype)
    _log("model ready")
    for a in alpha:
        workload = Workload(num_docs, doc_tokens, docs_per_request, a, query_tokens, output_tokens, num_requests, seed)
        docs, requests = workload.documents(), workload.requests()
        if check and not report:
            report = check_equivalence(bench, device, docs, requests[:4], cuda_graphs)
            _log("equivalence checked")
        for gb, rep in [(gb, rep) for gb in budget_gb for rep in range(repeats)]:
            for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
                if (mode, a, gb, rep) in done:
                    continue
                llm, setup = ready_engine(bench, mode, int(gb * 2**30), device, max_batched_tokens, concurrency,
                                          workload, docs, cuda_graphs, prefill_with_encodes,
                                          int(host_memory_gb * 2**30), torch_compile)
                params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
                row = {"mode": mode, "alpha": a, "budget_gb": gb, "repeat": rep, **setup,
                       **({"host_memory_gb": host_memory_gb} if mode == "lazy+host" else {}),
                       **timed_run(llm, requests, params, concurrency, None, seed)}
                print(json.dumps(row))
                runs.append(row)
                release(llm)
                # after every run: a cut-short sweep keeps its rows (and --resume goes on from them)
                write_runs(name, setting, commands, equivalence=report, summary=cell_medians(runs), runs=runs)


@app.command()
def rates(arch: str = "llama-3.1-8b", device: str = "cuda", dtype: str = "bfloat16", budget_gb: float = 10.0,
          alpha: float = 2.1, rate: list[float] = typer.Option([1.0, 2.0, 4.0, 8.0]),
          modes: list[str] = typer.Option(["lazy", "block_attention"]), num_docs: int = 200, doc_tokens: int = 512,
          num_requests: int = 100, max_batched_tokens: int = 16384, max_num_seqs: int = 256, seed: int = 0,
          cuda_graphs: bool = True, resume: bool = False, out: str = "") -> None:
    """Poisson arrivals at increasing rates: TTFT vs arrival rate per mode (``--resume`` as in ``sweep``)."""
    name = out or f"serving_rates_{arch}_{device}"
    setting = {"arch": arch, "dtype": dtype, "budget_gb": budget_gb, "alpha": alpha, "num_docs": num_docs,
               "doc_tokens": doc_tokens, "num_requests": num_requests, "max_batched_tokens": max_batched_tokens,
               "max_num_seqs": max_num_seqs, "seed": seed, "cuda_graphs": cuda_graphs}
    start = resumed(name, setting, resume)
    runs, commands = start["runs"], start["commands"]
    done = {(r["mode"], r["rate_per_s"]) for r in runs}
    bench = Bench.build(arch, device, dtype)
    workload = Workload(num_docs, doc_tokens, 5, alpha, 64, 32, num_requests, seed)
    docs, requests = workload.documents(), workload.requests()
    for mode in modes:
        for r in rate:
            if (mode, r) in done:
                continue
            llm, setup = ready_engine(bench, mode, int(budget_gb * 2**30), device, max_batched_tokens, max_num_seqs,
                                      workload, docs, cuda_graphs)
            row = {"mode": mode, "rate_per_s": r, **setup,
                   **timed_run(llm, requests, SamplingParams(max_tokens=32, ignore_eos=True), None, r, seed)}
            print(json.dumps(row))
            runs.append(row)
            release(llm)
            write_runs(name, setting, commands, runs=runs)  # after every run, as in sweep


@app.command()
def micro(arch: str = "llama-3.1-8b", device: str = "cuda", dtype: str = "bfloat16", doc_tokens: int = 4096,
          query_tokens: int = 64, output_tokens: int = 32, budget_gb: float = 20.0, repeats: int = 3,
          cuda_graphs: bool = True, out: str = "") -> None:
    """One request of 5 documents x ``doc_tokens`` + a query, 3 documents hot: time per phase and mode.

    Each repeat serves the request twice, on fresh documents each time: as the engine runs it
    (the 2 cold documents' encodes and the query prefill in one step: ``ttft_ms``), and with
    ``prefill_with_encodes=False`` so that document processing and query prefill are separate
    steps that can be timed apart (``doc_processing_ms``, ``query_prefill_ms``, ``ttft_two_steps_ms``).
    """
    bench = Bench.build(arch, device, dtype)
    text = partial(random_text, np.random.default_rng(7))
    rows = []
    for mode in MODES:
        engines = {merged: make_engine(bench, mode, int(budget_gb * 2**30), device, 32768, 4, cuda_graphs=cuda_graphs,
                                       prefill_with_encodes=merged) for merged in (True, False)}
        for llm in engines.values():
            warm_up(llm, Workload(doc_tokens=256))
        for rep in range(repeats):
            row = {"mode": mode, "repeat": rep}
            for merged, llm in engines.items():
                ids = [f"r{rep}-{merged}-d{i}" for i in range(5)]
                row.update(micro_times(*micro_request(llm, ids, text, doc_tokens, query_tokens, output_tokens), merged))
            rows.append(row)
            print(json.dumps(row))
        for llm in engines.values():
            release(llm)
        keys = ("ttft_ms", "ttft_two_steps_ms", "doc_processing_ms", "query_prefill_ms", "decode_ms_per_token")
        summary = {m: {k: statistics.median(r[k] for r in rows if r["mode"] == m) for k in keys}
                   for m in MODES if any(r["mode"] == m for r in rows)}
        write(out or f"serving_micro_{arch}_{device}", {"environment": environment(), "arch": arch,
                                                        "cuda_graphs": cuda_graphs, "command": command_line(),
                                                        "summary": summary, "runs": rows})


@app.command()
def profile(arch: str = "llama-3.1-8b", device: str = "cuda", dtype: str = "bfloat16", doc_tokens: int = 4096,
            query_tokens: int = 64, output_tokens: int = 32, mode: str = "lazy", cuda_graphs: bool = True,
            top: int = 25, out: str = "") -> None:
    """Where the time of one micro-benchmark request goes: torch.profiler's top device kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    bench = Bench.build(arch, device, dtype)
    text = partial(random_text, np.random.default_rng(7))
    llm = make_engine(bench, mode, 20 * 2**30, device, 32768, 4, cuda_graphs=cuda_graphs)
    warm_up(llm, Workload(doc_tokens=256))
    ids = [f"d{i}" for i in range(5)]
    three_hot(llm, ids, text, doc_tokens, query_tokens)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res = llm.generate(text(query_tokens), ids, sampling=SamplingParams(max_tokens=output_tokens, ignore_eos=True))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    rows, busy_ms = top_device_kernels(prof, top)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=top))
    release(llm)
    write(out or f"serving_profile_{arch}_{mode}_{device}", {
        "environment": environment(), "arch": arch, "mode": mode, "cuda_graphs": cuda_graphs,
        "command": command_line(), "ttft_ms": res.stats.ttft_ms, "tpot_ms": res.stats.tpot_ms,
        "e2e_ms": res.stats.e2e_ms, "device_busy_ms": busy_ms, "top_by_device_time": rows})


LAYER_SETTINGS = ("dense", "packed", "compiled")  # the CPU engine's default first


@app.command()
def cpu(doc_words: int = 220, repeats: int = 5, out: str = "serving_cpu_smollm2", dtype: str = "float32",
        layers: list[str] = typer.Option(["dense"], help="our engine's layers, interleaved: dense (the default), "
                                                         "packed (oneDNN weights), compiled (torch.compile)"),
        output_tokens: int = 32) -> None:
    """The default SmolLM2 on the CPU, 3 hot documents of ~300 tokens: our TTFT vs transformers generate,
    interleaved repeat by repeat (ours in each ``--layers`` setting, then transformers), both in ``dtype``;
    and each setting's TPOT over ``output_tokens`` greedy tokens (EOS ignored) after the same prompt."""
    from transformers import AutoModelForCausalLM

    from lazyattn_rag.engine.model.compiled_layers import CompiledLayers
    from lazyattn_rag.engine.model.packed_linear import pack_linears, unpack_linears

    if unknown := set(layers) - set(LAYER_SETTINGS):
        raise typer.BadParameter(f"unknown --layers {sorted(unknown)}; choose from {', '.join(LAYER_SETTINGS)}")
    # exact-prefix caching off: each layer setting asks the repeat's question in turn, and the second
    # would read the first's tail blocks (a repeat, 1 token computed instead of the question's 17)
    llm = LazyAttention(EngineConfig(device="cpu", dtype=dtype, cache=CacheConfig(prefix_caching=False)))
    rng = np.random.default_rng(0)
    words = "the of and to in is was for on as with by at from that which this are be or an".split()
    docs = {f"hot{i}": " ".join(rng.choice(words, doc_words)) + "." for i in range(3)}
    llm.add_documents(list(docs.items()))
    llm.warm(list(docs))
    # The baseline runs on the engine's thread too, so both share one intra-op thread pool (a second
    # OpenMP pool on a 2-core machine slows both; see LazyAttention._build). One engine serves every
    # layer setting (a second engine would bring a second thread and pool): they are switched
    # between requests, on the engine's thread.
    runner = llm.engine.runner
    compiled = llm.loop.call(CompiledLayers, runner.model) if "compiled" in layers else None

    def use(setting: str) -> None:
        def switch():
            (pack_linears if setting == "packed" else unpack_linears)(runner.model)
            runner.compiled = compiled if setting == "compiled" else None
        llm.loop.call(switch)

    for setting in layers:  # warm-up (compiles)
        use(setting)
        llm.generate("warm up", list(docs), sampling=SamplingParams(max_tokens=2))
    hf = llm.loop.call(lambda: AutoModelForCausalLM.from_pretrained(str(llm_model_dir()), dtype=getattr(torch, dtype)).eval())
    ours, theirs, tpot = {s: [] for s in layers}, [], {s: [] for s in layers}
    for i in range(repeats):
        question = f"What is said about item number {i}?"
        for setting in layers:
            use(setting)
            res = llm.generate(question, list(docs), sampling=SamplingParams(max_tokens=1))
            ours[setting].append(res.stats.ttft_ms)
            decoded = llm.generate(question + " Go on.", list(docs),
                                   sampling=SamplingParams(max_tokens=output_tokens, ignore_eos=True))
            tpot[setting].append(decoded.stats.tpot_ms)
        ids = torch.tensor([llm.plan(question, list(docs)).token_ids()])
        theirs.append(llm.loop.call(_hf_ttft_ms, hf, ids))
    hf_ms = statistics.median(theirs)
    summary = {"dtype": dtype, "prompt_tokens": res.stats.num_prompt_tokens,
               "computed_tokens": res.stats.num_computed_tokens, "hf_generate_ttft_ms_median": hf_ms}
    for setting in layers:
        summary[f"lazy_{setting}_ttft_ms_median"] = statistics.median(ours[setting])
        summary[f"speedup_{setting}"] = hf_ms / statistics.median(ours[setting])
        summary[f"lazy_{setting}_tpot_ms_median"] = statistics.median(tpot[setting])
    print(json.dumps(summary))
    write(out, {"environment": environment(), "command": command_line(), "summary": summary,
                **{f"lazy_{s}_ttft_ms": v for s, v in ours.items()},
                **{f"lazy_{s}_tpot_ms": v for s, v in tpot.items()}, "hf_generate_ttft_ms": theirs})


def _hf_ttft_ms(hf, ids: torch.Tensor) -> float:
    """transformers ``generate``'s time to the first token over prompt ``ids``, in ms."""
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=1, do_sample=False)
    return (time.perf_counter() - t0) * 1e3


def llm_model_dir() -> Path:
    from lazyattn_rag.engine.model.model_loading import resolve_model

    return resolve_model(None, EngineConfig().resolved_cache_dir()).path


if __name__ == "__main__":
    app()
