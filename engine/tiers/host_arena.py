"""Host memory for chunk K/V below the KV pool: one arena of fixed-size pages (issue 17).

The host tier keeps each chunk's K/V in pages of one arena allocated once, at start-up, for the
tier's whole budget (in slabs of at most 1 GiB): pinned on a GPU machine, so a chunk moves between the pool and host memory
with asynchronous copies and no allocation on the way (with two fresh pinned buffers per evicted
chunk, the earlier host tier stalled an H200's decode steps to 39-56 ms; with the arena TPOT is
level with no tier; vLLM's CPU swap space and LMCache's CPU backend preallocate pinned memory too). A page
holds ``page_bytes`` bytes (the keys of one KV block over all layers); a chunk's keys and values
take ``ceil(bytes / page_bytes)`` pages each, anywhere in the arena.

* :class:`HostArena`: the pages, a free list, and reads that keep the pages they copy from
  from being reused until the copy is done (:meth:`HostArena.free` waits for readers; the
  host store takes the pages for a load under its own lock, so an eviction between finding
  a chunk and copying it cannot hand its pages to another).
* :class:`HostChunk`: one stored chunk: its metadata, pages and
  :func:`~lazyattn_rag.engine.tiers.chunk_format.kv_checksum` taken on the pool's device.
* :func:`gather_event` / :func:`copy_to_host`: the device side of write-back.

Copies run on a side stream of the device that holds the K/V (the tiers' writer thread), so the
engine's stream never waits for them.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from lazyattn_rag.engine.tiers.chunk_format import ChunkKV, CorruptChunkError, kv_checksum

SLAB_BYTES = 1 << 30  # the largest single allocation of an arena


class HostArena:
    """``capacity_bytes // page_bytes`` pages of host memory (or a few fewer), allocated at once.

    The memory comes in slabs of a power-of-two size, at most :data:`SLAB_BYTES` each, because
    torch's pinned-memory allocator rounds every allocation up to a power of two: a budget that
    is not one would otherwise pin up to twice its size. Pages tile each slab; what is left of a
    slab (less than a page) and of the budget (less than the smallest slab worth a page) is unused.

    Args:
        capacity_bytes: the budget (the host tier's).
        page_bytes: bytes per page.
        pin: pin the memory (a GPU machine); the whole budget is pinned here, once, at start-up.
    Raises:
        ValueError: not even one page fits.
    """

    def __init__(self, capacity_bytes: int, page_bytes: int, pin: bool = False):
        sizes, left = [], capacity_bytes
        while left >= page_bytes:
            size = min(SLAB_BYTES, 1 << (left.bit_length() - 1))  # the largest power of two <= left
            if size < page_bytes:  # a page in a slab of the next power of two would pin twice what it holds
                break
            sizes.append(size)
            left -= size
        if not sizes:
            raise ValueError(f"a host arena of {capacity_bytes} bytes holds no page of {page_bytes} bytes")
        self.page_bytes, self.pinned = page_bytes, pin
        self._slabs = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for size in sizes]
        self._where = [(s, row * page_bytes) for s, size in enumerate(sizes) for row in range(size // page_bytes)]
        self.num_pages = len(self._where)
        self._free = list(range(self.num_pages - 1, -1, -1))  # popped from the end: pages 0, 1, 2, ...
        self._readers: Counter[int] = Counter()
        self._freed_while_read: set[int] = set()
        self._lock = threading.Lock()

    def page(self, page: int) -> torch.Tensor:
        """Page ``page``'s bytes, ``[page_bytes]`` uint8 (a view)."""
        slab, start = self._where[page]
        return self._slabs[slab][start:start + self.page_bytes]

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def num_free_pages(self) -> int:
        with self._lock:
            return len(self._free)

    def pages_for(self, num_bytes: int) -> int:
        return math.ceil(num_bytes / self.page_bytes)

    def allocate(self, num_pages: int) -> list[int] | None:
        """``num_pages`` free pages, or ``None`` when fewer are free (nothing taken then)."""
        with self._lock:
            if len(self._free) < num_pages:
                return None
            return [self._free.pop() for _ in range(num_pages)]

    def free(self, pages: list[int]) -> None:
        """Return ``pages``; a page a read is copying from returns when that read ends."""
        with self._lock:
            for page in pages:
                (self._freed_while_read.add if self._readers[page] else self._free.append)(page)

    def write(self, tensor: torch.Tensor, pages: list[int]) -> None:
        """Copy ``tensor``'s bytes into ``pages`` in order (asynchronous from a GPU tensor into
        pinned pages, on the current stream)."""
        flat = tensor.reshape(-1).view(torch.uint8)
        for i, page in enumerate(pages):
            part = flat[i * self.page_bytes:(i + 1) * self.page_bytes]
            self.page(page)[:len(part)].copy_(part, non_blocking=True)

    def read(self, pages: list[int], num_bytes: int, device: torch.device | str) -> torch.Tensor:
        """``num_bytes`` bytes from ``pages`` into one new uint8 tensor on ``device``; the copy has
        finished when this returns. The caller holds the pages (:meth:`acquire` or :meth:`reading`)."""
        out = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        for i, page in enumerate(pages):
            part = out[i * self.page_bytes:(i + 1) * self.page_bytes]
            part.copy_(self.page(page)[:len(part)], non_blocking=True)
        if out.device.type == "cuda":
            torch.cuda.current_stream(out.device).synchronize()
        return out

    def acquire(self, pages) -> None:
        """Hold ``pages`` for a read: :meth:`free` of any of them takes effect at :meth:`release`."""
        with self._lock:
            self._readers.update(pages)

    def release(self, pages) -> None:
        with self._lock:
            self._readers.subtract(pages)
            for page in pages:
                if not self._readers[page] and page in self._freed_while_read:
                    self._freed_while_read.discard(page)
                    self._free.append(page)

    @contextmanager
    def reading(self, pages: list[int]):
        """:meth:`acquire` at the entry, :meth:`release` at the exit."""
        self.acquire(pages)
        try:
            yield
        finally:
            self.release(pages)


@dataclass(frozen=True)
class HostChunk:
    """A chunk in a :class:`HostArena`: what :class:`ChunkKV` holds, with pages for its tensors.

    Attributes:
        meta: the chunk's key, model digest, tokens and local start (``keys``/``values`` unused).
        shape: ``[num_layers, num_tokens, num_kv_heads, head_dim]`` of keys and of values.
        dtype: their dtype.
        key_pages, value_pages: the arena pages holding their bytes, in order.
        checksum: :func:`kv_checksum` of the K/V on the pool's device, taken when stored.
        arena: the arena.
    """

    meta: ChunkKV
    shape: tuple[int, ...]
    dtype: torch.dtype
    key_pages: tuple[int, ...]
    value_pages: tuple[int, ...]
    checksum: str
    arena: HostArena

    @property
    def num_bytes(self) -> int:
        """Bytes of the arena it takes (whole pages: what the tier's budget counts)."""
        return (len(self.key_pages) + len(self.value_pages)) * self.arena.page_bytes

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def release(self) -> None:
        """Give its pages back to the arena (the tier evicted or dropped it)."""
        self.arena.free(list(self.pages))

    @property
    def pages(self) -> tuple[int, ...]:
        return (*self.key_pages, *self.value_pages)

    def load(self, key: str, model_digest: str, device: torch.device | str, leased: bool = False) -> ChunkKV:
        """The chunk's K/V copied to ``device`` and checked there: key, model, shape, then
        :func:`kv_checksum` of the copies against the stored one. Its pages are held while they
        are copied; ``leased``: they already are (``HostMemoryStore.lease``), and are released here.

        Raises:
            CorruptChunkError: saying which check failed.
        """
        if not leased:
            self.arena.acquire(self.pages)
        try:
            return self._load(key, model_digest, device)
        finally:
            self.arena.release(self.pages)

    def _load(self, key: str, model_digest: str, device: torch.device | str) -> ChunkKV:
        meta = self.meta
        if meta.key != key:
            raise CorruptChunkError(f"stored under {key[:12]} but holds chunk {meta.key[:12]}")
        if meta.model_digest != model_digest:
            raise CorruptChunkError(f"chunk {key[:12]} was computed by model {meta.model_digest[:12]}, "
                                    f"not {model_digest[:12]}")
        if len(self.shape) != 4 or self.shape[1] != len(meta.token_ids):
            raise CorruptChunkError(f"chunk {key[:12]}: K/V {self.shape} do not hold its {len(meta.token_ids)} tokens")
        keys, values = (self.arena.read(list(pages), self.tensor_bytes, device).view(self.dtype).view(self.shape)
                        for pages in (self.key_pages, self.value_pages))
        if kv_checksum(keys, values) != self.checksum:
            raise CorruptChunkError(f"chunk {key[:12]}: checksum mismatch (damaged K/V in host memory)")
        return replace(meta, keys=keys, values=values)


def gather_event(device: torch.device):
    """An event on ``device``'s current stream after the K/V gathered for write-back (``None``
    on the CPU): what the side stream waits for before it reads them."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def store_in_arena(arena: HostArena, chunk: ChunkKV, gathered) -> HostChunk | None:
    """Copy ``chunk``'s K/V (on the pool's device, gathered before ``gathered``) into new pages of
    ``arena`` with their checksum, on a side stream; ``None`` when too few pages are free."""
    key_pages = arena.allocate(arena.pages_for(chunk.num_bytes // 2))
    value_pages = arena.allocate(len(key_pages)) if key_pages is not None else None
    if value_pages is None:
        arena.free(key_pages or [])
        return None
    with _side_stream(chunk.keys.device, gathered) as stream:
        arena.write(chunk.keys, key_pages)
        arena.write(chunk.values, value_pages)
        checksum = kv_checksum(chunk.keys, chunk.values)
        if stream is not None:
            stream.synchronize()
    meta = replace(chunk, keys=None, values=None)
    return HostChunk(meta, tuple(chunk.keys.shape), chunk.keys.dtype, tuple(key_pages), tuple(value_pages),
                     checksum, arena)


def copy_to_host(chunk: ChunkKV, gathered) -> ChunkKV:
    """``chunk`` with its K/V copied to the CPU (for encoding to disk or Redis), on a side stream."""
    if chunk.keys.device.type == "cpu":
        return chunk
    with _side_stream(chunk.keys.device, gathered):
        keys, values = chunk.keys.cpu(), chunk.values.cpu()
    return replace(chunk, keys=keys, values=values)


class _side_stream:
    """``with _side_stream(device, event) as stream:`` a new stream of a CUDA ``device`` that
    waits for ``event`` first (``stream`` is ``None`` on the CPU, where nothing is asynchronous)."""

    def __init__(self, device: torch.device, event):
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._context = torch.cuda.stream(self.stream) if self.stream is not None else None
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def __enter__(self):
        if self._context is not None:
            self._context.__enter__()
        return self.stream

    def __exit__(self, *exc):
        if self._context is not None:
            self._context.__exit__(*exc)
        return False
