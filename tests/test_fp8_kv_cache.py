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
    values, scales = quantize_rows(x, dtype)
    assert values.dtype == dtype and scales.dtype == torch.float32 and scales.shape == (6, 3)
    assert scales[2, 1] == 1 and not values[2, 1].float().any()
    peak = values.float().abs().amax(dim=-1)
    assert torch.equal(peak[scales != 1], torch.full_like(peak[scales != 1], fp8_max(dtype)))
    torch.testing.assert_close(dequantize_rows(values, scales), rounded(dtype)(x), rtol=0, atol=0)
    relative = (dequantize_rows(values, scales) - x).abs().amax(dim=-1) / x.abs().amax(dim=-1).clamp_min(1e-30)
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
