"""Shared test setup. Kernels run under Triton's interpreter when no CUDA device is present; this
must be set before anything imports triton, so it lives at the top of the first conftest."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
