"""oneDNN-packed linear layers (``engine/model/packed_linear.py``, issue 19): the same products as
``F.linear`` (float32 rounding), the same parameters and state dict, and undone exactly."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lazyattn_rag.engine.model.packed_linear import PackedLinear, onednn_available, pack_linears, unpack_linears
from tests.paged_case import our_logits
from tests.tiny import hf_logits
from tests.tiny import hf_and_ours, hf_config

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 17, 300])
def test_packed_linear_equals_f_linear(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(rows, 96)
    expected = F.linear(x, linear.weight, linear.bias)
    actual = packed(x)
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert (actual - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert packed(x[:, None, :].expand(rows, 2, 96)).shape == (rows, 2, 200)  # non-contiguous, 3-D


def test_other_dtypes_take_the_dense_path_and_bad_weights_are_refused():
    with pytest.raises(ValueError, match="float32 CPU weight"):
        PackedLinear(nn.Linear(8, 4).to(torch.bfloat16))
    linear = nn.Linear(8, 4)
    packed = PackedLinear(linear)
    x = torch.randn(3, 8, dtype=torch.float64)
    for layer in (linear, packed):  # not float32: F.linear itself, which refuses mixed dtypes as nn.Linear does
        with pytest.raises(RuntimeError, match="dtype"):
            layer(x)


def test_pack_and_unpack_keep_the_model_and_its_logits():
    cfg = hf_config("qwen2")  # q/k/v biases
    hf, ours = hf_and_ours(cfg)
    names = dict(ours.state_dict())
    ids = list(range(4, 41))
    dense = our_logits(ours, ids, 3)
    assert pack_linears(ours) == 4 * cfg.num_hidden_layers
    assert pack_linears(ours) == 0  # idempotent
    assert all(torch.equal(v, names[k]) for k, v in ours.state_dict().items()) and ours.state_dict().keys() == names.keys()
    assert type(ours.lm_head) is nn.Linear  # left dense
    packed = our_logits(ours, ids, 3)
    assert (packed - hf_logits(hf, ids, 3)).abs().max().item() <= 1e-4
    assert unpack_linears(ours) == 4 * cfg.num_hidden_layers
    assert not any(isinstance(m, PackedLinear) for m in ours.modules())
    assert torch.equal(our_logits(ours, ids, 3), dense)  # the dense path exactly as before


def test_cpu_engine_packs_only_when_told(make_llm):
    _, on = make_llm(cpu_weight_packing=True)
    assert sum(isinstance(m, PackedLinear) for m in on.engine.runner.model.modules()) == 4 * 2
    _, off = make_llm()
    assert not any(isinstance(m, PackedLinear) for m in off.engine.runner.model.modules())


def test_packed_copy_follows_the_weights_and_survives_copies_and_gradients():
    import copy
    import io

    torch.manual_seed(0)
    linear = nn.Linear(32, 24)
    packed = PackedLinear(linear)
    x = torch.randn(5, 32)
    with torch.no_grad():
        linear.weight.mul_(2.0)  # changed in place after packing
    with torch.inference_mode():
        assert (packed(x) - F.linear(x, linear.weight, linear.bias)).abs().max().item() <= 1e-5
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 32))
        assert (packed(x) - F.linear(x, linear.weight, linear.bias)).abs().max().item() <= 1e-5
    clone = copy.deepcopy(packed)
    buffer = io.BytesIO()
    torch.save(nn.Sequential(packed), buffer)
    with torch.no_grad():
        assert (clone(x) - F.linear(x, linear.weight, linear.bias)).abs().max().item() <= 1e-5
    y = packed(x.requires_grad_())  # gradients: the dense path
    y.sum().backward()
    assert linear.weight.grad is not None and x.grad is not None


def test_the_engine_packs_a_model_again_after_its_weights_changed(make_llm):
    hf, llm = make_llm(cpu_weight_packing=True)
    model = llm.engine.runner.model
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    prompt = list(range(5, 30))
    params = __import__("lazyattn_rag").SamplingParams(max_tokens=1, logprobs=-1)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(0.9)
    model.load_hf_state_dict(hf.state_dict())  # in place, after the first engine packed it
    _, again = make_llm(model=model, cpu_weight_packing=True)
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    ours = torch.tensor(list(again.complete(prompt, sampling=params).logprobs[0].values()))
    with torch.no_grad():
        expected = torch.log_softmax(hf(input_ids=torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    assert (ours - expected).abs().max().item() <= 1e-4


def test_compiled_engines_do_not_pack(make_llm):
    _, llm = make_llm(torch_compile=True, cpu_weight_packing=True)
    assert not any(isinstance(m, PackedLinear) for m in llm.engine.runner.model.modules())
