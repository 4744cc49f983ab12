"""Compile the attention kernels for Hopper (sm_90a) without a GPU and print their resource usage.

Registers per thread and stack bytes (spills, and libdevice's local array for large-argument
sin/cos) per kernel configuration, read with the ``cuobjdump`` that Triton's NVIDIA backend ships.
Costs no device time; use it before spending any. Integer and pointer arguments are compiled as
divisible by 16, which is how Triton's JIT specializes them for the engine's contiguous caches
(without that, loads are not vectorized and every configuration looks like it spills).

    python benchmarks/kernel_resources.py

The local Triton may differ from the device's (3.9 here, 3.6 on the H200 image): read the numbers
as leads.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lazyattn_rag.kernels import decode, prefill
from lazyattn_rag.kernels.launch import ROTATION_CODES

POINTER_TYPES = {
    "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16", "key_ptr": "*bf16",
    "value_ptr": "*bf16", "q_rot_ptr": "*bf16", "qr_run_rows_ptr": "*i32",
    "block_tables_ptr": "*i64", "inv_freq_ptr": "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
}


FLOAT_ARGS = ("sm_scale_log2", "chunk_inv_temperature", "chunk_log2_weight")  # the kernels' float scalars


def cuobjdump() -> str:
    found = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(found) if found.exists() else (shutil.which("cuobjdump") or "cuobjdump")


def resources(fn, constexprs: dict, num_warps: int, num_stages: int, types: dict | None = None) -> str:
    """``types`` overrides :data:`POINTER_TYPES` (e.g. a tensor descriptor's ``tensordesc<...>``)."""
    names = fn.arg_names
    types = {**POINTER_TYPES, **(types or {})}
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in types:
            sig[n] = types[n]
        elif n.endswith("_ptr"):
            sig[n] = "*i32"
        else:
            sig[n] = "fp32" if n in FLOAT_ARGS else "i32"
    divisible = [n for n in names if n.endswith("_ptr") or n.startswith("stride")]
    src = ASTSource(
        fn=fn, signature=sig,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible},
    )
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([cuobjdump(), "--dump-resource-usage", str(path)], capture_output=True, text=True).stdout
    line = next((x for x in out.splitlines() if "REG:" in x), "")
    fields = dict(f.split(":") for f in line.split() if ":" in f and f.split(":")[0] in ("REG", "STACK", "SHARED"))
    return f"regs {fields.get('REG', '?'):>3}  stack {fields.get('STACK', '?'):>4} B"


def rope(head_dim: int) -> dict:
    return dict(HEAD_DIM=head_dim, HALF=head_dim // 2, PAIR_STRIDE=1, X2_OFF=head_dim // 2, BLOCK_SIZE=16,
                ACCURATE_TRIG=True, DOT_PRECISION=None, DOT_UPCAST=False, CHUNK_SCALING=False, KV_SCALED=False)


def main() -> None:
    print("kernel   heads       tile               rotation  resources")
    for head_dim, group, (bm, bn, warps, stages) in ((128, 4, (64, 64, 4, 3)), (128, 4, (128, 64, 8, 3)),
                                                    (64, 3, (128, 64, 4, 3))):
        for rotation, tma in (("none", True), ("query", True), ("prerotated", True), ("key", True), ("query", False)):
            c = dict(rope(head_dim), GROUP=group, BLOCK_M=bm, BLOCK_N=bn, TILE_BLOCKS=bn // 16, IN_STEP=True,
                     ROTATION=ROTATION_CODES[rotation], STEP_TMA=tma)
            desc = f"tensordesc<bf16[{bn},{head_dim}]>"  # the step's K/V boxes (STEP_TMA, the Hopper default)
            types = {"key_desc": desc, "value_desc": desc} if tma else {"key_desc": "*bf16", "value_desc": "*bf16"}
            label = rotation + ("" if tma else ", step K/V through pointers")
            print(f"prefill  d{head_dim:<3} g{group}    {bm}x{bn} w{warps} s{stages}    {label:<8}  "
                  f"{resources(prefill.prefill_kernel, c, warps, stages, types)}")
    for head_dim, group, bn, split, stages in ((128, 4, 64, True, 3), (128, 4, 128, False, 2), (64, 3, 128, True, 3)):
        for rotation in ("none", "query"):
            c = dict(rope(head_dim), GROUP=group, BLOCK_G=16, BLOCK_N=bn, TILE_BLOCKS=bn // 16, SPLIT_KV=split,
                     ROTATION=ROTATION_CODES[rotation], FP8_DOTS_F16=False)
            print(f"decode   d{head_dim:<3} g{group}    n{bn} split {split:d} w4 s{stages}   {rotation:<8}  "
                  f"{resources(decode.decode_kernel, c, 4, stages)}")
    fp8 = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    for split, stages in ((False, 2), (True, 3)):  # FP8 caches (issue 42): 128-key tiles, float16 dots or not
        for f16 in (True, False):
            c = dict(rope(128), GROUP=4, BLOCK_G=16, BLOCK_N=128, TILE_BLOCKS=8, SPLIT_KV=split,
                     ROTATION=ROTATION_CODES["query"], KV_SCALED=True, FP8_DOTS_F16=f16)
            print(f"decode   d128 g4    n128 split {split:d} w4 s{stages}   fp8, {'f16' if f16 else 'bf16'} dots  "
                  f"{resources(decode.decode_kernel, c, 4, stages, fp8)}")


if __name__ == "__main__":
    main()
