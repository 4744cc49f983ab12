"""Hardware-counter profile of the attention kernels on the shapes issue 19 targets, under Nsight Compute.

Each case launches our kernel once to compile and warm it, then once between
``torch.cuda.profiler.start()``/``stop()``, so that ``ncu --profile-from-start off`` reads one
launch per case: the decode kernel (plus its split reduction where the launch splits the
context: with ``choose_num_splits`` on an H200, 49 splits at batch 1 x 20k and 3 at batch 32 x 8k;
the committed profile, ``kernel_profile_h200_ncu.csv``, is of the earlier power-of-two rule's 32
and 1) or the prefill kernel. Each case's launch is inside an NVTX range named after it. The cases,
with the layouts of ``benchmarks/kernels.py`` and its default launch configurations (Llama-3.1-8B
heads: 32 q / 8 kv, d 128, bf16, block 16):

* ``decode_b32_8k``: batch 32 x 8k context (a 256-token head, 4 chunks of 1900 at offsets, own tokens);
* ``decode_b1_20k``: batch 1 x 20k context, the same layout;
* ``prefill_16k``: 16k new tokens, causal, nothing cached;
* ``prefill_4k_after_12k`` and ``..._norot``: 4k new tokens after 4 chunks of 3072, with the
  chunks' rotation and with it compiled out (``rotation="none"``): the rotation's cost in counters.

    ncu --clock-control none --profile-from-start off --nvtx -k regex:'decode|prefill' \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \\
        -o kprof python benchmarks/investigations/kernel_profile.py
    ncu --import kprof.ncu-rep --csv --page details > kprof.csv

Profiled launches come in the order printed (``profiled launch: <case>``). ``--static`` instead
prints, without a profiler, each case's median time (``kernels.bench_ms``: CUDA-graph replays with
the L2 cache flushed before each; ``--decode-splits``: at each split count, against the default) and what
Triton compiled for it (registers per thread, spills, shared memory, warps, stages): the
part of a profile that needs no hardware counters.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton

if __package__ in (None, ""):  # run as a script: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels_setup import (BLOCK_SIZE, DTYPE, MODELS, bench_ms, build_paged, decode_segments,
                                     inv_freq_for, prefill_segments)
from lazyattn_rag.kernels.decode import (WIDE_TILE_BLOCK_N, WIDE_TILE_STAGES, decode_kernel, decode_reduce_kernel,
                                         paged_decode)
from lazyattn_rag.kernels.launch import block_key_starts, block_runs
from lazyattn_rag.kernels.prefill import paged_prefill, prefill_kernel

LLAMA = MODELS["llama3.1-8b"]


@functools.lru_cache(maxsize=1)  # one shape's inputs at a time: every split count reads the same data
def decode_inputs(batch: int, context: int, device) -> dict:
    """The benchmark's decode layout (``kernels.bench_decode``) and a query, on ``device``."""
    P = build_paged(decode_segments(batch, context), LLAMA["num_kv_heads"], LLAMA["head_dim"], device, seed=1)
    P["q"] = torch.randn(batch, LLAMA["num_heads"], LLAMA["head_dim"], dtype=DTYPE, device=device)
    P["cu"] = torch.arange(batch + 1, dtype=torch.int32, device=device)
    P["runs"] = block_runs(P["block_tables"], P["num_blocks"], BLOCK_SIZE)
    P["seq_ids"] = torch.arange(batch, dtype=torch.int32, device=device)  # given: no arange kernel in the profile
    return P


def decode_case(batch: int, context: int, device, **options):
    """A launcher of one decode step (its own output buffer) over :func:`decode_inputs`;
    ``options``: ``paged_decode``'s launch options (none: its defaults)."""
    P = decode_inputs(batch, context, device)
    out = torch.empty_like(P["q"])
    inv_freq, max_len = inv_freq_for(LLAMA["head_dim"], LLAMA["theta"], device), max(P["seq_lens_list"])
    return lambda: paged_decode(P["q"], P["k_cache"], P["v_cache"], P["block_tables"], P["num_blocks"], P["cu"],
                                max_len, inv_freq, LLAMA["head_dim"] ** -0.5, runs=P["runs"], out=out,
                                seq_ids=P["seq_ids"], **options)


def prefill_case(new_tokens: int, cached_chunks: int, device, rotation: str = "query", chunk_len: int = 3072):
    """A launcher of one prefill (see ``kernels.bench_prefill``)."""
    P = build_paged(prefill_segments(new_tokens, cached_chunks, chunk_len), LLAMA["num_kv_heads"],
                    LLAMA["head_dim"], device, seed=2)
    q = torch.randn(new_tokens, LLAMA["num_heads"], LLAMA["head_dim"], dtype=DTYPE, device=device)
    cu = torch.tensor([0, new_tokens], dtype=torch.int32, device=device)
    ks, runs = block_key_starts(P["block_tables"], P["num_blocks"]), block_runs(P["block_tables"], P["num_blocks"],
                                                                                 BLOCK_SIZE)
    out, inv_freq = torch.empty_like(q), inv_freq_for(LLAMA["head_dim"], LLAMA["theta"], device)
    seq_ids = torch.zeros(1, dtype=torch.int32, device=device)
    return lambda: paged_prefill(q, P["k_cache"], P["v_cache"], P["block_tables"], P["num_blocks"], P["seq_lens"], cu,
                                 new_tokens, inv_freq, LLAMA["head_dim"] ** -0.5, key_starts=ks, runs=runs, out=out,
                                 rotation=rotation, seq_ids=seq_ids)


# (batch, context) of the decode split sweep (``--decode-splits``): the two profiled cases, two
# batch sizes between them and two above.
DECODE_SHAPES = {"decode_b32_8k": (32, 8192), "decode_b1_20k": (1, 20480), "decode_b8_8k": (8, 8192),
                 "decode_b4_16k": (4, 16384), "decode_b64_4k": (64, 4096), "decode_b128_2k": (128, 2048)}
CASES = {
    **{name: (lambda d, shape=DECODE_SHAPES[name]: decode_case(*shape, d))
       for name in ("decode_b32_8k", "decode_b1_20k")},
    "prefill_16k": lambda d: prefill_case(16384, 0, d),
    "prefill_4k_after_12k": lambda d: prefill_case(4096, 4, d),
    "prefill_4k_after_12k_norot": lambda d: prefill_case(4096, 4, d, rotation="none"),
}


def compiled_variants(fn) -> list[dict]:
    """What Triton compiled for the ``@triton.jit`` function ``fn`` so far: one dict per variant
    (registers per thread, spilled registers, shared memory bytes, warps, stages)."""
    rows = []
    for caches in fn.device_caches.values():
        for kernel in caches[0].values():  # the kernel cache: specialization key -> CompiledKernel
            kernel._init_handles()
            meta = kernel.metadata
            rows.append({"kernel": fn.__name__, "n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                         "shared_bytes": meta.shared, "num_warps": meta.num_warps, "num_stages": meta.num_stages})
    return rows


# --decode-wide-splits: wide tiles (decode.WIDE_TILE_*) at the given split counts.
WIDE_TILE = {"block_n": WIDE_TILE_BLOCK_N, "num_stages": WIDE_TILE_STAGES}


def split_sweep(name: str, splits: list[int], device, rounds: int = 3, **options) -> None:
    """Time the decode case ``name`` at each split count (with the launch ``options``) against
    the default, interleaved over ``rounds``; print one JSON line per count (median ms, speedup,
    max |difference| of outputs)."""
    batch, context = DECODE_SHAPES[name]
    prefix = "".join(f"{k}={v}," for k, v in options.items())
    variants = {"default": decode_case(batch, context, device)}
    variants.update({f"{prefix}splits={n}": decode_case(batch, context, device, num_splits=n, **options)
                     for n in splits})
    outs = {label: fn().float().clone() for label, fn in variants.items()}
    times = {label: [] for label in variants}
    for _ in range(rounds):
        for label, fn in variants.items():
            times[label].append(bench_ms(fn))
    base = sorted(times["default"])[rounds // 2]
    for label, ms in times.items():
        med = sorted(ms)[rounds // 2]
        print(json.dumps({"case": name, "variant": label, "ms": ms, "median_ms": med,
                          "speedup_vs_default": base / med,
                          "max_abs_diff_vs_default": float((outs[label] - outs["default"]).abs().max())}), flush=True)


def static_report(launchers: dict, decode_splits: list[int], wide_splits: list[int], device) -> None:
    """Print each case's median ms, the split sweeps, then each compiled kernel variant, as JSON lines."""
    for name, fn in launchers.items():
        print(json.dumps({"case": name, "median_ms": bench_ms(fn)}), flush=True)
    for name in DECODE_SHAPES if decode_splits else ():
        split_sweep(name, decode_splits, device)
    for name in DECODE_SHAPES if wide_splits else ():
        split_sweep(name, wide_splits, device, **WIDE_TILE)
    for fn in (decode_kernel, decode_reduce_kernel, prefill_kernel):
        for row in compiled_variants(fn):
            print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    ap.add_argument("--static", action="store_true", help="time each case and list the compiled variants "
                    "(no profiler ranges)")
    ap.add_argument("--decode-splits", default="", help="with --static: comma-separated split counts to time "
                    "each decode case at (e.g. 1,3,32,48)")
    ap.add_argument("--decode-wide-splits", default="", help="with --static: the same sweep with wide "
                    "tiles (128 keys, 2 stages)")
    args = ap.parse_args()
    if (args.decode_splits or args.decode_wide_splits) and not args.static:
        raise SystemExit("--decode-splits and --decode-wide-splits need --static")
    device = torch.device("cuda")
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    launchers = {name: CASES[name](device) for name in names}
    for fn in launchers.values():  # compile and warm every case before the profiled launches
        fn()
    torch.cuda.synchronize()
    if args.static:
        static_report(launchers, [int(n) for n in args.decode_splits.split(",") if n],
                      [int(n) for n in args.decode_wide_splits.split(",") if n], device)
        return
    for name, fn in launchers.items():
        print(f"profiled launch: {name}", flush=True)
        torch.cuda.profiler.start()
        with torch.cuda.nvtx.range(name):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
