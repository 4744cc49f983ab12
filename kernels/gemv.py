"""Matrix-vector product for decode steps of one sequence: ``y = x W^T + b`` with one row ``x``.

Its reference is ``torch.nn.functional.linear`` (the same product; float32 accumulation on both
sides, in another order, so results agree to rounding).

At batch 1 a decode step is bound by reading its weights once. On an H200 (``benchmarks/gemv.py``,
32 weights per product in one CUDA graph) cuBLAS reads Llama-3.1-8B's q/k/v, output and down projections at
2.6-3.7 TB/s at one row, two of them as split-K GEMMs with a separate reduction kernel; this
kernel reads them at 3.2-4.0 TB/s in one launch each. The gate/up product (117 Mi weights) is
as fast under cuBLAS, so :func:`gemv_applies` keeps the large products there.

Kernel structure: one program computes ``BLOCK_N`` outputs. It walks ``K`` in ``BLOCK_K`` steps,
each loading a ``[BLOCK_N, BLOCK_K]`` tile of ``W`` (row-major, ``K`` contiguous) and the matching
slice of ``x``, and accumulates their elementwise products in float32; one row sum at the end.
No tensor cores: at one row the product is a stream of loads (two FLOPs per weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Weights up to this many elements go through the kernel; larger ones stay with cuBLAS (the
# measured gate/up product, 117 Mi weights, is 1.5 % faster there; on the others, 16-56 Mi, the
# kernel takes 7-18 % less time).
GEMV_MAX_WEIGHT_ELEMENTS = 64 * 2**20


@triton.jit
def gemv_kernel(
    x_ptr,  # [K] the one input row (contiguous)
    w_ptr,  # [N, K] weight, row stride stride_wn, K contiguous
    b_ptr,  # [N] bias (read only with HAS_BIAS)
    y_ptr,  # [N] output (contiguous)
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks
    BLOCK_N: tl.constexpr,  # outputs per program
    BLOCK_K: tl.constexpr,  # weights per row and step
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptr + k0 + offs_k)
        else:
            k_ok = k0 + offs_k < K
            w = tl.load(w_ptrs + k0, mask=(offs_n < N)[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for an ``[n, k]`` weight.

    The best of the H200 sweep (``benchmarks/gemv.py``; 8 or 16 outputs, 512 or 1,024 weights per
    step, 4 or 8 warps, 2-4 stages; q/k/v 13.88 us against cuBLAS's 15.14, output 10.50 against
    12.83, down 29.30 against 31.48): from 6,144 outputs (the q/k/v product: 768
    programs) 8 outputs per program, 4 warps and 512-wide steps; below (the output and down
    projections: 4,096 outputs) 16 outputs, 8 warps and 1,024-wide steps, so 256 programs."""
    if n >= 6144:
        return 8, min(512, triton.next_power_of_2(k)), 4, 3
    return 16, min(1024, triton.next_power_of_2(k)), 8, 3


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the compiled layers hand this product to :func:`gemv`: one row on a CUDA device,
    contiguous along ``K > 0``, half-type operands of one dtype on one device, a 2-D weight of at
    most ``GEMV_MAX_WEIGHT_ELEMENTS`` contiguous along ``K``, a 1-D bias or none, and nothing
    that needs a gradient (the kernel has no backward)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.float16, torch.bfloat16)
            and x.stride(-1) == 1 and weight.dim() == 2 and weight.shape[1] == x.shape[1] > 0
            and weight.dtype == x.dtype and weight.device == x.device and weight.stride(-1) == 1
            and weight.numel() <= GEMV_MAX_WEIGHT_ELEMENTS
            and (bias is None or (bias.dim() == 1 and bias.device == x.device))
            and not _needs_grad(x, weight, bias))


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for one row.

    Args:
        x: ``[1, K]``, contiguous along ``K``; float16, bfloat16 or float32.
        weight: ``[N, K]``, contiguous along ``K`` (an ``nn.Linear`` weight), ``x``'s dtype and device.
        bias: ``[N]`` on ``x``'s device, or ``None``.

    Returns:
        ``[1, N]`` in ``x``'s dtype (float32 accumulation, rounded once); no autograd graph.

    Raises:
        ValueError: another row count, mismatched ``K``, a weight or input not contiguous along
            ``K``, another dtype or device than ``x``'s, a bias of another length, or inputs that
            need a gradient.

    Example:
        >>> y = gemv(hidden[:1], layer.self_attn.o_proj.weight)  # [1, hidden_size]
    """
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be one row [1, K], got {list(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {list(weight.shape)}")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {k}")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a float16, bfloat16 or float32 dtype, got {x.dtype}, {weight.dtype}")
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {list(bias.shape)}")
    if _needs_grad(x, weight, bias):
        raise ValueError("gemv has no backward: call it under torch.no_grad() or inference_mode()")
    if k == 0:  # an empty sum
        return (torch.zeros(1, n, dtype=x.dtype, device=x.device) if bias is None
                else bias.to(x.dtype).reshape(1, n).clone())
    bias = None if bias is None else bias.contiguous()  # the kernel reads it at unit stride
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = gemv_config(n, k)
    gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else out, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN=n % block_n == 0 and k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return out
