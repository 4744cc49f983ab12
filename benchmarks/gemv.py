"""One-row matrix products (batch-1 decode steps): cuBLAS against ``kernels/gemv.py`` (H200).

For each of Llama-3.1-8B's four products per layer (q/k/v 6144 x 4096, output 4096 x 4096,
gate/up 28672 x 4096, down 4096 x 14336; bf16), 32 distinct weights (one per layer, so nothing
stays in L2) are multiplied by one row inside one CUDA graph, as in a decode step's replay:
``torch.mm`` (cuBLAS, with its split-K reduction kernel where it takes one), the kernel at its
default configuration (:func:`~lazyattn_rag.kernels.gemv.gemv_config`), and a sweep of
configurations (8 or 16 outputs per program, 512 or 1,024 weights per step, 4 or 8 warps, 2-4
stages). Median of 20 replays (10 for the sweep) in microseconds per product, and GB/s of weights
read. Each output's largest error against a float32 product is reported for both.

``results/gemv_h200.json`` was written by this script's first form (the same measurements,
its kernel the same loop as ``gemv_kernel``'s unmasked path, without the default line)::

    python benchmarks/gemv.py --out benchmarks/results/gemv_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lazyattn_rag.kernels.gemv import gemv, gemv_kernel

NUM_LAYERS = 32
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SWEEP = list(itertools.product((8, 16), (512, 1024), (4, 8), (2, 3, 4)))  # BLOCK_N, BLOCK_K, warps, stages


def graph_ms(fn, replays: int) -> float:
    """Median ms of one replay of a CUDA graph of ``fn``."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[replays // 2]


def launch(x, w, out, block_n, block_k, num_warps, num_stages):
    n, k = w.shape
    gemv_kernel[(triton.cdiv(n, block_n),)](x, w, out, out, n, k, w.stride(0), HAS_BIAS=False,
                                            EVEN=n % block_n == 0 and k % block_k == 0, BLOCK_N=block_n,
                                            BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)


def bench_shape(n: int, k: int, sweep: bool) -> dict:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(NUM_LAYERS)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
    gb = n * k * 2 * NUM_LAYERS / 1e9

    def row(ms: float) -> dict:
        return {"us_each": ms * 1e3 / NUM_LAYERS, "GBps": gb / ms * 1e3}

    def cublas():
        for w, o in zip(weights, outs):
            torch.mm(x, w.t(), out=o)

    res = {"cublas": row(graph_ms(cublas, 20)), "default": row(graph_ms(lambda: [gemv(x, w) for w in weights], 20))}
    if sweep:
        for cfg in SWEEP:
            if n % cfg[0] or k % cfg[1]:
                continue
            res["bn{} bk{} w{} s{}".format(*cfg)] = row(graph_ms(
                lambda cfg=cfg: [launch(x, w, o, *cfg) for w, o in zip(weights, outs)], 10))
    exact = F.linear(x.float(), weights[0].float())
    res["default_max_abs_err_vs_fp32"] = (gemv(x, weights[0]).float() - exact).abs().max().item()
    res["cublas_max_abs_err_vs_fp32"] = (F.linear(x, weights[0]).float() - exact).abs().max().item()
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gemv.json")
    parser.add_argument("--no-sweep", action="store_true", help="cuBLAS and the default configuration only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "command": " ".join(sys.argv)}
    for name, (n, k) in SHAPES.items():
        results[name] = bench_shape(n, k, not args.no_sweep)
        print(name, {key: results[name][key] for key in ("cublas", "default")}, flush=True)
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
