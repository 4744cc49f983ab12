"""Llama-family decoder (Llama, SmolLM2, Llama-3.x, Mistral, Qwen2, Qwen3) over a paged KV cache.

Parameter names follow Hugging Face's ``*ForCausalLM`` so their state dicts load as they are.
Attention goes through an :class:`~lazyattn_rag.engine.worker.attention.AttentionBackend`; this
module applies RoPE to q and k at their global positions (float32 angles) and leaves the
deferred rotation of cached chunks to the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lazyattn_rag.engine.worker.attention import AttentionBackend, AttentionMetadata
from lazyattn_rag.kernels.rope import PositionTables, RotaryEmbedding

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or an option of it is not implemented."""


@dataclass(frozen=True)
class ModelArchConfig:
    """The architecture facts the engine needs, read from a transformers config.

    Attributes:
        model_type: one of :data:`SUPPORTED_MODEL_TYPES`.
        vocab_size, hidden_size, intermediate_size, num_layers: usual sizes.
        num_heads, num_kv_heads, head_dim: attention shape (GQA when ``num_kv_heads < num_heads``).
        rms_norm_eps: RMSNorm epsilon.
        qkv_bias: q/k/v projections have a bias (Qwen2, ``attention_bias`` Llama).
        o_bias: output projection has a bias (``attention_bias`` Llama).
        mlp_bias: MLP projections have a bias.
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        tie_word_embeddings: ``lm_head`` shares the embedding matrix.
        max_position_embeddings: the model's context length in tokens.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelArchConfig":
        """Raises :class:`UnsupportedModelError` for other architectures or activations."""
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        num_heads = cfg.num_attention_heads
        return cls(
            model_type=model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            rms_norm_eps=float(cfg.rms_norm_eps),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
        )


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as transformers' ``LlamaRMSNorm``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)  # x * rsqrt(mean(x^2) + eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.qkv_sizes = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
        self.qkv_proj = nn.Linear(h, sum(self.qkv_sizes), bias=cfg.qkv_bias)  # q, k, v in one product
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project(self, x, rope: PositionTables):
        """``x`` ``[n, hidden_size]`` -> q ``[n, num_heads, head_dim]``, k and v ``[n, num_kv_heads,
        head_dim]``, q and k rotated to ``rope``'s positions."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # views of one [n, sum(qkv_sizes)] product
        q = q.view(n, self.num_heads, self.head_dim)  # [n, num_heads, head_dim]
        k = k.view(n, self.num_kv_heads, self.head_dim)  # [n, num_kv_heads, head_dim]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return rope.apply(q), rope.apply(k), v

    def forward(self, x, rope: PositionTables, backend, key_cache, value_cache, metadata, key_scale=None,
                value_scale=None):
        q, k, v = self.project(x, rope)
        out = backend.forward(q, k, v, key_cache, value_cache, metadata, key_scale=key_scale, value_scale=value_scale)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # gate, up
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [n, intermediate_size] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope: PositionTables, backend, key_cache, value_cache, metadata, key_scale=None,
                value_scale=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, backend, key_cache, value_cache, metadata, key_scale,
                               value_scale)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        # Built on the meta device (CausalLM.from_hf_state_dict), the embedding is given its empty
        # weight: its default normal_ init on meta imports torch._dynamo (~1.5 s of CPU).
        on_meta = torch.get_default_device().type == "meta"
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size) if on_meta else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache (HF parameter names: ``model.*``, ``lm_head``)."""

    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.config = cfg
        self.rotary = rotary
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64, all sequences' new tokens, flattened
        positions: torch.Tensor,  # [num_tokens] int64 global positions
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, ...]],  # per layer KVPool.layers: K and V caches (FP8: then their scales)
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,  # [num_out] rows whose logits are wanted
        compiled: Any = None,  # a CompiledLayers of this model (engine/model/compiled_layers.py), or None: eager
    ) -> torch.Tensor:  # [num_out or num_tokens, vocab_size] float32
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.tables(positions)  # once per pass, shared by every layer
        if compiled is not None:
            x = compiled.run(x, rope, backend, kv_caches, metadata)
        else:
            for layer, (kc, vc, *scales) in zip(self.model.layers, kv_caches):
                x = layer(x, rope, backend, kc, vc, metadata, *scales)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.lm_head(self.model.norm(x)).to(torch.float32)

    @torch.inference_mode()
    def dense_kv(self, input_ids: torch.Tensor, positions: torch.Tensor, layer: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer ``layer`` for one whole sequence, computed densely (no KV cache):
        layers ``0 .. layer - 1`` run with causal attention over the sequence (PyTorch's
        ``scaled_dot_product_attention``, softmax scale ``scale``). Selective recompute's cheap
        measure of how much each token's K/V depend on the context (``engine/scheduling/selective_recompute.py``).

        Args:
            input_ids: ``[n]`` int64, the sequence's tokens.
            positions: ``[n]`` int64, their positions.
            layer: ``0 <= layer < num_layers``.
        Returns:
            ``(k, v)``, each ``[n, num_kv_heads, head_dim]`` in the model's dtype; k rotated to ``positions``.
        """
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.tables(positions)
        for i, lyr in enumerate(self.model.layers[: layer + 1]):
            attn = lyr.self_attn
            q, k, v = attn.project(lyr.input_layernorm(x), rope)
            if i == layer:
                return k, v
            group = attn.num_heads // attn.num_kv_heads
            out = F.scaled_dot_product_attention(  # [1, num_heads, n, head_dim]
                q.transpose(0, 1)[None], k.repeat_interleave(group, dim=1).transpose(0, 1)[None],
                v.repeat_interleave(group, dim=1).transpose(0, 1)[None], is_causal=True, scale=scale)
            x = x + attn.o_proj(out[0].transpose(0, 1).reshape(x.shape[0], -1))
            x = x + lyr.mlp(lyr.post_attention_layernorm(x))
        raise ValueError(f"layer {layer} is outside the model's {self.config.num_layers} layers")

    @classmethod
    def from_hf_state_dict(cls, cfg: ModelArchConfig, rotary: RotaryEmbedding,
                           state_dict: dict[str, torch.Tensor]) -> "CausalLM":
        """The model whose parameters are ``state_dict``'s tensors (see :meth:`load_hf_state_dict`).

        Built on the meta device and filled by assignment: no random initialization and no copy
        into it (those took 2.0 s of CPU on a busy 2-core machine, now 0.12 s); only the fused q/k/v
        and gate/up projections are new tensors. Tensors of ``safetensors.torch.load_file`` stay views of the file's private mapping (page cache),
        read on first use. The model takes the state dict's dtype; ``.to(dtype)`` converts.

        Raises:
            UnsupportedModelError: missing or unexpected weights (names listed).
        """
        with torch.device("meta"):
            model = cls(cfg, rotary)
        model.load_hf_state_dict(state_dict, assign=True)
        return model

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor], assign: bool = False) -> None:
        """Load a transformers ``*ForCausalLM`` state dict (strict; rotary buffers ignored).

        Args:
            state_dict: transformers' parameter names (separate q/k/v and gate/up projections).
            assign: make the tensors the parameters instead of copying into them (a model built
                on the meta device; see :meth:`from_hf_state_dict`).
        Raises:
            UnsupportedModelError: missing or unexpected weights (names listed).
        """
        state = {k: v for k, v in state_dict.items() if "rotary_emb" not in k}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, reported = _fuse_projections(state, self.config.num_layers)
        expected = {k for k in self.state_dict() if not (self.config.tie_word_embeddings and k == "lm_head.weight")}
        missing += sorted(expected - state.keys() - reported)
        unexpected = state.keys() - expected
        if missing or unexpected:
            raise UnsupportedModelError(
                f"weights do not match the architecture: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        self.load_state_dict(state, strict=False, assign=assign)
        if assign and self.config.tie_word_embeddings:  # assignment replaced the shared parameter
            self.lm_head.weight = self.model.embed_tokens.weight


# transformers' separate projections -> ours, concatenated along the output dimension in this order.
_FUSED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _fuse_projections(state: dict[str, torch.Tensor], num_layers: int) -> tuple[list[str], set[str]]:
    """Replace, in ``state``, each layer's q/k/v and gate/up weights (and biases) by their
    concatenation under our names. Returns the transformers names of the parts missing where
    others of the same projection are present, and our names of the projections they leave
    unloadable (already reported through those parts)."""
    missing, reported = [], set()
    for i in range(num_layers):
        for fused, parts in _FUSED_PROJECTIONS.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{part}.{kind}" for part in parts]
                absent = [n for n in names if n not in state]
                present = [state.pop(n) for n in names if n in state]
                if not absent:
                    state[f"model.layers.{i}.{fused}.{kind}"] = torch.cat(present, dim=0)
                elif present:  # none present: no bias, or the whole projection is reported under our name
                    missing += absent
                    reported.add(f"model.layers.{i}.{fused}.{kind}")
    return missing, reported
