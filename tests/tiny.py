"""Tiny random models, a word-level tokenizer and engines over them, built in code (no files, no hub).

The engines' one home: :func:`tiny_config` and :func:`tiny_llm` here, and the ``make_llm`` and
``tiny_model`` fixtures of ``tests/conftest.py`` over them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lazyattn_rag import CacheConfig, EngineConfig, PromptConfig, SchedulerConfig
from lazyattn_rag.engine.model.transformer import CausalLM, ModelArchConfig
from lazyattn_rag.kernels.rope import RotaryEmbedding
from lazyattn_rag.llm import LazyAttention

WORDS = [f"w{i}" for i in range(200)] + ["Answer", "Question", ":", "documents", "below", "."]

PROMPT = PromptConfig(instruction="w190 w191 w192 ", document_separator=" ", question_prefix="Question : ")
"""The tiny engines' prompt: every piece is whole words of :func:`word_tokenizer` (no chat template)."""

MODEL_CASES = {
    "llama": ("llama", None, {}),
    "llama-gqa-9-3-tied": ("llama", None, dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                                               head_dim=8, tie_word_embeddings=True)),
    "llama-attention-bias": ("llama", None, dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("mistral", None, {}),
    "qwen2-qkv-bias": ("qwen2", None, {}),
    "qwen3-qk-norm": ("qwen3", None, {}),
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, {}),
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, {}),
    "yarn": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                       "rope_theta": 10000.0}, {}),
}
"""Tiny model variants by name: ``(family, rope, overrides)`` for :func:`hf_config`."""

_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}


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


def tiny_config(*, device: str = "cpu", attention_backend: str = "torch", prompt: PromptConfig = PROMPT,
                max_model_len: int | None = None, cuda_graphs: bool = True, torch_compile: bool = False,
                cpu_weight_packing: bool = False, cpu_threads: int | None = None,
                **cache_and_scheduler: Any) -> EngineConfig:
    """The tiny engines' configuration: float32, :data:`PROMPT`, 256 blocks of 16 tokens unless
    ``num_blocks`` says otherwise; the other keywords are :class:`SchedulerConfig` fields
    (``max_num_batched_tokens``, ``max_num_seqs``, ``prefill_with_encodes``) or
    :class:`CacheConfig` fields (``anchor``, ``mode``, ``eviction_policy``, ...); what is not
    given is the library's default."""
    scheduler = {k: cache_and_scheduler.pop(k) for k in list(cache_and_scheduler) if k in _SCHEDULER_FIELDS}
    cache = {"num_blocks": 256, **cache_and_scheduler}
    return EngineConfig(device=device, dtype="float32", attention_backend=attention_backend, max_model_len=max_model_len,
                        cuda_graphs=cuda_graphs, torch_compile=torch_compile,
                        cpu_weight_packing=cpu_weight_packing, cpu_threads=cpu_threads, prompt=prompt,
                        cache=CacheConfig(**cache),
                        scheduler=SchedulerConfig(**scheduler))


def tiny_llm(model: CausalLM | None = None, tokenizer: Any = None, **config: Any) -> LazyAttention:
    """A :class:`LazyAttention` over ``model`` (a fresh default tiny Llama when ``None``) and
    ``tokenizer`` (:func:`word_tokenizer` when ``None``), configured by :func:`tiny_config`.
    The caller closes it (the ``make_llm`` fixture does that for a test)."""
    if model is None:
        model = hf_and_ours(hf_config())[1]
    return LazyAttention.from_model(model, tokenizer or word_tokenizer(), tiny_config(**config))


def hf_logits(hf, token_ids: list[int], start_pos: int) -> torch.Tensor:
    """``[len(token_ids), vocab_size]``: transformers' logits for ``token_ids`` at positions
    ``start_pos, start_pos + 1, ...`` (the reference our model is checked against)."""
    ids = torch.tensor([token_ids])
    pos = torch.arange(start_pos, start_pos + len(token_ids))[None]
    with torch.no_grad():
        return hf(input_ids=ids, position_ids=pos).logits[0]


def save_model_dir(path, eos: int | list[int] | None = None):
    """The default tiny random Llama saved as a Hugging Face directory at ``path`` (safetensors,
    the word tokenizer); with ``eos``, that ``eos_token_id`` in config.json and no
    generation_config.json. Returns ``path``."""
    import json

    hf, _ = hf_and_ours(hf_config())
    hf.save_pretrained(path, safe_serialization=True)
    word_tokenizer().save_pretrained(path)
    if eos is not None:
        (path / "generation_config.json").unlink(missing_ok=True)
        config = json.loads((path / "config.json").read_text())
        config["eos_token_id"] = eos
        (path / "config.json").write_text(json.dumps(config))
    return path
