"""The self-check's rotary part: our rotary tables and pure rotation against transformers'.

See :mod:`lazyattn_rag.engine.self_check.checks` (the check as a whole) and ``docs/architecture.md``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from lazyattn_rag.kernels.rope import RotaryEmbedding
from lazyattn_rag.types.errors import SelfCheckError

ROTARY_TOLERANCE = 1e-4  # on probe vectors scaled to max |x| = 1; the same float32 angles agree to ~1e-7


def probe_positions(hf_config: Any) -> list[int]:
    """Positions the rotary tables are compared at: small, a tile boundary, the model's last
    position, and offsets near 2^20 and 2^24 (the block table's supported range)."""
    last = int(getattr(hf_config, "max_position_embeddings", 2048)) - 1
    return sorted({0, 1, 17, 4095, last, 2**20 - 1, 2**24 - 1})


def hf_rotary(hf_config: Any):
    """transformers' rotary module for ``hf_config``'s architecture, and that architecture's
    ``apply_rotary_pos_emb`` (found from the config's ``model_type``; no weights are made)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(hf_config, "model_type", None)
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if class_name is None:
        raise SelfCheckError(f"transformers has no causal LM for model_type {model_type!r} to check against")
    module = sys.modules[getattr(transformers, class_name).__module__]
    rotary_name = class_name.replace("ForCausalLM", "RotaryEmbedding")
    rotary_cls = getattr(module, rotary_name, None)
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if rotary_cls is None or apply is None:
        raise SelfCheckError(f"{module.__name__} has no {rotary_name} / apply_rotary_pos_emb to check against")
    return rotary_cls(config=hf_config).eval(), apply


def check_rotary(rotary: RotaryEmbedding, hf_config: Any) -> dict:
    """Compare our rotary encoding and pure rotation with transformers' (CPU, float32).

    Returns:
        A JSON-able report: ``passed``, ``max_abs_diff``, ``tolerance``, per-position errors of
        the encoding (``encode``) and of the deferred rotation (``rotate_by``), the sizes of both
        ``inv_freq`` buffers and, when failed, ``problem`` (a sentence for the error).
    """
    hf_module, apply = hf_rotary(hf_config)
    positions = probe_positions(hf_config)
    head_dim = rotary.head_dim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 1, head_dim, generator=gen)  # [batch, heads, 1, head_dim], transformers' layout
    x = x / x.abs().max()

    def theirs(pos: list[int]) -> torch.Tensor:  # [n, heads, head_dim], encoded at pos by transformers
        xs = x.expand(1, 2, len(pos), head_dim)
        with torch.no_grad():
            cos, sin = hf_module(xs, torch.tensor([pos]))
            q, _ = apply(xs, xs, cos, sin)
        return q[0].transpose(0, 1)

    def ours_at(pos: list[int]) -> torch.Tensor:
        return rotary.encode(x[0].transpose(0, 1).expand(len(pos), 2, head_dim), torch.tensor(pos))

    report: dict[str, Any] = {"positions": positions, "tolerance": ROTARY_TOLERANCE,
                              "inv_freq_size": int(rotary.inv_freq.numel()),
                              "transformers_inv_freq_size": int(hf_module.inv_freq.numel()),
                              "transformers_module": type(hf_module).__name__}
    try:
        encode_err = per_row_max(ours_at(positions) - theirs(positions))
    except RuntimeError as error:  # shapes disagree (e.g. rotary_dim): the tables cannot even be compared
        report.update(passed=False, max_abs_diff=float("inf"), problem=(
            f"our rotary encoding and transformers' {type(hf_module).__name__} could not be compared ({error}); "
            f"we rotate {rotary.rotary_dim} of {head_dim} dimensions with {report['inv_freq_size']} frequencies, "
            f"transformers has {report['transformers_inv_freq_size']}"))
        return report
    # R_delta of a vector encoded at j lands where transformers encodes j + delta, and R_-delta brings it
    # back; float32 angles at position p are exact to ~p * max(inv_freq) * 2^-24, hence the bound below.
    j, limit = 5, int(getattr(hf_config, "max_position_embeddings", 2048))
    deltas = sorted({d for d in positions if 0 < d < limit - 1 - j} | {limit - 1 - j})
    moved = rotary.rotate_by(ours_at([j] * len(deltas)), torch.tensor(deltas))
    back = rotary.rotate_by(ours_at([j + d for d in deltas]), -torch.tensor(deltas))
    rotate_err = torch.maximum(per_row_max(moved - theirs([j + d for d in deltas])),
                               per_row_max(back - theirs([j] * len(deltas))))
    f_max = float(rotary.inv_freq.abs().max()) if rotary.inv_freq.numel() else 0.0
    rotate_tol = [ROTARY_TOLERANCE + 2.0**-21 * (j + d) * f_max for d in deltas]
    bad_encode = [(p, e) for p, e in zip(positions, encode_err.tolist()) if not e <= ROTARY_TOLERANCE]
    bad_rotate = [(d, e) for d, e, t in zip(deltas, rotate_err.tolist(), rotate_tol) if not e <= t]
    report.update(
        encode={str(p): e for p, e in zip(positions, encode_err.tolist())},
        rotate_by={str(d): e for d, e in zip(deltas, rotate_err.tolist())},
        max_abs_diff=max(encode_err.max().item(), rotate_err.max().item() if deltas else 0.0),
        passed=not bad_encode and not bad_rotate,
    )
    problems = []
    if bad_encode:
        problems.append(
            f"our rotary encoding differs from transformers' {type(hf_module).__name__} at positions "
            f"{format_pairs(bad_encode)} (max abs error {max(e for _, e in bad_encode):.3g}, tolerance "
            f"{ROTARY_TOLERANCE:g} on unit-scaled vectors); we rotate {rotary.rotary_dim} of {head_dim} dimensions "
            f"with {report['inv_freq_size']} frequencies, transformers has {report['transformers_inv_freq_size']}")
    if bad_rotate:
        problems.append(
            f"our deferred rotation R_delta does not move a key encoded at position {j} to where transformers "
            f"encodes position {j} + delta, for delta {format_pairs(bad_rotate)} (max abs error "
            f"{max(e for _, e in bad_rotate):.3g})")
    if problems:
        report["problem"] = "; ".join(problems)
    return report


def per_row_max(diff: torch.Tensor) -> torch.Tensor:
    return diff.abs().flatten(1).amax(dim=1)


def format_pairs(items: list[tuple[int, float]], limit: int = 8) -> str:
    shown = ", ".join(f"{p}: {e:.3g}" for p, e in items[:limit])
    return "{" + shown + (", ..." if len(items) > limit else "") + "}"
