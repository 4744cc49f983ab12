"""Linear layers whose weights are kept pre-packed for oneDNN: an option for the CPU engine.

A request over cached documents computes only its question (tens of rows), so on a CPU each of
its matrix products streams a whole weight matrix for a few rows. Through aten's default path
(MKL's sgemm on the dense weight) the layers of SmolLM2-135M took 45.6 ms for 17 rows on the
2-vCPU machine of 2026-12-01; through oneDNN with the weights reordered once into its blocked
layout, 27.3 ms (measured in isolation). On the 2-core machines measured since, the packed path
is the slower one (decode 61 against 43 ms a token, ``docs/benchmarks.md``), so the engine uses
it only when ``EngineConfig.cpu_weight_packing`` asks. PyTorch ships that path
(``torch.utils.mkldnn``, whose ``MkldnnLinear`` is a TorchScript module); :class:`PackedLinear`
calls the same operator from a plain module that keeps the dense parameters under their usual
names (state dicts, fingerprints and ``.weight`` readers are unchanged).

Results equal ``F.linear``'s to float32 rounding (oneDNN sums in another order), not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_available() -> bool:
    """Whether this torch build has oneDNN (``torch.backends.mkldnn``)."""
    return bool(torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    """``nn.Linear`` over a oneDNN-packed copy of its float32 CPU weight.

    The packed copy follows the parameters: a weight or bias changed in place (its version
    counter moves) or replaced is packed again at the next call. Calls that need gradients, or
    inputs or parameters that are not float32 on the CPU, take the dense ``F.linear`` path.
    Pickling or deep-copying the module leaves the packed copy out (it is made again on use).

    Args:
        linear: the layer (float32, on the CPU); its ``weight`` and ``bias`` stay this module's
            parameters.
    Raises:
        ValueError: ``linear`` is not float32 on the CPU.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            raise ValueError(f"PackedLinear needs a float32 CPU weight, got {w.dtype} on {w.device}")
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed: tuple | None = None  # (state the copy was made of, weight, bias) in oneDNN's layout
        self._pack()

    def _state(self) -> tuple:
        """What the packed copy depends on: the parameters' identities and version counters."""
        return tuple((id(p), p.data_ptr(), p._version) if p is not None else None for p in (self.weight, self.bias))

    def _pack(self) -> None:
        w, b = self.weight, self.bias
        bias = b if b is not None else torch.zeros(w.shape[0])
        with torch.no_grad():  # [out_features, in_features] and [out_features], oneDNN layout
            self._packed = (self._state(), w.detach().to_mkldnn(), bias.detach().to(torch.float32).to_mkldnn())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        w = self.weight
        dense = (x.device.type != "cpu" or x.dtype != torch.float32 or w.device.type != "cpu"
                 or w.dtype != torch.float32 or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))
        if dense:
            return F.linear(x, w, self.bias)
        if self._packed is None or self._packed[0] != self._state():
            self._pack()
        _, packed_weight, packed_bias = self._packed
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), packed_weight, packed_bias).to_dense()

    def __getstate__(self):
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state["_packed"] = None  # oneDNN tensors cannot be pickled; packed again on use
        return state


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`pack_linears`: every :class:`PackedLinear` of ``model`` becomes an
    ``nn.Linear`` over the same parameters again. Returns how many it replaced."""
    replaced = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(parent, name, linear)
                replaced += 1
    return replaced


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model``'s decoder layers by a :class:`PackedLinear`
    (idempotent; layers packed before are packed again if their weights changed since). The
    lm_head stays dense (it multiplies one row per sequence, and may share the embedding's
    weight). Returns how many layers it replaced."""
    replaced = 0
    for layer in model.model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, PackedLinear(child))
                    replaced += 1
                elif isinstance(child, PackedLinear) and (child._packed is None or child._packed[0] != child._state()):
                    child._pack()
    return replaced
