"""Kernel benchmark: deferred-RoPE paged decode and prefill vs dense torch SDPA, on one GPU.

Measures, for Llama-3.1-8B heads (32 q / 8 kv, d 128) and SmolLM2 heads (9 / 3, d 64), bf16:

* copy bandwidth: a large device-to-device copy (bytes read + bytes written over time), the
  ceiling for decode;
* decode at batch 32 x 8k context, every sequence a 256-token head plus 4 chunks of 1900 tokens
  at distinct offsets (partial last blocks) plus its own tokens, block size 16, blocks scattered
  over a larger pool: GB/s = K/V bytes of the context / time, against the copy bandwidth and
  against SDPA (flash, cuDNN) decode on the equivalent dense [B, H, L, D] K/V;
* prefill of 16k new tokens (causal, no cache): TFLOP/s = 4 * heads * head_dim * attended pairs /
  time, against SDPA flash and cuDNN with ``is_causal``; the new tokens' K/V are given to the
  kernel as the engine gives them (``key=``/``value=``, read contiguously), and the launch
  without them (every key through the block table) is timed beside it;
* prefill of 4k new tokens after 12k cached tokens in 4 chunks at offsets, against SDPA with a
  bottom-right causal mask where the backend takes one;
* decode at batch 1 x 20k context (the same layout, 12.6k own tokens), with its own sweep of the
  split count and tile shape (few programs: the split count decides the occupancy);
* rotation overhead: the same kernels with the rotation compiled out (``rotation="none"``);
  for prefill also the K-tile rotation (``rotation="key"``) and the queries rotated beforehand by
  a small kernel (``rotation="prerotated"``, issue 43) against the default query rotation once
  per chunk (``rotation="query"``).
* chunk attention scaling (APE, issue 20): the same kernels with every chunk block flagged and
  ``ChunkScaling(0.8, 0.9)``, against the plain run.

Every time is the median of many runs with the L2 cache flushed before each (triton's do_bench),
each run a CUDA-graph replay so that host launch overhead is not counted. Sanity checks compare
the kernels (rotation off) with SDPA on the same data before timing.

    python benchmarks/kernels.py --out benchmarks/results/kernels_h200.json            # with tile sweeps
    python benchmarks/kernels.py --quick --out benchmarks/results/kernels_h200.json    # default configs
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
import triton.testing

from benchmarks.kernels_setup import (BLOCK_SIZE, CHUNK_SCALING, DTYPE, MODELS, add_chunk_scaling, bench_ms,
                                      build_paged, config_sweep, copy_bandwidth, decode_segments, flag_chunk_blocks,
                                      inv_freq_for, launch_options, prefill_segments, rel_err, sdpa_runner)
from lazyattn_rag.kernels.decode import paged_decode
from lazyattn_rag.kernels.launch import block_key_starts, block_runs
from lazyattn_rag.kernels.prefill import (
    CONFIG_CACHED,
    CONFIG_LONG_STEP,
    _default_config,
    _shared_bytes,
    paged_prefill,
)
from lazyattn_rag.kernels.query_rotation import plan_query_rotations

QUICK = False  # --quick: default configs only


def bench_decode(name: str, cfg: dict, copy_gbps: float, device, batch=32, context=8192) -> dict:
    Hq, Hkv, D = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    P = build_paged(decode_segments(batch, context), Hkv, D, device, seed=1)
    q = torch.randn(batch, Hq, D, dtype=DTYPE, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    inv_freq = inv_freq_for(D, cfg["theta"], device)
    scale = D**-0.5
    max_len = max(P["seq_lens_list"])
    kv_bytes = sum(P["seq_lens_list"]) * Hkv * D * 2 * 2
    out = torch.empty_like(q)
    res = {"shape": f"batch {batch} x {context} ctx, {Hq}/{Hkv} heads, d{D}, bf16, block 16, 4 chunks/seq",
           "kv_bytes": kv_bytes, "copy_GBps": copy_gbps}

    runs = block_runs(P["block_tables"], P["num_blocks"], BLOCK_SIZE)  # once per batch, as the backend does
    scaled_tables, scaled_runs = flag_chunk_blocks(P)

    def ours(splits=None, block_n=None, rotation="query", warps=None, stages=None, scaled=False, **options):
        tables, run_list = (scaled_tables, scaled_runs) if scaled else (P["block_tables"], runs)
        return lambda: paged_decode(q, P["k_cache"], P["v_cache"], tables, P["num_blocks"], cu, max_len,
                                    inv_freq, scale, runs=run_list, out=out, num_splits=splits, rotation=rotation,
                                    block_n=block_n, num_warps=warps, num_stages=stages,
                                    chunk_scaling=CHUNK_SCALING if scaled else None, **options)

    # sanity: rotation compiled out == SDPA on the stored (local-position) keys
    qd = q[:, :, None, :]  # [B, H, 1, D]
    ref = torch.nn.functional.scaled_dot_product_attention(
        qd.float(), P["k_dense"].float().repeat_interleave(Hq // Hkv, 1), P["v_dense"].float().repeat_interleave(Hq // Hkv, 1))
    ours(rotation="none")()
    res["check_rel_err_vs_sdpa_fp32"] = rel_err(out, ref[:, :, 0])
    if batch == 1:  # the v3 sweep's best tile (128 keys) against the default's 64
        res["launch_options"] = launch_options(ours, {"block_n=128": dict(block_n=128)}, kv_bytes, "GBps")

    if QUICK:  # defaults only (the sweeps of earlier runs are in results/kernels_h200_v*.json)
        return finish_decode(res, lambda rotation, scaled=False: ours(rotation=rotation, scaled=scaled), "default",
                             kv_bytes, copy_gbps, qd, P)
    # Tile shape, warps and stages around the default (64 keys at d128, 4 warps, 3 stages), at
    # split counts around choose_num_splits' (3 at batch 32 x 8k, 49 at batch 1 x 20k on an H200).
    configs = {f"block_n={bn},splits={sp},warps={wp},stages={st}": dict(splits=sp, block_n=bn, warps=wp, stages=st)
               for bn in (32, 64, 128) for sp in ((16, 32, 49, 64) if batch == 1 else (1, 3, 6))
               for wp, st in ((4, 2), (4, 3), (4, 4), (8, 3))}
    res["sweep"], best_key = config_sweep(ours, configs, kv_bytes, "GBps")
    res["default_config_ms"] = bench_ms(ours())
    res["default_config_GBps"] = kv_bytes / res["default_config_ms"] / 1e6
    best = configs[best_key]
    return finish_decode(res, lambda rotation, scaled=False: ours(rotation=rotation, scaled=scaled, **best), best_key,
                         kv_bytes, copy_gbps, qd, P)


def finish_decode(res, make, config, kv_bytes, copy_gbps, qd, P) -> dict:
    ms_on = [bench_ms(make("query")) for _ in range(2)]
    ms_off = [bench_ms(make("none")) for _ in range(2)]
    res["config"] = config
    res["ours_ms"] = ms_on
    res["ours_GBps"] = kv_bytes / min(ms_on) / 1e6
    res["ours_fraction_of_copy"] = res["ours_GBps"] / copy_gbps
    res["rotation_off_ms"] = ms_off
    res["rotation_overhead_pct"] = 100 * (sorted(ms_on)[0] / sorted(ms_off)[0] - 1)
    res["rotation_overhead_spread_pct"] = 100 * (max(ms_on) - min(ms_on)) / min(ms_on)
    add_chunk_scaling(res, make, ms_on)
    for backend in ("flash", "cudnn"):
        try:
            fn, how = sdpa_runner(backend, qd, P["k_dense"], P["v_dense"])
            ms = bench_ms(fn)
            res[f"sdpa_{backend}"] = {"ms": ms, "GBps": kv_bytes / ms / 1e6, "how": how,
                                      "ours_speedup": ms / min(ms_on)}
        except Exception as e:  # noqa: BLE001
            res[f"sdpa_{backend}"] = {"error": repr(e)[:300]}
    return res


def bench_prefill(name: str, cfg: dict, device, new_tokens=16384, cached_chunks=0, chunk_len=3072) -> dict:
    Hq, Hkv, D = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    P = build_paged(prefill_segments(new_tokens, cached_chunks, chunk_len), Hkv, D, device, seed=2)
    seq_len = P["seq_lens_list"][0]
    ctx = seq_len - new_tokens
    q = torch.randn(new_tokens, Hq, D, dtype=DTYPE, device=device)
    cu = torch.tensor([0, new_tokens], dtype=torch.int32, device=device)
    inv_freq = inv_freq_for(D, cfg["theta"], device)
    scale = D**-0.5
    ks = block_key_starts(P["block_tables"], P["num_blocks"])
    runs = block_runs(P["block_tables"], P["num_blocks"], BLOCK_SIZE)
    scaled_tables, scaled_runs = flag_chunk_blocks(P)
    out = torch.empty_like(q)
    pairs = new_tokens * ctx + new_tokens * (new_tokens + 1) // 2
    flops = 4 * Hq * D * pairs
    res = {"shape": f"{new_tokens} new tokens after {ctx} cached ({cached_chunks} chunks), {Hq}/{Hkv} heads, d{D}, bf16",
           "flops": flops}

    # the new tokens' K/V as the engine hands them to the kernel with the cache (the same values)
    k_new = P["k_dense"][0, :, ctx:].transpose(0, 1).contiguous()  # [new_tokens, Hkv, D]
    v_new = P["v_dense"][0, :, ctx:].transpose(0, 1).contiguous()

    # rotation="prerotated": the layout of the rows rotated beforehand, planned once on the host as
    # the engine would plan it once per step (the rotating kernel itself runs inside each call)
    rotations = plan_query_rotations(P["block_tables"].cpu(), P["num_blocks"].cpu(), cu.cpu(), device,
                                     block_size=BLOCK_SIZE)

    def ours(rotation="query", bm=None, bn=None, warps=None, stages=None, scaled=False, step=True, **options):
        tables, run_list = (scaled_tables, scaled_runs) if scaled else (P["block_tables"], runs)
        if rotation == "prerotated":
            options = {**options, "query_rotations": rotations}
        return lambda: paged_prefill(q, P["k_cache"], P["v_cache"], tables, P["num_blocks"], P["seq_lens"],
                                     cu, new_tokens, inv_freq, scale, key_starts=ks, runs=run_list, out=out,
                                     rotation=rotation, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                                     chunk_scaling=CHUNK_SCALING if scaled else None,
                                     key=k_new if step else None, value=v_new if step else None,
                                     max_context_len=ctx, **options)

    qd = q.transpose(0, 1)[None]  # [1, H, L, D]
    mask_kw = {"is_causal": True} if ctx == 0 else None
    if ctx:
        from torch.nn.attention.bias import causal_lower_right

        mask_kw = {"attn_mask": causal_lower_right(new_tokens, seq_len)}
    # sanity: rotation compiled out == SDPA (flash) on the stored keys
    try:
        fn, _ = sdpa_runner("flash", qd, P["k_dense"], P["v_dense"], **mask_kw)
        ours(rotation="none")()
        res["check_rel_err_vs_sdpa_flash"] = rel_err(out.transpose(0, 1)[None], fn())
    except Exception as e:  # noqa: BLE001
        res["check_rel_err_vs_sdpa_flash"] = repr(e)[:200]

    out_key = ours("key")().clone()
    out_pre = ours("prerotated")().clone()
    ours("query")()
    res["check_rel_err_query_vs_key_rotation"] = rel_err(out, out_key)  # two independent rotation paths
    res["check_prerotated_equals_query"] = bool(torch.equal(out, out_pre))
    default = _default_config(D, BLOCK_SIZE, False, q.element_size(), new_tokens, ctx, _shared_bytes(device))
    res["default_launch"] = default
    variants = {}
    for bm, bn, warps, stages in (CONFIG_CACHED, CONFIG_LONG_STEP):  # the tile rule's other choice
        if (bm, bn, warps, stages) != tuple(default[k] for k in ("block_m", "block_n", "num_warps", "num_stages")):
            variants[f"{bm}x{bn} w{warps} s{stages}"] = dict(bm=bm, bn=bn, warps=warps, stages=stages)
    variants["new_tokens_through_block_table"] = dict(step=False)  # the kernel without key=/value=
    res["launch_options"] = launch_options(ours, variants, flops, "TFLOPs", per=1e9)
    if QUICK:
        return finish_prefill(res, lambda rotation, scaled=False: ours(rotation, scaled=scaled), "default", flops, qd,
                              P, mask_kw)
    # 64-row tiles of one warpgroup with 2-3 stages of 64 keys fit two programs per multiprocessor
    # (registers <= 255 at 4 warps, shared memory <= 114 KB each): the other program's softmax can
    # overlap this one's products
    configs = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (128, 128, 8, 3),
               (64, 128, 4, 3), (64, 128, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 4),
               (128, 64, 8, 2), (256, 64, 8, 2), (256, 128, 8, 2)]
    named = {f"block_m={bm},block_n={bn},warps={w},stages={st}": dict(bm=bm, bn=bn, warps=w, stages=st)
             for bm, bn, w, st in configs}
    res["sweep"], best_key = config_sweep(ours, named, flops, "TFLOPs", per=1e9)
    res["default_config_ms"] = bench_ms(ours())
    best = named[best_key]
    return finish_prefill(res, lambda rotation, scaled=False: ours(rotation, scaled=scaled, **best), best_key,
                          flops, qd, P, mask_kw)


def finish_prefill(res, make, config, flops, qd, P, mask_kw) -> dict:
    ms_on = [bench_ms(make("query")) for _ in range(2)]
    ms_off = [bench_ms(make("none")) for _ in range(2)]
    ms_key = [bench_ms(make("key")) for _ in range(2)]
    ms_pre = [bench_ms(make("prerotated")) for _ in range(2)]
    res["key_tile_rotation_ms"] = ms_key
    res["prerotated_ms"] = ms_pre  # queries rotated beforehand (issue 43), the rotating kernel included
    res["prerotated_overhead_pct"] = 100 * (min(ms_pre) / min(ms_off) - 1)
    res["key_tile_rotation_overhead_pct"] = 100 * (min(ms_key) / min(ms_off) - 1)
    res["config"] = config
    res["ours_ms"] = ms_on
    res["ours_TFLOPs"] = flops / min(ms_on) / 1e9
    res["rotation_off_ms"] = ms_off
    res["rotation_overhead_pct"] = 100 * (min(ms_on) / min(ms_off) - 1)
    res["rotation_overhead_spread_pct"] = 100 * (max(ms_on) - min(ms_on)) / min(ms_on)
    add_chunk_scaling(res, make, ms_on)
    for backend in ("flash", "cudnn"):
        try:
            fn, how = sdpa_runner(backend, qd, P["k_dense"], P["v_dense"], **mask_kw)
            ms = bench_ms(fn)
            res[f"sdpa_{backend}"] = {"ms": ms, "TFLOPs": flops / ms / 1e9, "how": how, "ours_speedup": ms / min(ms_on)}
        except Exception as e:  # noqa: BLE001
            res[f"sdpa_{backend}"] = {"error": repr(e)[:300]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/kernels_h200.json")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--quick", action="store_true", help="default tile configs only, no sweeps")
    args = ap.parse_args()
    global QUICK
    QUICK = args.quick
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    results = {
        "hardware": {"gpu": props.name, "sms": props.multi_processor_count, "memory_GiB": props.total_memory / 2**30,
                     "l2_MiB": getattr(props, "L2_cache_size", 0) / 2**20},
        "software": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version(), "python": platform.python_version()},
        "method": "median of do_bench runs (L2 flushed before each run), each run a CUDA-graph replay; bf16",
        "quick": args.quick,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    results["copy"] = copy_bandwidth(device)
    print(f"copy: {results['copy']['GBps']:.0f} GB/s", flush=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    for name in args.models.split(","):
        cfg = MODELS[name]
        entry = results.setdefault(name, {})
        steps = []
        if not args.skip_decode:
            steps.append(("decode_b32_8k", lambda: bench_decode(name, cfg, results["copy"]["GBps"], device)))
            steps.append(("decode_b1_20k", lambda: bench_decode(name, cfg, results["copy"]["GBps"], device, 1, 20480)))
        if not args.skip_prefill:
            steps.append(("prefill_16k_causal", lambda: bench_prefill(name, cfg, device)))
            steps.append(("prefill_4k_after_12k_chunks", lambda: bench_prefill(name, cfg, device, 4096, 4, 3072)))
        for key, step in steps:
            t0 = time.time()
            try:
                entry[key] = step()
            except Exception:  # noqa: BLE001
                entry[key] = {"error": traceback.format_exc()[-1500:]}
            entry[key]["bench_wall_s"] = round(time.time() - t0, 1)
            save()
            print(name, key, json.dumps({k: v for k, v in entry[key].items() if k != "sweep"}, default=str)[:1500],
                  flush=True)
            torch.cuda.empty_cache()
    save()
    summary(results)


def summary(results: dict) -> None:
    print("\n| model | bench | ours | SDPA flash | SDPA cuDNN | rotation overhead |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in MODELS:
        for key, r in results.get(name, {}).items():
            if "error" in r:
                print(f"| {name} | {key} | error | | | |")
                continue
            unit = "GBps" if key.startswith("decode") else "TFLOPs"
            cells = [f"{r.get('ours_' + unit, math.nan):.0f} {unit}"]
            for b in ("flash", "cudnn"):
                s = r.get(f"sdpa_{b}", {})
                cells.append(f"{s[unit]:.0f} ({s['ours_speedup']:.2f}x)" if unit in s else "n/a")
            cells.append(f"{r.get('rotation_overhead_pct', math.nan):+.2f}%")
            print(f"| {name} | {key} | " + " | ".join(cells) + " |")
    for name in MODELS:
        for key, r in results.get(name, {}).items():
            for option, o in r.get("launch_options", {}).items():
                print(f"{name} {key} {option}: " + (o["error"] if "error" in o else
                      f"{o['median_ms']:.4f} ms, {o['speedup_vs_default']:.3f}x default, "
                      f"max |diff| {o['max_abs_diff_vs_default']:.2e}"))


if __name__ == "__main__":
    main()
