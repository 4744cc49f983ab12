"""Bring your own GGUF (issue 20): a local GGUF file of each supported architecture loads through
``EngineConfig(model="file.gguf")`` (converted once, like the default model) and computes the
model it was written from; what the engine cannot run is refused by name before converting."""

import numpy as np
import pytest
import torch

from lazyattn_rag import EngineConfig, SamplingParams
from lazyattn_rag.engine.model.transformer import UnsupportedModelError
from lazyattn_rag.llm import LazyAttention
from tests.gguf_tiny import finish, write_gguf
from tests.tiny import hf_and_ours, hf_config

PROMPT = list(range(40, 75))


def tiny_hf(family: str):
    # 300 tokens: the byte-level vocabulary needs its 256 bytes; transformers' GGUF reader
    # takes Qwen3's head_dim as 128 (every released Qwen3), so the tiny Qwen3 has it too.
    return hf_and_ours(hf_config(family, vocab_size=300, **({"head_dim": 128} if family == "qwen3" else {})))[0]


def first_token_logprobs(llm: LazyAttention) -> torch.Tensor:
    out = llm.complete(PROMPT, sampling=SamplingParams(max_tokens=1, logprobs=-1))
    return torch.tensor(list(out.logprobs[0].values()))


def hf_logprobs(hf) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=torch.tensor([PROMPT])).logits[0, -1].float(), dim=-1)


def engine(path, cache) -> LazyAttention:
    return LazyAttention(EngineConfig(model=str(path), device="cpu", cache_dir=cache, max_model_len=512))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_gguf_of_each_architecture_computes_its_model(tmp_path, family):
    hf = tiny_hf(family)
    path = write_gguf(hf, tmp_path / f"tiny-{family}.F32.gguf", family, name=f"Tiny {family.title()} 1B")
    with engine(path, tmp_path / "cache") as llm:
        assert llm.engine.info["model_type"] == ("llama" if family == "mistral" else family)  # llama.cpp's layout
        assert (first_token_logprobs(llm) - hf_logprobs(hf)).abs().max().item() <= 1e-4
    converted = list((tmp_path / "cache" / "models").glob(f"tiny-{family}.F32-*"))
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()


def test_a_quantized_gguf_computes_its_dequantized_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = tiny_hf("llama")
    path = write_gguf(hf, tmp_path / "tiny.Q8_0.gguf", "llama", quantization="Q8_0")
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    with engine(path, tmp_path / "cache") as llm:
        ours = first_token_logprobs(llm)
    assert (ours - hf_logprobs(reference)).abs().max().item() <= 1e-4
    assert (ours - hf_logprobs(hf)).abs().max().item() > 1e-4  # it is the quantized model, not the original


def test_an_unsupported_architecture_is_refused_before_converting(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    finish(writer)
    with pytest.raises(UnsupportedModelError, match=r"'phi3' is not supported; supported: llama, qwen2, qwen3"):
        engine(tmp_path / "phi.gguf", tmp_path / "cache")
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_a_tensor_type_gguf_cannot_dequantize_is_named(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    block = np.zeros((1, 40), dtype=np.uint8)  # one Q8_1 block: 32 values in 40 bytes
    writer.add_tensor("blk.0.attn_q.weight", block, raw_shape=block.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    finish(writer)
    with pytest.raises(UnsupportedModelError, match=r"blk.0.attn_q.weight is stored as Q8_1"):
        engine(tmp_path / "odd.gguf", tmp_path / "cache")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF"):
        engine(tmp_path / "junk.gguf", tmp_path / "cache")
