"""FP8 KV cache, decode attention (issue 42): our decode kernel reading FP8 rows and their per-token
scales, against the same kernel on bfloat16 and against cuDNN's bfloat16 SDPA on dense K/V, on one GPU.

Shapes (Llama-3.1-8B heads, 32 q / 8 kv, d 128, block size 16, blocks scattered over the pool):
batch 32 x 8k and batch 1 x 20k (the layout of ``benchmarks/kernels.py``: a head plus 4 chunks
at distinct offsets per sequence), and batch 16 x 2,720 (a decode step of the serving sweep: a
64-token head and 5 documents of 512 per sequence). For each shape the variants run in
interleaved rounds (bf16, FP8, cuDNN, the FP8 launch variants, then again), each a median of
CUDA-graph replays with a cold L2 (``bench_ms``); a variant's figure is the median over rounds.
Reported per variant: ms, decode tokens/s (batch / time: one token per sequence per step) and
GB/s (the bytes that variant reads: bfloat16 K/V, or FP8 K/V plus one float32 scale per token
and KV head for K and for V). The FP8 variants (``FP8_LAUNCHES``) change the tile (``block_n``,
stages), the split count, or go back to bfloat16 dots (``fp8_dots_f16=False``); ``fp8 scales
head-major`` reads the same scales laid out ``[blocks, kv_heads, slots]`` (the kernels index scales
by their strides), so a program's scales of one block are contiguous. Sanity: the FP8
kernel against the bfloat16 kernel on the dequantized data (relative error) and against the
bfloat16 data (the rounding).

    python benchmarks/fp8_decode.py --out benchmarks/results/fp8_decode_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton

from benchmarks.kernels_setup import MODELS, bench_ms, build_paged, decode_segments, inv_freq_for, rel_err, sdpa_runner
from lazyattn_rag.kernels.decode import paged_decode
from lazyattn_rag.kernels.launch import block_runs
from lazyattn_rag.types.kv_quant import dequantize_rows, quantize_rows

def serving_segments(batch: int, context: int) -> list[list[tuple[int, int]]]:
    """The serving trace's decode layout (``benchmarks/serving.py``): a 64-token head, 5 documents
    of 512 tokens at offsets distinct per sequence, and the sequence's own tokens up to ``context``."""
    head, n_chunks, chunk = 64, 5, 512
    return [[(head, 0)] + [(chunk, c * chunk + 7 * b) for c in range(n_chunks)]
            + [(context - head - n_chunks * chunk, 0)] for b in range(batch)]


# (batch, context, layout): the two shapes, and a step of the serving sweep at 1 GiB
# (16 requests decoding over 5 pasted documents each, where FP8 decode moved ~1.3 TB/s in the
# serving profile of 2026-12-06 against bf16's ~2.9)
SHAPES = [(32, 8192, decode_segments), (1, 20480, decode_segments), (16, 2720, serving_segments)]
# the default FP8 launch takes twice bf16's keys per tile (the same bytes); these around it
FP8_LAUNCHES = {"block_n=64": dict(block_n=64),
                "block_n=128,stages=2": dict(block_n=128, num_stages=2),
                "splits=1": dict(num_splits=1), "splits=2": dict(num_splits=2),
                "bf16 dots": dict(fp8_dots_f16=False),  # the tiles widened to bfloat16 (before 2026-12-06)
                "warps=8": dict(num_warps=8), "warps=8,block_n=256": dict(num_warps=8, block_n=256),
                "warps=8,splits=2": dict(num_warps=8, num_splits=2),
                # smaller programs, more of them resident: 64 keys a tile with 2 to 4 splits
                "block_n=64,splits=2": dict(block_n=64, num_splits=2), "block_n=64,splits=4": dict(block_n=64, num_splits=4),
                "block_n=64,stages=2,splits=3": dict(block_n=64, num_stages=2, num_splits=3),
                "splits=3": dict(num_splits=3)}


def bench_shape(cfg: dict, batch: int, context: int, layout, rounds: int, device) -> dict:
    heads, kv_heads, head_dim = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    P = build_paged(layout(batch, context), kv_heads, head_dim, device, seed=1)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    inv_freq, scale, max_len = inv_freq_for(head_dim, cfg["theta"], device), head_dim**-0.5, max(P["seq_lens_list"])
    runs = block_runs(P["block_tables"], P["num_blocks"], 16)
    (k8, ks), (v8, vs) = quantize_rows(P["k_cache"], torch.float8_e4m3fn), quantize_rows(P["v_cache"], torch.float8_e4m3fn)
    k8, v8, ks, vs = k8.contiguous(), v8.contiguous(), ks.contiguous(), vs.contiguous()
    # the same scales as views of [blocks, kv_heads, slots] storage: a program's scales of a block
    # are 16 contiguous floats instead of 16 floats kv_heads apart (one 32-byte sector each)
    head_major = [x.permute(0, 2, 1).contiguous().permute(0, 2, 1) for x in (ks, vs)]
    num_keys = sum(P["seq_lens_list"])
    bytes_read = {"bf16": num_keys * kv_heads * head_dim * 2 * 2, "fp8": num_keys * kv_heads * (head_dim + 4) * 2}
    out = torch.empty_like(q)

    def ours(fp8: bool, scales_head_major: bool = False, **launch):
        caches = (k8, v8) if fp8 else (P["k_cache"], P["v_cache"])
        scales = dict(zip(("key_scale", "value_scale"), head_major if scales_head_major else (ks, vs))) if fp8 else {}
        return lambda: paged_decode(q, *caches, P["block_tables"], P["num_blocks"], cu, max_len, inv_freq, scale,
                                    runs=runs, out=out, **scales, **launch)

    chunks = "5 chunks of 512" if layout is serving_segments else "4 chunks of 1900"
    res = {"shape": f"batch {batch} x {context}, {heads}/{kv_heads} heads, d{head_dim}, block 16, {chunks}/seq",
           "num_keys": num_keys, "bytes_read": bytes_read}
    ours(False)()
    bf16_out = out.clone()
    ours(True, scales_head_major=True)()
    head_major_out = out.clone()
    ours(True)()
    res["fp8_vs_bf16_data_rel_err"] = rel_err(out, bf16_out)
    res["fp8_scales_head_major_equal"] = bool(torch.equal(head_major_out, out))
    dq_k = dequantize_rows(k8, ks).to(torch.bfloat16)
    dq_v = dequantize_rows(v8, vs).to(torch.bfloat16)
    paged_decode(q, dq_k, dq_v, P["block_tables"], P["num_blocks"], cu, max_len, inv_freq, scale, runs=runs, out=bf16_out)
    res["fp8_vs_bf16_kernel_on_dequantized_rel_err"] = rel_err(out, bf16_out)
    del dq_k, dq_v

    qd = q[:, :, None, :]
    cudnn, how = sdpa_runner("cudnn", qd, P["k_dense"], P["v_dense"])
    variants = {"bf16": ours(False), "fp8": ours(True), "cudnn_bf16": cudnn}
    variants |= {f"fp8 {name}": ours(True, **launch) for name, launch in FP8_LAUNCHES.items()}
    variants["bf16 warps=8"] = ours(False, num_warps=8)  # the bf16 kernel gets the same offer
    variants["fp8 scales head-major"] = ours(True, scales_head_major=True)  # issue 42's scale-layout lead
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(bench_ms(fn))
    for name, ms_list in times.items():
        ms = statistics.median(ms_list)
        read = bytes_read["fp8" if name.startswith("fp8") else "bf16"]
        res[name] = {"ms": ms, "ms_rounds": ms_list, "tokens_per_s": batch / ms * 1e3, "GBps": read / ms / 1e6}
    res["cudnn_how"] = how
    best_fp8 = min((n for n in times if n.startswith("fp8")), key=lambda n: res[n]["ms"])
    res["fp8_best"] = best_fp8
    res["fp8_speedup_vs_bf16"] = res["bf16"]["ms"] / res["fp8"]["ms"]
    res["fp8_best_speedup_vs_bf16"] = res["bf16"]["ms"] / res[best_fp8]["ms"]
    res["fp8_speedup_vs_cudnn_bf16"] = res["cudnn_bf16"]["ms"] / res["fp8"]["ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/fp8_decode_h200.json")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    device = torch.device("cuda")
    results = {"command": "python benchmarks/fp8_decode.py --out " + args.out, "date": time.strftime("%Y-%m-%d %H:%M"),
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "cudnn": torch.backends.cudnn.version(), "python": platform.python_version(), "rounds": args.rounds}
    for batch, context, layout in SHAPES:
        key = f"llama3.1-8b batch {batch} x {context}"
        results[key] = bench_shape(MODELS["llama3.1-8b"], batch, context, layout, args.rounds, device)
        r = results[key]
        print(f"{key}: bf16 {r['bf16']['ms']:.4f} ms ({r['bf16']['GBps']:.0f} GB/s), fp8 {r['fp8']['ms']:.4f} ms "
              f"({r['fp8']['GBps']:.0f} GB/s, x{r['fp8_speedup_vs_bf16']:.2f}), best {r['fp8_best']} "
              f"x{r['fp8_best_speedup_vs_bf16']:.2f}, cudnn {r['cudnn_bf16']['ms']:.4f} ms", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
