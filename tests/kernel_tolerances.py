"""Per-dtype tolerances for kernel-vs-reference checks, in one place.

Kernels compute in float32 (online softmax, float32 accumulators) but read K/V and do the dot
products in the storage dtype; the deferred rotation rounds the rotated K (prefill) or q (decode)
back to the storage dtype before the tensor-core dot. The reference computes everything in float32
from the same stored values, so the error is about one rounding of the storage dtype.
"""

import torch

# dtype -> (atol, rtol) for torch.testing.assert_close on attention outputs (values O(1)).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    """Compare a kernel output with a float32 reference at ``dtype``'s tolerance; NaN never passes."""
    actual = actual.detach().float().cpu()
    expected = expected.detach().float().cpu()
    assert not torch.isnan(actual).any(), f"NaN in kernel output {msg}"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{msg}\n{m}")
