"""Content keys of cached chunks.

A chunk's stored K/V depends on the model (weights, dtype, RoPE, tokenizer), on the KV layout, on the
anchor it was encoded after (see ``docs/architecture.md``) and on its token ids. Its key
is a sha256 over exactly these, so a change of any of them can never hit a stale entry.
"""

from __future__ import annotations

import array
import hashlib
import json
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class ModelFingerprint:
    """Everything about the model that changes a chunk's stored K/V.

    Attributes:
        weights_sha256: hash of the weight files' bytes (or of the tensors, for in-memory models).
        dtype: KV/compute dtype name, e.g. ``"float32"``.
        rope: :meth:`RotaryEmbedding.fingerprint` as canonical JSON.
        tokenizer_sha256: hash of the serialized tokenizer.
        block_size: slots per KV block (the stored layout).
        kv_format: what the stored bytes mean (``KVLayout.format_name()``: element type and scales).
    """

    weights_sha256: str
    dtype: str
    rope: str
    tokenizer_sha256: str
    block_size: int
    kv_format: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def anchor_fingerprint(mode: str, anchor_token_ids: list[int]) -> str:
    """Key part for the anchor a chunk is encoded after (``mode`` none/bos/head)."""
    return hashlib.sha256(json.dumps([mode, anchor_token_ids]).encode()).hexdigest()


def chunk_key(model: ModelFingerprint | str, anchor: str, token_ids: list[int]) -> str:
    """sha256 over the model fingerprint, the anchor fingerprint and the chunk's token ids."""
    model_digest = model if isinstance(model, str) else model.digest()
    h = hashlib.sha256()
    h.update(model_digest.encode())
    h.update(b"|")
    h.update(anchor.encode())
    h.update(b"|")
    h.update(array.array("q", token_ids).tobytes())  # int64, native order: the bytes of an int64 tensor
    return h.hexdigest()


def tensors_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """Hash of named tensors' bytes (for models built in memory)."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")  # the buffer itself, not a copy
    return h.hexdigest()


def file_sha256(path: str, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()
