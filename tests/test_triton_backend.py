"""The triton attention backend against the torch reference backend on the same batches.

Batches come from the one metadata builder (``build_attention_metadata``): decode rows, prefill
rows and mixes of both, chunks at offsets (near 2**24 too), partial blocks, GQA ratios. Both
backends write K/V into their own copy of the cache; the caches and the outputs must agree.
"""

import pytest
import torch
from kernel_tolerances import assert_close
from paged_case import KINDS, make_batch, make_rotary

from lazyattn_rag.engine.worker.attention import build_attention_metadata, get_backend_class
from lazyattn_rag.engine.worker.attention.torch_backend import TorchAttentionBackend
from lazyattn_rag.engine.worker.attention.triton_backend import TritonAttentionBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,dtype", [
    (8, 2, 64, torch.float32), (9, 3, 64, torch.bfloat16), (8, 1, 128, torch.float16),
])
def test_triton_backend_matches_torch_backend(kind, num_heads, num_kv_heads, head_dim, dtype):
    block_size = 16
    seqs, k_cache, v_cache, g = make_batch(KINDS[kind], block_size, num_kv_heads, head_dim, dtype, seed=len(kind))
    rotary = make_rotary(head_dim)
    n = sum(s.query_len for s in seqs)
    query = torch.randn(n, num_heads, head_dim, generator=g).to(dtype=dtype, device=DEVICE)
    key = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype=dtype, device=DEVICE)
    value = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype=dtype, device=DEVICE)
    args = (rotary, num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    torch_be, triton_be = TorchAttentionBackend(*args), get_backend_class("triton")(*args)
    assert isinstance(triton_be, TritonAttentionBackend)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    md_ref = build_attention_metadata(seqs, block_size, DEVICE)
    md = build_attention_metadata(seqs, block_size, DEVICE)
    assert md.any_delta == (kind != "prefill_no_delta")
    expected = torch_be.forward(query, key, value, k_ref, v_ref, md_ref)
    for _ in range(2):  # the second call reuses the plan cached in metadata.backend_state
        out = triton_be.forward(query, key, value, k_cache, v_cache, md)
        assert out.shape == query.shape and out.dtype == dtype
        assert_close(out, expected, dtype, kind)
    torch.testing.assert_close(k_cache, k_ref, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, equal_nan=True)


def test_any_delta_reaches_the_prefill_launch():
    """``metadata.any_delta`` is what decides the prefill's rotation: a batch with moved chunks
    whose flag is forced off comes out unrotated (wrong), which proves the flag is not ignored."""
    seqs, k_cache, v_cache, g = make_batch(KINDS["prefill"], 16, 2, 64, torch.float32, seed=3)
    n = sum(s.query_len for s in seqs)
    query, key = torch.randn(n, 4, 64, generator=g).to(DEVICE), torch.randn(n, 2, 64, generator=g).to(DEVICE)
    backend = TritonAttentionBackend(make_rotary(64), 4, 2, 64, 0.125)
    md = build_attention_metadata(seqs, 16, DEVICE)
    right = backend.forward(query, key, key, k_cache.clone(), v_cache.clone(), md)
    md_off = build_attention_metadata(seqs, 16, DEVICE)
    md_off.any_delta = False
    unrotated = backend.forward(query, key, key, k_cache.clone(), v_cache.clone(), md_off)
    first = seqs[0].query_len  # the first sequence reads chunks at deltas 3 and 70; the second none
    assert (right[:first] - unrotated[:first]).abs().max() > 1e-2
    torch.testing.assert_close(right[first:], unrotated[first:], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["mixed", "prefill_negative_delta", "prefill_cancelling_deltas", "prefill_no_delta"])
def test_queries_rotated_beforehand_give_the_same_output_bit_for_bit(kind):
    """``prerotate_queries`` (issue 43): the prefill reads each chunk's queries rotated by a small
    kernel first; the result equals the in-kernel rotation's exactly, decode rows in the batch too."""
    seqs, k_cache, v_cache, g = make_batch(KINDS[kind], 16, 2, 64, torch.bfloat16, seed=4)
    n = sum(s.query_len for s in seqs)
    query = torch.randn(n, 4, 64, generator=g).to(DEVICE, torch.bfloat16)
    key = torch.randn(n, 2, 64, generator=g).to(DEVICE, torch.bfloat16)
    backend = TritonAttentionBackend(make_rotary(64), 4, 2, 64, 0.125)
    default = backend.forward(query, key, key, k_cache.clone(), v_cache.clone(), build_attention_metadata(seqs, 16, DEVICE))
    backend.prerotate_queries = True
    md = build_attention_metadata(seqs, 16, DEVICE)
    for _ in range(2):  # the second layer reuses the step's layout
        assert torch.equal(backend.forward(query, key, key, k_cache.clone(), v_cache.clone(), md), default)
    planned = md.backend_state["triton"].query_rotations
    assert (planned is not None) == md.any_delta and (kind != "prefill_no_delta") == md.any_delta
    if planned is not None:  # rows for the prefill's sequences only (decode rows rotate in their own kernel)
        assert [n > 0 for n in planned.num_deltas.tolist()] == [len(c) > 0 and q > 1 for c, _, q in KINDS[kind]]


def test_torch_backend_refuses_a_rotation_it_has_no_form_for():
    """The torch backend forces ``rotation`` "query" or "key" (None: its own choice); "none" has no form there."""
    seqs, k_cache, v_cache, g = make_batch(KINDS["decode"], 16, 2, 64, torch.float32, seed=1)
    n = sum(s.query_len for s in seqs)
    backend = TorchAttentionBackend(make_rotary(64), 4, 2, 64, 0.125)
    backend.rotation = "none"
    query, key = torch.randn(n, 4, 64).to(DEVICE), torch.randn(n, 2, 64).to(DEVICE)
    with pytest.raises(ValueError, match="rotation must be 'query', 'key' or None"):
        backend.forward(query, key, key, k_cache, v_cache, build_attention_metadata(seqs, 16, DEVICE))


@pytest.mark.parametrize("rotation", ["query", "key"])
@pytest.mark.parametrize("kind", ["prefill", "prefill_no_delta"])
def test_torch_backend_scores_long_prompts_in_tiles_of_rows_with_the_same_result(kind, rotation, monkeypatch):
    """The reference backend scores a long query ``QUERY_TILE_ROWS`` rows at a time (its memory
    bounded: an 8k prompt on the CPU needed 2.4 GB of scores at once); the rows' results are
    those of the whole query at once, the causal mask placed at each tile's own positions."""
    from lazyattn_rag.engine.worker.attention import torch_backend

    seqs, k_cache, v_cache, g = make_batch(KINDS[kind], 16, 2, 64, torch.float32, seed=5)
    n = sum(s.query_len for s in seqs)
    query, key = torch.randn(n, 4, 64, generator=g).to(DEVICE), torch.randn(n, 2, 64, generator=g).to(DEVICE)
    backend = TorchAttentionBackend(make_rotary(64), 4, 2, 64, 0.125)
    backend.rotation = rotation
    whole = backend.forward(query, key, key, k_cache.clone(), v_cache.clone(), build_attention_metadata(seqs, 16, DEVICE))
    monkeypatch.setattr(torch_backend, "QUERY_TILE_ROWS", 3)
    assert max(s.query_len for s in seqs) > 3
    tiled = backend.forward(query, key, key, k_cache.clone(), v_cache.clone(), build_attention_metadata(seqs, 16, DEVICE))
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=1e-6)


def test_unsupported_head_layout_fails_at_construction():
    with pytest.raises(NotImplementedError):
        TritonAttentionBackend(make_rotary(96), 4, 2, 96, 0.1)


def _engine_outputs(backend: str, run, max_num_batched_tokens: int = 2048,
                    kv_cache_dtype: str = "auto") -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and first-token logits of ``run(llm)`` on a tiny random Llama with documents
    of 1, 15, 16, 17 and 37 tokens registered (``d<n>``)."""
    from tests.observe import StepLog
    from tests.tiny import hf_and_ours, hf_config, tiny_llm, words

    _, model = hf_and_ours(hf_config("llama", head_dim=32), seed=3)  # rotary_dim/2 = 16: tl.dot minimum
    llm = tiny_llm(model, device=DEVICE, attention_backend=backend, anchor="head", num_blocks=128,
                   max_num_batched_tokens=max_num_batched_tokens, kv_cache_dtype=kv_cache_dtype)
    try:
        assert llm.engine.runner.backend.name == backend
        for i, n in enumerate([1, 15, 16, 17, 37]):
            llm.add_document(f"d{n}", words(n, start=i * 30))
        steps = StepLog(llm, logits=True)
        out = run(llm)
        return out.token_ids, steps.logits[-len(out.token_ids)][-1]  # the sampled row: its step's last compute job
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_engine_greedy_tokens_match_torch_backend(kv_cache_dtype):
    """The whole engine on a tiny random Llama: chunks at offsets (1, 15, 16, 17, 37 tokens, one
    twice), prefill then decode; the triton backend (the interpreter on the CPU) generates the same
    greedy tokens as the torch backend, with first-token logits within float32 rounding; over an
    FP8 cache too (both write the same FP8 rows and scales)."""
    from lazyattn_rag import SamplingParams

    def run(llm):
        return llm.generate("w5 w6 w7", ["d37", "d1", "d17", "d16", "d15", "d17"],
                            sampling=SamplingParams(max_tokens=6, ignore_eos=True))

    (torch_ids, torch_logits), (triton_ids, triton_logits) = (_engine_outputs(b, run, kv_cache_dtype=kv_cache_dtype)
                                                              for b in ("torch", "triton"))
    assert triton_ids == torch_ids
    assert (triton_logits - torch_logits).abs().max().item() <= 1e-3


def test_engine_chat_with_text_between_documents_matches_torch_backend():
    """Private text segments between chunks (partial blocks mid-table, each prefilled as its own
    sequence of the step): the triton backend agrees with the torch backend."""
    from lazyattn_rag import DocumentRef, SamplingParams
    from tests.tiny import words

    def run(llm):
        content = ("w1 ", DocumentRef("d37"), words(19, 60), DocumentRef("d1"), "w2", DocumentRef("d17"),
                   "Question : w5 w6")
        return llm.chat([("system", "w100 w101"), ("user", content)],
                        sampling=SamplingParams(max_tokens=6, ignore_eos=True))

    (torch_ids, torch_logits), (triton_ids, triton_logits) = (_engine_outputs(b, run) for b in ("torch", "triton"))
    assert triton_ids == torch_ids
    assert (triton_logits - torch_logits).abs().max().item() <= 1e-3


def test_engine_chunked_encoding_matches_torch_backend():
    """A 12-token step budget: documents are encoded in pieces (each attending the anchor, its
    earlier pieces in partly filled blocks, and itself); the triton backend agrees with the torch
    backend and with the same request encoded whole."""
    from lazyattn_rag import SamplingParams

    def run(llm):
        return llm.generate("w5 w6 w7", ["d37", "d17", "d16"], sampling=SamplingParams(max_tokens=6, ignore_eos=True))

    (torch_ids, torch_logits), (triton_ids, triton_logits) = (
        _engine_outputs(b, run, max_num_batched_tokens=12) for b in ("torch", "triton"))
    whole_ids, whole_logits = _engine_outputs("torch", run)
    assert triton_ids == torch_ids == whole_ids
    assert (triton_logits - torch_logits).abs().max().item() <= 1e-3
    assert (torch_logits - whole_logits).abs().max().item() <= 1e-4
