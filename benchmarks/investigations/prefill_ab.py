"""The paged prefill kernel of an earlier commit against today's, on serving-shaped batches (H200).

Side by side in one process (``benchmarks/kernels.py``'s ``launch_options``: interleaved 3 times,
median of triton's ``do_bench`` over CUDA-graph replays, L2 flushed; the earlier kernel is the
``default``): the earlier kernel file, today's kernel with its default launch and with each of
``TILE_CONFIGS`` (today's given the new tokens' K/V, as the engine does), on the prefills the
serving engine runs most (Llama
heads 32/8, d128, bf16, block 16): requests of 64 new tokens over 5 cached 512-token chunks at
distinct offsets, 512-token document encodes (no context, delta 0), and requests of 512 new
tokens over 5 chunks. Also each output's largest difference from the earlier kernel's.
(``results/prefill_ab_h200.json`` was written by this script's first form, same shapes and timing.)

    git show eb4fe53:kernels/prefill.py > /tmp/old_prefill.py
    python benchmarks/investigations/prefill_ab.py --old /tmp/old_prefill.py --label eb4fe53 --out benchmarks/results/prefill_ab_h200.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels_setup import BLOCK_SIZE, build_paged, inv_freq_for, launch_options
from lazyattn_rag.kernels import prefill as current
from lazyattn_rag.kernels.launch import block_key_starts, block_runs

HEADS, KV_HEADS, HEAD_DIM, THETA = 32, 8, 128, 500000.0
# launch configurations timed beside the default (block_m, block_n, warps, stages): the best of
# kernels.py's sweep for a causal prefill from the step's K/V (128 rows, 3 stages) and after
# cached chunks (64 x 64, one warpgroup, two programs per multiprocessor)
TILE_CONFIGS = [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3)]


def shapes() -> dict:
    """name -> (per-sequence segments ``[(length, delta), ...]``, new tokens per sequence)."""
    chunks = lambda b: [(512, 700 * c + 13 * b) for c in range(5)]  # noqa: E731 - 5 chunks at distinct offsets
    return {
        "16 requests: 5 chunks x 512 cached + 64 new": ([chunks(b) + [(64, 0)] for b in range(16)], 64),
        "16 encodes of 512 tokens (delta 0)": ([[(512, 0)] for _ in range(16)], 512),
        "4 requests: 5 chunks x 512 cached + 512 new": ([chunks(b) + [(512, 0)] for b in range(4)], 512),
        "1 prompt of 8192 tokens (delta 0)": ([[(8192, 0)]], 8192),
    }


def load_kernel_module(path: str):
    spec = importlib.util.spec_from_file_location("earlier_prefill", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(segs, query_len: int, earlier, device) -> dict:
    """``kernels.launch_options`` with the earlier kernel as the default: today's kernel (its
    default launch, and 3 stages) timed interleaved with it, outputs compared."""
    P = build_paged(segs, KV_HEADS, HEAD_DIM, device, seed=3)
    num_seqs = len(segs)
    q = torch.randn(num_seqs * query_len, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    cu = torch.arange(0, num_seqs * query_len + 1, query_len, dtype=torch.int32, device=device)
    inv_freq = inv_freq_for(HEAD_DIM, THETA, device)
    key_starts = block_key_starts(P["block_tables"], P["num_blocks"])
    runs = block_runs(P["block_tables"], P["num_blocks"], BLOCK_SIZE)
    out = torch.empty_like(q)
    pairs = sum(query_len * (n - query_len) + query_len * (query_len + 1) // 2 for n in P["seq_lens_list"])

    # the new tokens' K/V as the engine passes them (the last query_len keys of each sequence)
    seq_len = P["seq_lens_list"][0]
    step = {n: t[:, :, seq_len - query_len: seq_len].permute(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD_DIM)
            for n, t in (("key", P["k_dense"]), ("value", P["v_dense"]))}

    def launch(module=earlier, **kw):
        return lambda: module.paged_prefill(q, P["k_cache"], P["v_cache"], P["block_tables"], P["num_blocks"],
                                            P["seq_lens"], cu, query_len, inv_freq, HEAD_DIM**-0.5,
                                            key_starts=key_starts, runs=runs, out=out, **kw)

    variants = {"now": dict(module=current, **step)}
    for bm, bn, warps, stages in TILE_CONFIGS:
        variants[f"now, {bm}x{bn} w{warps} s{stages}"] = dict(module=current, block_m=bm, block_n=bn,
                                                               num_warps=warps, num_stages=stages, **step)
    return launch_options(launch, variants, 4 * HEADS * HEAD_DIM * pairs, "TFLOPs", per=1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="an earlier commit's kernels/prefill.py (git show <commit>:...)")
    ap.add_argument("--label", default="earlier")
    ap.add_argument("--out", default="benchmarks/results/prefill_ab_h200.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    earlier = load_kernel_module(args.old)
    results = {"gpu": torch.cuda.get_device_name(), "default": f"the earlier kernel ({args.label})", "shapes": {}}
    for name, (segs, query_len) in shapes().items():
        results["shapes"][name] = compare(segs, query_len, earlier, device)
        print(name, {k: v.get("speedup_vs_default", v.get("error"))
                     for k, v in results["shapes"][name].items()}, flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
