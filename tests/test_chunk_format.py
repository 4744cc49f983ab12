"""A chunk's K/V as stored bytes (engine/tiers/chunk_format.py) and its way out of and back into the pool.

Groundwork for the storage tiers (issue 17): what a tier will store must come back bit-identical,
give the same logits as a fresh encode when loaded into other blocks, and be refused, never
served, when it is damaged or belongs to another model, key or format version.
"""

import pytest
import torch

from lazyattn_rag import SamplingParams
from lazyattn_rag.engine.tiers import chunk_format
from lazyattn_rag.engine.tiers.chunk_format import ChunkKV, CorruptChunkError, decode_chunk, encode_chunk
from tests.tiny import words

MODEL = "m" * 64
KEY = "k" * 64


def chunk(dtype=torch.float32, num_tokens=5, seed=0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (3, num_tokens, 2, 8)  # [num_layers, num_tokens, num_kv_heads, head_dim]
    keys = torch.randn(shape, generator=g).to(dtype)
    values = torch.randn(shape, generator=g).to(dtype)
    return ChunkKV(KEY, MODEL, tuple(range(100, 100 + num_tokens)), 1, keys, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_chunk_round_trips_bit_identical(dtype):
    original = chunk(dtype)
    back = decode_chunk(encode_chunk(original), KEY, MODEL)
    assert back.token_ids == original.token_ids and back.local_start == 1 and back.keys.dtype == dtype
    assert torch.equal(back.keys.view(torch.uint8), original.keys.view(torch.uint8))
    assert torch.equal(back.values.view(torch.uint8), original.values.view(torch.uint8))
    assert back.num_bytes == 2 * original.keys.numel() * original.keys.element_size()


def test_damaged_or_foreign_payloads_are_refused_with_the_reason(monkeypatch):
    data = encode_chunk(chunk())
    flipped = bytearray(data)
    flipped[-20] ^= 0x01  # one bit inside the values
    cases = {
        "truncated": (data[: len(data) - 7], KEY, MODEL, "unreadable payload"),
        "bit flip": (bytes(flipped), KEY, MODEL, "checksum mismatch"),
        "other model": (data, KEY, "n" * 64, "computed by model"),
        "other key": (data, "j" * 64, MODEL, "holds chunk"),
        "not a payload": (b"\x00\x01garbage", KEY, MODEL, "not a chunk payload"),
        "header cut": (data[:40], KEY, MODEL, "not a chunk payload"),
    }
    for name, (payload, key, model, message) in cases.items():
        with pytest.raises(CorruptChunkError, match=message):
            decode_chunk(payload, key, model)
    monkeypatch.setattr(chunk_format, "FORMAT_VERSION", 2)  # a payload of an older format version
    with pytest.raises(CorruptChunkError, match="chunk format '1', this version reads 2"):
        decode_chunk(data, KEY, MODEL)


def _reference_sums(t: torch.Tensor) -> list[int]:
    """kv_sums' three numbers for one tensor in plain Python integers, reduced mod 2**64."""
    rows = t.reshape(-1, t.shape[-2] * t.shape[-1]).contiguous().view(torch.int32).tolist()
    wrap = lambda x: (x + 2**63) % 2**64 - 2**63  # noqa: E731 - int64 two's complement
    row_sums = [sum(r) for r in rows]
    col_sums = [sum(c) for c in zip(*rows)]
    return [wrap(sum(row_sums)), wrap(sum(i * x for i, x in enumerate(row_sums, 1))),
            wrap(sum(i * x for i, x in enumerate(col_sums, 1)))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_sums_match_a_plain_integer_reference_and_change_with_any_bit(dtype):
    c = chunk(dtype, num_tokens=7)
    sums = chunk_format.kv_sums(c.keys, c.values)
    assert list(sums) == _reference_sums(c.keys) + _reference_sums(c.values)
    raw = c.values.clone().view(-1).view(torch.uint8)
    for byte in range(0, raw.numel(), 5):  # a flipped bit anywhere changes them
        for bit in (0, 7):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            assert chunk_format.kv_sums(c.keys, flipped.view(dtype).view(c.values.shape)) != sums
    swapped = c.keys.clone()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]  # two tokens' rows exchanged
    assert chunk_format.kv_sums(swapped, c.values) != sums


def test_mismatched_tensors_are_not_encoded():
    c = chunk()
    with pytest.raises(ValueError, match="differ"):
        encode_chunk(ChunkKV(KEY, MODEL, c.token_ids, 0, c.keys, c.values.to(torch.bfloat16)))
    with pytest.raises(ValueError, match="must be"):
        encode_chunk(ChunkKV(KEY, MODEL, c.token_ids[:-1], 0, c.keys, c.values))


def test_a_chunk_read_out_of_the_pool_and_loaded_into_other_blocks_gives_the_same_logits(make_llm):
    """Encode a document, store its K/V as bytes, evict it, load the bytes into fresh blocks as a
    ready entry: the next request hits it, and its logits equal, bit for bit, those of a request
    that hit the freshly encoded chunk (the same batch shapes; the encoding run itself batches
    the chunk with its prefill, so its rows agree only to rounding)."""
    hf, llm = make_llm(anchor="bos")
    llm.add_document("a", words(37, start=5))
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    first = llm.generate("w1 w2", ["a"], sampling=sampling)  # encodes "a"
    rows = []
    llm.add_step_listener(lambda step: rows.extend(step.logits[i].clone() for i, job in
                                                   enumerate(step.output.computes) if job.sample))
    hit = llm.generate("w1 w2", ["a"], sampling=sampling)
    key = llm.plan("w1 w2", ["a"]).chunks[-1].key

    def store_evict_load(engine):
        entry = engine.cache.lookup(key, touch=False)
        keys, values = engine.runner.kv_pool.read(entry.block_ids, entry.num_tokens)
        data = encode_chunk(ChunkKV(key, engine.model_digest, entry.token_ids, entry.local_start, keys, values))
        old_blocks = list(entry.block_ids)
        engine.cache.evict(key)
        stored = decode_chunk(data, key, engine.model_digest)
        blocks = engine.cache.allocate(len(old_blocks))
        engine.runner.kv_pool.write(blocks, stored.keys, stored.values)
        engine.cache.insert(key, blocks, len(stored.token_ids), stored.local_start, stored.token_ids)
        engine.cache.check_integrity()
        return old_blocks, blocks, keys, engine.runner.kv_pool.read(blocks, len(stored.token_ids))[0]

    old_blocks, new_blocks, keys, reloaded = llm.loop.call(store_evict_load, llm.engine)
    assert set(old_blocks).isdisjoint(new_blocks)  # other blocks, same bits
    assert torch.equal(keys, reloaded)
    loaded = llm.generate("w1 w2", ["a"], sampling=sampling)
    llm.loop.call(lambda: None)
    assert hit.stats.docs_hit == loaded.stats.docs_hit == ["a"]
    assert loaded.token_ids == hit.token_ids == first.token_ids
    assert len(rows) == 8 and all(torch.equal(a, b) for a, b in zip(rows[:4], rows[4:]))


def test_loading_into_a_pool_of_another_shape_is_refused(make_llm):
    hf, llm = make_llm()
    c = chunk(num_tokens=3)  # 3 layers, 2 heads of 8: not this model's pool
    with pytest.raises(ValueError, match="does not fit this pool"):
        llm.loop.call(lambda engine: engine.runner.kv_pool.write([0], c.keys, c.values), llm.engine)
