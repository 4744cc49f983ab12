"""Selective recompute (CacheBlend, Yao et al., EuroSys 2025, section 4): which document tokens a
request recomputes.

A document's cached K/V were computed with the document alone; placed after other text, each
of its tokens would have other K/V from the second layer on (the first layer's depend on the
token and its position only). CacheBlend recomputes, at every layer, the few tokens whose K/V
deviate most, and reads the rest as cached. The deviation is measured cheaply, once: a dense
pass over the whole prompt through the first two layers (``CausalLM.dense_kv``) gives each
token's fresh K/V at the second layer, compared with the cached ones (K rotated to the token's
position in the request). CacheBlend narrows its selection layer by layer; this keeps the
second layer's for every layer.

The scheduler turns the selection into the request's own copies of the blocks holding the
selected tokens and one query per token (``Scheduler._apply_selection``); the runner computes
the deviation (:func:`select_tokens`).
"""

from __future__ import annotations

import math

import torch

from lazyattn_rag.engine.model import CausalLM

SELECTION_LAYER = 1  # the first layer whose K/V depend on the context (0 for a one-layer model)


def num_selected(num_tokens: int, ratio: float) -> int:
    """Tokens selected of a ``num_tokens``-token document at ratio ``ratio``: ``ceil(ratio * n)``
    (rounded to 9 digits first, so that e.g. ``0.15 * 20`` is 3, not 4)."""
    return min(num_tokens, math.ceil(round(ratio * num_tokens, 9)))


def kv_deviation(fresh_k: torch.Tensor, fresh_v: torch.Tensor, cached_k: torch.Tensor,
                 cached_v: torch.Tensor) -> torch.Tensor:
    """Per-token squared L2 distance between fresh and cached K/V, summed over heads and both.

    Args:
        fresh_k, fresh_v, cached_k, cached_v: ``[n, num_kv_heads, head_dim]``, K at the same positions.
    Returns:
        ``[n]`` float32.
    """
    dk = (fresh_k.float() - cached_k.float()).square().sum(dim=(1, 2))
    dv = (fresh_v.float() - cached_v.float()).square().sum(dim=(1, 2))
    return dk + dv


def top_tokens(deviation: torch.Tensor, ratio: float) -> tuple[int, ...]:
    """Indices of the ``num_selected(len(deviation), ratio)`` largest deviations, ascending
    (ties go to the earlier token)."""
    k = num_selected(deviation.numel(), ratio)
    if k == 0:
        return ()
    order = torch.argsort(deviation, descending=True, stable=True)[:k]
    return tuple(sorted(order.tolist()))


@torch.inference_mode()
def select_tokens(model: CausalLM, scale: float, prompt_ids: list[int], chunks: list[tuple[int, int, torch.Tensor,
                  torch.Tensor]], ratio: float) -> dict[int, tuple[int, ...]]:
    """The tokens to recompute of each document chunk.

    Args:
        model: the engine's model (on the KV cache's device).
        scale: attention softmax scale.
        prompt_ids: the request's whole prompt (positions ``0 ..``).
        chunks: per document chunk ``(chunk index in the plan, global start, cached K, cached V)``,
            K/V ``[num_tokens, num_kv_heads, head_dim]`` of the selection layer, K at the chunk's
            local positions already rotated to its global ones.
        ratio: ``r`` in ``(0, 1]``.
    Returns:
        chunk index -> selected local token indices (ascending).
    """
    device = model.lm_head.weight.device
    ids = torch.tensor(prompt_ids, dtype=torch.int64, device=device)
    positions = torch.arange(len(prompt_ids), device=device)
    layer = min(SELECTION_LAYER, model.config.num_layers - 1)
    fresh_k, fresh_v = model.dense_kv(ids, positions, layer, scale)
    selected = {}
    for index, start, cached_k, cached_v in chunks:
        n = cached_k.shape[0]
        deviation = kv_deviation(fresh_k[start:start + n], fresh_v[start:start + n], cached_k, cached_v)
        selected[index] = top_tokens(deviation, ratio)
    return selected
