"""Tiny random models and a word-level tokenizer, built in code (no files, no hub)."""

from __future__ import annotations

import torch

from lazyattn_rag.engine.model import CausalLM, ModelArchConfig
from lazyattn_rag.kernels.rope import RotaryEmbedding

WORDS = [f"w{i}" for i in range(200)] + ["Answer", "Question", ":", "documents", "below", "."]


def word_tokenizer(prepend_bos: bool = False):
    """A whitespace word-level fast tokenizer: one token per word, ids 4.. (0 pad, 1 unk, 2 bos, 3 eos).

    ``prepend_bos`` gives it the shape of base Llama and Mistral tokenizers: BOS before the text
    when special tokens are added, and no chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "<s>": 2, "</s>": 3}
    for w in WORDS:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    if prepend_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]",
                                   pad_token="[PAD]")


def words(n: int, start: int = 0) -> str:
    """Text of exactly ``n`` word tokens."""
    return " ".join(f"w{(start + i) % 200}" for i in range(n))


def hf_config(family: str = "llama", rope: dict | None = None, **overrides):
    """A small random-weight transformers config of ``family`` (llama, mistral, qwen2, qwen3)."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    kwargs = dict(vocab_size=len(WORDS) + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=16384,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=2, eos_token_id=3, pad_token_id=0,
                  rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    if family == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    cfg = cls(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def hf_and_ours(cfg, seed: int = 0):
    """A random HF model (float32, eval) and our :class:`CausalLM` loaded from its state dict."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # make RMSNorm weights and biases non-trivial so bugs show
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ours = CausalLM(ModelArchConfig.from_hf_config(cfg), RotaryEmbedding.from_hf_config(cfg))
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours.eval()
