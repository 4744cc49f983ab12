"""The torch.compile'd layers (``engine/model/compiled_layers.py``, issue 19) compute the same model:
logits equal transformers' within 1e-4 (fp32), for a prefill and a one-token step."""

import pytest
import torch

from lazyattn_rag.engine.model.compiled_layers import CompiledLayers
from tests.paged_case import our_logits
from tests.tiny import hf_logits
from tests.tiny import MODEL_CASES, hf_and_ours, hf_config


@pytest.mark.parametrize("name", ["qwen3-qk-norm", "llama-attention-bias"])  # q/k norms; every bias
def test_compiled_layers_match_transformers(name):
    family, rope, overrides = MODEL_CASES[name]
    hf, ours = hf_and_ours(hf_config(family, rope, **overrides))
    torch.manual_seed(1)
    ids = torch.randint(4, hf.config.vocab_size, (37,)).tolist()
    layers = CompiledLayers(ours)
    for n in (37, 1, 20):  # a prefill, one token (Dynamo's size-1 specialization), another size
        expected = hf_logits(hf, ids[:n], 5)
        compiled = our_logits(ours, ids[:n], 5, compiled=layers)
        assert (compiled - expected).abs().max().item() <= 1e-4, n
    assert layers.num_passes == 3  # (torch.compile with fullgraph=True raises rather than run eagerly)
