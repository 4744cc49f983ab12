"""The paged prefill kernel against variants of it, and its rotation's cost, on one H200.

Side by side in one process (``benchmarks/kernels.py``'s ``launch_options``: interleaved
``--repeats`` times, median of triton's ``do_bench`` over CUDA-graph replays, L2 flushed): today's
kernel with its default launch (the ``default``), today's kernel with the rotation compiled out
(``rotation="none"``: what the rotation costs), today's kernel reading queries rotated
beforehand (``rotation="prerotated"``, issue 43: the small rotating kernel included), today's
kernel reading the step's K/V through pointers (``step_tma=False``: what the tensor descriptors
give), and each ``--variant`` file (a
whole ``kernels/prefill.py``: an earlier commit's, or one made from a patch in
``benchmarks/investigations/variants/``). Llama-3.1-8B heads (32/8, d128, bf16, block 16), the new tokens' K/V
handed to the kernel as the engine does. Shapes: ``kernels.py``'s 4k new tokens after 12k in 4
chunks, four serving-shaped batches (:func:`serving_shapes`), a 16k prompt, and a 20k prompt whose K/V
are views of one fused q/k/v product (the engine's layout). Each variant's largest difference from
the default's output is recorded (a variant marked "timing" in its patch computes something else).

    git show 954d456:kernels/prefill.py > /tmp/prefill_954d456.py
    patch -o /tmp/rotation_registers.py /tmp/prefill_954d456.py benchmarks/investigations/variants/rotation_registers.patch
    python benchmarks/investigations/prefill_variants.py --variant /tmp/prefill_954d456.py --variant /tmp/rotation_registers.py \\
        --out benchmarks/results/prefill_variants_h200.json

Write-up: docs/history/benchmarks-log.md, "Issue 19, eighth pass" (and "ninth pass" for ``--repeats 7``).
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

from benchmarks.kernels_setup import BLOCK_SIZE, build_paged, inv_freq_for, launch_options, prefill_segments
from lazyattn_rag.kernels import prefill as current
from lazyattn_rag.kernels.launch import block_key_starts, block_runs
from lazyattn_rag.kernels.query_rotation import plan_query_rotations

HEADS, KV_HEADS, HEAD_DIM, THETA = 32, 8, 128, 500000.0


def serving_shapes() -> dict:
    """name -> (per-sequence segments ``[(length, delta), ...]``, new tokens per sequence): batches
    as the serving sweep's steps make them (5 documents of 512 at distinct offsets per request)."""
    chunks = lambda b: [(512, 700 * c + 13 * b) for c in range(5)]  # noqa: E731 - 5 chunks at distinct offsets
    return {
        "16 requests: 5 chunks x 512 cached + 64 new": ([chunks(b) + [(64, 0)] for b in range(16)], 64),
        "16 encodes of 512 tokens (delta 0)": ([[(512, 0)] for _ in range(16)], 512),
        "4 requests: 5 chunks x 512 cached + 512 new": ([chunks(b) + [(512, 0)] for b in range(4)], 512),
        "1 prompt of 8192 tokens (delta 0)": ([[(8192, 0)]], 8192),
    }


def load_kernel_module(path: str):
    """A whole ``kernels/prefill.py`` from ``path`` (an earlier commit's, or a patched one)."""
    spec = importlib.util.spec_from_file_location("earlier_prefill", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def all_shapes() -> dict:
    """name -> (per-sequence segments, new tokens per sequence, K/V as views of a fused product)."""
    out = {"4k new after 12k in 4 chunks (kernels.py)": (prefill_segments(4096, 4, 3072), 4096, False)}
    out.update({name: (segs, q_len, False) for name, (segs, q_len) in serving_shapes().items()})
    out["1 prompt of 16384 tokens (delta 0)"] = ([[(16384, 0)]], 16384, False)
    out["1 prompt of 20480 tokens, K/V views of a fused q/k/v product"] = ([[(20480, 0)]], 20480, True)
    return out


def step_kv(P: dict, num_seqs: int, q_len: int, fused: bool, device) -> dict:
    """The new tokens' K/V (the last ``q_len`` keys of each sequence) as ``[tokens, KV_HEADS,
    HEAD_DIM]``: contiguous, or (``fused``) views into one ``[tokens, (HEADS + 2 KV_HEADS) *
    HEAD_DIM]`` tensor as the engine's q/k/v product gives them."""
    seq_len = P["seq_lens_list"][0]
    kv = {name: t[:, :, seq_len - q_len: seq_len].permute(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD_DIM).contiguous()
          for name, t in (("key", P["k_dense"]), ("value", P["v_dense"]))}
    if not fused:
        return kv
    qkv = torch.empty(num_seqs * q_len, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.bfloat16, device=device)
    views = qkv[:, HEADS * HEAD_DIM:].view(-1, 2 * KV_HEADS, HEAD_DIM)  # [tokens, 2 KV_HEADS, HEAD_DIM]
    views[:, :KV_HEADS].copy_(kv["key"])
    views[:, KV_HEADS:].copy_(kv["value"])
    return {"key": views[:, :KV_HEADS], "value": views[:, KV_HEADS:]}


def compare(segs, q_len: int, fused: bool, variants: dict, repeats: int, device, variant_rotations: bool = False) -> dict:
    P = build_paged(segs, KV_HEADS, HEAD_DIM, device, seed=3)
    num_seqs = len(segs)
    q = torch.randn(num_seqs * q_len, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    cu = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device=device)
    inv_freq = inv_freq_for(HEAD_DIM, THETA, device)
    key_starts = block_key_starts(P["block_tables"], P["num_blocks"])
    runs = block_runs(P["block_tables"], P["num_blocks"], BLOCK_SIZE)
    out = torch.empty_like(q)
    step = step_kv(P, num_seqs, q_len, fused, device)
    pairs = sum(q_len * (n - q_len) + q_len * (q_len + 1) // 2 for n in P["seq_lens_list"])
    context = max(P["seq_lens_list"]) - q_len

    def launch(module=current, **kw):
        return lambda: module.paged_prefill(q, P["k_cache"], P["v_cache"], P["block_tables"], P["num_blocks"],
                                            P["seq_lens"], cu, q_len, inv_freq, HEAD_DIM**-0.5, key_starts=key_starts,
                                            runs=runs, out=out, max_context_len=context, **step, **kw)

    rotations = plan_query_rotations(P["block_tables"].cpu(), P["num_blocks"].cpu(), cu.cpu(), device,
                                     block_size=BLOCK_SIZE)  # planned on the host once, as per engine step
    options = {name: dict(module=module) for name, module in variants.items()}
    for name, module in variants.items() if variant_rotations else ():
        options[f"{name}, rotation off"] = dict(module=module, rotation="none")
        options[f"{name}, queries rotated beforehand"] = dict(module=module, rotation="prerotated",
                                                              query_rotations=rotations)
    options["now, rotation off"] = dict(rotation="none")
    options["now, queries rotated beforehand"] = dict(rotation="prerotated", query_rotations=rotations)
    options["now, step K/V through pointers"] = dict(step_tma=False)
    return launch_options(launch, options, 4 * HEADS * HEAD_DIM * pairs, "TFLOPs", per=1e9, repeats=repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", default=[], help="a kernels/prefill.py to time beside today's")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant-rotations", action="store_true",
                    help="time each --variant with rotation='none' and 'prerotated' too")
    ap.add_argument("--shape", action="append", default=[],
                    help="time only the shapes whose name contains this text (repeatable; default: all)")
    ap.add_argument("--out", default="benchmarks/results/prefill_variants_h200.json")
    args = ap.parse_args()
    shapes = {name: shape for name, shape in all_shapes().items()
              if not args.shape or any(part in name for part in args.shape)}
    if not shapes:
        ap.error(f"no shape matches {args.shape}; shapes: {list(all_shapes())}")
    device = torch.device("cuda")
    variants = {Path(p).stem: load_kernel_module(p) for p in args.variant}
    results = {"gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
               "default": "today's kernels/prefill.py, default launch (rotation='query')", "shapes": {}}
    for name, (segs, q_len, fused) in shapes.items():
        res = results["shapes"][name] = compare(segs, q_len, fused, variants, args.repeats, device,
                                                     args.variant_rotations)
        print(name, {k: (round(v["median_ms"], 4), round(v["speedup_vs_default"], 3)) if "ms" in v else v
                     for k, v in res.items()}, flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
