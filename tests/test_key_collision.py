"""A content-key collision never serves another sequence's K/V (issue 14, item 7): every hit
compares the tokens the entry holds with the tokens the request places, and a mismatch is a
miss (issue 37): the request is computed right, under a key salted with its tokens, counted."""

import dataclasses


from lazyattn_rag import SamplingParams
from lazyattn_rag.engine.planning.prompt_plan import PromptPlan
from tests.integrations_kit import tiny_engine
from tests.tiny import words

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)


def _run(llm, plan):
    return [d.token_id for d in llm._submit(lambda engine, sink: engine.submit(plan, GREEDY, sink))
            if d.token_id is not None]


def _collisions(llm):
    return llm.stats()["num_key_collisions"]


def test_a_forced_document_key_collision_is_a_miss_and_the_cache_stays_right():
    llm = tiny_engine(num_blocks=64)
    try:
        llm.add_document("a", words(20))
        llm.add_document("b", words(20, 50))
        first = llm.generate(words(3, 120), ["a"], sampling=GREEDY)
        plan_b = llm.plan(words(3, 120), ["b"])
        a_key = llm.plan(words(3, 120), ["a"]).chunks[-1].key
        # b's tokens under a's key: a digest collision
        forged = dataclasses.replace(plan_b, chunks=(*plan_b.chunks[:-1], dataclasses.replace(plan_b.chunks[-1], key=a_key)))
        assert _run(llm, forged) == _run(llm, plan_b)  # b's own answer, never a's K/V
        assert _collisions(llm) == 1
        again = llm.generate(words(3, 120), ["a"], sampling=GREEDY)  # a is still cached and right
        assert again.stats.docs_hit == ["a"] and again.token_ids == first.token_ids
        llm.engine.cache.check_integrity()
    finally:
        llm.shutdown()


def test_a_forced_prefix_block_collision_is_computed():
    llm = tiny_engine(num_blocks=64, mode="prefix")
    try:
        llm.add_document("a", words(40))
        llm.generate(words(3, 120), ["a"], sampling=GREEDY)
        plan = llm.plan(words(3, 120), ["a"])
        other = list(plan.query_token_ids)
        other[5] = other[5] + 1 if other[5] + 1 < 150 else 4  # another token in the first block
        forged = PromptPlan((), tuple(other), plan.prefix_block_keys)
        assert _run(llm, forged) == _run(llm, PromptPlan((), tuple(other)))  # computed whole, as without a cache
        assert _collisions(llm) == 1
        llm.engine.cache.check_integrity()
    finally:
        llm.shutdown()


def test_a_collision_on_the_copy_path_is_encoded_instead():
    """block_attention mode copies a document's K/V from its copy at another offset: the copy's
    tokens are compared too (a forged source key used to serve, and store, the other document);
    a mismatch encodes the chunk from its own tokens."""
    from lazyattn_rag.engine.planning.fingerprint import chunk_key

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
        honest = _run(llm, plan)
        assert _run(llm, dataclasses.replace(plan, chunks=(*plan.chunks[:-1], forged_b))) == honest
        assert _collisions(llm) == 1
        entry = llm.loop.call(lambda: llm.engine.cache.lookup(forged_b.key, touch=False))
        assert entry.token_ids == b.token_ids  # what it stored under the forged key is b's own K/V, named by its tokens
        llm.loop.call(llm.engine.cache.check_integrity)
    finally:
        llm.shutdown()
