"""The pure-PyTorch deferred-RoPE paged attention backend: the CPU path and the oracle.

Every Triton kernel is checked against this backend. It is written for clarity first:
per sequence it gathers the valid slots of the block table, moves cached keys to their
global positions and runs a masked softmax in float32.

* Rotating keys: each cached key is rotated once by its block's ``delta``
  (``R_delta (R_j k) = R_(j+delta) k``), then a causal mask over key indices. Used for
  prefill rows when there are more query rows than keys per chunk (compute-bound).
* Rotating the query: the query rows are rotated by ``-delta`` once per run of blocks that
  share a ``delta`` (once per chunk) and keys are read as stored:
  ``(R_m q) . (R_(j+delta) k) = (R_(-delta) R_m q) . (R_j k)``. Used for decode rows and
  for short prefills (a question after long cached documents), where it is far cheaper.

Chunk attention scaling (APE, ``chunk_scaling``): keys of flagged blocks get the logits
``scale * q.k / temperature + ln(weight)`` (:meth:`~lazyattn_rag.kernels.launch.ChunkScaling.logits`).

``rotation`` (:data:`~lazyattn_rag.kernels.launch.Rotation`: ``"key"`` or ``"query"``; ``None``,
the default, chooses per sequence as above) forces one form, for tests.

FP8 caches (``key_scale``/``value_scale``): gathered rows are dequantized (``lazyattn_rag/types/kv_quant.py``)
before anything else; a prefill's new tokens see each other's K/V in full precision where they
lie in the sequence's last run of blocks of delta 0 (``launch.fresh_keys_from``, the rule the Triton
prefill follows when it reads them from the step).

Source: LazyAttention (ICML 2026, arXiv 2606.04302), Sec. 3 "deferred RoPE".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lazyattn_rag.engine.worker.attention.base import AttentionBackend, write_kv
from lazyattn_rag.engine.worker.attention.metadata import AttentionMetadata
from lazyattn_rag.types.cache_config import KV_CACHE_DTYPES
from lazyattn_rag.kernels.block_table import block_scaled, unpack_block_table
from lazyattn_rag.types.kv_quant import dequantize_rows
from lazyattn_rag.kernels.launch import Rotation, fresh_keys_from
from lazyattn_rag.kernels.rope import apply_rotation

QUERY_TILE_ROWS = 1024  # query rows scored at once: a tile's scores are heads x 1024 x seq_len float32
# (SmolLM2, 9 heads, an 8k prompt: 300 MB instead of 2.4 GB for the whole prompt at once)


@dataclass
class _SeqGather:
    slots: torch.Tensor  # [seq_len] int64 flat slot of each context key, in key order
    deltas: torch.Tensor  # [seq_len] int64 delta of each key's block
    runs: list[tuple[int, int, int]]  # (start, end, delta) of key runs sharing one delta
    any_delta: bool
    flagged: torch.Tensor  # [seq_len] bool keys of blocks flagged for chunk attention scaling
    fresh_from: int  # first key of the last run of blocks when it has delta 0 (unflagged), else seq_len + 1
    tables: dict = field(default_factory=dict)  # cos/sin per rotation, made once and reused by every layer


def _gather_plan(metadata: AttentionMetadata, device: torch.device, chunk_scaling: bool = False) -> list[_SeqGather]:
    cached = metadata.backend_state.get("torch")
    if cached is not None:
        return cached
    plans = []
    bs = metadata.block_size
    for i in range(metadata.num_seqs):
        n = int(metadata.num_blocks_per_seq[i])
        words = metadata.block_tables[i, :n].cpu()
        block_ids, deltas, valid = unpack_block_table(words)
        offsets = torch.arange(bs, dtype=torch.int64)
        keep = offsets[None, :] < valid[:, None]  # [n, bs]
        slots = (block_ids[:, None] * bs + offsets[None, :])[keep]
        key_deltas = deltas[:, None].expand(n, bs)[keep]
        flagged = block_scaled(words)[:, None].expand(n, bs)[keep]
        runs, start = [], 0
        for b in range(n):
            v, d = int(valid[b]), int(deltas[b])
            if runs and runs[-1][2] == d:
                runs[-1] = (runs[-1][0], runs[-1][1] + v, d)
            else:
                runs.append((start, start + v, d))
            start += v
        fresh_from = fresh_keys_from(words, bs, chunk_scaling)
        plans.append(_SeqGather(slots.to(device), key_deltas.to(device), runs, bool((deltas != 0).any()),
                                flagged.to(device), fresh_from))
    metadata.backend_state["torch"] = plans
    return plans


def _gathered(key_cache, value_cache, scales, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at flat ``slots`` (``[seq_len]``), ``[seq_len, num_kv_heads, head_dim]`` float32 each
    (an FP8 cache's dequantized with ``scales``, ``(key_scale, value_scale)``)."""
    rows = [c.view(-1, *c.shape[2:])[slots] for c in (key_cache, value_cache)]
    if scales is None:
        return rows[0].to(torch.float32), rows[1].to(torch.float32)
    return tuple(dequantize_rows(r, s.view(-1, s.shape[-1])[slots]) for r, s in zip(rows, scales))


class TorchAttentionBackend(AttentionBackend):
    """Reference backend (float32 math, any device). See the module docstring."""

    name = "torch"
    supported_kv_cache_dtypes = KV_CACHE_DTYPES  # every one (FP8: kernels read rows times their scales)
    rotation: Rotation | None = None  # None: per sequence, the cheaper form (see the module docstring)

    def forward(self, query, key, value, key_cache, value_cache, metadata, key_scale=None, value_scale=None):
        write_kv(key, value, key_cache, value_cache, metadata.slot_mapping, key_scale, value_scale)
        scales = None if key_scale is None else (key_scale, value_scale)
        self.copy_step_slots(key_cache, value_cache, metadata, scales)
        out = torch.empty_like(query)
        plans = _gather_plan(metadata, query.device, self.chunk_scaling is not None)
        starts = metadata.cu_seqlens_q.tolist()
        for i, plan in enumerate(plans):
            q = query[starts[i] : starts[i + 1]].to(torch.float32)  # [q_len, num_heads, head_dim]
            k, v = _gathered(key_cache, value_cache, scales, plan.slots)  # [seq_len, num_kv_heads, head_dim] float32
            first_pos = metadata.seq_lens_list[i] - q.shape[0]  # the first query row's key index
            if scales is not None and q.shape[0] > 1 and plan.fresh_from <= first_pos:  # the step's own, unrounded
                k[first_pos:], v[first_pos:] = key[starts[i] : starts[i + 1]], value[starts[i] : starts[i + 1]]
            rotate_query = self._rotate_query(q.shape[0], plan)
            if not rotate_query and plan.any_delta:
                k = self._rotate(k, plan, "keys", plan.deltas)
            for row in range(0, q.shape[0], QUERY_TILE_ROWS):  # scores of one tile of rows at a time
                tile = q[row : row + QUERY_TILE_ROWS]
                o = (self._attend_rotating_query(tile, k, v, plan, first_pos + row) if rotate_query
                     else self._attend(tile, k, v, plan, first_pos + row))
                out[starts[i] + row : starts[i] + row + tile.shape[0]] = o.to(out.dtype)
        return out

    def _rotate(self, x: torch.Tensor, plan: _SeqGather, name, deltas: torch.Tensor) -> torch.Tensor:
        """Pure rotation of ``x`` by ``deltas`` (one per row, or one for all rows), tables cached in ``plan``."""
        if name not in plan.tables:
            plan.tables[name] = self.rotary.cos_sin(deltas)
        cos, sin = plan.tables[name]
        return apply_rotation(x, cos, sin, self.rotary.rotary_dim, self.rotary.interleaved)

    def _grouped(self, q: torch.Tensor) -> torch.Tensor:
        """[q_len, num_heads, d] -> [q_len, num_kv_heads, group, d] (GQA: query heads of one KV head)."""
        return q.view(q.shape[0], self.num_kv_heads, self.num_heads // self.num_kv_heads, q.shape[-1])

    def _softmax_v(self, scores: torch.Tensor, v: torch.Tensor, plan: _SeqGather, first_pos: int) -> torch.Tensor:
        """Causal mask (query row ``j`` sees keys ``0 .. first_pos + j``), softmax (flagged keys
        scored by ``chunk_scaling``) and V: scores [kv_heads, group, q_len, seq_len] -> [q_len, num_heads, d]."""
        q_len, seq_len = scores.shape[2], scores.shape[3]
        if first_pos + q_len < seq_len or q_len > 1:
            q_pos = torch.arange(first_pos, first_pos + q_len, device=scores.device)[:, None]
            k_pos = torch.arange(seq_len, device=scores.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        if self.chunk_scaling is None:
            probs = torch.softmax(scores * self.scale, dim=-1)
        else:
            probs = torch.softmax(self.chunk_scaling.logits(scores, plan.flagged, self.scale), dim=-1)
        out = torch.einsum("cgqn,ncd->qcgd", probs, v)  # [q_len, kv_heads, group, d]
        return out.reshape(q_len, self.num_heads, v.shape[-1])

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _SeqGather,
                first_pos: int) -> torch.Tensor:
        scores = torch.einsum("qcgd,ncd->cgqn", self._grouped(q), k)  # [kv_heads, group, q_len, seq_len]
        return self._softmax_v(scores, v, plan, first_pos)

    def _rotate_query(self, q_len: int, plan: _SeqGather) -> bool:
        if self.rotation is not None:
            if self.rotation not in ("query", "key"):
                raise ValueError(f"the torch backend's rotation must be 'query', 'key' or None, got {self.rotation!r}")
            return self.rotation == "query"
        return q_len == 1 or q_len * len(plan.runs) <= plan.slots.numel()

    def _attend_rotating_query(self, q, k, v, plan: _SeqGather, first_pos: int) -> torch.Tensor:
        q_len = q.shape[0]
        k = k.to(torch.float32)
        group = self.num_heads // self.num_kv_heads
        scores = torch.empty(self.num_kv_heads, group, q_len, k.shape[0], dtype=torch.float32, device=q.device)
        for start, end, delta in plan.runs:
            q_run = q
            if delta != 0:  # once per chunk: R_(-delta) applied to every query row
                q_run = self._rotate(q, plan, -delta, torch.tensor([-delta], device=q.device))
            scores[..., start:end] = torch.einsum("qcgd,ncd->cgqn", self._grouped(q_run), k[start:end])
        return self._softmax_v(scores, v, plan, first_pos)
