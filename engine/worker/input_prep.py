"""Model-input preparation: a step's jobs -> sequences of token ids, positions, slots and block tables.

The runner owns this. The scheduler's output carries block ids and RoPE offsets only (a
chunk's blocks with ``delta = g - l``; a request's private blocks, ``delta = 0``); this module
is the one place they are packed into the kernels' 64-bit block-table words
(``kernels/block_table.py``). A running request's context (its chunks and text segments,
fixed once its chunks are written) is packed once, at its first computation, and kept in
:class:`InputPreparer`'s table until the scheduler reports the request released; each step
then packs only the request's own private blocks, whose last valid count grows.
"""

from __future__ import annotations

import torch

from lazyattn_rag.engine.worker.attention import SequenceInput
from lazyattn_rag.engine.kv.block_table import BlockEntry
from lazyattn_rag.engine.scheduling.request import Request
from lazyattn_rag.engine.scheduling.scheduler_output import ComputeJob, ChunkPrefillJob, SchedulerOutput
from lazyattn_rag.kernels.block_table import pack_entries, pack_run


class InputPreparer:
    """Builds a step's :class:`SequenceInput` s and keeps running requests' packed contexts.

    Args:
        block_size: KV slots per block.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._contexts: dict[str, torch.Tensor] = {}  # request id -> [num_context_blocks] int64 packed

    @property
    def num_tables(self) -> int:
        """Requests whose packed context is kept."""
        return len(self._contexts)

    def release(self, request_ids: list[str]) -> None:
        """Drop the packed contexts of requests the scheduler released (finished, failed,
        aborted or preempted: a preempted request's context is packed again when it returns)."""
        for request_id in request_ids:
            self._contexts.pop(request_id, None)

    def clear(self) -> None:
        self._contexts.clear()

    def prepare(self, out: SchedulerOutput) -> tuple[list[SequenceInput], list[int]]:
        """The step's sequences (encodes first, then each compute job's) and, per compute job, the
        index of its last sequence (the row whose logits it samples from)."""
        seqs = [self._encode_sequence(job) for job in out.chunk_prefills]
        last_rows = []
        for job in out.computes:
            seqs += self._compute_sequences(job)
            last_rows.append(len(seqs) - 1)
        return seqs, last_rows

    def _encode_sequence(self, job: ChunkPrefillJob) -> SequenceInput:
        context = pack_entries(job.context)
        context_len = sum(e.num_valid for e in job.context)
        return self._sequence(job.token_ids, job.local_start + job.start, context, context_len, job.block_ids,
                              job.start)

    def _compute_sequences(self, job: ComputeJob) -> list[SequenceInput]:
        """One sequence per private run the job's tokens fall in: a text segment's tokens attend
        the context entries before it and its own blocks; the tail's attend all of the context."""
        r, bs = job.request, self.block_size
        context = self._context(r)
        seqs, index, end = [], job.start, job.start + job.num_tokens
        if job.num_selected:  # selective recompute: each selected document token over its block's copy
            seqs += [self._sequence([q.token_id], q.position, context[:q.entry_index], q.num_keys_before,
                                    [q.block_id], q.slot) for q in r.selected_queries]
        for run in r.private_runs(bs):
            run_end = end if run.length is None else min(end, run.start + run.length)
            if index >= run_end:
                continue
            ids = r.private_token_slice(index, run_end)
            offset = index - run.start
            own = r.private_blocks[run.first_block:]
            if run.length is None:
                seqs.append(self._sequence(ids, run.global_start + offset, context, r.context_len, own, offset))
            else:
                n, keys = _entries_before(r.context_entries, run.global_start)
                seqs.append(self._sequence(ids, run.global_start + offset, context[:n], keys,
                                           own[: -(-run.length // bs)], offset))
            index = run_end
        return seqs

    def _context(self, r: Request) -> torch.Tensor:
        """``r``'s packed context, packed on first use."""
        words = self._contexts.get(r.request_id)
        if words is None:
            words = self._contexts[r.request_id] = pack_entries(r.context_entries)
        return words

    def _sequence(self, token_ids, first_pos: int, context: torch.Tensor, context_len: int,
                  own_blocks: list[int], own_filled: int) -> SequenceInput:
        """New tokens after ``own_filled`` slots of ``own_blocks`` (delta 0), after ``context``
        (``context_len`` valid keys)."""
        n, bs = len(token_ids), self.block_size
        own = pack_run(own_blocks, own_filled + n, 0, bs)
        slots = [own_blocks[(own_filled + i) // bs] * bs + (own_filled + i) % bs for i in range(n)]
        return SequenceInput(list(token_ids), list(range(first_pos, first_pos + n)), torch.cat((context, own)),
                             context_len + own_filled + n, slots)


def _entries_before(entries: list[BlockEntry], position: int) -> tuple[int, int]:
    """How many of ``entries`` hold the keys at positions ``< position``, and those keys' count."""
    count, keys = 0, 0
    while keys < position:
        keys += entries[count].num_valid
        count += 1
    return count, keys
