"""The host tier's arena (engine/tiers/host_arena.py): exact pages handed out and back, pages kept from
reuse while a load copies from them, K/V round trips bit-identical, damaged or foreign entries
refused, and the host store's budget kept in whole pages with every evicted page returned."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lazyattn_rag.engine.tiers.chunk_format import ChunkKV, CorruptChunkError
from lazyattn_rag.engine.tiers.chunk_store import HostMemoryStore
from lazyattn_rag.engine.kv.eviction import LRUPolicy
from lazyattn_rag.engine.tiers.host_arena import HostArena, store_in_arena

MODEL = "m" * 64
PAGE = 256  # bytes: a 5-token chunk()'s keys (480 bytes) take 2 pages


def chunk(key: str = "k" * 64, num_tokens: int = 5, dtype=torch.float32, seed: int = 0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_tokens, 3, 4)  # [num_layers, num_tokens, num_kv_heads, head_dim]
    keys, values = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    return ChunkKV(key, MODEL, tuple(range(7, 7 + num_tokens)), 1, keys, values)


def test_pages_are_handed_out_in_order_and_come_back():
    arena = HostArena(2560 + 200, PAGE)  # slabs of 2048 (8 pages) + 512 bytes (2 pages); 200 bytes hold no slab
    assert arena.num_pages == 10 and arena.capacity_bytes == 10 * PAGE
    assert arena.allocate(3) == [0, 1, 2] and arena.allocate(2) == [3, 4]
    assert arena.allocate(6) is None and arena.num_free_pages == 5  # nothing taken by a refusal
    arena.free([1, 3])
    assert arena.allocate(3) == [3, 1, 5]  # the last freed first
    with pytest.raises(ValueError, match="holds no page"):
        HostArena(PAGE - 1, PAGE)
    big = HostArena((3 << 30) + (1 << 29) + 100, 1 << 20)  # slabs of 1, 1, 1 GiB and 512 MiB: no page lost
    assert big.num_pages == 3 * 1024 + 512 and [s.numel() for s in big._slabs] == [1 << 30] * 3 + [1 << 29]
    page = big.page(3 * 1024 + 5)  # the last slab's sixth page
    assert page.numel() == 1 << 20 and page.data_ptr() == big._slabs[3].data_ptr() + 5 * (1 << 20)


def test_a_page_freed_while_a_load_reads_it_comes_back_only_after():
    arena = HostArena(4 * PAGE, PAGE)
    pages = arena.allocate(4)
    with arena.reading([pages[0], pages[1]]):
        arena.free(pages)
        assert sorted(arena.allocate(2)) == [2, 3]  # the two pages not being read
        assert arena.allocate(1) is None
    assert sorted(arena.allocate(2)) == [0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 5, 13])
def test_kv_round_trips_bit_identical_through_pages(dtype, num_tokens):
    arena = HostArena(64 * PAGE, PAGE)
    original = chunk(num_tokens=num_tokens, dtype=dtype)
    held = store_in_arena(arena, original, None)
    key_bytes = original.keys.numel() * original.keys.element_size()
    assert len(held.key_pages) == len(held.value_pages) == -(-key_bytes // PAGE)
    assert held.num_bytes == 2 * len(held.key_pages) * PAGE
    back = held.load(original.key, MODEL, "cpu")
    assert back.token_ids == original.token_ids and back.local_start == 1 and back.keys.dtype == dtype
    assert torch.equal(back.keys.view(torch.uint8), original.keys.view(torch.uint8))
    assert torch.equal(back.values.view(torch.uint8), original.values.view(torch.uint8))
    held.release()
    assert arena.num_free_pages == 64


def test_damaged_or_foreign_entries_are_refused_with_the_reason():
    arena = HostArena(64 * PAGE, PAGE)
    good = store_in_arena(arena, chunk(), None)
    flipped = store_in_arena(arena, chunk(), None)
    arena.page(flipped.value_pages[1])[17] ^= 0x04
    cases = {
        "checksum mismatch": (flipped, "k" * 64, MODEL),
        "do not hold its 5 tokens": (replace(good, shape=(2, 4, 3, 4)), "k" * 64, MODEL),
        "computed by model": (good, "k" * 64, "n" * 64),
        "holds chunk": (good, "j" * 64, MODEL),
    }
    for message, (value, key, model) in cases.items():
        with pytest.raises(CorruptChunkError, match=message):
            value.load(key, model, "cpu")


def test_the_host_store_keeps_its_budget_in_pages_and_returns_every_evicted_page():
    arena = HostArena(12 * PAGE, PAGE)  # a 5-token chunk takes 2 pages of keys and 2 of values
    store = HostMemoryStore(arena.capacity_bytes, LRUPolicy(), arena)
    chunks = [chunk(key=f"{i}" * 64, seed=i) for i in range(4)]
    for c in chunks[:3]:
        assert store.put_kv(c)
    assert store.keys() == [c.key for c in chunks[:3]] and arena.num_free_pages == 0
    assert store.get(chunks[0].key) is not None  # chunk 1 is now the least recently used
    assert store.put_kv(chunks[3])
    assert sorted(store.keys()) == sorted(c.key for c in (chunks[0], chunks[2], chunks[3]))
    assert store.stats.num_evictions == 1 and store.num_bytes == 12 * PAGE and arena.num_free_pages == 0
    assert store.put_kv(replace(chunks[3], values=chunks[3].values + 1))  # replaced: the old pages come back
    assert arena.num_free_pages == 0 and len(store) == 3
    back = store.get(chunks[3].key).load(chunks[3].key, MODEL, "cpu")
    assert torch.equal(back.values, chunks[3].values + 1)
    assert not store.put_kv(chunk(num_tokens=40)) and store.stats.num_too_large == 1  # larger than the whole arena
    assert store.clear() == 3 and arena.num_free_pages == 12 and store.num_bytes == 0
    with pytest.raises(ValueError, match="no arena"):
        HostMemoryStore(1 << 20).put_kv(chunks[0])


def test_a_chunk_leased_for_a_load_keeps_its_pages_through_an_eviction():
    """The engine leases a host chunk (under the store's lock) before it copies the pages; the
    writer evicting it meanwhile cannot hand those pages to the next chunk until the load ends."""
    arena = HostArena(8 * PAGE, PAGE)  # room for two 5-token chunks
    store = HostMemoryStore(arena.capacity_bytes, LRUPolicy(), arena)
    first, second, third, fourth = (chunk(key=f"{i}" * 64, seed=i) for i in range(4))
    assert store.put_kv(first) and store.put_kv(second)
    leased = store.lease(first.key)  # also its most recent use: second goes first
    assert store.put_kv(third) and second.key not in store
    assert not store.put_kv(fourth)  # first is evicted now, but its pages are being read: no room yet
    assert first.key not in store and store.stats.num_errors == 1
    back = leased.load(first.key, MODEL, "cpu", leased=True)
    assert torch.equal(back.keys, first.keys) and torch.equal(back.values, first.values)
    assert store.put_kv(fourth) and arena.num_free_pages == 0  # the pages came back when the load ended
    assert store.lease("9" * 64) is None
