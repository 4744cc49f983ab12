"""Write a tiny transformers model as a GGUF file, the way llama.cpp's converter lays it out
(tensor names, metadata keys, the q/k row permutation of Llama-architecture files), with
``gguf``'s own writer and quantizers: the input of the GGUF loading tests (issue 20)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# transformers family -> GGUF ``general.architecture`` (llama.cpp writes Mistral as "llama")
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER_TENSORS = {  # transformers suffix -> GGUF suffix
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}

# A few byte-level merges (older transformers build a Qwen2 tokenizer only from a file's merges).
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation for Llama-architecture files (transformers undoes it on load)."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab(vocab_size: int) -> list[str]:
    """A byte-level BPE vocabulary of ``vocab_size`` tokens: the 256 byte symbols, the tokens of
    :data:`MERGES`, then fillers.

    Raises:
        ValueError: ``vocab_size < 256``.
    """
    if vocab_size < 256 + len(MERGES):
        raise ValueError(f"a byte-level vocabulary with {len(MERGES)} merges needs >= {256 + len(MERGES)} tokens, "
                         f"got {vocab_size}")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + [a + b for a, b in MERGES]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    return tokens[:vocab_size]



def write_gguf(hf_model, path: Path, family: str, quantization: str = "F32", name: str | None = None) -> Path:
    """Write ``hf_model`` (a tiny ``*ForCausalLM`` of ``family``) to ``path``.

    Args:
        quantization: ``"F32"`` (exact), ``"F16"`` or a ``gguf.GGMLQuantizationType`` name such as
            ``"Q8_0"`` for the 2-D weights (norms and biases stay F32, as llama.cpp keeps them).
        name: ``general.name`` (transformers reads a Llama-architecture file as Mistral when it
            contains "mistral"); default ``"tiny-<family>"``.
    """
    import gguf

    cfg, arch = hf_model.config, GGUF_ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or f"tiny-{family}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(byte_level_vocab(cfg.vocab_size))
    writer.add_token_scores([0.0] * cfg.vocab_size)
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    for name_, array in _gguf_tensors(hf_model, family).items():
        _add(writer, name_, array, quantization)
    finish(writer)
    return path


def finish(writer) -> None:
    """Write a ``gguf.GGUFWriter``'s header, metadata and tensors to its file, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_tensors(hf_model, family: str) -> dict[str, np.ndarray]:
    cfg, out = hf_model.config, {}
    state = {k: v.detach().to(torch.float32).numpy() for k, v in hf_model.state_dict().items()}
    out["token_embd.weight"] = state.pop("model.embed_tokens.weight")
    out["output_norm.weight"] = state.pop("model.norm.weight")
    if not cfg.tie_word_embeddings:
        out["output.weight"] = state.pop("lm_head.weight")
    state.pop("lm_head.weight", None)
    for key, value in state.items():
        if "rotary_emb" in key:
            continue
        _, _, layer, suffix = key.split(".", 3)
        if GGUF_ARCH[family] == "llama" and suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = cfg.num_attention_heads if "q_proj" in suffix else cfg.num_key_value_heads
            value = _permute(value, heads)
        out[f"blk.{layer}.{_LAYER_TENSORS[suffix]}"] = value
    return out


def _add(writer, name: str, array: np.ndarray, quantization: str) -> None:
    import gguf

    if array.ndim == 1 or quantization == "F32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif quantization == "F16":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float16))
    else:
        qtype = gguf.GGMLQuantizationType[quantization]
        data = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
