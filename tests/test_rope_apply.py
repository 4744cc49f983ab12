"""The one-launch RoPE of q and k (``kernels/rope_apply.py``) against ``apply_rotation`` (the
eager reference): float32 bit for bit under the interpreter, otherwise within one rounding of the
output's dtype (fused multiply-adds compiled; the interpreter rounds to bfloat16 toward zero); and
its use in the compiled layers on CUDA."""

import pytest
import torch

from lazyattn_rag.kernels.rope import RotaryEmbedding, apply_rotation
from lazyattn_rag.kernels.rope_apply import BLOCK_H, BLOCK_T, rope_applies, rope_apply, rope_apply_op

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def angles(num_tokens: int, rotary_dim: int, first_position: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of Llama's frequencies (base 500,000) at positions ``first_position ..``."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    a = torch.arange(first_position, first_position + num_tokens).float()[:, None] * inv_freq[None, :]
    return a.cos(), a.sin()


def check(x: torch.Tensor, cos, sin, rotary_dim: int, interleaved: bool) -> None:
    """Float32 inputs under the interpreter: equal to apply_rotation. Otherwise each output within
    one rounding of apply_rotation's float32 result (before it rounds to x's dtype)."""
    got = rope_apply(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), rotary_dim, interleaved).cpu()
    assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
    if CUDA or x.dtype != torch.float32:
        exact = apply_rotation(x.float(), cos, sin, rotary_dim, interleaved).double()
        eps = torch.finfo(x.dtype).eps
        assert ((got.double() - exact).abs() <= eps * exact.abs() + 1e-6).all()
    else:
        assert torch.equal(got, apply_rotation(x, cos, sin, rotary_dim, interleaved))


@pytest.mark.parametrize("num_tokens,num_heads,head_dim,rotary_dim,interleaved,dtype", [
    (9, 10, 32, 32, False, torch.float32),  # a partial head tile (BLOCK_H 8)
    (5, 3, 32, 32, True, torch.float32),  # GPT-J pairing
    (7, 12, 64, 48, False, torch.bfloat16),  # partial rotary; 24 pairs (not a power of two), 16 kept
    (6, 4, 32, 20, True, torch.float16),  # interleaved, partial, 12 columns copied
    (1, 40, 128, 128, False, torch.bfloat16),  # a batch-1 decode step of Llama-3.1-8B's q and k
    (3, 5, 48, 48, False, torch.float32),  # full rotary, 24 pairs: masked pairs write nothing past a head
    (2, 9, 96, 96, True, torch.float16),  # the same, interleaved
])
def test_matches_apply_rotation(num_tokens, num_heads, head_dim, rotary_dim, interleaved, dtype):
    g = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
    x = (torch.randn(num_tokens, num_heads, head_dim, generator=g) * 3).to(dtype)
    cos, sin = angles(num_tokens, rotary_dim, first_position=4090)
    check(x, cos, sin, rotary_dim, interleaved)


def test_strided_views_of_a_fused_product_and_a_magnitude_factor():
    """q and k as views of a fused q/k/v product (token stride past the heads' width), angles
    carrying YaRN's magnitude factor: the rows read are the view's, the output is contiguous."""
    num_tokens, num_q, num_kv, head_dim = 6, 4, 2, 32
    qkv = torch.randn(num_tokens, (num_q + 2 * num_kv) * head_dim).to(torch.bfloat16)
    qk = qkv[:, : (num_q + num_kv) * head_dim].view(num_tokens, num_q + num_kv, head_dim)
    assert qk.stride(0) == (num_q + 2 * num_kv) * head_dim
    cos, sin = angles(num_tokens, head_dim)
    check(qk, cos * 1.2, sin * 1.2, head_dim, False)
    every_other_head = torch.randn(num_tokens, 2 * num_q, head_dim)[:, ::2]  # head stride 2 * head_dim
    check(every_other_head, cos, sin, head_dim, False)


def test_cos_and_sin_of_other_layouts():
    """sin read with its own row stride (a column slice of a wider table), cos with another; and at
    rotary_dim 2 a one-column table whose column stride is irrelevant."""
    x = torch.randn(5, 3, 32)
    cos, sin = angles(5, 32)
    wide = torch.zeros(5, 48)
    wide[:, 8:24] = sin
    assert wide[:, 8:24].stride(0) == 48 and cos.stride(0) == 16
    check(x, cos, wide[:, 8:24], 32, False)
    c1, s1 = angles(5, 2)
    one_column = torch.zeros(3, 5).t()[:, :1]  # [5, 1], column stride 5
    one_column.copy_(c1)
    assert one_column.stride(1) != 1
    check(x, one_column, s1, 2, False)


def test_the_rotation_encodes_positions():
    """Independent of apply_rotation: the kernel's rotation at position p equals the model's RoPE
    (RotaryEmbedding.encode), and scores after it depend only on relative position."""
    cfg = type("Cfg", (), {"hidden_size": 64, "num_attention_heads": 2, "rope_theta": 10000.0})()
    rotary = RotaryEmbedding.from_hf_config(cfg)
    g = torch.Generator().manual_seed(11)
    q, k = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)

    def at(x, position):
        tables = rotary.tables(torch.tensor([position]))
        return rope_apply(x.to(DEVICE), tables.cos.to(DEVICE), tables.sin.to(DEVICE), 32, False).cpu()

    assert torch.allclose(at(q, 7), rotary.encode(q, torch.tensor([7])), atol=1e-6)
    near = (at(q, 10) * at(k, 3)).sum()
    far = (at(q, 1010) * at(k, 1003)).sum()
    assert torch.allclose(near, far, atol=2e-3)  # float32 angles at position ~1,000


def test_empty_and_bad_inputs():
    cos, sin = angles(3, 32)
    empty = rope_apply(torch.zeros(0, 2, 32, device=DEVICE), cos[:0].to(DEVICE), sin[:0].to(DEVICE), 32, False)
    assert empty.shape == (0, 2, 32)
    x = torch.randn(3, 2, 32, device=DEVICE)
    c, s = cos.to(DEVICE), sin.to(DEVICE)
    with pytest.raises(ValueError, match="contiguous along head_dim"):
        rope_apply(torch.randn(3, 32, 2, device=DEVICE).transpose(1, 2), c, s, 32, False)
    with pytest.raises(ValueError, match=r"rotary_dim must be even and in \[2, head_dim=32\], got 33"):
        rope_apply(x, c, s, 33, False)
    with pytest.raises(ValueError, match=r"cos must be \[3, 16\] float32"):
        rope_apply(x, c[:2], s, 32, False)
    with pytest.raises(ValueError, match=r"sin must be \[3, 16\] float32"):
        rope_apply(x, c, s.double(), 32, False)
    with pytest.raises(ValueError, match="cos must be contiguous along its rows, got column stride 3"):
        rope_apply(x, torch.randn(16, 3, device=DEVICE).t(), s, 32, False)
    with pytest.raises(ValueError, match="sin is on meta, x on"):
        rope_apply(x, c, s.to("meta"), 32, False)
    with pytest.raises(ValueError, match=r"x must be \[num_tokens, num_heads, head_dim\], got shape \[2, 32\]"):
        rope_apply(x[0], c, s, 32, False)
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32, got torch.float64"):
        rope_apply(x.double(), c, s, 32, False)
    with torch.enable_grad(), pytest.raises(ValueError, match="no backward"):
        rope_apply(x.clone().requires_grad_(), c, s, 32, False)
    assert rope_applies(x, c, s, 32) and not rope_applies(x, c, s, 34)
    # the fake refuses what the operator refuses (Dynamo reports it as a RuntimeError naming it)
    with pytest.raises(RuntimeError, match="rope_apply: rotary_dim must be even"):
        torch.compile(rope_apply_op, fullgraph=True)(x, c, s, 33, False)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    """Outside the interpreter a CPU tensor is refused with a clear error, not a driver failure."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, (cos, sin) = torch.randn(3, 2, 32), angles(3, 32)
    assert not rope_applies(x, cos, sin, 32)
    with pytest.raises(ValueError, match="x is on cpu: the kernel runs on CUDA"):
        rope_apply(x, cos, sin, 32, False)
    assert (BLOCK_T, BLOCK_H) == (1, 8)  # the tiles the tests' partial shapes were chosen around


def test_the_operator_and_its_fake():
    """The operator the compiled layers call: torch.library's checks (schema, fake tensor, dynamic
    shapes) and, in a graph compiled like a layer's (a fused product, views, the rotation, a split),
    the kernel's result."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, 32, generator=g).to(DEVICE)
    cos, sin = (t.to(DEVICE) for t in angles(6, 32))
    torch.library.opcheck(rope_apply_op, (x, cos, sin, 32, False))
    torch.library.opcheck(rope_apply_op, (x[:, :, :24].contiguous(), cos[:, :8], sin[:, :8], 16, True))

    def layer_like(h, weight, cos, sin):
        qkv = h @ weight.t()
        qk, v = qkv.split([3 * 32, 32], dim=-1)
        q, k = rope_apply_op(qk.view(h.shape[0], 3, 32), cos, sin, 32, False).split([2, 1], dim=1)
        return q, k, v.view(h.shape[0], 1, 32)

    compiled = torch.compile(layer_like, fullgraph=True, dynamic=True)
    weight = torch.randn(128, 48, generator=g).to(DEVICE)
    for n in (5, 9):
        h = torch.randn(n, 48, generator=g).to(DEVICE)
        c, s = (t.to(DEVICE) for t in angles(n, 32, first_position=n))
        q, k, v = compiled(h, weight, c, s)
        eq, ek, ev = layer_like(h, weight, c, s)
        for got, want in ((q, eq), (k, ek), (v, ev)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="the compiled layers take the kernel on CUDA only")
def test_compiled_attention_input_on_cuda():
    """The whole compiled ``attention_input`` (norm, fused product, Qwen3's q/k norms, the
    rotation, the splits) on CUDA, one graph for every size past one, against the eager function
    on the CPU (apply_rotation) in float32."""
    from lazyattn_rag.engine.model.compiled_layers import attention_input

    g = torch.Generator().manual_seed(7)
    hidden, num_heads, num_kv_heads, head_dim = 256, 4, 2, 64
    weights = {
        "norm_weight": 1 + 0.1 * torch.randn(hidden, generator=g),
        "qkv_weight": torch.randn((num_heads + 2 * num_kv_heads) * head_dim, hidden, generator=g) / 16,
        "qkv_bias": None,
        "q_norm_weight": 1 + 0.1 * torch.randn(head_dim, generator=g),
        "k_norm_weight": 1 + 0.1 * torch.randn(head_dim, generator=g),
    }
    compiled = torch.compile(attention_input, fullgraph=True, dynamic=True)
    for num_tokens, qk_norm, with_delta in ((1, False, True), (37, False, True), (64, True, False), (20, False, False)):
        x = torch.randn(num_tokens, hidden, generator=g)
        delta = torch.randn(num_tokens, hidden, generator=g) if with_delta else None
        cos, sin = angles(num_tokens, head_dim, first_position=3000)
        w = dict(weights, **({} if qk_norm else {"q_norm_weight": None, "k_norm_weight": None}))
        args = (1e-5, num_heads, num_kv_heads, head_dim, head_dim, False)

        def on(device):
            moved = {k: None if v is None else v.to(device) for k, v in w.items()}
            return (x.to(device), None if delta is None else delta.to(device), *moved.values(),
                    cos.to(device), sin.to(device), *args)

        got = compiled(*on("cuda"))
        expected = attention_input(*on("cpu"))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not CUDA, reason="the compiled layers take the kernel on CUDA only")
def test_compiled_rotation_runs_the_kernel():
    """``torch.compile(fullgraph=True, dynamic=True)`` of the layers' rotation calls the operator
    at one token and at many (one graph for the sizes past one), and runs the kernel."""
    from torch.profiler import ProfilerActivity, profile

    from lazyattn_rag.engine.model.compiled_layers import _rotate

    compiled = torch.compile(_rotate, fullgraph=True, dynamic=True)
    for num_tokens in (1, 37, 2048):
        qkv = torch.randn(num_tokens, 48 * 128, device="cuda", dtype=torch.bfloat16)
        qk = qkv[:, : 40 * 128].view(num_tokens, 40, 128)
        cos, sin = (t.cuda() for t in angles(num_tokens, 128, first_position=100))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = compiled(qk, cos, sin, 128, False)
            torch.cuda.synchronize()
        assert torch.equal(got, rope_apply(qk, cos, sin, 128, False))
        assert any("rope_kernel" in e.name for e in prof.events())
        expected = apply_rotation(qk, cos, sin, 128, False)
        assert ((got.double() - expected.double()).abs() <= 2**-7 * expected.double().abs() + 1e-6).all()
