"""Our Llama-family forward equals transformers' forward (fp32, max abs <= 1e-4)."""

import pytest
import torch

from lazyattn_rag.engine.model.transformer import ModelArchConfig, UnsupportedModelError
from lazyattn_rag.kernels.rope import RotaryEmbedding, UnsupportedRopeError
from tests.paged_case import our_logits
from tests.tiny import MODEL_CASES, hf_and_ours, hf_config, hf_logits


@pytest.mark.parametrize("name", list(MODEL_CASES))
@pytest.mark.parametrize("start_pos", [0, 8200])
def test_logits_match_transformers(name, start_pos):
    family, rope, overrides = MODEL_CASES[name]
    hf, ours = hf_and_ours(hf_config(family, rope, **overrides))
    torch.manual_seed(1)
    ids = torch.randint(4, hf.config.vocab_size, (37,)).tolist()
    expected = hf_logits(hf, ids, start_pos)
    actual = our_logits(ours, ids, start_pos)
    assert (actual - expected).abs().max().item() <= 1e-4


def test_inv_freq_equals_transformers_buffer():
    for name, (family, rope, overrides) in MODEL_CASES.items():
        hf, ours = hf_and_ours(hf_config(family, rope, **overrides))
        assert torch.equal(ours.rotary.inv_freq, hf.model.rotary_emb.inv_freq.float()), name
        assert ours.rotary.attention_scaling == pytest.approx(hf.model.rotary_emb.attention_scaling), name


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_refused(rope_type):
    params = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=4096)
    cfg = hf_config("llama", params)
    with pytest.raises(UnsupportedRopeError, match=rope_type):
        RotaryEmbedding.from_hf_config(cfg)


def test_unsupported_architecture_refused():
    import transformers

    cfg = transformers.GPT2Config()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelArchConfig.from_hf_config(cfg)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_separate_projections_load_into_the_fused_ones_and_mismatches_are_named(family):
    """transformers' q/k/v and gate/up weights (and Qwen2's q/k/v biases) load into our fused
    qkv_proj / gate_up_proj in that order; a missing part or an extra weight is named."""
    from lazyattn_rag.engine.model.transformer import CausalLM

    cfg = hf_config(family)
    hf, ours = hf_and_ours(cfg)
    layer, ref = ours.model.layers[1], hf.model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.split(layer.self_attn.qkv_sizes, dim=0)
    assert torch.equal(q, ref.self_attn.q_proj.weight) and torch.equal(v, ref.self_attn.v_proj.weight)
    assert torch.equal(k, ref.self_attn.k_proj.weight)
    if family == "qwen2":
        assert torch.equal(layer.self_attn.qkv_proj.bias[-v.shape[0]:], ref.self_attn.v_proj.bias)
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2, dim=0)
    assert torch.equal(gate, ref.mlp.gate_proj.weight) and torch.equal(up, ref.mlp.up_proj.weight)

    fresh = CausalLM(ModelArchConfig.from_hf_config(cfg), RotaryEmbedding.from_hf_config(cfg))
    state = dict(hf.state_dict())
    del state["model.layers.0.self_attn.v_proj.weight"]
    state["model.layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(UnsupportedModelError, match=r"missing \['model.layers.0.self_attn.v_proj.weight'.*"
                                                     r"unexpected .*'model.layers.0.extra.weight'"):
        fresh.load_hf_state_dict(state)
