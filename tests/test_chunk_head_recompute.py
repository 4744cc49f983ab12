"""Chunk-head recompute (EPIC; ``CacheConfig.recompute_chunk_head_tokens``, issue 20): the first
``k`` tokens of each placed document are computed by the request.

Checked against independent references: transformers composing the same prompt by hand
(``benchmarks/qa_recompute.py``'s ``RecomputeReference``) for k inside a block, at a block
boundary and past one; a full prefill in transformers for k covering whole documents; plain
reuse, bit for bit, for k = 0. The cached chunks' bytes never change and the request's own
blocks are freed (finished, aborted, preempted)."""

import pytest
import torch
from lazyattn_rag.types.config import RequestRemedies

from benchmarks.qa_recompute import RecomputeReference
from lazyattn_rag.types.config import CacheConfig
from tests.recompute_case import (DOCS, FIRST, QUESTION, assert_chunks_unchanged_and_nothing_held,
                                  assert_preempted_requests_answer_as_alone, first_logprobs, remedy_engine)


def engine(make_llm, k: int, backend: str = "torch", **config):
    return remedy_engine(make_llm, backend, recompute_chunk_head_tokens=k, **config)


def reference_logprobs(hf, llm, k: int, ids=("a", "b", "c")) -> torch.Tensor:
    plan = llm.plan(QUESTION, list(ids))
    head = [c for c in plan.chunks if c.doc_id is None]
    docs = [list(c.token_ids) for c in plan.chunks if c.doc_id is not None]
    ref = RecomputeReference.from_model(hf, eos_ids=set())
    logits = ref.first_token_logits(list(head[0].token_ids) if head else [], docs, list(plan.query_token_ids), k)
    return torch.log_softmax(logits.float(), dim=-1)


# k = 4: inside a block; 16: a block boundary; 20: past one (the copy behind the head). The Triton
# kernels (under the interpreter, slow) run the case that exercises every path.
@pytest.mark.parametrize("k, backend", [(4, "torch"), (16, "torch"), (20, "torch"), (20, "triton")])
def test_recomputed_heads_equal_the_composed_reference(make_llm, k, backend):
    hf, llm = engine(make_llm, k, backend)
    first_logprobs(llm)  # the documents' chunks encoded (misses), then served as hits
    ours = first_logprobs(llm)
    stats = llm.generate(QUESTION, ["a", "b", "c"], sampling=FIRST).stats
    assert stats.docs_hit == ["a", "b", "c"]
    assert stats.num_computed_tokens == sum(min(k, len(d.split())) for d in DOCS.values()) + \
        len(llm.plan(QUESTION, ["a"]).query_token_ids)
    assert (ours - reference_logprobs(hf, llm, k)).abs().max().item() <= 1e-4
    assert (ours - reference_logprobs(hf, llm, 0)).abs().max().item() > 1e-3  # the heads made a difference


def test_recomputing_whole_documents_is_full_attention(make_llm):
    hf, llm = engine(make_llm, 64)
    first_logprobs(llm)
    ours = first_logprobs(llm)
    with torch.no_grad():
        full = hf(input_ids=torch.tensor([llm.plan(QUESTION, ["a", "b", "c"]).token_ids()])).logits[0, -1]
    assert (ours - torch.log_softmax(full.float(), dim=-1)).abs().max().item() <= 1e-3


def test_k0_is_plain_reuse_bit_for_bit(make_llm):
    _, plain = make_llm(seed=2, anchor="none")
    plain.add_documents(list(DOCS.items()))
    _, zero = engine(make_llm, 0)
    assert torch.equal(first_logprobs(plain), first_logprobs(zero))


def test_cached_chunks_unchanged_and_private_blocks_freed(make_llm):
    _, llm = engine(make_llm, 20, num_blocks=40, max_num_seqs=4)
    assert_chunks_unchanged_and_nothing_held(llm)


def test_preempted_requests_recompute_their_heads(make_llm):
    """Requests whose private blocks are taken back mid-answer give the same tokens as alone."""
    _, roomy = engine(make_llm, 20)
    _, tight = engine(make_llm, 20, num_blocks=24, max_num_seqs=4)
    assert_preempted_requests_answer_as_alone(roomy, tight)


def test_config_is_checked():
    with pytest.raises(ValueError, match="recompute_chunk_head_tokens"):
        CacheConfig(recompute_chunk_head_tokens=-1)
    with pytest.raises(ValueError, match="mode must be 'lazy'"):
        CacheConfig(recompute_chunk_head_tokens=4, mode="block_attention")


def test_per_request_setting_overrides_the_engines(make_llm):
    """``recompute_chunk_head_tokens=`` on a call: that request only, the engine's setting otherwise."""
    import asyncio

    from lazyattn_rag import AsyncLazyAttention

    hf, plain = engine(make_llm, 0)
    _, k16 = engine(make_llm, 16)
    first_logprobs(plain)
    def close(a, b):  # two engines (other batches, hits and misses): equal to float32 rounding
        return (a - b).abs().max().item() <= 1e-5

    first_logprobs(k16)
    asked = plain.generate(QUESTION, ["a", "b", "c"], sampling=FIRST, remedies=RequestRemedies(recompute_chunk_head_tokens=16))
    assert close(torch.tensor(list(asked.logprobs[0].values())), first_logprobs(k16))
    assert not close(first_logprobs(plain), first_logprobs(k16))  # the next request is plain again
    off = asyncio.run(AsyncLazyAttention(k16).generate(QUESTION, ["a", "b", "c"], sampling=FIRST,
                                                        remedies=RequestRemedies(recompute_chunk_head_tokens=0)))
    assert close(torch.tensor(list(off.logprobs[0].values())), first_logprobs(plain))
    with pytest.raises(ValueError, match="recompute_chunk_head_tokens"):
        plain.generate(QUESTION, ["a"], remedies=RequestRemedies(recompute_chunk_head_tokens=-1))
    _, copies = make_llm(mode="block_attention")
    copies.add_documents(list(DOCS.items()))
    with pytest.raises(ValueError, match="mode 'lazy'"):
        copies.generate(QUESTION, ["a"], remedies=RequestRemedies(recompute_chunk_head_tokens=4))
    messages = [("user", ["Context:", {"type": "document", "id": "a"}, QUESTION])]
    chat = plain.chat(messages, sampling=FIRST, remedies=RequestRemedies(recompute_chunk_head_tokens=64))
    assert chat.stats.num_computed_tokens == len(plain.plan_chat(messages).token_ids()) - \
        chat.stats.num_exact_prefix_tokens
