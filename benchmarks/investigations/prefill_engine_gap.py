"""Why the 20k-token prefill's attention is slower in the engine than in the kernel benchmark (H200).

In the engine's profile of a 20,480-token prefill (``decode_step.py``) the prefill kernel runs at
~397 TFLOP/s; ``kernels.py`` measures ~470 at 16k. Two candidate causes, each measured with the
engine's launch (Llama-3.1-8B heads 32/8, d128, bf16, no cached keys, the new tokens' K/V from
the step):

* **layout** (``--part layout``): the engine's q and k are views of one rotated ``[T, 40, 128]``
  tensor and v a view of the fused q/k/v product (token strides 5,120 and 6,144 elements), the
  benchmark's are contiguous. Each combination, cold L2 (``kernels.bench_ms``), at 16k and 20k,
  then 8 back-to-back launches in one graph.
* **neighbours** (``--part neighbours``): in the engine each attention launch sits between the
  layer's matrix products at M = T (q/k/v, output, gate/up, down). A graph of 8 such layers
  against a graph of 8 attention launches alone (and alone again), the attention kernel's median
  device time from the profiler.

``results/prefill_layout_h200.json`` and ``results/prefill_neighbours_h200.json`` were written by
this script's first form (two scratch scripts, the same launches and timing)::

    python benchmarks/investigations/prefill_engine_gap.py --out benchmarks/results/prefill_engine_gap_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gemv import graph_ms
from benchmarks.kernels_setup import DTYPE, bench_ms, build_paged, inv_freq_for, prefill_segments
from lazyattn_rag.kernels.launch import block_key_starts, block_runs
from lazyattn_rag.kernels.prefill import paged_prefill

HEADS, KV_HEADS, HEAD_DIM, THETA = 32, 8, 128, 500000.0
LAYER_PRODUCTS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # [N, K] of each weight


def attention_launch(tokens: int, views: tuple[bool, bool]):
    """The engine's prefill launch over ``tokens`` new tokens: ``views`` = (q is a view, k/v are
    views) as in the engine, else contiguous copies. Returns (launch, causal FLOPs)."""
    paged = build_paged(prefill_segments(tokens, 0, 3072), KV_HEADS, HEAD_DIM, "cuda", seed=2)
    qk = torch.randn(tokens, HEADS + KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DTYPE)
    q, k = qk.split([HEADS, KV_HEADS], dim=1)  # [T, 32, 128] and [T, 8, 128], token stride 5,120
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(tokens, KV_HEADS, HEAD_DIM)  # token stride 6,144
    if not views[0]:
        q = q.contiguous()
    if not views[1]:
        k, v = k.contiguous(), v.contiguous()
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    inv_freq = inv_freq_for(HEAD_DIM, THETA, "cuda")
    key_starts = block_key_starts(paged["block_tables"], paged["num_blocks"])
    runs = block_runs(paged["block_tables"], paged["num_blocks"], 16)
    out = torch.empty(tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)

    def run():
        paged_prefill(q, paged["k_cache"], paged["v_cache"], paged["block_tables"], paged["num_blocks"],
                      paged["seq_lens"], cu, tokens, inv_freq, HEAD_DIM**-0.5, key_starts=key_starts, runs=runs,
                      out=out, key=k, value=v, max_context_len=0)

    return run, 4 * HEADS * HEAD_DIM * (tokens * (tokens + 1) // 2)


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def layout(tokens_list=(16384, 20480)) -> dict:
    res = {}
    for tokens in tokens_list:
        row = {}
        for name, views in (("contiguous", (False, False)), ("engine_views", (True, True)),
                            ("q_view_only", (True, False)), ("kv_views_only", (False, True)),
                            ("contiguous_again", (False, False)), ("engine_views_again", (True, True))):
            run, flops = attention_launch(tokens, views)
            ms = bench_ms(run, rep=100)
            row[name] = {"ms": ms, "TFLOPs": flops / ms / 1e9}
        for name, views in (("contiguous_x8_graph", (False, False)), ("engine_views_x8_graph", (True, True))):
            run, flops = attention_launch(tokens, views)
            ms = graph_ms(lambda run=run: [run() for _ in range(8)], 5) / 8
            row[name] = {"ms": ms, "TFLOPs": flops / ms / 1e9}
        print(tokens, row, flush=True)
        res[str(tokens)] = row
    return res


def neighbours(tokens: int = 20480) -> dict:
    from torch.profiler import ProfilerActivity, profile

    attn, flops = attention_launch(tokens, (True, True))
    x = torch.randn(tokens, 4096, device="cuda", dtype=DTYPE)
    h = torch.randn(tokens, 14336, device="cuda", dtype=DTYPE)
    weights = [torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02 for n, k in LAYER_PRODUCTS]

    def layer():
        torch.mm(x, weights[0].t())
        attn()
        torch.mm(x, weights[1].t())
        torch.mm(x, weights[2].t())
        torch.mm(h, weights[3].t())

    res = {}
    for name, fn in (("attention_alone", lambda: [attn() for _ in range(8)]),
                     ("between_products", lambda: [layer() for _ in range(8)]),
                     ("attention_alone_again", lambda: [attn() for _ in range(8)])):
        graph = graph_of(fn)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        us = sorted(e.time_range.elapsed_us() for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("prefill_kernel"))
        res[name] = {"attention_us_median": us[len(us) // 2], "TFLOPs": flops / us[len(us) // 2] / 1e6,
                     "num": len(us)}
        print(name, res[name], flush=True)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["layout", "neighbours", "both"], default="both")
    parser.add_argument("--out", default="benchmarks/results/prefill_engine_gap.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    if args.part in ("layout", "both"):
        results["layout"] = layout()
    if args.part in ("neighbours", "both"):
        results["neighbours"] = neighbours()
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
