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
selected tokens and one query per token (``engine/scheduling/selective_schedule.py``); the runner measures
the deviation (``ModelRunner.select_tokens``). This module holds the arithmetic both share.
"""

from __future__ import annotations

import math

import torch

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
