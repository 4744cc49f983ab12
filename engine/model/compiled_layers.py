"""The non-attention part of each decoder layer as two functions compiled by ``torch.compile``.

A decode step of an 8B model at batch 1 is bound by reading its weights, but eagerly each layer
also launches some forty small kernels around its five matrix products (the float32 casts and
products of two RMSNorms, RoPE on q and k, the residual adds, SiLU and the gate product), each
costing a few microseconds of GPU time however small its tensor (issue 19). Inductor fuses each
run of them into one kernel. The layer is cut at the attention backend, which stays as it is
(its Triton kernels, its CUDA-graph plan):

* :func:`attention_input`: the previous layer's MLP output added to the residual stream, the
  input RMSNorm, the fused q/k/v product, Qwen3's q/k norms and RoPE of q and k (together; on
  CUDA one launch of ``kernels/rope_apply.py``'s kernel, see :func:`_rotate`);
* :func:`attention_output`: the output projection added to the residual stream, the
  post-attention RMSNorm and the SwiGLU MLP, whose output is added by the next layer's
  :func:`attention_input` (or before the final norm) so that add fuses with that norm.

At one row on CUDA (a batch-1 decode step) the half-type products of up to 64 Mi weights
(Llama-3.1-8B's q/k/v, output and down) run ``kernels/gemv.py``'s one-row kernel instead of
cuBLAS, which reads them more slowly at M = 1 and adds a split-K reduction kernel to two of them
(:func:`_linear`).

Both take the layer's weights as tensor arguments, so one compiled graph serves every layer
(Dynamo would recompile per module instance otherwise). The arithmetic is that of
``engine/model/transformer.py``'s modules, float32 where they use float32; inductor may order float
operations differently, so results match the eager model to rounding, not bit for bit (the
eager path, the reference, is unchanged: ``EngineConfig.torch_compile``).
"""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lazyattn_rag.kernels.rope import apply_rotation

if TYPE_CHECKING:
    from lazyattn_rag.engine.model.transformer import CausalLM, DecoderLayer


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``; one row on a CUDA device (a batch-1 decode step) goes through the one-row
    kernel (``kernels/gemv.py``: no split-K reduction kernel, more of the copy bandwidth) where
    :func:`~lazyattn_rag.kernels.gemv.gemv_applies`. Dynamo traces the Triton launch into the
    graph; the row count is a static guard (it specializes size 1)."""
    if x.is_cuda and x.shape[0] == 1:
        from lazyattn_rag.kernels.gemv import gemv, gemv_applies

        if gemv_applies(x, weight, bias):
            return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``engine/model/transformer.py``'s RMSNorm: float32 statistics, the weight applied in ``x``'s dtype."""
    return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps).to(x.dtype)


def attention_input(
    x: torch.Tensor,  # [n, hidden_size] residual stream
    delta: torch.Tensor | None,  # [n, hidden_size] previous layer's MLP output, or None (first layer)
    norm_weight: torch.Tensor,  # [hidden_size]
    qkv_weight: torch.Tensor,  # [q_size + 2 * kv_size, hidden_size]
    qkv_bias: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,  # [head_dim] (Qwen3)
    k_norm_weight: torch.Tensor | None,
    cos: torch.Tensor,  # [n, rotary_dim // 2] float32
    sin: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual stream after ``delta`` and the layer's rotated q, k and v.

    Returns:
        ``(x, q, k, v)``: ``[n, hidden_size]``, ``[n, num_heads, head_dim]``,
        ``[n, num_kv_heads, head_dim]`` twice, all in ``x``'s dtype.
    """
    if delta is not None:
        x = x + delta
    n, kv_size = x.shape[0], num_kv_heads * head_dim
    qkv = _linear(_rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias)
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, kv_size], dim=-1)
    qk, v = qk.view(n, num_heads + num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)
    if q_norm_weight is not None:  # Qwen3: per-head norms of q and k, each its own weight
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        qk = torch.cat((_rms_norm(q, q_norm_weight, eps), _rms_norm(k, k_norm_weight, eps)), dim=1)
    # q and k rotated together: one kernel instead of one each (every launch counts at batch 1)
    q, k = _rotate(qk, cos, sin, rotary_dim, interleaved).split([num_heads, num_kv_heads], dim=1)
    return x, q, k, v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """``apply_rotation``; on a CUDA device through ``kernels/rope_apply.py``'s kernel where
    :func:`~lazyattn_rag.kernels.rope_apply.rope_applies` (the kernel inductor fuses from
    ``apply_rotation`` moved 0.56 TB/s, about an eighth of the copy bandwidth, at 20k tokens)."""
    if x.is_cuda:
        from lazyattn_rag.kernels.rope_apply import rope_applies, rope_apply_op

        if rope_applies(x, cos, sin, rotary_dim):
            return rope_apply_op(x, cos, sin, rotary_dim, interleaved)
    return apply_rotation(x, cos, sin, rotary_dim, interleaved)


def attention_output(
    x: torch.Tensor,  # [n, hidden_size] residual stream
    attn: torch.Tensor,  # [n, num_heads * head_dim] attention output
    o_weight: torch.Tensor,  # [hidden_size, num_heads * head_dim]
    o_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,  # [hidden_size]
    gate_up_weight: torch.Tensor,  # [2 * intermediate_size, hidden_size]
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,  # [hidden_size, intermediate_size]
    down_bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after attention, and the MLP's output (not yet added to it).

    Returns:
        ``(x, delta)``, both ``[n, hidden_size]`` in ``x``'s dtype.
    """
    # The residual add in float32, rounded once (equal to the half-type add): so inductor fuses it
    # with the norm below instead of folding it into the product as addmm (whose bias copy and
    # split-K reduction were two more kernels per layer in an H200 decode step).
    x = (x.to(torch.float32) + _linear(attn, o_weight, o_bias).to(torch.float32)).to(x.dtype)
    gate, up = _linear(_rms_norm(x, norm_weight, eps), gate_up_weight, gate_up_bias).chunk(2, dim=-1)
    return x, _linear(F.silu(gate) * up, down_weight, down_bias)


@functools.cache
def _compiled(fn, model_key: tuple):
    """``fn`` compiled for models of one ``model_key`` (architecture, dtype, device type).

    Dynamo keeps compiled graphs per code object, up to ``recompile_limit`` (8) of them; each
    model shape is given its own copy of ``fn``'s code, so several models in one process (tests,
    benchmarks) do not share that limit, while engines of one model share their graphs.
    ``dynamic=True``: one graph for every batch size past 1 (Dynamo specializes size 1 itself).
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{abs(hash(model_key)):x}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return torch.compile(copy, dynamic=True, fullgraph=True)


class CompiledLayers:
    """Runs a :class:`~lazyattn_rag.engine.model.transformer.CausalLM`'s layers through the compiled functions.

    Args:
        model: the model (on its device and dtype; its parameters are read at each call, so a
            later ``.to()`` is seen).
    """

    def __init__(self, model: "CausalLM"):
        self.model = model
        weight = model.lm_head.weight
        key = (model.config, weight.dtype, weight.device.type)
        self.attention_input = _compiled(attention_input, key)
        self.attention_output = _compiled(attention_output, key)
        self.num_passes = 0  # forward passes run through the compiled functions

    def run(self, x, rope, backend, kv_caches, metadata) -> torch.Tensor:
        """The residual stream after every layer (the final norm not applied): ``[n, hidden_size]``."""
        cfg, delta = self.model.config, None
        self.num_passes += 1
        for layer, (key_cache, value_cache, *scales) in zip(self.model.model.layers, kv_caches):
            x, q, k, v = self._input(layer, x, delta, rope, cfg)
            attn = backend.forward(q, k, v, key_cache, value_cache, metadata, *scales)
            x, delta = self._output(layer, x, attn.reshape(x.shape[0], -1), cfg)
        return x + delta

    def _input(self, layer: "DecoderLayer", x, delta, rope, cfg):
        a = layer.self_attn
        q_norm = a.q_norm.weight if cfg.qk_norm else None
        k_norm = a.k_norm.weight if cfg.qk_norm else None
        return self.attention_input(
            x, delta, layer.input_layernorm.weight, a.qkv_proj.weight, a.qkv_proj.bias, q_norm, k_norm,
            rope.cos, rope.sin, cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            rope.rotary_dim, rope.interleaved)

    def _output(self, layer: "DecoderLayer", x, attn, cfg):
        a, m = layer.self_attn, layer.mlp
        return self.attention_output(
            x, attn, a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm.weight,
            m.gate_up_proj.weight, m.gate_up_proj.bias, m.down_proj.weight, m.down_proj.bias, cfg.rms_norm_eps)
