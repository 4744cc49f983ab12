"""The one-launch K/V cache write against the two indexed assignments it replaces (``write_kv``)."""

import pytest
import torch

from lazyattn_rag.engine.worker.attention.base import write_kv
from lazyattn_rag.kernels.kv_write import write_kv_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_kv_heads,head_dim,src_dtype,cache_dtype", [
    (3, 64, torch.float32, torch.float32), (8, 128, torch.bfloat16, torch.bfloat16),
    (2, 16, torch.float32, torch.bfloat16), (1, 32, torch.float16, torch.float16),
])
def test_caches_equal_the_indexed_assignments_bit_for_bit(num_kv_heads, head_dim, src_dtype, cache_dtype):
    g = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_blocks, block_size, num_tokens = 9, 16, 21
    # K as a view of a fused q/k/v product (strided rows), V contiguous
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=g).to(src_dtype)
    key = qkv[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(src_dtype)
    slots = torch.randperm(num_blocks * block_size - 1, generator=g)[:num_tokens]  # distinct, not the last
    slots[0] = -1  # the last slot, as torch indexing counts it
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(cache_dtype)
              for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv(key, value, *expected, slots)
    got = [c.clone().to(DEVICE) for c in caches]
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), *got, slots.to(DEVICE))
    for e, o in zip(expected, got):
        assert torch.equal(o.cpu(), e)
    assert not torch.equal(expected[0], caches[0])  # the write changed something


def test_no_tokens_and_bad_inputs():
    cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    k = torch.zeros(0, 2, 64, device=DEVICE)
    write_kv_cache(k, k, cache, cache.clone(), torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.count_nonzero(cache) == 0
    k = torch.ones(3, 2, 64, device=DEVICE)
    slots = torch.tensor([0, 5, 17], device=DEVICE)
    with pytest.raises(ValueError, match=r"must be \[num_tokens, 2, 64\]"):
        write_kv_cache(k[:, :1], k[:, :1], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="int64 \\[3\\]"):
        write_kv_cache(k, k, cache, cache.clone(), slots.to(torch.int32))
    with pytest.raises(ValueError, match="one shape and layout"):
        write_kv_cache(k, k, cache, cache[:1].clone(), slots)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        write_kv_cache(k, torch.ones(3, 64, 2, device=DEVICE).transpose(1, 2), cache, cache.clone(), slots)
