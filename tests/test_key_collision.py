"""A content-key collision never serves another sequence's K/V (issue 14, item 7): every hit
compares the tokens the entry holds with the tokens the request places."""

import dataclasses

import pytest

from lazyattn_rag import SamplingParams
from lazyattn_rag.engine.chunk_cache import ChunkKeyCollisionError
from lazyattn_rag.engine.prompt_plan import PromptPlan
from tests.integrations_kit import tiny_engine
from tests.tiny import words

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)


def _run(llm, plan):
    return list(llm._submit(lambda engine, sink: engine.submit(plan, GREEDY, sink)))


def test_a_forced_document_key_collision_fails_the_request_not_the_cache():
    llm = tiny_engine(num_blocks=64)
    try:
        llm.add_document("a", words(20))
        llm.add_document("b", words(20, 50))
        first = llm.generate(words(3, 120), ["a"], sampling=GREEDY)
        plan_b = llm.plan(words(3, 120), ["b"])
        a_key = llm.plan(words(3, 120), ["a"]).chunks[-1].key
        # b's tokens under a's key: a digest collision
        forged = dataclasses.replace(plan_b, chunks=(*plan_b.chunks[:-1], dataclasses.replace(plan_b.chunks[-1], key=a_key)))
        with pytest.raises(ChunkKeyCollisionError, match="refusing to serve"):
            _run(llm, forged)
        again = llm.generate(words(3, 120), ["a"], sampling=GREEDY)  # a is still cached and right
        assert again.stats.docs_hit == ["a"] and again.token_ids == first.token_ids
        llm.engine.cache.check_integrity()
    finally:
        llm.shutdown()


def test_a_forced_prefix_block_collision_is_refused():
    llm = tiny_engine(num_blocks=64, mode="prefix")
    try:
        llm.add_document("a", words(40))
        llm.generate(words(3, 120), ["a"], sampling=GREEDY)
        plan = llm.plan(words(3, 120), ["a"])
        other = list(plan.query_token_ids)
        other[5] = other[5] + 1 if other[5] + 1 < 150 else 4  # another token in the first block
        forged = PromptPlan((), tuple(other), plan.prefix_block_keys)
        with pytest.raises(ChunkKeyCollisionError):
            _run(llm, forged)
        llm.engine.cache.check_integrity()
    finally:
        llm.shutdown()


def test_a_collision_on_the_copy_path_is_refused():
    """block_attention mode copies a document's K/V from its copy at another offset: the copy's
    tokens are compared too (a forged source key used to serve, and store, the other document)."""
    from lazyattn_rag.engine.fingerprint import chunk_key

    llm = tiny_engine(num_blocks=64, mode="block_attention")
    try:
        llm.add_document("a", words(20))
        llm.add_document("b", words(20, 50))
        llm.add_document("pad", words(7, 100))
        llm.generate(words(3, 120), ["a"], sampling=GREEDY)  # a's copy at the head's end
        a_source = llm.plan(words(3, 120), ["a"]).chunks[-1].source_key
        plan = llm.plan(words(3, 120), ["pad", "b"])
        b = plan.chunks[-1]
        forged_b = dataclasses.replace(b, source_key=a_source, key=chunk_key(a_source, f"at:{b.global_start}", []))
        with pytest.raises(ChunkKeyCollisionError):
            _run(llm, dataclasses.replace(plan, chunks=(*plan.chunks[:-1], forged_b)))
        assert llm.loop.call(lambda: llm.engine.cache.lookup(forged_b.key, touch=False)) is None  # nothing stored
        llm.loop.call(llm.engine.cache.check_integrity)
    finally:
        llm.shutdown()
