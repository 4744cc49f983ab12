"""Selective recompute (CacheBlend; ``CacheConfig.recompute_selective_ratio``, issue 20): the
tokens of each placed document whose second-layer K/V deviate most from the cached ones are
recomputed at every layer.

Checked against independent references built in transformers: the selection against the
deviation of transformers' own second-layer K/V (a full forward of the prompt against each
document encoded alone), the recomputed prompt against transformers composing it token run by
token run (``RecomputeReference.selected_first_token_logits``); r = 1 against a full prefill;
r = 0 against plain reuse, bit for bit. The cached chunks' bytes never change and the request's
own blocks are freed (finished, aborted, preempted)."""

import math
from lazyattn_rag.types.config import RequestRemedies

import pytest
import torch

from benchmarks.qa_recompute import RecomputeReference, cache_argument
from lazyattn_rag import SamplingParams
from lazyattn_rag.types.config import CacheConfig
from tests.observe import StepLog, fail_first_call
from tests.recompute_case import (DOCS, FIRST, QUESTION, assert_nothing_held, assert_remedy_per_request, close,
                                  first_logprobs, logprobs_of,
                                  remedy_engine)
from tests.tiny import words


def engine(make_llm, ratio: float, backend: str = "torch", **config):
    return remedy_engine(make_llm, backend, recompute_selective_ratio=ratio, **config)


def prompt_parts(llm, ids=("a", "b", "c")):
    plan = llm.plan(QUESTION, list(ids))
    head = [list(c.token_ids) for c in plan.chunks if c.doc_id is None]
    docs = [c for c in plan.chunks if c.doc_id is not None]
    return plan, (head[0] if head else []), docs


@torch.no_grad()
def reference_selection(hf, llm, ratio: float) -> list[set[int]]:
    """Per document, the ceil(r * n) tokens whose second-layer K/V in transformers' full forward
    of the prompt differ most (squared L2 of K and V) from those of the document encoded alone,
    its K rotated to its place."""
    from transformers import DynamicCache

    plan, _, docs = prompt_parts(llm)
    ref = RecomputeReference.from_model(hf, eos_ids=set())
    cache = DynamicCache()
    hf(input_ids=torch.tensor([plan.token_ids()]), **{cache_argument(type(hf)): cache}, use_cache=True)
    full_k, full_v = cache.layers[1].keys[0], cache.layers[1].values[0]  # [kv_heads, n, head_dim]
    alone_k, alone_v = ref._encode_alone([list(c.token_ids) for c in docs])[1]
    selected = []
    for i, c in enumerate(docs):
        n, g = len(c.token_ids), c.global_start
        k = ref._shift_keys(alone_k[i : i + 1, :, :n], g)[0]
        deviation = ((full_k[:, g : g + n] - k) ** 2).sum(dim=(0, 2)) + \
            ((full_v[:, g : g + n] - alone_v[i, :, :n]) ** 2).sum(dim=(0, 2))
        count = min(n, math.ceil(round(ratio * n, 9)))
        selected.append(set(torch.argsort(deviation, descending=True)[:count].tolist()))
    return selected


def composed_logprobs(hf, llm, selected: list[set[int]]) -> torch.Tensor:
    plan, head, docs = prompt_parts(llm)
    ref = RecomputeReference.from_model(hf, eos_ids=set())
    logits = ref.selected_first_token_logits(head, [list(c.token_ids) for c in docs], list(plan.query_token_ids),
                                             selected)
    return torch.log_softmax(logits.float(), dim=-1)


# r = 0.05: one token per document; 0.15: a few, in several blocks. The Triton kernels (under
# the interpreter, slow) run one case.
@pytest.mark.parametrize("ratio, backend", [(0.05, "torch"), (0.15, "torch"), (0.15, "triton")])
def test_selected_tokens_equal_the_composed_reference(make_llm, ratio, backend):
    hf, llm = engine(make_llm, ratio, backend)
    first_logprobs(llm)  # the documents' chunks encoded (misses), then served as hits
    ours = first_logprobs(llm)
    selected = reference_selection(hf, llm, ratio)
    stats = llm.generate(QUESTION, ["a", "b", "c"], sampling=FIRST).stats
    assert stats.docs_hit == ["a", "b", "c"]
    assert stats.num_computed_tokens == sum(len(s) for s in selected) + len(llm.plan(QUESTION, ["a"]).query_token_ids)
    assert (ours - composed_logprobs(hf, llm, selected)).abs().max().item() <= 1e-4
    # the selection matters: another of the same size (each document's first tokens) gives other logits
    firsts = [set(range(len(s))) for s in selected]
    assert firsts != selected
    assert (ours - composed_logprobs(hf, llm, firsts)).abs().max().item() > 1e-4


def test_config_is_checked():
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="recompute_selective_ratio"):
            CacheConfig(recompute_selective_ratio=bad)
    with pytest.raises(ValueError, match="mode must be 'lazy'"):
        CacheConfig(recompute_selective_ratio=0.1, mode="block_attention")
    with pytest.raises(ValueError, match="cannot both be set"):
        CacheConfig(recompute_selective_ratio=0.1, recompute_chunk_head_tokens=4)


def test_per_request_setting_overrides_the_engines(make_llm):
    """``recompute_selective_ratio=`` on a call: that request only (asking for it turns the
    engine's chunk-head recompute off for it); the engine's setting otherwise."""
    _, plain = engine(make_llm, 0.0)
    _, sel = engine(make_llm, 0.15)
    assert_remedy_per_request(plain, sel, RequestRemedies(recompute_selective_ratio=0.15),
                              RequestRemedies(recompute_selective_ratio=0.0))
    hf, heads = make_llm(seed=2, anchor="none", recompute_chunk_head_tokens=4)
    heads.add_documents(list(DOCS.items()))
    swapped = heads.generate(QUESTION, ["a", "b", "c"], sampling=FIRST, remedies=RequestRemedies(recompute_selective_ratio=0.15))
    assert close(logprobs_of(swapped), first_logprobs(sel))
    with pytest.raises(ValueError, match="recompute_selective_ratio"):
        plain.generate(QUESTION, ["a"], remedies=RequestRemedies(recompute_selective_ratio=2.0))
    with pytest.raises(ValueError, match="cannot both be set"):
        plain.generate(QUESTION, ["a"], remedies=RequestRemedies(recompute_selective_ratio=0.1, recompute_chunk_head_tokens=4))
    messages = [("user", ["Context:", {"type": "document", "id": "a"}, QUESTION])]
    chat = plain.chat(messages, sampling=FIRST, remedies=RequestRemedies(recompute_selective_ratio=1.0))
    assert chat.stats.num_computed_tokens == len(plain.plan_chat(messages).token_ids()) - \
        chat.stats.num_exact_prefix_tokens


@pytest.mark.parametrize("method", ["select_tokens", "copy_slots"])
def test_a_failed_selection_or_copy_fails_its_request_alone(make_llm, monkeypatch, method):
    """The measurement (or the block copies) of one request raises: that request fails (it used
    to stay waiting, its measurement retried and failing every step), nothing is left held, and
    the same request then succeeds."""
    _, llm = engine(make_llm, 0.15)
    first_logprobs(llm)
    expected = first_logprobs(llm)
    calls = fail_first_call(monkeypatch, llm.engine.runner, method, "device fault")
    with pytest.raises(RuntimeError, match="device fault"):
        first_logprobs(llm)
    assert_nothing_held(llm)
    assert torch.equal(first_logprobs(llm), expected)
    assert len(calls) == 2  # the failed call, then the request that succeeded


def test_requests_waiting_for_copy_room_do_not_block_each_other(make_llm):
    """Two requests that each fit alone, but not together with their block copies: the copies
    are reserved at admission, so the second waits unadmitted instead of both holding their
    chunks and waiting for each other forever (found by an adversarial review)."""
    import asyncio

    from lazyattn_rag import AsyncLazyAttention

    _, llm = engine(make_llm, 1.0, num_blocks=12, max_num_seqs=4)
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def both():
        allm = AsyncLazyAttention(llm)
        return await asyncio.wait_for(asyncio.gather(allm.generate(QUESTION, ["a", "b"], sampling=params),
                                                     allm.generate(QUESTION, ["b", "a"], sampling=params)), 60)

    results = asyncio.run(both())
    assert all(len(r.token_ids) == 2 for r in results)
    assert_nothing_held(llm)


def test_a_split_prefill_with_text_between_documents_is_exact(make_llm):
    """A chat whose text segment sits between documents, its first step sharing the budget with a
    running decode: its selected tokens attend to that text, so the text runs in the same step
    (it ran in a later one, and r = 1 drifted from full attention by 1.5e-2); no step goes over
    the budget unless it runs alone."""
    hf, llm = engine(make_llm, 1.0, max_num_batched_tokens=16)
    messages = [("user", ["Context:", {"type": "document", "id": "a"}, words(30, start=100),
                          {"type": "document", "id": "b"}, QUESTION])]
    llm.chat(messages, sampling=FIRST)
    with torch.no_grad():
        full = torch.log_softmax(hf(input_ids=torch.tensor([llm.plan_chat(messages).token_ids()])).logits[0, -1], -1)
    log = StepLog(llm)
    decode = llm.stream(QUESTION, ["c"], sampling=SamplingParams(max_tokens=400, ignore_eos=True),
                        remedies=RequestRemedies(recompute_selective_ratio=0.0))
    next(iter(decode))
    ours = torch.tensor(list(llm.chat(messages, sampling=FIRST).logprobs[0].values()))
    decode.close()
    assert (ours - full).abs().max().item() <= 1e-3
    steps = [(len(out.computes) + len(out.chunk_prefills), out.num_batched_tokens) for out in log.outputs]
    assert all(tokens <= 16 or items == 1 for items, tokens in steps)
    assert any(tokens > 16 for _, tokens in steps)  # the chat's first step ran, alone, over the budget
