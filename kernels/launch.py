"""What the paged prefill and decode launchers share, host side (torch only, no Triton import).

* :data:`Rotation`, the one switch for where a block's RoPE offset ``delta`` is applied, and
  :func:`rotation_code`, its value as the kernels' ``ROTATION`` constexpr.
* :func:`rope_layout`: which head-dimension columns pair up, as constexprs.
* :func:`check_inputs`: clear errors for inputs the kernels would otherwise misread.
* :func:`block_key_starts` and :func:`block_runs`: views of the packed block table
  (``kernels/block_table.py``) that the kernels walk; built once per batch by the attention
  backend and shared by every layer (device ops, no host sync, so they can be captured in a
  CUDA graph).
* :class:`ChunkScaling`: the attention-level remedy (APE) both kernels apply to flagged blocks.
* :func:`launch_prologue`: the checks, defaults, strides and constexprs both launchers pass
  their kernel in the same order and under the same names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from lazyattn_rag.kernels.block_table import block_scaled, unpack_block_table
from lazyattn_rag.types.kv_quant import FP8_DTYPES, check_scales

Rotation = Literal["query", "key", "none", "prerotated"]
"""Where a kernel applies each block's offset ``delta`` (LazyAttention, arXiv 2606.04302, Sec. 3):

* ``"query"`` (default): the query by ``-delta``, once per run of blocks with one delta;
* ``"key"``: every K tile by ``delta`` in registers (prefill only; same scores, more work: kept to
  measure the difference: on an H200, +54 % over ``"none"`` at 4k new tokens after 12k in 4 chunks,
  where ``"query"`` costs +4.3 %);
* ``"prerotated"`` (prefill only): the query rows rotated by each chunk's ``-delta`` beforehand by a
  small kernel (``kernels/query_rotation.py``) and only loaded per run; the same result as
  ``"query"`` bit for bit, without the rotation's registers in the attention loop;
* ``"none"``: not at all, the rotation code compiled out: the result is wrong for any block
  with a nonzero delta; the Triton backend launches the prefill so for batches whose deltas are
  all 0, and benchmarks use it to measure the rotation's cost.
"""

ROTATION_CODES: dict[str, int] = {"none": 0, "query": 1, "key": 2, "prerotated": 3}  # the kernels' ROTATION constexpr


def fp8_dtype_error(kv_cache_dtype: str, capability: tuple[int, int] | None) -> str | None:
    """Why the kernels cannot read ``kv_cache_dtype`` on a GPU of compute ``capability``
    (``None``: the interpreter, which reads every dtype), or ``None``: Triton's e4m3 type
    (``"fp8"``, ``"fp8_e4m3"``) needs sm_89 or newer (Ada, Hopper); e5m2 runs on sm_80 too."""
    if capability is not None and kv_cache_dtype in ("fp8", "fp8_e4m3") and tuple(capability) < (8, 9):
        return (f"FP8 e4m3 K/V need a GPU of compute capability 8.9 or newer (this one is "
                f"{capability[0]}.{capability[1]}); use kv_cache_dtype 'fp8_e5m2' or 'auto'")
    return None


def rotation_code(rotation: str, supported: tuple[str, ...] = ("query", "key", "none")) -> int:
    """The ``ROTATION`` constexpr for ``rotation``; ``ValueError`` if the kernel does not support it."""
    if rotation not in supported:
        raise ValueError(f"rotation must be one of {sorted(supported)}, got {rotation!r}")
    return ROTATION_CODES[rotation]


@dataclass(frozen=True)
class RopeLayout:
    """Which head-dimension columns pair up, as the kernels' constexpr arguments.

    Attributes:
        half: ``rotary_dim // 2`` (a power of two).
        rest: ``head_dim - rotary_dim`` (0 or a power of two).
        pair_stride: column step between consecutive pairs (1 half-split, 2 interleaved).
        x2_offset: column of a pair's second element relative to its first (``half`` or 1).
    """

    half: int
    rest: int
    pair_stride: int
    x2_offset: int


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def rope_layout(head_dim: int, rotary_dim: int, interleaved: bool) -> RopeLayout:
    """Column layout for the kernels; raises ``NotImplementedError`` for shapes they do not cover."""
    half, rest = rotary_dim // 2, head_dim - rotary_dim
    if not _is_pow2(head_dim) or head_dim < 16:
        raise NotImplementedError(f"Triton kernels need a power-of-two head_dim >= 16, got {head_dim}")
    if rotary_dim % 2 or not _is_pow2(half) or not (rest == 0 or _is_pow2(rest)):
        raise NotImplementedError(
            f"Triton kernels need rotary_dim/2 and head_dim - rotary_dim to be powers of two "
            f"(or 0 for the latter); got head_dim {head_dim}, rotary_dim {rotary_dim}"
        )
    if interleaved:
        return RopeLayout(half, rest, 2, 1)
    return RopeLayout(half, rest, 1, half)


def on_interpreter(t: torch.Tensor) -> bool:
    """True when kernels run under ``TRITON_INTERPRET=1`` (tensors on the CPU)."""
    return t.device.type != "cuda"


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 inputs use exact float32 dots (tests); half types use the tensor cores' default."""
    return "ieee" if dtype == torch.float32 else None


def check_gpu_shapes(layout: RopeLayout) -> None:
    """Refuse rotary layouts not yet run compiled. The kernels once multiplied each rotary half in
    its own ``tl.dot`` (an inner dimension of at least 16 each); since their tiles are full head
    width (one product per tile) that reason is gone, but smaller halves have not been run on a
    GPU, so they stay refused there."""
    if layout.half < 16 or 0 < layout.rest < 16:
        raise NotImplementedError(
            f"compiled kernels need rotary_dim/2 >= 16 and head_dim - rotary_dim in {{0}} or >= 16; got "
            f"rotary_dim/2 = {layout.half}, rest = {layout.rest} (the interpreter takes any power of two)"
        )


def check_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> tuple[RopeLayout, bool]:
    """Clear errors for inputs the kernels would otherwise misread (both launchers' checks).

    Returns:
        the RoPE layout and whether the kernels run under Triton's interpreter.
    Raises:
        ValueError: heads that do not group, a layout not contiguous in head_dim, mixed dtypes or
            devices, unequal caches, a block table that is not packed int64 rows.
        NotImplementedError: a head layout the compiled kernels do not cover.
    """
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    layout = rope_layout(query.shape[2], 2 * inv_freq.numel(), interleaved)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for t, name in ((query, "query"), (key_cache, "key_cache"), (value_cache, "value_cache")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    if key_cache.dtype != value_cache.dtype or (query.dtype != key_cache.dtype and key_cache.dtype not in FP8_DTYPES):
        raise ValueError(f"query, key_cache and value_cache must share a dtype (or the caches be FP8), got "
                         f"{query.dtype}, {key_cache.dtype}, {value_cache.dtype}")
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ")
    if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a 2-d int64 tensor with contiguous rows (packed words)")
    if query.device != key_cache.device or query.device != block_tables.device:
        raise ValueError(f"tensors on different devices: query {query.device}, key_cache {key_cache.device}, "
                         f"block_tables {block_tables.device}")
    interpreter = on_interpreter(query)
    if not interpreter:
        check_gpu_shapes(layout)
    return layout, interpreter


def addressable_table(block_tables: torch.Tensor) -> torch.Tensor:
    """``block_tables`` [num_seqs, max_blocks], or one zero column when ``max_blocks`` is 0 (every
    sequence padding), so the table argument points at memory. Defensive: a CUDA tensor of no
    elements passes a null pointer, which Triton's launcher accepts; the zero-width launch ran on a
    GPU (an H200) only with this column. With consistent
    input (block counts 0) the column is never read."""
    if block_tables.shape[1] > 0:
        return block_tables
    return block_tables.new_zeros(block_tables.shape[0], 1)


def block_key_starts(block_tables: torch.Tensor, num_blocks_per_seq: torch.Tensor) -> torch.Tensor:
    """Index of each block's first key (exclusive prefix sum of valid slots along each row).

    Args:
        block_tables: ``[num_seqs, max_blocks]`` int64 packed words.
        num_blocks_per_seq: ``[num_seqs]`` int32 used entries per row.
    Returns:
        ``[num_seqs, max_blocks]`` int32 (entries past a row's blocks hold that row's key count).
    """
    _, _, valid = unpack_block_table(block_tables)
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < num_blocks_per_seq[:, None]
    valid = torch.where(used, valid, torch.zeros_like(valid))
    return (torch.cumsum(valid, dim=1) - valid).to(torch.int32)


@dataclass
class BlockRuns:
    """Runs of consecutive blocks sharing one delta and scaled flag, only the last one partly
    filled (one run per chunk; the prefix and the request's own tokens are runs with delta 0).

    Attributes:
        starts: ``[num_seqs, max_blocks + 1]`` int32: first block of run ``r`` at ``starts[s, r]``;
            entries from ``num_runs[s]`` on hold the sequence's block count (so ``starts[s, r + 1]``
            ends run ``r``).
        num_runs: ``[num_seqs]`` int32.
    """

    starts: torch.Tensor
    num_runs: torch.Tensor


def block_runs(block_tables: torch.Tensor, num_blocks_per_seq: torch.Tensor, block_size: int) -> BlockRuns:
    """Split every block-table row into runs of equal delta and scaled flag in which only the last
    block may be partly filled (a new run starts after a partial block too). Device ops, no host
    sync."""
    num_seqs, max_blocks = block_tables.shape
    device = block_tables.device
    _, deltas, valid = unpack_block_table(block_tables)
    scaled = block_scaled(block_tables)
    idx = torch.arange(max_blocks, device=device)[None, :].expand(num_seqs, max_blocks)
    used = idx < num_blocks_per_seq[:, None].to(torch.int64)
    changed = torch.ones_like(used)
    changed[:, 1:] = ((deltas[:, 1:] != deltas[:, :-1]) | (valid[:, :-1] < block_size)
                      | (scaled[:, 1:] != scaled[:, :-1]))
    is_start = used & changed
    # Compact the run starts to the front of each row: start r goes to column r (its rank among
    # the row's starts); every other block goes to a spare last column that is dropped after.
    rank = torch.cumsum(is_start, dim=1) - 1
    target = torch.where(is_start, rank, torch.full_like(rank, max_blocks + 1))
    n_blocks = num_blocks_per_seq.to(torch.int64)[:, None]
    starts = n_blocks.expand(num_seqs, max_blocks + 2).clone()
    starts.scatter_(1, target, idx)
    starts = starts[:, : max_blocks + 1].to(torch.int32)
    return BlockRuns(starts=starts.contiguous(), num_runs=is_start.sum(dim=1).to(torch.int32))


def fresh_keys_from(words: torch.Tensor, block_size: int, chunk_scaling: bool) -> int:
    """The first key index of a sequence's last run of blocks (:func:`block_runs`: equal delta and
    scaling flag, a partial block ends a run) when that run has delta 0 (and, with
    ``chunk_scaling``, no flag), else the sequence's length + 1. A prefill's new tokens from this
    index on see each other in full precision over an FP8 cache: the Triton prefill reads them
    from the step (its ``in_step`` rule), the torch backend and the reference do the same.

    Args:
        words: ``[n]`` int64 packed block-table words of one sequence (CPU).
    """
    _, deltas, valid = unpack_block_table(words)
    flags = block_scaled(words)
    n, total = len(words), int(valid.sum())
    if n == 0 or int(deltas[-1]) != 0 or (chunk_scaling and bool(flags[-1])):
        return total + 1
    first = n - 1
    while first > 0 and int(deltas[first - 1]) == 0 and bool(flags[first - 1]) == bool(flags[-1]) \
            and int(valid[first - 1]) == block_size:
        first -= 1
    return int(valid[:first].sum())


@dataclass(frozen=True)
class ChunkScaling:
    """Chunk attention scaling (APE: Yang, Chen and Chen, "APE: Faster and Longer
    Context-Augmented Generation via Adaptive Parallel Encoding", ICLR 2025, Sec. 4): keys of
    blocks whose word has the ``scaled`` flag (``kernels/block_table.py``) are scored at
    ``temperature`` and their softmax weights multiplied by ``weight``:

        ``p_j ~ weight * exp(scale * q.k_j / temperature)`` for a flagged key ``j``,
        ``p_j ~ exp(scale * q.k_j)`` for every other key,

    normalised over all keys together. ``temperature < 1`` sharpens the query's attention to
    the independently encoded documents; ``weight`` rescales their share of the softmax mass.
    ``ChunkScaling(1, 1)`` is plain attention.

    Raises:
        ValueError: a temperature or weight that is not a finite number > 0.
    """

    temperature: float = 1.0
    weight: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"chunk attention {name} must be a finite number > 0, got {value!r}")

    @property
    def is_identity(self) -> bool:
        return self.temperature == 1 and self.weight == 1

    def logits(self, scores: torch.Tensor, flagged: torch.Tensor, scale: float) -> torch.Tensor:
        """Softmax logits (natural-log domain) from raw dot products ``scores`` ``[..., n]``:
        ``scores * scale``, and ``scores * scale / temperature + ln(weight)`` where ``flagged``
        (``[n]`` bool) holds. The two references' form of what the kernels compute."""
        if self.is_identity or not bool(flagged.any()):
            return scores * scale
        return torch.where(flagged, scores * (scale / self.temperature) + math.log(self.weight), scores * scale)

    def kernel_args(self) -> dict:
        """The kernels' arguments: ``chunk_inv_temperature``, ``chunk_log2_weight`` and the
        ``CHUNK_SCALING`` constexpr (off for the identity: the kernels then skip the flag)."""
        return dict(chunk_inv_temperature=1.0 / self.temperature, chunk_log2_weight=math.log2(self.weight),
                    CHUNK_SCALING=not self.is_identity)


@dataclass(frozen=True)
class Launch:
    """What both launchers derive from their shared arguments (see :func:`launch_prologue`).

    Attributes:
        interpreter: the kernels run under ``TRITON_INTERPRET=1`` (tensors on the CPU).
        out: ``[num_tokens, num_heads, head_dim]``, the caller's or a new one like ``query``.
        seq_ids: ``[num_work]`` int32 sequences this launch handles (default all).
        inv_freq: ``[rotary_dim // 2]`` float32, contiguous, on the query's device.
        sm_scale_log2: softmax scale times ``log2(e)`` (the kernels use ``exp2``).
        strides: ``stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, stride_ot, stride_oh``, in the order both kernels take them.
        scales: ``(key_scale, value_scale)`` of FP8 caches (``[num_cache_blocks, block_size,
            num_kv_heads]`` float32, any layout), else the caches themselves as unused pointers.
        scale_strides: ``stride_sb, stride_ss, stride_sh``: both scales' strides (block, slot,
            head); zeros without scales.
        constexprs: ``GROUP, HEAD_DIM, HALF, PAIR_STRIDE, X2_OFF, BLOCK_SIZE, KV_SCALED,
            ACCURATE_TRIG, DOT_PRECISION, DOT_UPCAST``, named as in both kernels.
    """

    interpreter: bool
    out: torch.Tensor
    seq_ids: torch.Tensor
    inv_freq: torch.Tensor
    sm_scale_log2: float
    strides: tuple[int, ...]
    scales: tuple[torch.Tensor, torch.Tensor]
    scale_strides: tuple[int, int, int]
    constexprs: dict


def launch_prologue(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64 packed
    inv_freq: torch.Tensor,  # [rotary_dim // 2] float32
    scale: float,
    *,
    interleaved: bool,
    out: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]
    seq_ids: torch.Tensor | None,  # [num_work] int32
    key_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32 (FP8 caches)
    value_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32
) -> Launch:
    """Checks (:func:`check_inputs`, :func:`~lazyattn_rag.types.kv_quant.check_scales`),
    defaults for ``out`` and ``seq_ids``, and the arguments both kernels take alike.

    Raises:
        ValueError, NotImplementedError: as :func:`check_inputs` and ``check_scales``.
    """
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    layout, interpreter = check_inputs(query, key_cache, value_cache, block_tables, inv_freq, interleaved)
    scaled = check_scales(key_cache, key_scale, value_scale, contiguous=False)
    if out is None:
        out = torch.empty_like(query)
    if seq_ids is None:
        seq_ids = torch.arange(block_tables.shape[0], dtype=torch.int32, device=query.device)
    return Launch(
        interpreter=interpreter,
        out=out,
        seq_ids=seq_ids,
        inv_freq=inv_freq.to(device=query.device, dtype=torch.float32).contiguous(),
        sm_scale_log2=scale * math.log2(math.e),
        strides=(
            query.stride(0), query.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            out.stride(0), out.stride(1),
        ),
        scales=(key_scale, value_scale) if scaled else (key_cache, value_cache),
        scale_strides=tuple(key_scale.stride()) if scaled else (0, 0, 0),
        constexprs=dict(
            GROUP=num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            HALF=layout.half,
            PAIR_STRIDE=layout.pair_stride,
            X2_OFF=layout.x2_offset,
            BLOCK_SIZE=block_size,
            KV_SCALED=scaled,  # FP8 caches: a key's scores times its K scale, its softmax weight times its V scale
            # libdevice cos/sin on the GPU (full range reduction: offsets reach 2**24 tokens, where
            # the fast approximate instructions are wrong); the interpreter has only tl.cos/tl.sin.
            ACCURATE_TRIG=not interpreter,
            DOT_PRECISION=dot_precision(query.dtype),
            DOT_UPCAST=interpreter,  # the interpreter's half-type dot is wrong: compute in float32
        ),
    )
