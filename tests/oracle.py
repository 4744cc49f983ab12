"""An independent eager oracle for chunk reuse, written with transformers only.

Each cached chunk is encoded alone by the HF model (after its anchor, positions
``0 .. l+L-1``), its K rotated to its offset ``delta = g - l`` with HF's own
``rotate_half`` formula, all chunks' K/V concatenated into a ``DynamicCache``, then the
query tail is run and decoded greedily by the HF model.

The caches are plain ``DynamicCache()`` objects, without the model's config: with one, a
sliding-window model would get layers that keep only the window, and the oracle reads every
chunk's whole K/V back out of them.
"""

from __future__ import annotations

import torch

from benchmarks.qa_recompute import cache_argument


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)



def _forward(hf, ids: list[int], start: int, cache):
    """``hf`` over ``ids`` at positions ``start ..``, appending their K/V to ``cache`` (no grad)."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([list(ids)]), position_ids=torch.arange(start, start + len(ids))[None],
                  use_cache=True, **{cache_argument(type(hf)): cache})


def _encode_alone(hf, anchor_ids: list[int], ids: list[int], kv_round=None):
    """Per-layer (K, V) ``[1, kv_heads, len(ids), d]`` of ``ids`` encoded after ``anchor_ids``
    (whose K/V the chunk sees through ``kv_round``, as a cached anchor is read)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if kv_round is not None and anchor_ids:
        _forward(hf, list(anchor_ids), 0, cache)
        cache = _cache_of([(kv_round(layer.keys), kv_round(layer.values)) for layer in cache.layers])
        _forward(hf, list(ids), len(anchor_ids), cache)
    else:
        _forward(hf, list(anchor_ids) + list(ids), 0, cache)
    n = len(anchor_ids)
    return [(layer.keys[:, :, n:], layer.values[:, :, n:]) for layer in cache.layers]


def _shift_keys(hf, k: torch.Tensor, delta: int) -> torch.Tensor:
    rotary = hf.model.rotary_emb
    pos = torch.full((1, k.shape[2]), delta, dtype=torch.int64)
    cos, sin = rotary(k, pos)  # [1, n, d], multiplied by attention_scaling
    cos, sin = cos / rotary.attention_scaling, sin / rotary.attention_scaling
    return k * cos[:, None] + _rotate_half(k) * sin[:, None]


def oracle_generate(hf, chunks, query_ids: list[int], num_tokens: int, kv_round=None):
    """Greedy tokens and first-token logits of the reuse semantics.

    Args:
        hf: a transformers ``*ForCausalLM`` (float32, eval, eager attention).
        chunks: ``[(anchor_ids, token_ids, global_start)]`` in prompt order; contiguous. An
            entry whose ``anchor_ids`` is ``None`` is a private text segment: run by the HF
            model at its positions after everything before it (its K/V join the context).
        query_ids: the new tokens after the chunks.
        num_tokens: how many tokens to decode greedily.
        kv_round: applied to each cached chunk's K and V as encoded (``[1, kv_heads, n, head_dim]``,
            K at its local positions) before the shift: an FP8 cache's quantize-and-dequantize.
    Returns:
        (token ids, logits of the first generated token ``[vocab]``).
    """
    per_layer = []
    pos = 0
    for anchor_ids, ids, g in chunks:
        assert g == pos, "chunks must be contiguous"
        if anchor_ids is None:
            cache = _cache_of(per_layer)
            _forward(hf, ids, pos, cache)
            per_layer = [(layer.keys, layer.values) for layer in cache.layers]
        else:
            kv = _encode_alone(hf, anchor_ids, ids, kv_round)
            if kv_round is not None:
                kv = [(kv_round(k), kv_round(v)) for k, v in kv]
            delta = g - len(anchor_ids)
            kv = [(_shift_keys(hf, k, delta) if delta else k, v) for k, v in kv]
            per_layer = kv if not per_layer else [
                (torch.cat((a, k), dim=2), torch.cat((b, v), dim=2)) for (a, b), (k, v) in zip(per_layer, kv)]
        pos += len(ids)
    cache = _cache_of(per_layer)
    tokens, first_logits, ids = [], None, list(query_ids)
    for _ in range(num_tokens):
        logits = _forward(hf, ids, pos, cache).logits[0, -1]
        first_logits = logits if first_logits is None else first_logits
        pos += len(ids)
        ids = [int(logits.argmax())]
        tokens.append(ids[0])
    return tokens, first_logits


def _cache_of(per_layer):
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(per_layer):
        cache.update(k, v, i)
    return cache


def plan_oracle(hf, plan, anchor_ids: list[int], num_tokens: int):
    """:func:`oracle_generate` of an engine ``PromptPlan`` (chunks, text segments, tail)."""
    segments = []
    for s in plan.segments():
        if hasattr(s, "key"):
            segments.append(([] if s.doc_id is None else list(anchor_ids), list(s.token_ids), s.global_start))
        else:
            segments.append((None, list(s.token_ids), s.global_start))
    return oracle_generate(hf, segments, list(plan.query_token_ids), num_tokens)


def full_prefill_generate(hf, prompt_ids: list[int], num_tokens: int):
    """Greedy tokens and first logits of a plain full forward over the prompt (no reuse)."""
    ids, tokens, first = list(prompt_ids), [], None
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = hf(input_ids=torch.tensor([ids])).logits[0, -1]
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
            tokens.append(ids[-1])
    return tokens, first
