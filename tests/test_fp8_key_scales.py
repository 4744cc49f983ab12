"""The FP8 key-scale measurement's parts (benchmarks/fp8_key_scales.py, issue 42) against
independent references: the round trip against float8_e4m3fn's own rounding, the causal GQA
attention against PyTorch's scaled_dot_product_attention, and the rotation against rotating
each pair by its angle."""

import math

import pytest
import torch

from benchmarks.fp8_key_scales import FP8_MAX, attention, fp8_round_trip, rotate


def test_the_round_trip_uses_one_scale_per_group_and_fp8_rounding():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 8) * torch.tensor([1e-3, 1.0, 50.0, 2.0, 3.0, 0.5, 9.0, 1e2])  # channels of unlike size
    got = fp8_round_trip(x, (1,))  # one scale per (head, channel) over the tokens
    scale = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    want = (x / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    assert torch.equal(got, want)
    assert torch.allclose(got.abs().amax(dim=1), x.abs().amax(dim=1), rtol=1e-6)  # each group's largest is exact
    rel = ((got - x).abs() / x.abs().amax(dim=1, keepdim=True)).max().item()
    assert 0 < rel <= 2 ** -4, rel  # 3 mantissa bits: at most half a step of 2^-3 of the group's largest
    per_tensor = fp8_round_trip(x, (0, 1, 2))
    assert (per_tensor[..., 0] - x[..., 0]).abs().max() > (got[..., 0] - x[..., 0]).abs().max()  # tiny channel


def test_causal_gqa_attention_equals_sdpa():
    torch.manual_seed(1)
    q, k, v = torch.randn(6, 9, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    logp, out = attention(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q[None], k.repeat_interleave(3, 0)[None],
                                                           v.repeat_interleave(3, 0)[None], is_causal=True)[0]
    assert torch.allclose(out, want, atol=1e-5)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(6, 9))
    assert torch.all(logp[:, 0, 1:] == float("-inf"))


@pytest.mark.parametrize("position", [0, 3, 1000])
def test_rotate_turns_each_half_split_pair_by_its_angle(position):
    d, base = 8, 10000.0
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = position * inv_freq
    cos, sin = torch.cat([angles.cos()] * 2)[None], torch.cat([angles.sin()] * 2)[None]
    x = torch.randn(1, 1, d, dtype=torch.float64)
    got = rotate(x, cos, sin)[0, 0]
    for i in range(d // 2):
        a, b, theta = x[0, 0, i], x[0, 0, i + d // 2], angles[i].item()
        assert math.isclose(got[i].item(), a * math.cos(theta) - b * math.sin(theta), abs_tol=1e-9)
        assert math.isclose(got[i + d // 2].item(), a * math.sin(theta) + b * math.cos(theta), abs_tol=1e-9)


@pytest.mark.parametrize("scheme,reduce_dims", [("pre_rope_per_channel", (1,)), ("pre_rope_per_tensor", (0, 1, 2))])
def test_the_scalings_benchmark_rounds_keys_before_rope_and_rotates_them_back(scheme, reduce_dims):
    """benchmarks/fp8_scalings.py gets rotated keys at local positions and rounds them before RoPE:
    against keys made before RoPE here and rotated with this file's own angles."""
    from benchmarks.fp8_scalings import scheme_transform
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=1e4))
    torch.manual_seed(2)
    k_pre = torch.randn(2, 11, 16) * torch.linspace(0.1, 8.0, 16)  # [kv_heads, n, d], channels of unlike size
    start = 5
    angles = torch.arange(start, start + 11)[:, None].float() * (1e4 ** (-torch.arange(0, 16, 2).float() / 16))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    v = torch.randn(2, 11, 16)
    k_out, v_out = scheme_transform(rotary, scheme)(rotate(k_pre, cos, sin)[None], v[None], start)
    want = rotate(fp8_round_trip(k_pre, reduce_dims), cos, sin)
    close = (k_out[0] - want).abs() <= 1e-5 * want.abs().amax()
    assert close.float().mean() >= 0.99  # the rotation back and forth may move a value across a rounding boundary
    assert torch.equal(v_out[0], fp8_round_trip(v, (2,)))  # values: one scale per token and KV head
    per_token, _ = scheme_transform(rotary, "per_token")(rotate(k_pre, cos, sin)[None], v[None], start)
    assert torch.equal(per_token[0], fp8_round_trip(rotate(k_pre, cos, sin), (2,)))
