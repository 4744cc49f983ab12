"""The shared case of the reuse-remedy tests (chunk-head and selective recompute, issue 20):
three documents, a question, and the checks both recompute remedies must pass (the cached chunks'
bytes never change, nothing private is left held, preempted requests answer as alone); and chunk
attention scaling's engine and its transformers reference."""

from __future__ import annotations

import asyncio
import math

import torch

from benchmarks.qa_recompute import cache_argument
from lazyattn_rag import AsyncLazyAttention, RequestRemedies, SamplingParams
from tests.oracle import _cache_of, _encode_alone, _shift_keys
from tests.tiny import words

DOCS = {"a": words(23, start=3), "b": words(37, start=40), "c": words(9, start=90)}
QUESTION = words(5, start=150)
FIRST = SamplingParams(max_tokens=1, logprobs=-1)


GPU = torch.cuda.is_available()


def on_device(backend: str) -> dict:
    """Where a test engine of ``backend`` runs: the triton backend on the GPU where there is one
    (the compiled kernels, over a ``head_dim`` 32 model: their smallest rotary half is 16), else
    on the CPU (the kernels under the interpreter, as CI runs them)."""
    if backend != "triton" or not GPU:
        return {}
    return dict(device="cuda", model_config=dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=32))


def remedy_engine(make_llm, backend: str = "torch", **config):
    """``(hf, llm)``: a tiny engine (no anchor) configured by ``config``, the documents registered."""
    hf, llm = make_llm(seed=2, anchor="none", attention_backend=backend, **config)
    llm.add_documents(list(DOCS.items()))
    return hf, llm


def first_logprobs(llm, ids=("a", "b", "c"), **request) -> torch.Tensor:
    """``[vocab_size]`` log-probabilities of the first answer token over documents ``ids``."""
    return logprobs_of(llm.generate(QUESTION, list(ids), sampling=FIRST, **request))


def logprobs_of(completion) -> torch.Tensor:
    """``[vocab_size]``: a completion's first-token log-probabilities (``FIRST`` sampling)."""
    return torch.tensor(list(completion.logprobs[0].values()))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two engines' first-token distributions (other batches, hits and misses): equal to float32 rounding."""
    return (a - b).abs().max().item() <= 1e-5


def assert_remedy_per_request(plain, remedied, on: RequestRemedies, off: RequestRemedies) -> None:
    """``on`` asked of ``plain`` for one request answers as ``remedied`` (configured with the
    remedy) does, and ``plain``'s next request is plain again; ``off`` asked of ``remedied``
    (through the async front door) answers as ``plain`` does."""
    first_logprobs(plain)
    first_logprobs(remedied)
    asked = plain.generate(QUESTION, ["a", "b", "c"], sampling=FIRST, remedies=on)
    assert close(logprobs_of(asked), first_logprobs(remedied))
    assert not close(first_logprobs(plain), first_logprobs(remedied))
    turned_off = AsyncLazyAttention(remedied).generate(QUESTION, ["a", "b", "c"], sampling=FIRST, remedies=off)
    assert close(logprobs_of(asyncio.run(turned_off)), first_logprobs(plain))


def assert_full_attention(hf, llm) -> None:
    """A remedy that recomputes everything: the first token's distribution is transformers' on
    the same prompt tokens computed whole (after one request has cached the documents)."""
    first_logprobs(llm)
    ours = first_logprobs(llm)
    with torch.no_grad():
        full = hf(input_ids=torch.tensor([llm.plan(QUESTION, ["a", "b", "c"]).token_ids()])).logits[0, -1]
    assert (ours - torch.log_softmax(full.float(), dim=-1)).abs().max().item() <= 1e-3


def assert_plain_reuse(make_llm, remedy_off) -> None:
    """A remedy at its zero setting gives plain reuse's first-token distribution, bit for bit."""
    _, plain = make_llm(seed=2, anchor="none")
    plain.add_documents(list(DOCS.items()))
    assert torch.equal(first_logprobs(plain), first_logprobs(remedy_off))


def assert_nothing_held(llm) -> None:
    stats = llm.stats()
    assert stats["num_blocks_free"] + stats["num_blocks_cached"] == stats["num_blocks_total"]


def cached_chunk_bytes(llm) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for doc_id in DOCS:
        key = llm.engine.planner.documents.get(doc_id, "").key
        entry = llm.engine.cache.lookup(key, touch=False)
        if entry is not None:
            out[doc_id] = llm.loop.call(llm.engine.runner.kv_pool.read, entry.block_ids, entry.num_tokens)
    return out


def assert_chunks_unchanged_and_nothing_held(llm) -> None:
    """The documents at other offsets (the remedy recomputing other tokens there) and a request
    aborted mid-answer leave the cached chunks' bytes as they were and no private block held."""
    first_logprobs(llm)
    before = cached_chunk_bytes(llm)
    assert set(before) == set(DOCS)
    for ids in [("a", "b", "c"), ("c", "a"), ("b",), ("b", "c", "a")]:
        llm.generate(QUESTION, list(ids), sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    stream = llm.stream(QUESTION, ["a", "c"], sampling=SamplingParams(max_tokens=50, ignore_eos=True))
    next(iter(stream))
    stream.close()  # aborted mid-answer
    after = cached_chunk_bytes(llm)
    assert all(torch.equal(before[d][0], after[d][0]) and torch.equal(before[d][1], after[d][1]) for d in DOCS)
    assert_nothing_held(llm)


def assert_preempted_requests_answer_as_alone(roomy, tight) -> None:
    """Four requests at once on ``tight`` (blocks taken back mid-answer) give ``roomy``'s tokens."""
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    requests = [("a", "b", "c"), ("b", "a"), ("c", "b", "a"), ("a",)]
    expected = [roomy.generate(QUESTION, list(ids), sampling=params).token_ids for ids in requests]

    async def run_all():
        allm = AsyncLazyAttention(tight)
        return await asyncio.gather(*(allm.generate(QUESTION, list(ids), sampling=params) for ids in requests))

    assert [r.token_ids for r in asyncio.run(run_all())] == expected
    assert tight.stats()["num_preemptions"] > 0
    assert_nothing_held(tight)


def ape_engine(make_llm, backend="torch", temperature=0.7, weight=1.5, on=True, scope="chunk"):
    """The shared remedy engine with chunk attention scaling (APE) over ``scope``
    (``CacheConfig.chunk_attention_scope``), where :func:`on_device` puts ``backend``."""
    return remedy_engine(make_llm, backend, chunk_attention_scaling=on, chunk_attention_temperature=temperature,
                         chunk_attention_weight=weight, chunk_attention_scope=scope, **on_device(backend))


def scaled_reference_logprobs(hf, llm, temperature: float, weight: float, ids=("a", "b", "c"),
                              num_scaled_tokens: int | None = None) -> torch.Tensor:
    """transformers: the head and each document encoded alone, composed at their offsets, the
    keys of each document's first ``num_scaled_tokens`` tokens (``None``: all) divided by
    ``temperature``; the tail attends with ``ln(weight)`` added to those keys' columns of its 4D
    mask."""
    plan = llm.plan(QUESTION, list(ids))
    per_layer, columns = [], []
    for c in plan.chunks:
        kv = _encode_alone(hf, [], list(c.token_ids))
        n = (len(c.token_ids) if num_scaled_tokens is None else min(num_scaled_tokens, len(c.token_ids))) \
            if c.doc_id is not None else 0
        divisor = torch.tensor([temperature] * n + [1.0] * (len(c.token_ids) - n))[:, None]  # [tokens, 1]
        kv = [(_shift_keys(hf, k, c.global_start) / divisor, v) for k, v in kv]
        per_layer = kv if not per_layer else [(torch.cat((a, k), 2), torch.cat((b, v), 2))
                                              for (a, b), (k, v) in zip(per_layer, kv)]
        columns += [math.log(weight)] * n + [0.0] * (len(c.token_ids) - n)
    tail, past = list(plan.query_token_ids), len(columns)
    mask = torch.full((len(tail), past + len(tail)), -math.inf)
    mask[:, :past] = torch.tensor(columns)
    mask[:, past:] = torch.triu(torch.full((len(tail), len(tail)), -math.inf), diagonal=1)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([tail]), position_ids=torch.arange(past, past + len(tail))[None],
                    attention_mask=mask[None, None], use_cache=True, **{cache_argument(type(hf)): _cache_of(per_layer)}).logits
    return torch.log_softmax(logits[0, -1].float(), dim=-1)
