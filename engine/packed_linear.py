"""Linear layers whose weights are kept pre-packed for oneDNN: the CPU engine's matrix products.

A request over cached documents computes only its question (tens of rows), so on a CPU each of
its matrix products streams a whole weight matrix for a few rows. Through aten's default path
(MKL's sgemm on the dense weight) the layers of SmolLM2-135M took 45.6 ms for 17 rows on the
2-core machine of docs/benchmarks.md; through oneDNN with the weights reordered once into its
blocked layout, 27.3 ms (issue 19, "CPU"). PyTorch ships that path
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

    Args:
        linear: the layer (float32, on the CPU); its ``weight`` and ``bias`` stay this module's
            parameters, and the packed copy is taken now (later changes to them are not seen).
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
        bias = linear.bias if linear.bias is not None else torch.zeros(w.shape[0])
        with torch.no_grad():
            self._packed_weight = w.detach().to_mkldnn()  # [out_features, in_features], oneDNN layout
            self._packed_bias = bias.detach().to(torch.float32).to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        if x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)  # the model was moved since: the dense path
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self._packed_weight,
                                          self._packed_bias).to_dense()


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
    (idempotent). The lm_head stays dense (it multiplies one row per sequence, and may share the
    embedding's weight). Returns how many layers it replaced."""
    replaced = 0
    for layer in model.model.layers:
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, PackedLinear(child))
                    replaced += 1
    return replaced
