"""The decode kernel with wide tiles (128 keys, 2 stages) at each split count against the default
launch, on kernel_profile's six sweep shapes (Llama-3.1-8B heads, bf16, cold L2, 3 interleaved
rounds): one JSON line per (shape, variant) on stdout. ``decode_wide_tile_sweep_h200.jsonl`` was
measured at 63eb21f, whose default was the split rule with 64-key tiles at every batch; since
then the default itself runs wide tiles from batch 32 at 8 KV heads (``decode.uses_wide_tiles``).

    python benchmarks/decode_wide_tiles.py > benchmarks/results/decode_wide_tile_sweep_h200.jsonl
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from benchmarks.kernel_profile import decode_inputs, DECODE_SHAPES, LLAMA
from benchmarks.kernels import bench_ms, inv_freq_for
from lazyattn_rag.kernels.decode import paged_decode
dev = torch.device("cuda")

for name, (b, c) in DECODE_SHAPES.items():
    P = decode_inputs(b, c, dev)
    out = torch.empty_like(P["q"])
    inv = inv_freq_for(LLAMA["head_dim"], LLAMA["theta"], dev)
    ml = max(P["seq_lens_list"])
    def f(**kw):
        return lambda: paged_decode(P["q"], P["k_cache"], P["v_cache"], P["block_tables"], P["num_blocks"], P["cu"],
                                    ml, inv, LLAMA["head_dim"] ** -0.5, runs=P["runs"], out=out, seq_ids=P["seq_ids"], **kw)
    vs = {"default": f()}
    for sp in (1, 2, 3, 4, 6, 8, 12, 16, 32, 49, 64):
        vs[f"block_n=128,stages=2,splits={sp}"] = f(block_n=128, num_stages=2, num_splits=sp)
    ref = vs["default"]().float().clone()
    diffs = {k: float((fn().float() - ref).abs().max()) for k, fn in vs.items()}
    t = {k: [] for k in vs}
    for _ in range(3):
        for k, fn in vs.items():
            t[k].append(bench_ms(fn))
    base = sorted(t["default"])[1]
    for k, v in t.items():
        print(json.dumps({"case": name, "variant": k, "ms": v, "median_ms": sorted(v)[1],
                          "speedup_vs_default": base / sorted(v)[1], "max_abs_diff_vs_default": diffs[k]}), flush=True)
