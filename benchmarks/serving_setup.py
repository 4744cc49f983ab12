"""The serving benchmark's model and engines: random-weight models of real architectures'
shapes (speed does not depend on weight values), a word tokenizer over their vocabulary, and
one engine per cache mode on the same weights, prompt and KV budget."""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass

import torch
import typer

from lazyattn_rag import CacheConfig, EngineConfig, PromptConfig, SchedulerConfig
from lazyattn_rag.engine.planning.fingerprint import tensors_sha256
from lazyattn_rag.engine.model.transformer import CausalLM, ModelArchConfig
from lazyattn_rag.kernels.rope import RotaryEmbedding
from lazyattn_rag.llm import LazyAttention

MODES = ("lazy", "block_attention", "prefix", "full")
TIERED_MODES = ("lazy+host",)  # lazy with a host-memory tier below the KV budget (issue 17)
# "lazy+fp8" (or lazy+fp8_e5m2): lazy over an FP8 KV cache (CacheConfig.kv_cache_dtype, issue 42), the
# same KV budget in bytes holding about twice the tokens.
# "lazy+prerot": lazy with the triton backend's prefill reading queries rotated beforehand
# (TritonAttentionBackend.prerotate_queries, issue 43): the same results, to time the two.
# "lazy+head<k>": lazy with the first k tokens of every document recomputed per request
# (CacheConfig.recompute_chunk_head_tokens, issue 20), e.g. lazy+head16.
# "lazy+sel<r>": lazy with r % of every document's tokens recomputed per request (selective
# recompute, CacheConfig.recompute_selective_ratio, issue 20), e.g. lazy+sel15.
# "lazy+ape<T>[w<W>]": lazy with every document read with chunk attention scaling at temperature
# T % and weight W % (APE, CacheConfig.chunk_attention_scaling, issue 20), e.g. lazy+ape80.
CHUNK_SCALING_MODE = re.compile(r"^lazy\+ape(\d+)(?:w(\d+))?$")
SINK_SCALING_MODE = re.compile(r"^lazy\+sink(\d+)$")  # chunk attention scaling of each document's first block
PROMPT = PromptConfig(system_prompt=None, instruction="t1 t2 t3 t4 t5 t6 t7 t8 ", document_separator=" ",
                      question_prefix="t9 ")

ARCHS = {
    "llama-3.1-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                   max_position_embeddings=131072, rms_norm_eps=1e-5,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192})),
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=40960, rms_norm_eps=1e-6,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "tiny": ("llama", dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=65536,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # tiny with the word tokenizer's whole vocabulary (t0 .. t31996): every word of a trace
    # (random_text's t10 .. t29999) is a known word, as for the 8B shapes; with tiny's 2,048 most
    # are [UNK], which the planner checks one by one (CPU costs of pasted prompts, http_reuse.py)
    "tiny-32k": ("llama", dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=65536,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def hf_config(arch: str):
    import transformers

    family, kwargs = ARCHS[arch]
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    return cls(**kwargs)


def random_model(arch: str, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """A random-weight model of ``arch``'s real shapes, created directly on ``device`` in ``dtype``."""
    cfg = hf_config(arch)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = CausalLM(ModelArchConfig.from_hf_config(cfg), RotaryEmbedding.from_hf_config(cfg))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.dim() > 1:
                        p.normal_(0.0, 0.02)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def word_tokenizer(vocab_size: int):
    """Whitespace word tokenizer over ``t0 .. t{vocab_size - 4}`` (documents are random token
    sequences of the first 30,000 words). Every id of the model's vocabulary is a word, so every
    token a random-weight model samples decodes to text, as a real tokenizer's tokens do: with
    32,000 words under a 128,256-token vocabulary, three sampled tokens in four decoded to
    nothing, and a streaming client saw its first content a few decode steps after the first
    token (``benchmarks/http_reuse.py``'s TTFT before 2026-12-06)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2}
    for i in range(vocab_size - 3):
        vocab[f"t{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


@dataclass(frozen=True)
class Bench:
    """The model every mode runs: random weights of ``arch``, its tokenizer, and its weights' hash
    (computed once per model instead of once per engine: hashing an 8B model's weights was most of
    an engine's set-up time: ~40 s an engine then, 0.6-2.8 s since)."""

    model: CausalLM
    tokenizer: object
    weights_sha256: str

    @classmethod
    def build(cls, arch: str, device: str, dtype: str, hash_weights: bool = True) -> Bench:
        """The model of ``arch`` (``hash_weights=False``: named by arch, dtype and seed instead of a
        hash of its weights, which :func:`random_model` makes the same every time; an 8B model's
        hash takes tens of seconds per engine).

        Raises ``typer.BadParameter`` for an unknown ``arch`` or a CUDA device on a machine without one."""
        if arch not in ARCHS:
            raise typer.BadParameter(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise typer.BadParameter(f"--device {device}: no CUDA device here; pass --device cpu (and --dtype float32)")
        model = random_model(arch, torch.device(device), getattr(torch, dtype))
        digest = tensors_sha256(model.state_dict()) if hash_weights else f"random-normal-0.02-seed0:{arch}:{dtype}"
        return cls(model, word_tokenizer(model.config.vocab_size), digest)


def chunk_scaling_percent(temperature: str, weight: str | None) -> tuple[float, float] | None:
    """``(T, W)`` of a mode's chunk attention scaling suffix ``ape<T %>[w<W %>]`` (``weight``
    ``None``: 100 %), or ``None`` for a setting ``CacheConfig`` would refuse (a 0, or both 100 %).
    The quality and serving benchmarks' modes share it."""
    t, w = int(temperature), int(weight or 100)
    return (t / 100, w / 100) if t > 0 and w > 0 and (t, w) != (100, 100) else None


def mode_cache_settings(mode: str) -> tuple[str, dict]:
    """A benchmark mode's cache mode and its ``CacheConfig`` remedy fields (``host: True`` for
    ``lazy+host``), checked here so that a sweep refuses a bad mode before its first run.

    Raises:
        ValueError: an unknown mode, or a remedy setting ``CacheConfig`` would refuse (``k`` < 1,
            ``r`` outside 1-100 %, a temperature or weight of 0, or both 100 %).
    """
    if mode in MODES:
        return mode, {}
    if mode in TIERED_MODES:
        return "lazy", {"host": True}
    if mode == "lazy+prerot":
        return "lazy", {"prerotate": True}
    if m := re.fullmatch(r"lazy\+(fp8(?:_e4m3|_e5m2)?)", mode):  # lazy over an FP8 KV cache (issue 42)
        return "lazy", {"kv_cache_dtype": m.group(1)}
    if (m := re.fullmatch(r"lazy\+head(\d+)(rest)?", mode)) and int(m.group(1)) >= 1:
        return "lazy", {"recompute_chunk_head_tokens": int(m.group(1)), "recompute_first_chunk_head": not m.group(2)}
    if (m := re.fullmatch(r"lazy\+sel(\d+)", mode)) and 1 <= int(m.group(1)) <= 100:
        return "lazy", {"recompute_selective_ratio": int(m.group(1)) / 100}
    if (m := CHUNK_SCALING_MODE.match(mode)) and (setting := chunk_scaling_percent(m.group(1), m.group(2))):
        return "lazy", {"chunk_attention_scaling": True, "chunk_attention_temperature": setting[0],
                        "chunk_attention_weight": setting[1]}
    if (m := SINK_SCALING_MODE.match(mode)) and (setting := chunk_scaling_percent("100", m.group(1))):
        return "lazy", {"chunk_attention_scaling": True, "chunk_attention_weight": setting[1],
                        "chunk_attention_scope": "head"}
    raise ValueError(f"unknown serving mode {mode!r}: one of {', '.join(MODES + TIERED_MODES)}, lazy+head<k>, "
                     "lazy+sel<r %>, lazy+ape<T %>[w<W %>], lazy+sink<W %>, lazy+head<k>rest, lazy+fp8[_e4m3|_e5m2], "
                     "lazy+prerot")


def make_engine(bench: Bench, mode: str, budget_bytes: int, device: str, max_batched: int, max_seqs: int,
                backend: str = "auto", cuda_graphs: bool = True, prefill_with_encodes: bool = True,
                host_memory_bytes: int = 0, torch_compile: bool = False,
                cache_fields: dict | None = None) -> LazyAttention:
    """An engine over ``bench``'s model in cache ``mode`` with a KV budget of ``budget_bytes``
    (``"lazy+host"``: ``lazy`` with a host-memory tier of ``host_memory_bytes``; ``"lazy+head<k>"``:
    ``lazy`` recomputing the first ``k`` tokens of each document per request (``...rest``: of each
    but the first); ``"lazy+sel<r>"``:
    ``lazy`` recomputing ``r`` % of each document's tokens (selective recompute); ``"lazy+ape<T>"``:
    ``lazy`` reading documents with chunk attention scaling at temperature ``T`` %; ``"lazy+sink<W>"``:
    ``lazy`` weighting each document's first block by ``W`` %; ``"lazy+prerot"``: ``lazy`` with the
    prefill reading queries rotated beforehand (triton backend); ``torch_compile``:
    ``EngineConfig.torch_compile``; ``cache_fields``: more ``CacheConfig`` fields, e.g.
    ``{"learn_passages": False}``)."""
    mode, remedy = mode_cache_settings(mode)
    prerotate = remedy.pop("prerotate", False)
    config = EngineConfig(device=device, dtype=str(next(bench.model.parameters()).dtype).removeprefix("torch."),
                          attention_backend=backend, prompt=PROMPT, cuda_graphs=cuda_graphs,
                          torch_compile=torch_compile,
                          cache=CacheConfig(kv_cache_bytes=budget_bytes, mode=mode, eviction_policy="lfu",
                                            anchor="none",  # the papers' setting (block_attention has no anchor)
                                            host_memory_bytes=host_memory_bytes if remedy.pop("host", False) else 0,
                                            **remedy, **(cache_fields or {})),
                          scheduler=SchedulerConfig(max_num_batched_tokens=max_batched, max_num_seqs=max_seqs,
                                                    prefill_with_encodes=prefill_with_encodes))
    llm = LazyAttention.from_model(bench.model, bench.tokenizer, config, name="random",
                                   weights_sha256=bench.weights_sha256)
    if prerotate:  # a triton-backend switch, not an engine option (the results are the same)
        backend = llm.engine.runner.backend
        if not hasattr(backend, "prerotate_queries"):
            llm.close()
            raise ValueError(f"mode lazy+prerot needs the triton attention backend, not {backend.name!r}")
        backend.prerotate_queries = True
    return llm


def release(llm: LazyAttention) -> None:
    """Close ``llm`` (its KV cache and decode graphs are freed) before the next engine is built."""
    llm.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
