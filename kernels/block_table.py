"""One packed 64-bit word per block-table entry: ``(block id, scaled, delta, valid slots)``.

The prompt plan (see ``docs/architecture.md``) gives every KV block of a request a
physical block id, the RoPE offset ``delta`` of the chunk that owns it (``g - l``:
global start minus local start; 0 for the request's own tokens) and how many of its
slots hold tokens (a chunk's last block may be partly filled), and whether the request reads
the block's keys with chunk attention scaling (APE, ``CacheConfig.chunk_attention_scaling``).
Kernels read one int64 per block instead of four tensors.

Bit layout of the (signed) int64 word, low to high::

    bits  0..29  block id          30 bits, 0 <= id < 2**30
    bit  30      scaled             1 bit: a document block read with chunk attention scaling
    bits 31..37  valid slots - 1    7 bits, 1 <= valid <= 128 (so block_size <= 128)
    bits 38..63  delta             26 bits, two's complement, -2**25 <= delta < 2**25

Offsets up to +-2**24 tokens (and beyond, to 2**25 - 1) fit. Anything outside these
ranges raises :class:`BlockTableOverflowError`; nothing wraps. The layout is read in one
place on each side: :func:`unpack_word` here, ``triton_helpers``' ``word_*`` helpers in the kernels
(an arithmetic shift keeps delta's sign).
"""

from __future__ import annotations

import torch

BLOCK_ID_BITS = 30
SCALED_SHIFT = BLOCK_ID_BITS
VALID_BITS = 7
DELTA_BITS = 26
VALID_SHIFT = BLOCK_ID_BITS + 1
DELTA_SHIFT = VALID_SHIFT + VALID_BITS
MAX_BLOCK_ID = (1 << BLOCK_ID_BITS) - 1
MAX_VALID = 1 << VALID_BITS
MAX_DELTA = (1 << (DELTA_BITS - 1)) - 1
MIN_DELTA = -(1 << (DELTA_BITS - 1))
MAX_BLOCK_SIZE = MAX_VALID


class BlockTableOverflowError(ValueError):
    """A block id, offset or valid count does not fit the packed block-table word."""


def _check_bounds(name: str, smallest: int, largest: int, lo: int, hi: int) -> None:
    """``BlockTableOverflowError`` naming the first bound crossed by values in ``[smallest, largest]``."""
    if smallest < lo or largest > hi:
        raise BlockTableOverflowError(f"{name} {smallest if smallest < lo else largest} is outside the packed "
                                      f"range [{lo}, {hi}]")


def _check_range(name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    if t.numel():
        _check_bounds(name, int(t.min()), int(t.max()), lo, hi)


def pack_block_table(block_ids: torch.Tensor, deltas: torch.Tensor, valid: torch.Tensor,
                     scaled: torch.Tensor | None = None) -> torch.Tensor:
    """Pack entries into int64 words.

    Args:
        block_ids: ``[...]`` integer physical block ids in ``[0, 2**30)``.
        deltas: same shape, RoPE offsets in ``[-2**25, 2**25)`` tokens.
        valid: same shape, filled slots per block in ``[1, 128]``.
        scaled: same shape, bool or 0/1: blocks read with chunk attention scaling (default none).
    Returns:
        ``[...]`` int64 words on the inputs' device.
    Raises:
        BlockTableOverflowError: any value is outside its field (checked before packing).
        ValueError: shapes differ.
    """
    if scaled is None:
        scaled = torch.zeros_like(block_ids, dtype=torch.int64)
    if not (block_ids.shape == deltas.shape == valid.shape == scaled.shape):
        raise ValueError(
            f"shapes differ: block_ids {tuple(block_ids.shape)}, deltas {tuple(deltas.shape)}, "
            f"valid {tuple(valid.shape)}, scaled {tuple(scaled.shape)}"
        )
    block_ids, deltas, valid = (t.to(torch.int64) for t in (block_ids, deltas, valid))
    _check_range("block id", block_ids, 0, MAX_BLOCK_ID)
    _check_range("delta", deltas, MIN_DELTA, MAX_DELTA)
    _check_range("valid slot count", valid, 1, MAX_VALID)
    scaled = scaled.to(torch.int64)
    _check_range("scaled flag", scaled, 0, 1)
    return (deltas << DELTA_SHIFT) | ((valid - 1) << VALID_SHIFT) | (scaled << SCALED_SHIFT) | block_ids


def unpack_word(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fields of packed words: the one Python reading of the layout above (its Triton twin is
    :func:`~lazyattn_rag.kernels.triton_helpers.unpack_word`).

    Args:
        words: ``[...]`` int64 (any integer dtype is widened first).
    Returns:
        ``(block_ids, scaled, valid, deltas)``: int64, bool, int64, int64, each ``[...]``.
    """
    words = words.to(torch.int64)
    block_ids = words & MAX_BLOCK_ID
    scaled = ((words >> SCALED_SHIFT) & 1).bool()
    valid = ((words >> VALID_SHIFT) & (MAX_VALID - 1)) + 1
    deltas = words >> DELTA_SHIFT  # arithmetic: keeps the sign
    return block_ids, scaled, valid, deltas


def unpack_block_table(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_block_table` without the flag.

    Args:
        words: ``[...]`` int64.
    Returns:
        ``(block_ids, deltas, valid)``, each ``[...]`` int64.
    """
    block_ids, _, valid, deltas = unpack_word(words)
    return block_ids, deltas, valid


def block_scaled(words: torch.Tensor) -> torch.Tensor:
    """``[...]`` bool: which words have the chunk-attention-scaling flag."""
    return unpack_word(words)[1]


def pack_entries(entries: list[tuple]) -> torch.Tensor:
    """Pack a Python list of ``(block_id, delta, valid)`` or ``(block_id, delta, valid, scaled)``
    (e.g. :class:`~lazyattn_rag.engine.kv.block_table.BlockEntry`) into ``[len(entries)]`` int64."""
    if not entries:
        return torch.zeros(0, dtype=torch.int64)
    t = torch.tensor(entries, dtype=torch.int64)
    return pack_block_table(t[:, 0], t[:, 1], t[:, 2], t[:, 3] if t.shape[1] > 3 else None)


def pack_run(block_ids: list[int], num_tokens: int, delta: int, block_size: int) -> torch.Tensor:
    """Pack the entries of ``num_tokens`` tokens laid out from slot 0 of ``block_ids[0]``, all
    with ``delta``: every block full but the last; blocks past the last token are left out.

    Equals ``pack_entries`` of the same entries word for word. The range checks run on Python
    ints and the words take one tensor and two in-place operations: every running request packs
    its private run each step, where a few dozen small tensor operations cost more than the
    words (a 5-block run: 32 us with elementwise tensor operations, 7.5 us so; 1,280 blocks:
    105 and 98 us; a 2-core CPU, ``benchmarks/host_step.py``).

    Returns:
        ``[min(len(block_ids), ceil(num_tokens / block_size))]`` int64 words.
    Raises:
        BlockTableOverflowError: as :func:`pack_block_table`.
    """
    num_tokens, delta, block_size = int(num_tokens), int(delta), int(block_size)  # NumPy scalars too
    num_blocks = min(len(block_ids), -(-num_tokens // block_size)) if num_tokens > 0 else 0
    if num_blocks == 0:
        return torch.zeros(0, dtype=torch.int64)
    ids = block_ids[:num_blocks]
    last_valid = min(block_size, num_tokens - (num_blocks - 1) * block_size)
    _check_bounds("block id", int(min(ids)), int(max(ids)), 0, MAX_BLOCK_ID)
    _check_bounds("delta", delta, delta, MIN_DELTA, MAX_DELTA)
    full_valid = block_size if num_blocks > 1 else last_valid  # only the blocks packed are checked
    _check_bounds("valid slot count", min(last_valid, full_valid), max(last_valid, full_valid), 1, MAX_VALID)
    high = delta << DELTA_SHIFT  # Python ints: | on a negative delta gives the int64 word's two's complement
    words = torch.tensor(ids, dtype=torch.int64)
    words |= high | ((block_size - 1) << VALID_SHIFT)
    words[-1] = high | ((last_valid - 1) << VALID_SHIFT) | int(ids[-1])
    return words
