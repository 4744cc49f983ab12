"""RoPE rotation identities (float32) and the packed block-table word."""

import pytest
import torch

from lazyattn_rag.kernels.block_table import (
    MAX_BLOCK_ID,
    MAX_DELTA,
    MIN_DELTA,
    BlockTableOverflowError,
    pack_block_table,
    pack_entries,
    pack_run,
    unpack_block_table,
)
from lazyattn_rag.kernels.rope import RotaryEmbedding
from tests.tiny import hf_config


def _rotary(rope=None, interleaved=False, partial=1.0):
    params = dict(rope or {"rope_type": "default", "rope_theta": 10000.0})
    params["partial_rotary_factor"] = partial
    return RotaryEmbedding.from_hf_config(hf_config("llama", params), interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                         "rope_theta": 10000.0}])
def test_relative_rotation_equals_encoding_at_shifted_position(interleaved, partial, rope):
    """R_delta (encode at j) == encode at j + delta, for deltas of both signs.

    Angles are float32 (as in transformers), so both sides round ``position * inv_freq`` to
    float32: at positions ~2e4 that is ~1e-3 rad, hence the tolerance.
    """
    rot = _rotary(rope, interleaved, partial)
    torch.manual_seed(0)
    x = torch.randn(6, 2, rot.head_dim, dtype=torch.float64).float()
    local = torch.tensor([0, 1, 5, 100, 3000, 7])
    delta = torch.tensor([0, 3, -5, 20000, -2000, 12345])
    moved = rot.rotate_by(rot.encode(x, local), delta)
    direct = rot.encode(x, local + delta)
    torch.testing.assert_close(moved, direct, atol=1e-2, rtol=0)
    small = rot.rotate_by(rot.encode(x[:3], local[:3]), delta[:3])
    torch.testing.assert_close(small, rot.encode(x[:3], local[:3] + delta[:3]), atol=1e-5, rtol=0)
    assert rot.rotary_dim == int(rot.head_dim * partial)
    torch.testing.assert_close(moved[..., rot.rotary_dim:], x[..., rot.rotary_dim:])


def test_rotation_preserves_scores_relative_position():
    rot = _rotary()
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    s1 = (rot.encode(q, torch.tensor([50])) * rot.encode(k, torch.tensor([20]))).sum()
    s2 = (rot.encode(q, torch.tensor([1030])) * rot.encode(k, torch.tensor([1000]))).sum()
    assert s1.item() == pytest.approx(s2.item(), abs=1e-4)


def test_pack_roundtrip_at_field_limits():
    entries = [(0, 0, 1), (MAX_BLOCK_ID, 2**24, 128), (7, -(2**24), 16), (123, 2**25 - 1, 5), (9, -(2**25), 77)]
    words = pack_entries(entries)
    assert words.dtype == torch.int64
    ids, deltas, valid = unpack_block_table(words)
    assert ids.tolist() == [e[0] for e in entries]
    assert deltas.tolist() == [e[1] for e in entries]
    assert valid.tolist() == [e[2] for e in entries]


@pytest.mark.parametrize("bad", [(2**31, 0, 1), (-1, 0, 1), (0, 2**25, 1), (0, -(2**25) - 1, 1), (0, 0, 0), (0, 0, 129)])
def test_pack_rejects_out_of_range(bad):
    with pytest.raises(BlockTableOverflowError):
        pack_entries([bad])


def test_pack_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shapes differ"):
        pack_block_table(torch.zeros(2), torch.zeros(3), torch.ones(2))


@pytest.mark.parametrize("num_tokens, num_blocks", [(0, 3), (1, 3), (16, 3), (17, 3), (48, 3), (40, 5), (60, 3)])
@pytest.mark.parametrize("delta", [0, -7, 4096, MIN_DELTA, MAX_DELTA])
def test_pack_run_equals_packing_each_entry(num_tokens, num_blocks, delta):
    """The packing of a run of blocks gives exactly the words of packing its entries
    one by one (full blocks, a partial last one, blocks past the last token left out, fewer
    blocks than the tokens need)."""
    blocks = [11 * i + 5 for i in range(num_blocks)]
    entries = [(b, delta, min(16, num_tokens - i * 16)) for i, b in enumerate(blocks) if num_tokens > i * 16]
    assert pack_run(blocks, num_tokens, delta, 16).tolist() == pack_entries(entries).tolist()


@pytest.mark.parametrize("block_ids, delta, match", [
    ([3, MAX_BLOCK_ID + 1], 0, f"block id {MAX_BLOCK_ID + 1} "),
    ([-1, 4], 0, "block id -1 "),
    ([3, 4], MAX_DELTA + 1, f"delta {MAX_DELTA + 1} "),
    ([3, 4], MIN_DELTA - 1, f"delta {MIN_DELTA - 1} "),
])
def test_pack_run_refuses_what_the_word_cannot_hold(block_ids, delta, match):
    """A run's ids and offset are range-checked as pack_entries checks each entry (nothing wraps)."""
    with pytest.raises(BlockTableOverflowError, match=match):
        pack_run(block_ids, 20, delta, 16)
    with pytest.raises(BlockTableOverflowError, match=match):
        pack_entries([(b, delta, 16) for b in block_ids])


def test_pack_run_takes_numpy_integers_and_checks_only_the_blocks_it_packs():
    import numpy as np

    ids = list(np.array([3, 4, 5], dtype=np.int32))
    want = pack_entries([(3, -7, 16), (4, -7, 16), (5, -7, 8)]).tolist()
    assert pack_run(ids, 40, -7, 16).tolist() == want
    assert pack_run([3, 4, 5], np.int32(40), np.int32(-7), np.int32(16)).tolist() == want
    # one block: the block size is no word's valid count, so it is not checked (as pack_entries)
    assert pack_run([10], 50, 0, 200).tolist() == pack_entries([(10, 0, 50)]).tolist()
