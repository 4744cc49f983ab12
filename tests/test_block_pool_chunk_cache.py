"""Block pool and chunk cache: exact block ids, LRU order, pinning, document rebinding."""

import pytest

from lazyattn_rag.engine.kv.block_pool import BlockPool, NoFreeBlocksError
from lazyattn_rag.engine.kv.chunk_cache import ChunkCache


def test_pool_allocates_fifo_and_refcounts():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.incref([1])
    assert pool.decref([0, 1]) == [0]  # block 1 still has a holder
    assert pool.free_block_ids() == [3, 0]
    assert pool.allocate(2) == [3, 0]
    with pytest.raises(NoFreeBlocksError, match="need 1 KV blocks, 0 free of 4"):
        pool.allocate(1)
    assert pool.num_free == 0  # a failed allocation takes nothing
    pool.check_integrity()
    with pytest.raises(RuntimeError, match="decref of free block"):
        pool.decref([1, 1])  # second decref hits a free block
    

def _cache(num_blocks=6, block_size=4):
    return ChunkCache(BlockPool(num_blocks), block_size)


def _put(cache, key, num_tokens):
    blocks = cache.allocate(-(-num_tokens // cache.block_size))
    return cache.insert(key, blocks, num_tokens, 0)


def test_insert_lookup_exact_blocks():
    c = _cache()
    a = _put(c, "a", 5)  # 2 blocks
    b = _put(c, "b", 4)  # 1 block
    assert a.block_ids == [0, 1] and b.block_ids == [2]
    assert c.lookup("a") is a and c.lookup("zz") is None
    assert c.num_cached_blocks == 3 and c.pool.num_free == 3
    with pytest.raises(KeyError):
        c.insert("a", [3], 1, 0)
    with pytest.raises(ValueError, match="need 2 blocks"):
        c.insert("q", [3], 5, 0)
    c.check_integrity()


def test_lru_eviction_order_and_pinning():
    c = _cache(num_blocks=4, block_size=4)
    _put(c, "a", 4)  # block 0
    _put(c, "b", 4)  # block 1
    _put(c, "c", 4)  # block 2
    c.lookup("a")  # a becomes most recent: order b, c, a
    assert c.eviction_order() == ["b", "c", "a"]
    c.pin("c")
    assert c.eviction_order() == ["b", "a"]
    blocks = c.allocate(2)  # 1 free (3) + evict b (1)
    assert blocks == [3, 1]
    assert c.lookup("b") is None and c.num_evictions == 1
    with pytest.raises(NoFreeBlocksError, match="1 evictable"):
        c.allocate(2)  # only a is evictable (c pinned), and nothing is free
    assert c.lookup("a") is not None  # the failed allocation evicted nothing
    c.unpin("c")
    assert c.eviction_order() == ["c", "a"]  # order of last access (a was just looked up)
    c.pool.decref(blocks)
    c.check_integrity()


def test_document_rebind_drops_stale_entry_when_unpinned():
    c = _cache()
    c.retain_key("k1")  # what the registry does when "doc" is registered with the text of k1
    e1 = _put(c, "k1", 4)
    assert c.num_document_refs("k1") == 1 and not e1.dead
    c.pin("k1")
    c.retain_key("k2")  # "doc"'s text changed while a request reads k1
    c.release_key("k1")
    assert c.lookup("k1") is None and e1.dead  # never served stale
    assert c.pool.ref_count(e1.block_ids[0]) == 1  # still held for the running reader
    c.unpin("k1")
    assert c.num_entries == 0 and c.pool.num_free == 6
    c.check_integrity()


def test_shared_key_survives_other_document_removal():
    c = _cache()
    c.retain_key("k")  # documents x and y have the same text
    c.retain_key("k")
    e = _put(c, "k", 3)
    c.release_key("k")  # x removed
    assert c.lookup("k") is e and c.num_document_refs("k") == 1
    c.release_key("k")  # y removed
    assert c.lookup("k") is None and c.pool.num_free == 6 and c.num_document_refs("k") == 0
    with pytest.raises(KeyError, match="no registered document uses chunk k"):
        c.release_key("k")
    c.check_integrity()


def test_a_dead_pinned_entry_revives_when_its_text_is_registered_again():
    c = _cache()
    c.retain_key("k")
    e = _put(c, "k", 3)
    c.pin("k")
    c.release_key("k")
    assert e.dead and c.lookup("k") is None
    c.retain_key("k")
    assert not e.dead and c.lookup("k") is e
    c.unpin("k")
    assert c.eviction_order() == ["k"]
    c.check_integrity()


def test_evict_pinned_refused():
    c = _cache()
    _put(c, "a", 1)
    c.pin("a")
    with pytest.raises(RuntimeError, match="pinned or pending"):
        c.evict("a")
    with pytest.raises(RuntimeError, match="unpin of unpinned"):
        c.unpin("a") or c.unpin("a")
