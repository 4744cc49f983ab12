"""FP8 KV cache (issue 42): per-token scales, the engine against transformers with the cached K/V
quantized and dequantized the same way, chunks at any offset, tiers, and refusals."""

import pytest
import torch

from lazyattn_rag import SamplingParams
from lazyattn_rag.types.kv_quant import dequantize_rows, fp8_max, quantize_rows
from tests.observe import StepLog
from tests.oracle import oracle_generate
from tests.tiny import words

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def rounded(dtype):
    """An FP8 cache's round trip of K or V rows ``[..., head_dim]``, written independently of
    ``kv_quant``: the row's max magnitude maps to the format's largest finite value."""
    def round_trip(x):
        limit = torch.finfo(dtype).max
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
        return (x / scale).to(dtype).to(torch.float32) * scale
    return round_trip


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rows_quantize_to_their_own_scale_and_zero_rows_stay_zero(dtype):
    x = torch.randn(6, 3, 16) * torch.tensor([1e-3, 1.0, 50.0])[None, :, None]
    x[2, 1] = 0
    x[3, 2] = 0
    x[3, 2, 0] = 1e-43  # a float32 denormal: max|x| / fp8_max underflows to 0
    values, scales = quantize_rows(x, dtype)
    assert scales[3, 2] == 1 and torch.isfinite(dequantize_rows(values, scales)).all()
    assert values.dtype == dtype and scales.dtype == torch.float32 and scales.shape == (6, 3)
    assert scales[2, 1] == 1 and not values[2, 1].float().any()
    peak = values.float().abs().amax(dim=-1)
    assert torch.equal(peak[scales != 1], torch.full_like(peak[scales != 1], fp8_max(dtype)))
    normal = x.abs().amax(dim=-1) > 1e-30  # [6, 3]: every row but the zero and the denormal one
    torch.testing.assert_close(dequantize_rows(values, scales)[normal], rounded(dtype)(x)[normal], rtol=0, atol=0)
    relative = (dequantize_rows(values, scales) - x).abs().amax(dim=-1)[normal] / x.abs().amax(dim=-1)[normal]
    assert relative.max() <= (0.0625 if dtype == torch.float8_e4m3fn else 0.125)


def first_logits(llm, hf, question, doc_ids, kv_round):
    """The oracle's first-token logits of the engine's plan, cached K/V through ``kv_round``."""
    plan = llm.engine.planner.plan(question, doc_ids)
    anchor = list(llm.engine.planner.anchor_ids)
    chunks = [([] if c.doc_id is None else anchor, list(c.token_ids), c.global_start) for c in plan.chunks]
    return oracle_generate(hf, chunks, list(plan.query_token_ids), 1, kv_round=kv_round)[1]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_the_engine_with_fp8_matches_transformers_with_the_cached_kv_rounded_alike(make_llm, kv_cache_dtype):
    hf, llm = make_llm(kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.kv_pool.layout.format_name() == f"{FP8[kv_cache_dtype]}".removeprefix("torch.") \
        + "/per_token_head"
    assert llm.info()["kv_cache_dtype"] == kv_cache_dtype  # what `lazyattn info` prints
    for i, n in enumerate([15, 16, 37]):
        llm.add_document(f"d{n}", words(n, start=i * 30))
    question = "w5 w6 w7"
    for order in (["d37", "d15", "d16"], ["d16", "d37", "d15"]):  # every chunk at a new offset
        steps = StepLog(llm, logits=True)
        llm.generate(question, order, sampling=GREEDY)
        steps.remove()
        got = steps.logits[-GREEDY.max_tokens][-1]  # the request's first sampled row
        expected = first_logits(llm, hf, question, order, rounded(FP8[kv_cache_dtype]))
        assert (got - expected).abs().max().item() <= 1e-5  # 1e-7 measured
        assert (got - first_logits(llm, hf, question, order, None)).abs().max().item() > 1e-3  # rounding is there
    llm.engine.cache.check_integrity()


def _pool_bytes(llm, doc_id):
    """The packed FP8 rows (values and scales) the KV pool holds for ``doc_id``."""
    def read(engine):
        entry = engine.cache.lookup(engine.documents[doc_id].key, touch=False)
        return engine.runner.kv_pool.read(entry.block_ids, entry.num_tokens)
    return llm.client.call(read)


def _ask(llm, doc_id):
    log = StepLog(llm, logits=True)
    out = llm.generate("w5 w6", [doc_id], sampling=SamplingParams(max_tokens=2))
    llm.client.call(lambda engine: engine.tiers.flush())
    log.remove()
    return out, log.logits[0][-1]


@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_fp8_chunks_and_their_scales_survive_every_tier(make_llm, tmp_path, request, tier):
    config = {"host": {"host_memory_bytes": 1 << 26}, "disk": {"disk_dir": str(tmp_path / "tier")}}.get(tier)
    if tier == "redis":
        config = {"redis_url": request.getfixturevalue("redis_server").url}
    _, llm = make_llm(kv_cache_dtype="fp8_e4m3", **config)
    llm.add_document("d0", words(100, start=10))
    _ask(llm, "d0")
    out, logits = _ask(llm, "d0")  # a hit on the fresh encode
    keys, values = _pool_bytes(llm, "d0")
    assert keys.dtype == torch.uint8 and keys.shape[-1] == 16 + 4  # head_dim FP8 bytes, then the scale's 4
    layout = llm.engine.runner.kv_pool.layout
    assert layout.unpack_rows(keys)[1].gt(0).all()  # every row has its scale
    llm.client.call(lambda engine: (engine.cache.evict(engine.documents["d0"].key), engine.tiers.flush()))
    again, again_logits = _ask(llm, "d0")
    assert again.stats.doc_tiers == {"d0": tier}
    loaded_keys, loaded_values = _pool_bytes(llm, "d0")
    assert torch.equal(loaded_keys, keys) and torch.equal(loaded_values, values)
    assert torch.equal(again_logits, logits) and again.text == out.text
    assert llm.stats()["tiers"][tier]["num_corrupt"] == 0
    stored = llm.client.call(lambda engine: next(t for t in engine.tiers.tiers if t.name == tier).num_bytes)
    assert 0 < stored <= layout.bytes_per_token * 112 + 4096  # FP8 rows and scales of 7 blocks (+ a header)


def test_kv_dtypes_never_share_a_chunk_and_a_mislabelled_one_is_refused_by_name(make_llm, tmp_path, caplog):
    disk = {"disk_dir": str(tmp_path / "tier")}
    _, auto = make_llm(**disk)
    auto.add_document("d0", words(100, start=10))
    assert _ask(auto, "d0")[0].stats.doc_tiers == {"d0": "computed"}
    auto_key, auto_kv = auto.engine.documents["d0"].key, _pool_bytes(auto, "d0")
    auto.shutdown()
    _, fp8 = make_llm(kv_cache_dtype="fp8", **disk)
    fp8.add_document("d0", words(100, start=10))
    assert fp8.engine.documents["d0"].key != auto_key  # the chunk key names the KV format
    assert _ask(fp8, "d0")[0].stats.doc_tiers == {"d0": "computed"}  # the float32 chunk on disk is not its

    def plant(engine):  # a float32 chunk stored under the FP8 chunk's key
        from lazyattn_rag.engine.tiers.chunk_format import ChunkKV, encode_chunk

        key = engine.documents["d0"].key
        entry = engine.cache.lookup(key, touch=False)
        engine.cache.evict(key)
        engine.tiers.flush()
        disk_tier = next(t for t in engine.tiers.tiers if t.name == "disk")
        assert disk_tier.put(key, encode_chunk(ChunkKV(key, engine.model_digest, entry.token_ids, entry.local_start,
                                                       *auto_kv)))

    fp8.client.call(plant)
    with caplog.at_level("WARNING"):
        out, _ = _ask(fp8, "d0")
    assert out.stats.doc_tiers == {"d0": "computed"}
    assert fp8.stats()["tiers"]["disk"]["num_corrupt"] == 1
    assert "does not fit this pool (kv_cache_dtype 'fp8'" in caplog.text and "float8_e4m3fn/per_token_head" in caplog.text
