"""The paged prefill kernel of an earlier commit against today's, on serving-shaped batches (H200).

Side by side in one process, interleaved 3 times (median of triton's ``do_bench`` over CUDA-graph
replays, L2 flushed, as ``benchmarks/kernels.py``): the earlier kernel file, today's kernel with
its default launch and with ``num_stages=3``, on the prefills the serving engine runs most (Llama
heads 32/8, d128, bf16, block 16): requests of 64 new tokens over 5 cached 512-token chunks at
distinct offsets, 512-token document encodes (no context, delta 0), and requests of 512 new
tokens over 5 chunks. Also each output's largest difference from the earlier kernel's.

    git show eb4fe53:kernels/prefill.py > /tmp/old_prefill.py
    python benchmarks/prefill_ab.py --old /tmp/old_prefill.py --label eb4fe53 --out benchmarks/results/prefill_ab_h200.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import BLOCK_SIZE, bench_ms, build_paged, inv_freq_for
from lazyattn_rag.kernels import prefill as current
from lazyattn_rag.kernels.launch import block_key_starts, block_runs

HEADS, KV_HEADS, HEAD_DIM, THETA = 32, 8, 128, 500000.0


def shapes() -> dict:
    """name -> (per-sequence segments ``[(length, delta), ...]``, new tokens per sequence)."""
    chunks = lambda b: [(512, 700 * c + 13 * b) for c in range(5)]  # noqa: E731 - 5 chunks at distinct offsets
    return {
        "16 requests: 5 chunks x 512 cached + 64 new": ([chunks(b) + [(64, 0)] for b in range(16)], 64),
        "16 encodes of 512 tokens (delta 0)": ([[(512, 0)] for _ in range(16)], 512),
        "4 requests: 5 chunks x 512 cached + 512 new": ([chunks(b) + [(512, 0)] for b in range(4)], 512),
    }


def load_kernel_module(path: str):
    spec = importlib.util.spec_from_file_location("earlier_prefill", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(segs, query_len: int, kernels: dict, device) -> dict:
    P = build_paged(segs, KV_HEADS, HEAD_DIM, device, seed=3)
    num_seqs = len(segs)
    q = torch.randn(num_seqs * query_len, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    cu = torch.arange(0, num_seqs * query_len + 1, query_len, dtype=torch.int32, device=device)
    inv_freq = inv_freq_for(HEAD_DIM, THETA, device)
    key_starts = block_key_starts(P["block_tables"], P["num_blocks"])
    runs = block_runs(P["block_tables"], P["num_blocks"], BLOCK_SIZE)
    out = torch.empty_like(q)

    def launch(module, **kw):
        return lambda: module.paged_prefill(q, P["k_cache"], P["v_cache"], P["block_tables"], P["num_blocks"],
                                            P["seq_lens"], cu, query_len, inv_freq, HEAD_DIM**-0.5,
                                            key_starts=key_starts, runs=runs, out=out, **kw)

    fns = {name: launch(module, **kw) for name, (module, kw) in kernels.items()}
    outputs = {name: fn().float().clone() for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(3):
        for name, fn in fns.items():
            times[name].append(bench_ms(fn, rep=100))
    base = next(iter(fns))
    median = {name: sorted(t)[1] for name, t in times.items()}
    return {name: {"ms": times[name], "median_ms": median[name], "speedup_vs_earlier": median[base] / median[name],
                   "max_abs_diff_vs_earlier": (outputs[name] - outputs[base]).abs().max().item()} for name in fns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="an earlier commit's kernels/prefill.py (git show <commit>:...)")
    ap.add_argument("--label", default="earlier")
    ap.add_argument("--out", default="benchmarks/results/prefill_ab_h200.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    earlier = load_kernel_module(args.old)
    kernels = {f"earlier ({args.label})": (earlier, {}), "now": (current, {}), "now, 3 stages": (current, {"num_stages": 3})}
    results = {"gpu": torch.cuda.get_device_name(), "earlier": args.label, "shapes": {}}
    for name, (segs, query_len) in shapes().items():
        results["shapes"][name] = compare(segs, query_len, kernels, device)
        print(name, {k: round(v["speedup_vs_earlier"], 3) for k, v in results["shapes"][name].items()}, flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
