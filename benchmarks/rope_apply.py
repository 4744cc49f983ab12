"""RoPE of q and k in a compiled layer: inductor's fused ``apply_rotation`` against
``kernels/rope_apply.py``'s kernel over its tile configurations (H200).

For each token count, 32 distinct fused q/k/v products (one per layer, Llama-3.1-8B: 32 query and
8 KV heads of 128; bf16) have their q and k heads rotated (``[tokens, 40, 128]`` views of token
stride 6,144) inside one CUDA graph, as in a step's replay: ``torch.compile(apply_rotation)``
(``dynamic=True``, as the compiled layers before the kernel), the kernel at its default tiles
(``BLOCK_T``, ``BLOCK_H``, ``NUM_WARPS`` of ``kernels/rope_apply.py``), and a sweep of tokens per program,
heads per program and warps. Median of the replays in microseconds per rotation, and GB/s of q
and k read and written. Every sweep output's largest difference from the compiled reference is recorded.

    python benchmarks/rope_apply.py --out benchmarks/results/rope_apply_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gemv import graph_ms
from lazyattn_rag.kernels.rope import apply_rotation
from lazyattn_rag.kernels.rope_apply import launch, rope_apply

NUM_LAYERS = 32
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
TOKENS = (1, 2, 4, 16, 64, 256, 1024, 4096, 20480)
SWEEP = list(itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4)))  # tokens, heads per program; warps


def bench_tokens(n: int, sweep: bool) -> dict:
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = [torch.randn(n, width, device="cuda", dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
    qk = [t[:, : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(n, NUM_HEADS + NUM_KV_HEADS, HEAD_DIM) for t in qkv]
    angles = torch.arange(n, device="cuda").float()[:, None] * (
        1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))[None, :]
    cos, sin = angles.cos(), angles.sin()
    outs = [torch.empty(x.shape, dtype=x.dtype, device="cuda") for x in qk]
    compiled = torch.compile(apply_rotation, dynamic=True)
    reference = [compiled(x, cos, sin, HEAD_DIM, False) for x in qk]
    replays = 10 if n >= 4096 else 30
    moved_gb = 2 * qk[0].numel() * 2 / 1e9  # q and k read and written, bf16

    def row(ms: float) -> dict:
        us = ms * 1e3 / NUM_LAYERS
        return {"us": round(us, 3), "GBps": round(moved_gb / (us * 1e-6), 1)}

    def run_compiled():
        for x in qk:
            compiled(x, cos, sin, HEAD_DIM, False)

    result = {"tokens": n, "inductor": row(graph_ms(run_compiled, replays))}

    def run_default():
        for x in qk:
            rope_apply(x, cos, sin, HEAD_DIM, False)

    result["kernel_default"] = row(graph_ms(run_default, replays))
    if sweep:
        result["sweep"] = []
        for block_t, block_h, warps in SWEEP:
            def run(bt=block_t, bh=block_h, w=warps):
                for x, o in zip(qk, outs):
                    launch(x, cos, sin, o, HEAD_DIM, False, bt, bh, w)

            ms = graph_ms(run, replays)
            diff = max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, reference))
            result["sweep"].append({"block_t": block_t, "block_h": block_h, "num_warps": warps, **row(ms),
                                    "max_abs_diff_vs_inductor": diff})
        best = min(result["sweep"], key=lambda r: r["us"])
        result["best"] = best
    print({k: v for k, v in result.items() if k != "sweep"}, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/rope_apply.json")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    rows = [bench_tokens(n, not args.no_sweep) for n in args.tokens]
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(sys.argv), "num_layers": NUM_LAYERS,
            "heads": [NUM_HEADS, NUM_KV_HEADS, HEAD_DIM], "rows": rows}
    Path(args.out).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
