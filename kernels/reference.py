"""Pure-PyTorch references of the paged kernels: the oracle every kernel test compares against.

Written for clarity, not speed: float32 on the CPU, one sequence and one key (prefill) or one
block (decode) at a time, straight from the semantics in ``prefill.py`` and ``decode.py``. The
two references move keys to their global positions in the two ways the kernels can: prefill's
rotates every cached key by its block's ``delta``, decode's rotates the query by ``-delta``.
"""

from __future__ import annotations

import torch

from lazyattn_rag.kernels.block_table import block_scaled, unpack_block_table
from lazyattn_rag.types.kv_quant import dequantize_rows
from lazyattn_rag.kernels.launch import ChunkScaling, fresh_keys_from
from lazyattn_rag.kernels.rope import apply_rotation


def gather_keys(
    cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    words: torch.Tensor,  # [n] int64 packed words of one sequence
    scales: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32 (FP8 caches)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid slots of a sequence in key order: ``([seq_len, num_kv_heads, head_dim], [seq_len] deltas)``
    (an FP8 cache's rows dequantized with ``scales``, float32)."""
    block_ids, deltas, valid = unpack_block_table(words.cpu())
    rows, row_deltas = [], []
    for b, d, v in zip(block_ids.tolist(), deltas.tolist(), valid.tolist()):
        rows.append(cache[b, :v] if scales is None else dequantize_rows(cache[b, :v], scales[b, :v]))
        row_deltas += [d] * v
    if not rows:
        return torch.zeros(0, *cache.shape[2:]), torch.zeros(0, dtype=torch.int64)
    return torch.cat(rows), torch.tensor(row_deltas, dtype=torch.int64)


def rotate(x: torch.Tensor, deltas: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``R_delta x`` in float32: ``x`` ``[n, heads, head_dim]``, ``deltas`` ``[n]``."""
    angles = deltas.to(torch.float32)[:, None] * inv_freq.float().cpu()[None, :]  # [n, rotary_dim/2]
    return apply_rotation(x.float().cpu(), angles.cos(), angles.sin(), 2 * inv_freq.numel(), interleaved)


def prefill_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64 packed
    num_blocks_per_seq: torch.Tensor,  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    inv_freq: torch.Tensor,  # [rotary_dim // 2] float32
    scale: float,
    interleaved: bool = False,
    chunk_scaling: ChunkScaling | None = None,
    key_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32 (FP8 caches)
    value_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim] the new tokens' K (FP8 caches)
    value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim] their V
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] float32 on the CPU
    """Float32 reference of :func:`~lazyattn_rag.kernels.prefill.paged_prefill`: rotate every cached key by its block's delta,
    then causal softmax attention per sequence (keys of flagged blocks scored by
    ``chunk_scaling``). Rows of sequences without keys are zeros. FP8 caches: rows dequantized
    with ``key_scale``/``value_scale``; with ``key``/``value``, a sequence's new tokens from
    :func:`~lazyattn_rag.kernels.launch.fresh_keys_from` on are read from them instead (full precision)."""
    num_tokens, num_heads, head_dim = query.shape
    group = num_heads // key_cache.shape[2]
    out = torch.zeros(num_tokens, num_heads, head_dim)
    cu = cu_seqlens_q.tolist()
    for s in range(len(cu) - 1):
        words = block_tables[s, : int(num_blocks_per_seq[s])].cpu()
        k, deltas = gather_keys(key_cache, words, key_scale)
        v, _ = gather_keys(value_cache, words, value_scale)
        _, _, valid = unpack_block_table(words)
        flagged = block_scaled(words).repeat_interleave(valid)  # [seq_len]
        q = query[cu[s] : cu[s + 1]].float().cpu()  # [q_len, H, D]
        q_len, seq_len = q.shape[0], k.shape[0]
        if seq_len == 0 or q_len == 0:
            continue
        first = seq_len - q_len
        if key is not None and key_scale is not None and \
                fresh_keys_from(words, key_cache.shape[1], chunk_scaling is not None and not chunk_scaling.is_identity) <= first:
            k, v = k.float(), v.float()
            k[first:], v[first:] = key[cu[s] : cu[s + 1]].float().cpu(), value[cu[s] : cu[s + 1]].float().cpu()
        k = rotate(k, deltas, inv_freq, interleaved).repeat_interleave(group, dim=1)  # [seq_len, H, D]
        v = v.float().cpu().repeat_interleave(group, dim=1)
        scores = (chunk_scaling or ChunkScaling()).logits(torch.einsum("qhd,khd->hqk", q, k), flagged, scale)
        allowed = torch.arange(seq_len)[None, :] <= (seq_len - q_len + torch.arange(q_len))[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[cu[s] : cu[s + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out


def decode_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_cache_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64 packed
    num_blocks_per_seq: torch.Tensor,  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    inv_freq: torch.Tensor,  # [rotary_dim // 2] float32
    scale: float,
    interleaved: bool = False,
    chunk_scaling: ChunkScaling | None = None,
    key_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32 (FP8 caches)
    value_scale: torch.Tensor | None = None,  # [num_cache_blocks, block_size, num_kv_heads] float32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] float32 on the CPU
    """Float32 reference of :func:`~lazyattn_rag.kernels.decode.paged_decode`, one block at a time: the query row of each
    sequence is rotated by ``-delta`` of every block and scored against the block's keys as
    stored (an FP8 cache's dequantized with ``key_scale``/``value_scale``); then one softmax
    (keys of flagged blocks scored by ``chunk_scaling``). Rows of sequences without blocks are zeros."""
    num_tokens, num_heads, head_dim = query.shape
    group = num_heads // key_cache.shape[2]
    out = torch.zeros(num_tokens, num_heads, head_dim)
    for s in range(block_tables.shape[0]):
        row = int(cu_seqlens_q[s])
        q = query[row].float().cpu()  # [H, D]
        n = int(num_blocks_per_seq[s])
        if n == 0:
            continue
        words = block_tables[s, :n].cpu()
        block_ids, deltas, valid = unpack_block_table(words)
        flagged = block_scaled(words).repeat_interleave(valid)  # [seq_len]
        scores, values = [], []
        for i, d in enumerate(deltas.tolist()):
            q_b = rotate(q[None], torch.tensor([-d]), inv_freq, interleaved)[0]  # [H, D]
            k, _ = gather_keys(key_cache, words[i : i + 1], key_scale)  # [v, kv_heads, D]
            scores.append(torch.einsum("hd,khd->hk", q_b, k.float().cpu().repeat_interleave(group, dim=1)))
            values.append(gather_keys(value_cache, words[i : i + 1], value_scale)[0].float().cpu()
                          .repeat_interleave(group, dim=1))
        logits = (chunk_scaling or ChunkScaling()).logits(torch.cat(scores, dim=1), flagged, scale)
        probs = torch.softmax(logits, dim=1)  # [H, seq_len]
        out[row] = torch.einsum("hk,khd->hd", probs, torch.cat(values))
    return out
