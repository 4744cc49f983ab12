"""The sampler: penalties, then greedy, temperature, top-k, top-p, min-p (seeded per request)."""

from __future__ import annotations

import torch

from lazyattn_rag.types.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM's semantics) on ``[vocab_size]`` logits."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64, device=logits.device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.numel())
        logits -= params.frequency_penalty * counts[: logits.numel()].to(logits.dtype)
        logits -= params.presence_penalty * (counts[: logits.numel()] > 0).to(logits.dtype)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token id from ``logits`` (``[vocab_size]`` float32), on their device.

    ``generator`` must be on that device (the engine makes each request's on the runner's).
    """
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > params.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if params.min_p > 0:  # relative to the most likely token left (multinomial renormalizes)
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))  # on the logits' device
