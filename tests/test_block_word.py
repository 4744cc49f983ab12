"""The packed block-table word is read in one place per side: the kernels' Triton
``unpack_word`` gives what the Python ``unpack_word`` gives, and both invert the packing, at
every field's extremes (Triton's interpreter without a GPU)."""

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lazyattn_rag.kernels.block_table import (  # noqa: E402
    MAX_BLOCK_ID, MAX_DELTA, MAX_VALID, MIN_DELTA, pack_block_table, unpack_word)
from lazyattn_rag.kernels.triton_helpers import unpack_word as triton_unpack_word  # noqa: E402


@triton.jit
def _unpack_kernel(words_ptr, ids_ptr, scaled_ptr, valid_ptr, deltas_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    block_id, scaled, valid, delta = triton_unpack_word(tl.load(words_ptr + offs))  # [N] each
    tl.store(ids_ptr + offs, block_id)
    tl.store(scaled_ptr + offs, scaled.to(tl.int64))
    tl.store(valid_ptr + offs, valid)
    tl.store(deltas_ptr + offs, delta)


def test_the_triton_and_python_readings_agree_and_invert_the_packing():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    n = 64
    ids = torch.randint(0, MAX_BLOCK_ID + 1, (n,), generator=generator)
    deltas = torch.randint(MIN_DELTA, MAX_DELTA + 1, (n,), generator=generator)
    valid = torch.randint(1, MAX_VALID + 1, (n,), generator=generator)
    scaled = torch.randint(0, 2, (n,), generator=generator)
    ids[:4], deltas[:4], valid[:4], scaled[:4] = (torch.tensor([0, MAX_BLOCK_ID, 0, MAX_BLOCK_ID]),
                                                  torch.tensor([MIN_DELTA, MAX_DELTA, -1, 0]),
                                                  torch.tensor([1, MAX_VALID, MAX_VALID, 1]), torch.tensor([1, 0, 1, 1]))
    words = pack_block_table(ids, deltas, valid, scaled).to(device)
    outs = [torch.empty(n, dtype=torch.int64, device=device) for _ in range(4)]
    _unpack_kernel[(1,)](words, *outs, N=n)
    python = unpack_word(words)
    assert torch.equal(python[0].cpu(), ids) and torch.equal(python[1].cpu(), scaled.bool())
    assert torch.equal(python[2].cpu(), valid) and torch.equal(python[3].cpu(), deltas)
    for got, want in zip(outs, (ids, scaled, valid, deltas)):
        assert torch.equal(got.cpu(), want)
