"""The one-row product kernel (``kernels/gemv.py``) against ``F.linear`` in float64, and its use in
the compiled layers (``engine/model/compiled_layers.py``) for batch-1 steps on CUDA."""

import pytest
import torch
import torch.nn.functional as F

from lazyattn_rag.kernels.gemv import GEMV_MAX_WEIGHT_ELEMENTS, gemv, gemv_applies, gemv_config

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def reference(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def within_one_rounding(y, x, weight, bias, dtype):
    """Each output within one unit of rounding of the float64 value (the interpreter rounds
    float32 to bfloat16 toward zero) plus float32 accumulation error (1e-6 of the sum of |terms|)."""
    expected = reference(x, weight, bias)
    scale = reference(x.abs(), weight.abs(), None if bias is None else bias.abs())
    eps = torch.finfo(dtype).eps
    return bool(((y.double() - expected).abs() <= eps * expected.abs() + 1e-6 * scale).all())


@pytest.mark.parametrize("n,k,dtype,with_bias", [
    (64, 128, torch.float32, False),  # whole tiles (EVEN), one step along K
    (16, 2048, torch.float32, False),  # whole tiles over two 1,024-wide steps
    (40, 72, torch.float32, True),  # partial output and weight tiles, a bias
    (48, 3000, torch.float16, True),  # three steps, the last partial
    (6152, 1536, torch.bfloat16, True),  # the q/k/v rule (8 outputs, 512-wide steps): three steps
    (6150, 96, torch.bfloat16, False),  # a partial last program under the q/k/v rule
    (24, 1000, torch.float16, False),
])
def test_matches_linear(n, k, dtype, with_bias):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    y = gemv(x.to(DEVICE), weight.to(DEVICE), None if bias is None else bias.to(DEVICE)).cpu()
    assert y.shape == (1, n) and y.dtype == dtype
    assert within_one_rounding(y, x, weight, bias, dtype)


def test_a_strided_bias_and_an_empty_sum():
    """A bias view at stride 2 is read as its values; K = 0 gives the bias (or zeros), as F.linear."""
    x, weight = torch.randn(1, 24), torch.randn(20, 24)
    bias = torch.arange(40.0)[::2]
    y = gemv(x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE)).cpu()
    assert within_one_rounding(y, x, weight, bias, torch.float32)
    empty_x, empty_w = torch.zeros(1, 0), torch.zeros(5, 0)
    assert torch.equal(gemv(empty_x.to(DEVICE), empty_w.to(DEVICE)).cpu(), torch.zeros(1, 5))
    assert torch.equal(gemv(empty_x.to(DEVICE), empty_w.to(DEVICE), torch.ones(5, device=DEVICE)).cpu(),
                       torch.ones(1, 5))


def test_a_strided_weight_view():
    """A weight that is a row slice of a larger one (row stride > K) reads the right rows."""
    full = torch.randn(32, 64, dtype=torch.float32)
    weight = full[:, :48]  # row stride 64, K = 48 contiguous
    x = torch.randn(1, 48)
    y = gemv(x.to(DEVICE), weight.to(DEVICE)).cpu()
    assert within_one_rounding(y, x, weight, None, torch.float32)


def test_bad_inputs():
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="columns"):
        gemv(torch.zeros(1, 15, device=DEVICE), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.zeros(1, 16, device=DEVICE), torch.zeros(16, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.zeros(1, 16, device=DEVICE), w, torch.zeros(7, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        gemv(torch.zeros(1, 16, device=DEVICE), w.half())
    with pytest.raises(ValueError, match="dtype"):
        gemv(torch.zeros(1, 16, device=DEVICE, dtype=torch.float64), w.double())
    with pytest.raises(ValueError, match="is on meta"):
        gemv(torch.zeros(1, 16, device=DEVICE), torch.zeros(8, 16, device="meta"))
    with pytest.raises(ValueError, match="backward"):
        gemv(torch.zeros(1, 16, device=DEVICE, requires_grad=True), w)
    with torch.no_grad():  # the same product without a gradient to keep
        gemv(torch.zeros(1, 16, device=DEVICE, requires_grad=True), w)


def test_which_products_take_the_kernel():
    """One half-type row on CUDA with a weight up to the measured size; nothing else (the CPU,
    float32, batches, the 117 Mi gate/up weight of Llama-3.1-8B stay with F.linear)."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    row = torch.empty(1, 4096, **meta)
    assert not gemv_applies(row, torch.empty(6144, 4096, **meta))  # meta is not CUDA
    if CUDA:
        cuda = dict(device="cuda", dtype=torch.bfloat16)
        x = torch.empty(1, 4096, **cuda)
        assert gemv_applies(x, torch.empty(6144, 4096, **cuda))
        assert not gemv_applies(torch.empty(2, 4096, **cuda), torch.empty(6144, 4096, **cuda))
        assert not gemv_applies(x.float(), torch.empty(64, 4096, device="cuda"))
        big = torch.empty(GEMV_MAX_WEIGHT_ELEMENTS // 4096 + 1, 4096, **cuda)
        assert not gemv_applies(x, big)
        w = torch.empty(64, 4096, **cuda)
        assert not gemv_applies(torch.empty(1, 8192, **cuda)[:, ::2], w)  # x strided along K
        assert not gemv_applies(torch.empty(1, 0, **cuda), torch.empty(64, 0, **cuda))  # K = 0
        assert not gemv_applies(x, torch.empty(64, 4096, device="cpu", dtype=torch.bfloat16))
        assert not gemv_applies(x, w, torch.empty(64, device="cpu", dtype=torch.bfloat16))
        with torch.enable_grad():
            assert not gemv_applies(x, w.requires_grad_())
    assert gemv_config(6144, 4096) == (8, 512, 4, 3) and gemv_config(4096, 14336) == (16, 1024, 8, 3)
    assert gemv_config(1536, 576) == (16, 1024, 8, 3)  # SmolLM2: one masked 1,024-wide step


@pytest.mark.skipif(not CUDA, reason="the compiled path takes the kernel on CUDA only")
def test_compiled_layers_trace_the_kernel_at_one_row():
    """``torch.compile(fullgraph=True)`` of the layers' product traces the Triton launch: at one row
    the compiled result is the kernel's bit for bit and the kernel runs; at two rows it is cuBLAS's."""
    from torch.profiler import ProfilerActivity, profile

    from lazyattn_rag.engine.model.compiled_layers import _linear

    compiled = torch.compile(_linear, fullgraph=True, dynamic=True)
    weight = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) / 32
    x = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        y1 = compiled(x[:1].contiguous(), weight, None)
        torch.cuda.synchronize()
    assert torch.equal(y1, gemv(x[:1].contiguous(), weight))
    assert any("gemv_kernel" in e.name for e in prof.events())
    y2 = compiled(x, weight, None)
    assert (y2.double() - reference(x, weight, None).cuda()).abs().max().item() <= 2e-2
    assert torch.allclose(y2[:1].float(), y1.float(), atol=2e-2)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)  # a q/k/v bias (Qwen2)
    assert torch.equal(compiled(x[:1].contiguous(), weight, bias), gemv(x[:1].contiguous(), weight, bias))
