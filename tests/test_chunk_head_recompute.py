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
from tests.recompute_case import (DOCS, FIRST, QUESTION, assert_remedy_per_request, first_logprobs, logprobs_of,
                                  on_device, remedy_engine)


def engine(make_llm, k: int, backend: str = "torch", **config):
    """The remedy engine with chunk-head recompute ``k``; the triton backend compiled on a GPU
    where there is one (:func:`~tests.recompute_case.on_device`)."""
    return remedy_engine(make_llm, backend, recompute_chunk_head_tokens=k, **on_device(backend), **config)


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


@pytest.mark.parametrize("k, backend", [(4, "torch"), (20, "triton")])
def test_a_head_copied_from_a_chunk_the_same_pass_encodes(make_llm, k, backend):
    """Misses: the documents' chunks are encoded in the pass that also computes the request's
    heads, whose cached slots behind the head are copied in each layer after the chunk's write
    (``AttentionBackend.copy_step_slots``); the answer equals the composed reference."""
    hf, llm = engine(make_llm, k, backend)
    steps = []  # (chunk pieces encoded, compute jobs) per step
    remove = llm.add_step_listener(lambda step: steps.append((len(step.output.chunk_prefills),
                                                              len(step.output.computes))))
    ours = first_logprobs(llm)
    remove()
    assert steps[0][0] > 0 and steps[0][1] == 1  # one pass: every chunk encoded and the request computed
    assert (ours - reference_logprobs(hf, llm, k)).abs().max().item() <= 1e-4


def test_the_first_documents_head_can_stay_cached(make_llm):
    """``recompute_first_chunk_head=False``: the heads of the documents after the first are
    recomputed, the first is read as cached. Reference: the composed prompt with exactly those
    tokens recomputed (``RecomputeReference.selected_first_token_logits``, itself checked to give
    the plain head-recompute reference when every document's head is selected)."""
    hf, llm = engine(make_llm, 4, recompute_first_chunk_head=False)
    first_logprobs(llm)  # the chunks encoded
    out = llm.generate(QUESTION, ["a", "b", "c"], sampling=FIRST)
    plan = llm.plan(QUESTION, ["a", "b", "c"])
    head = [list(c.token_ids) for c in plan.chunks if c.doc_id is None]
    docs = [list(c.token_ids) for c in plan.chunks if c.doc_id is not None]
    ref = RecomputeReference.from_model(hf, eos_ids=set())
    heads = [set(range(min(4, len(d)))) for d in docs]
    args = (head[0] if head else [], docs, list(plan.query_token_ids))
    assert torch.allclose(ref.selected_first_token_logits(*args, heads), ref.first_token_logits(*args, 4), atol=1e-5)
    expected = torch.log_softmax(ref.selected_first_token_logits(*args, [set()] + heads[1:]).float(), dim=-1)
    assert (logprobs_of(out) - expected).abs().max().item() <= 1e-4
    assert out.stats.num_recomputed_tokens == sum(len(h) for h in heads[1:]) > 0
    assert (logprobs_of(out) - reference_logprobs(hf, llm, 4)).abs().max().item() > 1e-3  # not every head


def test_config_is_checked():
    with pytest.raises(ValueError, match="recompute_chunk_head_tokens"):
        CacheConfig(recompute_chunk_head_tokens=-1)
    with pytest.raises(ValueError, match="mode must be 'lazy'"):
        CacheConfig(recompute_chunk_head_tokens=4, mode="block_attention")
    with pytest.raises(ValueError, match="recompute_first_chunk_head must be True or False"):
        CacheConfig(recompute_first_chunk_head=0)


def test_per_request_setting_overrides_the_engines(make_llm):
    """``recompute_chunk_head_tokens=`` on a call: that request only, the engine's setting otherwise."""
    _, plain = engine(make_llm, 0)
    _, k16 = engine(make_llm, 16)
    assert_remedy_per_request(plain, k16, RequestRemedies(recompute_chunk_head_tokens=16),
                              RequestRemedies(recompute_chunk_head_tokens=0))
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
