"""Attention backends: ``torch`` (reference, CPU default) and ``triton`` (fused kernels, CUDA)."""

from lazyattn_rag.engine.worker.attention.base import AttentionBackend
from lazyattn_rag.engine.worker.attention.metadata import (AttentionMetadata, SequenceInput, SlotCopies,
                                                   build_attention_metadata, check_sequence_input)

__all__ = ["AttentionBackend", "AttentionMetadata", "SequenceInput", "SlotCopies", "build_attention_metadata",
           "check_sequence_input", "get_backend_class"]


def get_backend_class(name: str) -> type[AttentionBackend]:
    """Return the backend class for ``name`` (``torch`` or ``triton``).

    Raises:
        ValueError: unknown name.
    """
    if name == "torch":
        from lazyattn_rag.engine.worker.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "triton":
        from lazyattn_rag.engine.worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
