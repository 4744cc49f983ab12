"""A cached chunk's K/V as bytes, for the storage tiers below the KV pool (issue 17).

A position-agnostic chunk's K/V does not depend on where a prompt places it, so one stored
copy serves every request, process and replica on the same model. The payload is a
safetensors file (no pickle): tensors ``keys`` and ``values``
``[num_layers, num_tokens, num_kv_heads, head_dim]`` in the pool's dtype (an FP8 pool's as packed
rows, ``[..., head_dim + 4]`` uint8: ``KVLayout.pack_rows``) and ``token_ids``
``[num_tokens]`` int64, with string metadata:

* ``format``: :data:`FORMAT_VERSION`; ``key``: the chunk's content key; ``model``: the model
  fingerprint's digest (weights, dtype, RoPE, tokenizer, block size);
* ``local_start``: the position its first token was encoded at (the anchor's length);
* ``xxh3_128``: an XXH3 128-bit checksum over the three tensors' bytes, in that order
  (safetensors checks the layout; the checksum catches flipped bits inside it). XXH3 runs at
  memory speed (about 13 GB/s here against sha256's 1.3 GB/s), so checking a 64 MiB chunk of an
  8B model costs ~5 ms, not the 50 ms that would make loading slower than recomputing it.

:func:`decode_chunk` checks all of it against what the caller expects and raises
:class:`CorruptChunkError` (saying what was wrong) rather than return K/V that could be
another model's, another sequence's or damaged.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

FORMAT_VERSION = 1


class CorruptChunkError(ValueError):
    """A stored chunk cannot be used: truncated, damaged, or made for another model, key or format."""


@dataclass(frozen=True)
class ChunkKV:
    """One chunk's K/V on the host, as a tier stores it.

    Attributes:
        key: the chunk's content key (``engine/planning/fingerprint.py``).
        model_digest: the model fingerprint's digest it was computed with.
        token_ids: its tokens.
        local_start: the position its first token was encoded at.
        keys, values: ``[num_layers, num_tokens, num_kv_heads, head_dim]``, the pool's dtype, CPU
            (an FP8 pool's: packed rows ``[..., head_dim + 4]`` uint8, ``KVLayout.pack_rows``).
    """

    key: str
    model_digest: str
    token_ids: tuple[int, ...]
    local_start: int
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def num_bytes(self) -> int:
        """K and V bytes (what a tier's byte budget counts)."""
        return self.keys.numel() * self.keys.element_size() * 2


def kv_sums(keys: torch.Tensor, values: torch.Tensor) -> tuple[int, ...]:
    """A checksum of K/V computed with torch on the device that holds them: for each tensor,
    viewed as rows of 32-bit words (one row per layer and token), the plain sum of all words,
    the sum of row sums weighted by row number and the sum of column sums weighted by column
    number, in int64 arithmetic that wraps (exact, so the CPU and a GPU give the same six
    numbers in any summation order). Any single flipped bit changes the plain sum; moved rows or
    columns change a weighted one. Taken on a GPU, it brought an H200's whole host-tier load of a
    64 MiB chunk (copy included) to 3.6 ms, from 13 ms with XXH3 on the host
    (``benchmarks/tiers.py``); on the CPU, torch's integer reductions are slower
    than XXH3. It guards against damage, not an adversary.

    Args:
        keys, values: ``[num_layers, num_tokens, num_kv_heads, head_dim]`` each, any dtype.
    Returns:
        six Python ints (the call waits for the device).
    """
    sums = []
    for t in (keys, values):
        rows = t.reshape(-1, t.shape[-2] * t.shape[-1]).contiguous()  # [num_layers * num_tokens, heads * dim]
        row_bytes = rows.shape[1] * rows.element_size()
        words = rows.view(torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.uint8)
        row_sums, col_sums = words.sum(dim=1, dtype=torch.int64), words.sum(dim=0, dtype=torch.int64)
        arange = lambda n: torch.arange(1, n + 1, dtype=torch.int64, device=t.device)  # noqa: E731
        sums += [row_sums.sum(), (row_sums * arange(len(row_sums))).sum(), (col_sums * arange(len(col_sums))).sum()]
    return tuple(torch.stack(sums).tolist())


def kv_checksum(keys: torch.Tensor, values: torch.Tensor) -> str:
    """The host tier's checksum of K/V, computed where they are, whichever is fastest there:
    ``"sums:..."`` (:func:`kv_sums`) for tensors on a GPU, ``"xxh3:..."`` (XXH3-128 of the bytes)
    for tensors on the CPU. An entry is stored and checked on the pool's device, so both sides
    of a comparison are of one kind."""
    if keys.device.type != "cpu":
        return "sums:" + ",".join(map(str, kv_sums(keys, values)))
    return "xxh3:" + _digest({"keys": keys, "values": values, "token_ids": torch.empty(0, dtype=torch.int64)})


def encode_chunk(chunk: ChunkKV) -> bytes:
    """The chunk as safetensors bytes with its checks in the metadata (see the module docstring).

    Raises:
        ValueError: keys and values differ in shape or dtype, or their token count differs
            from ``token_ids``.
    """
    if chunk.keys.shape != chunk.values.shape or chunk.keys.dtype != chunk.values.dtype:
        raise ValueError(f"keys {tuple(chunk.keys.shape)} {chunk.keys.dtype} and values "
                         f"{tuple(chunk.values.shape)} {chunk.values.dtype} differ")
    if chunk.keys.dim() != 4 or chunk.keys.shape[1] != len(chunk.token_ids):
        raise ValueError(f"keys {tuple(chunk.keys.shape)} must be [num_layers, {len(chunk.token_ids)} tokens, "
                         "num_kv_heads, head_dim]")
    from safetensors.torch import save

    tensors = {"keys": chunk.keys.contiguous().cpu(), "values": chunk.values.contiguous().cpu(),
               "token_ids": torch.tensor(chunk.token_ids, dtype=torch.int64)}
    metadata = {"format": str(FORMAT_VERSION), "key": chunk.key, "model": chunk.model_digest,
                "local_start": str(chunk.local_start), "xxh3_128": _digest(tensors)}
    return save(tensors, metadata)


def decode_chunk(data: bytes, key: str, model_digest: str) -> ChunkKV:
    """The chunk stored in ``data``, checked against the ``key`` and ``model_digest`` expected.

    Raises:
        CorruptChunkError: not a readable safetensors payload (truncated or damaged), another
            format version, key or model, tensors of the wrong shapes, or a checksum mismatch.
    """
    metadata = _metadata(data)
    if metadata.get("format") != str(FORMAT_VERSION):
        raise CorruptChunkError(f"chunk format {metadata.get('format')!r}, this version reads {FORMAT_VERSION}")
    if metadata.get("key") != key:
        raise CorruptChunkError(f"stored under {key[:12]} but holds chunk {str(metadata.get('key'))[:12]}")
    if metadata.get("model") != model_digest:
        raise CorruptChunkError(f"chunk {key[:12]} was computed by model {str(metadata.get('model'))[:12]}, "
                                f"not {model_digest[:12]}")
    tensors = _tensor_views(data, key)
    keys, values, token_ids = tensors.get("keys"), tensors.get("values"), tensors.get("token_ids")
    if keys is None or values is None or token_ids is None or keys.shape != values.shape or keys.dim() != 4 \
            or token_ids.shape != (keys.shape[1],):
        raise CorruptChunkError(f"chunk {key[:12]}: tensors {sorted(tensors)} do not form a chunk")
    if _digest(tensors) != metadata.get("xxh3_128"):
        raise CorruptChunkError(f"chunk {key[:12]}: checksum mismatch (damaged payload)")
    return ChunkKV(key, model_digest, tuple(token_ids.tolist()), int(metadata["local_start"]), keys, values)


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
           "U8": torch.uint8}  # U8: packed FP8 rows (KVLayout.pack_rows)


def _tensor_views(data: bytes, key: str) -> dict[str, torch.Tensor]:
    """The payload's tensors as views of ``data`` (no copy: a 64 MiB chunk of an 8B model is read
    at memory speed, where ``safetensors.torch.load`` copies it), from the safetensors header's
    dtype, shape and byte range of each (the format's documented layout: an 8-byte little-endian
    header length, the JSON header, then the tensors' bytes). Read-only: the caller copies them
    into the KV pool.

    Raises:
        CorruptChunkError: a header entry that is not a well-formed tensor inside ``data``.
    """
    import warnings

    (length,) = struct.unpack("<Q", data[:8])
    header, base, views = json.loads(data[8:8 + length]), 8 + length, {}
    buffer = memoryview(data)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = _DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
                raise ValueError(f"{name}: shape {shape}")
            numel = math.prod(shape)
            if start < 0 or end != start + numel * dtype.itemsize or base + end > len(data):
                raise ValueError(f"{name}: bytes {start}..{end} of {len(data) - base} for {shape} {dtype}")
            with warnings.catch_warnings():  # the bytes are immutable and never written through the view
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(buffer[base + start: base + end], dtype=dtype) if numel \
                    else torch.empty(0, dtype=dtype)
            views[name] = flat.view(shape)
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CorruptChunkError(f"chunk {key[:12]}: unreadable payload ({error!r})") from error
    return views


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for name in ("keys", "values", "token_ids"):
        buffer = tensors[name].contiguous().view(-1).view(torch.uint8).numpy()  # the buffer, not a copy
        for start in range(0, max(len(buffer), 1), _DIGEST_SLICE_BYTES):
            h.update(buffer[start:start + _DIGEST_SLICE_BYTES])
    return h.hexdigest()


# xxhash holds the GIL while it hashes: slices of 4 MiB (~0.2 ms each) let the engine thread run
# between them when the tiers' writer checksums a chunk, instead of waiting for a whole 64 MiB one.
_DIGEST_SLICE_BYTES = 4 << 20


def read_metadata(path) -> dict[str, str]:
    """The metadata of a stored chunk file (its header only, not the tensors): ``format``, ``key``,
    ``model``, ``local_start``, ``xxh3_128``. Raises ``CorruptChunkError`` or ``OSError``."""
    with open(path, "rb") as f:
        head = f.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
        return _metadata(head + f.read(min(length, 1 << 20)))


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's ``__metadata__`` (an 8-byte little-endian length, then JSON)."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        if length > len(data) - 8:
            raise ValueError(f"header of {length} bytes in a {len(data)}-byte payload")
        header = json.loads(data[8:8 + length])
        return dict(header.get("__metadata__") or {})
    except (struct.error, ValueError, UnicodeDecodeError, AttributeError) as error:
        raise CorruptChunkError(f"not a chunk payload ({error})") from error
