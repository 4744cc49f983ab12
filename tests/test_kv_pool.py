"""The KV pool (engine/kv/kv_pool.py) and its layout: exact slots, exact stored values, rotated
copies against a rotation written out by hand, refusals that leave the pool untouched, and the
kv_cache_dtype a backend must declare."""

import math
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lazyattn_rag import CacheConfig
from lazyattn_rag.engine.kv.kv_layout import KVLayout
from lazyattn_rag.engine.kv.kv_pool import KVPool
from lazyattn_rag.engine.planning.fingerprint import ModelFingerprint
from lazyattn_rag.kernels.rope import RotaryEmbedding
from lazyattn_rag.types.kv_quant import dequantize_rows, quantize_rows

LAYOUT = KVLayout(torch.float32, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)
ROOT = Path(__file__).resolve().parents[1]


def rotary() -> RotaryEmbedding:
    config = SimpleNamespace(head_dim=8, hidden_size=32, num_attention_heads=4,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return RotaryEmbedding.from_hf_config(config)


def rotated_by_hand(x: torch.Tensor, delta: int, theta: float = 10000.0) -> torch.Tensor:
    """Half-split RoPE by ``delta``: pairs ``(i, i + 4)`` of an 8-wide head turn by ``delta / theta^(2i/8)``."""
    out = x.clone()
    for i in range(4):
        angle = delta / theta ** (2 * i / 8)
        c, s = math.cos(angle), math.sin(angle)
        out[..., i] = x[..., i] * c - x[..., i + 4] * s
        out[..., i + 4] = x[..., i + 4] * c + x[..., i] * s
    return out


def chunk(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = LAYOUT.chunk_shape(num_tokens)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_layout_sizes_and_name():
    assert LAYOUT.block_shape == (4, 2, 8) and LAYOUT.chunk_shape(5) == (3, 5, 2, 8)
    assert LAYOUT.bytes_per_token == 2 * 3 * 2 * 8 * 4 and LAYOUT.bytes_per_block == 4 * 2 * 3 * 2 * 8 * 4
    assert replace(LAYOUT, dtype=torch.bfloat16).bytes_per_block == LAYOUT.bytes_per_block // 2
    assert LAYOUT.format_name() == "float32/none"
    assert LAYOUT.mismatch(((3, 5, 2, 8), torch.float32), ((3, 5, 2, 8), torch.float32), 5) is None
    assert "does not fit this pool (kv_cache_dtype 'auto': (3, 5, 2, 8) float32/none)" in \
        LAYOUT.mismatch(((3, 5, 2, 8), torch.float16), ((3, 5, 2, 8), torch.float16), 5)


def test_pool_tensors_and_padding_slot():
    pool = KVPool(LAYOUT, num_blocks=6, device=torch.device("cpu"))
    assert len(pool.layers) == 3 and pool.padding_slot == 24
    assert all(k.shape == v.shape == (7, 4, 2, 8) and k.dtype == torch.float32 for k, v in pool.layers)
    assert all(not k.any() and not v.any() for k, v in pool.layers)
    pool.close()
    assert pool.layers == []


def test_write_puts_each_token_in_its_slot_and_gather_reads_it_back():
    pool = KVPool(LAYOUT, num_blocks=6, device=torch.device("cpu"))
    keys, values = chunk(5)
    assert pool.slots([3, 1], 5).tolist() == [12, 13, 14, 15, 4]
    pool.write([3, 1], keys, values)
    for layer, (k, v) in enumerate(pool.layers):
        assert torch.equal(k[3], keys[layer, :4]) and torch.equal(v[1, 0], values[layer, 4])
        assert not k[1, 1:].any() and not k[0].any()  # nothing outside the chunk's slots
    got_k, got_v = pool.gather([3, 1], 5)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    assert all(torch.equal(a, b) for a, b in zip(pool.read([3, 1], 5), (keys, values)))
    layer_k, layer_v = pool.gather_layer(2, torch.tensor([4, 12]))
    assert torch.equal(layer_k, keys[2, [4, 0]]) and torch.equal(layer_v, values[2, [4, 0]])


@pytest.mark.parametrize("bad", ["dtype", "layers", "heads", "blocks"])
def test_a_write_that_does_not_fit_is_refused_and_writes_nothing(bad):
    pool = KVPool(LAYOUT, num_blocks=6, device=torch.device("cpu"))
    keys, values = chunk(5)
    blocks = [3, 1]
    if bad == "dtype":
        keys, values = keys.half(), values.half()
    elif bad == "layers":
        keys, values = keys[:2], values[:2]
    elif bad == "heads":
        keys, values = keys[:, :, :1], values[:, :, :1]
    else:
        blocks = [3]
    with pytest.raises(ValueError, match="cannot hold 5 tokens" if bad == "blocks" else "does not fit this pool"):
        pool.write(blocks, keys, values)
    assert all(not k.any() and not v.any() for k, v in pool.layers)


def test_copy_rotated_turns_keys_by_delta_and_copies_values():
    pool = KVPool(LAYOUT, num_blocks=6, device=torch.device("cpu"))
    keys, values = chunk(6, seed=1)
    pool.write([0, 1], keys, values)
    pool.copy_rotated([0, 1], [4, 2], 6, delta=37, rotary=rotary())
    got_k, got_v = pool.gather([4, 2], 6)
    torch.testing.assert_close(got_k, rotated_by_hand(keys, 37), rtol=1e-5, atol=1e-5)
    assert torch.equal(got_v, values)
    assert torch.equal(pool.gather([0, 1], 6)[0], keys)  # the source is unchanged


def test_copy_slots_turns_each_slot_by_its_own_delta():
    pool = KVPool(LAYOUT, num_blocks=6, device=torch.device("cpu"))
    keys, values = chunk(4, seed=2)
    pool.write([0], keys, values)
    src, dst = torch.tensor([0, 1, 3]), torch.tensor([9, 10, 20])
    pool.copy_slots(src, dst, torch.tensor([5, -3, 0]), rotary())
    got_k, got_v = pool.gather_layer(1, dst)
    expected = torch.stack([rotated_by_hand(keys[1, 0], 5), rotated_by_hand(keys[1, 1], -3), keys[1, 3]])
    torch.testing.assert_close(got_k, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_v, values[1, [0, 1, 3]])


FP8_LAYOUT = KVLayout.for_model(SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8), 4, torch.float32, "fp8")


def fp8_chunk(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed FP8 rows of random K and V (as ``KVPool.gather`` returns a chunk)."""
    keys, values = chunk(num_tokens, seed)
    return tuple(FP8_LAYOUT.pack_rows(*quantize_rows(x, torch.float8_e4m3fn)) for x in (keys, values))


def test_fp8_rows_and_their_scales_go_in_and_out_packed_bit_for_bit():
    pool = KVPool(FP8_LAYOUT, num_blocks=6, device=torch.device("cpu"))
    assert [tuple(t.shape) for t in pool.layers[0]] == [(7, 4, 2, 8), (7, 4, 2, 8), (7, 4, 2), (7, 4, 2)]
    assert pool.layers[0][0].dtype == torch.float8_e4m3fn and pool.layers[0][2].dtype == torch.float32
    keys, values = fp8_chunk(6, seed=3)
    assert keys.shape == FP8_LAYOUT.chunk_shape(6) == (3, 6, 2, 12) and keys.dtype == torch.uint8
    pool.write([5, 2], keys, values)
    got_k, got_v = pool.gather([5, 2], 6)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    k_rows, k_scales = FP8_LAYOUT.unpack_rows(keys[1])
    assert torch.equal(pool.layers[1][2][2, 1], k_scales[5])  # token 5: block 2, slot 1
    dense_k, dense_v = pool.gather_layer(1, pool.slots([5, 2], 6))
    assert torch.equal(dense_k, dequantize_rows(k_rows, k_scales))
    assert torch.equal(dense_v, dequantize_rows(*FP8_LAYOUT.unpack_rows(values[1])))
    with pytest.raises(ValueError, match=r"does not fit this pool \(kv_cache_dtype 'fp8'.*float8_e4m3fn/per_token_head"):
        pool.write([0, 1], *chunk(6))  # float32 rows


def test_fp8_copies_requantize_moved_keys_and_keep_the_bytes_of_the_rest():
    pool = KVPool(FP8_LAYOUT, num_blocks=6, device=torch.device("cpu"))
    keys, values = fp8_chunk(4, seed=4)
    pool.write([0], keys, values)
    src, dst = torch.tensor([0, 1, 3]), torch.tensor([9, 10, 20])
    pool.copy_slots(src, dst, torch.tensor([5, 0, -3]), rotary())
    k_rows, k_scales = FP8_LAYOUT.unpack_rows(keys[1])
    exact = dequantize_rows(k_rows, k_scales)
    got_k, got_v = pool.gather_layer(1, dst)
    for row, (i, delta) in enumerate([(0, 5), (1, 0), (3, -3)]):
        moved, moved_scales = quantize_rows(rotated_by_hand(exact[i], delta), torch.float8_e4m3fn)
        torch.testing.assert_close(got_k[row], dequantize_rows(moved, moved_scales), rtol=1e-6, atol=1e-6)
    flat_k = pool.layers[1][0].view(-1, 2, 8)
    assert torch.equal(flat_k[10].view(torch.uint8), k_rows[1].view(torch.uint8))  # delta 0: the same bytes
    assert torch.equal(got_v, dequantize_rows(*FP8_LAYOUT.unpack_rows(values[1]))[[0, 1, 3]])


def test_kv_cache_dtype_is_checked_and_named_in_chunk_keys():
    assert CacheConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3', "
                                         r"'fp8_e5m2'\), got 'int8'"):
        CacheConfig(kv_cache_dtype="int8")
    arch = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="'int8' is not supported"):
        KVLayout.for_model(arch, 4, torch.float32, "int8")
    for name, dtype in [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]:
        layout = KVLayout.for_model(arch, 4, torch.bfloat16, name)
        assert (layout.dtype, layout.scales, layout.chunk_dtype, layout.row_width) == (dtype, "per_token_head",
                                                                                      torch.uint8, 12)
        assert layout.format_name() == f"{str(dtype).removeprefix('torch.')}/per_token_head"
        assert layout.bytes_per_token == 2 * 1 * 1 * (8 + 4)  # one byte a value, four a scale
    base = ModelFingerprint("w" * 64, "bfloat16", "{}", "t" * 64, 16, "bfloat16/none")
    assert base.digest() != replace(base, kv_format="float8_e4m3fn/per-channel").digest()


def test_the_engine_refuses_a_kv_cache_dtype_its_backend_does_not_declare(make_llm, monkeypatch):
    from lazyattn_rag.engine.worker.attention.torch_backend import TorchAttentionBackend

    _, llm = make_llm()
    assert llm.engine.info["kv_cache_dtype"] == "auto"
    assert llm.engine.runner.kv_pool.layout.format_name() == "float32/none"
    assert llm.engine.fingerprint.kv_format == "float32/none"
    monkeypatch.setattr(TorchAttentionBackend, "supported_kv_cache_dtypes", ())
    with pytest.raises(ValueError, match=r"the 'torch' attention backend reads kv_cache_dtype \(\), not 'auto'"):
        make_llm()


def test_stored_kv_is_indexed_only_by_the_pool_and_the_attention_backends():
    """The K/V tensors are sliced in engine/kv/kv_pool.py (loads, copies, gathers) and by the attention
    backends (the step's own tokens, the context they read); nowhere else in the package."""
    pattern = re.compile(r"(key_cache|value_cache|kv_pool\.layers)\s*(\.view\(|\[)")
    allowed = {ROOT / "engine/kv/kv_pool.py", *(ROOT / "engine/worker/attention").glob("*.py")}
    offenders = [f"{path.relative_to(ROOT)}:{n}" for folder in ("engine", "lazyattn_rag", "integrations")
                 for path in (ROOT / folder).rglob("*.py") if path not in allowed
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
    assert pattern.search("flat = key_cache.view(-1, 2, 8)") and pattern.search("runner.kv_pool.layers[0]")
