"""The shared case of the reuse-remedy tests (chunk-head and selective recompute, issue 20):
three documents, a question, and the checks both remedies must pass (the cached chunks' bytes
never change, nothing private is left held, preempted requests answer as alone)."""

from __future__ import annotations

import asyncio

import torch

from lazyattn_rag import AsyncLazyAttention, SamplingParams
from tests.tiny import words

DOCS = {"a": words(23, start=3), "b": words(37, start=40), "c": words(9, start=90)}
QUESTION = words(5, start=150)
FIRST = SamplingParams(max_tokens=1, logprobs=-1)


def remedy_engine(make_llm, backend: str = "torch", **config):
    """``(hf, llm)``: a tiny engine (no anchor) configured by ``config``, the documents registered."""
    hf, llm = make_llm(seed=2, anchor="none", attention_backend=backend, **config)
    llm.add_documents(list(DOCS.items()))
    return hf, llm


def first_logprobs(llm, ids=("a", "b", "c"), **request) -> torch.Tensor:
    """``[vocab_size]`` log-probabilities of the first answer token over documents ``ids``."""
    out = llm.generate(QUESTION, list(ids), sampling=FIRST, **request)
    return torch.tensor(list(out.logprobs[0].values()))


def assert_nothing_held(llm) -> None:
    stats = llm.stats()
    assert stats["num_blocks_free"] + stats["num_blocks_cached"] == stats["num_blocks_total"]


def cached_chunk_bytes(llm) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for doc_id in DOCS:
        key = llm.engine.planner.documents.get(doc_id, "").key
        entry = llm.engine.cache.lookup(key, touch=False)
        if entry is not None:
            out[doc_id] = llm.loop.call(llm.engine.runner.read_blocks, entry.block_ids, entry.num_tokens)
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
