"""Rotary position encoding (RoPE) tables and rotations, in float32.

Deferred RoPE (LazyAttention, ICML 2026, arXiv 2606.04302, Sec. 3) relies on
``R_a R_b = R_(a+b)``: a cached key rotated at its local position ``j`` is moved to
global position ``j + delta`` by one pure rotation ``R_delta``. This module owns the
frequencies (``inv_freq``, identical to the model's own rotary buffer in transformers),
the cos/sin tables and the rotation itself; every attention backend and kernel takes
its tables from here.

Supported RoPE types keep fixed frequencies: ``default``, ``linear``, ``llama3`` and
(static) ``yarn``, with half-split (NeoX / HF ``rotate_half``) or interleaved (GPT-J)
pairing and partial rotary (``rotary_dim < head_dim``). Length-dependent schemes
(``dynamic`` NTK, ``longrope``) break the identity and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedRopeError(ValueError):
    """The model's RoPE scheme cannot be deferred (its frequencies depend on length)."""


def _rope_parameters(hf_config: Any) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers < 5 style
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


@dataclass(frozen=True)
class RotaryEmbedding:
    """Frequencies and rotation of one model's RoPE.

    Attributes:
        inv_freq: ``[rotary_dim // 2]`` float32, equal to transformers' ``rotary_emb.inv_freq``.
        attention_scaling: magnitude factor applied to cos/sin when encoding (YaRN ``mscale``;
            1.0 otherwise). Never applied by :meth:`rotate_by`, which is a pure rotation.
        head_dim: size of one attention head.
        rotary_dim: leading dimensions of each head that rotate (``<= head_dim``, even).
        interleaved: pair dimensions ``(2i, 2i+1)`` (GPT-J) instead of ``(i, i + rotary_dim/2)``.
        rope_type: one of :data:`SUPPORTED_ROPE_TYPES`.
        params: the RoPE parameters as sorted ``(name, value)`` pairs (used in cache keys).
    """

    inv_freq: torch.Tensor = field(repr=False)
    attention_scaling: float
    head_dim: int
    rotary_dim: int
    interleaved: bool
    rope_type: str
    params: tuple = ()
    _device_inv_freq: dict = field(default_factory=dict, repr=False, compare=False)  # device -> inv_freq copy

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` on ``device`` (copied once per device, so a forward pass does no host copy)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.inv_freq
        if device not in self._device_inv_freq:
            self._device_inv_freq[device] = self.inv_freq.to(device)
        return self._device_inv_freq[device]

    @classmethod
    def from_hf_config(cls, hf_config: Any, interleaved: bool = False) -> "RotaryEmbedding":
        """Build from a transformers config (``rope_parameters`` or legacy ``rope_scaling``).

        Raises:
            UnsupportedRopeError: for ``dynamic``, ``longrope`` or any unknown RoPE type.
        """
        params = _rope_parameters(hf_config)
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedRopeError(
                f"RoPE type {rope_type!r} is not supported: its frequencies depend on the sequence "
                f"length, which breaks R_a R_b = R_(a+b) and so deferred RoPE; supported types are "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        head_dim = _head_dim(hf_config)
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        if rope_type == "default":
            base = float(params["rope_theta"])
            exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
            inv_freq, scaling = 1.0 / (base**exponent), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        inv_freq = inv_freq.to(torch.float32)
        if inv_freq.numel() * 2 != rotary_dim:
            raise UnsupportedRopeError(
                f"inv_freq has {inv_freq.numel()} entries but rotary_dim is {rotary_dim}"
            )
        items = tuple(sorted((k, repr(v)) for k, v in params.items()))
        return cls(inv_freq, float(scaling), head_dim, rotary_dim, interleaved, rope_type, items)

    def fingerprint(self) -> dict:
        """A JSON-able description of everything that changes the rotation (for cache keys)."""
        return {
            "rope_type": self.rope_type,
            "params": [list(p) for p in self.params],
            "head_dim": self.head_dim,
            "rotary_dim": self.rotary_dim,
            "interleaved": self.interleaved,
            "attention_scaling": self.attention_scaling,
        }

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Angles ``positions * inv_freq`` in float32.

        Args:
            positions: ``[n]`` integer positions (any sign; int32 or int64).
        Returns:
            ``(cos, sin)``, each ``[n, rotary_dim // 2]`` float32, without ``attention_scaling``.
        """
        inv_freq = self.inv_freq_on(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        return angles.cos(), angles.sin()

    def tables(self, positions: torch.Tensor) -> "PositionTables":
        """The tables that encode at ``positions`` (``[n]`` integers): made once per forward pass,
        applied by every layer to its q and k."""
        cos, sin = self.cos_sin(positions)
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return PositionTables(cos, sin, self.rotary_dim, self.interleaved)

    def encode(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE at absolute ``positions`` (what a normal forward pass does to q and k).

        Args:
            x: ``[n, num_heads, head_dim]`` any float dtype.
            positions: ``[n]`` integer positions.
        Returns:
            Tensor like ``x``: rotated and multiplied by ``attention_scaling``, computed in float32.
        """
        return self.tables(positions).apply(x)

    def rotate_by(self, x: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Pure rotation ``R_delta`` (no magnitude factor): moves already-encoded vectors by ``deltas``.

        Args:
            x: ``[n, num_heads, head_dim]``, already encoded at some positions.
            deltas: ``[n]`` integer offsets (negative rotates back).
        Returns:
            Tensor like ``x``, as if it had been encoded at ``position + delta``.
        """
        return self.shifts(deltas).apply(x)

    def shifts(self, deltas: torch.Tensor) -> "PositionTables":
        """The pure rotations ``R_delta`` (no magnitude factor) by ``deltas`` (``[n]`` integers), as
        tables to apply to many tensors, e.g. every layer's keys (:meth:`rotate_by` applies them once)."""
        cos, sin = self.cos_sin(deltas)
        return PositionTables(cos, sin, self.rotary_dim, self.interleaved)


@dataclass(frozen=True)
class PositionTables:
    """RoPE at one forward pass's positions: ``cos``/``sin`` ``[n, rotary_dim // 2]`` float32,
    already multiplied by ``attention_scaling`` (see :meth:`RotaryEmbedding.tables`)."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int
    interleaved: bool

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Encode ``x`` ``[n, num_heads, head_dim]`` at the tables' positions (float32 math)."""
        return apply_rotation(x, self.cos, self.sin, self.rotary_dim, self.interleaved)


def apply_rotation(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    interleaved: bool,
) -> torch.Tensor:
    """Rotate dimension pairs of ``x`` by the given angles, in float32.

    Args:
        x: ``[n, num_heads, head_dim]``.
        cos, sin: ``[n, rotary_dim // 2]`` float32 (may already carry a magnitude factor).
        rotary_dim: leading dimensions that rotate; the rest pass through unchanged.
        interleaved: GPT-J pairing ``(2i, 2i+1)`` instead of half-split ``(i, i + rotary_dim/2)``.
    Returns:
        Tensor of ``x``'s shape and dtype.
    """
    xf = x.to(torch.float32)
    rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    if rest.shape[-1]:
        out = torch.cat((out, rest), dim=-1)
    return out.to(x.dtype)
