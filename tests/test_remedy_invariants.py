"""What every recompute remedy must keep (chunk-head recompute, selective recompute; issue 20):
recomputing everything is full attention, the zero setting is plain reuse bit for bit, cached
chunks are never written and nothing stays held, and a preempted request answers as alone."""

import pytest

from tests.recompute_case import (assert_chunks_unchanged_and_nothing_held, assert_full_attention, assert_plain_reuse,
                                  assert_preempted_requests_answer_as_alone, remedy_engine)

# per remedy: (its field, everything, zero, a share in between, KV blocks that force preemption)
REMEDIES = [("recompute_chunk_head_tokens", 64, 0, 20, 24), ("recompute_selective_ratio", 1.0, 0.0, 0.3, 28)]
IDS = ["chunk_head", "selective"]


@pytest.mark.parametrize("field, everything, zero, some, tight_blocks", REMEDIES, ids=IDS)
def test_recomputing_everything_is_full_attention(make_llm, field, everything, zero, some, tight_blocks):
    assert_full_attention(*remedy_engine(make_llm, **{field: everything}))


@pytest.mark.parametrize("field, everything, zero, some, tight_blocks", REMEDIES, ids=IDS)
def test_zero_is_plain_reuse_bit_for_bit(make_llm, field, everything, zero, some, tight_blocks):
    assert_plain_reuse(make_llm, remedy_engine(make_llm, **{field: zero})[1])


@pytest.mark.parametrize("field, everything, zero, some, tight_blocks", REMEDIES, ids=IDS)
def test_cached_chunks_unchanged_and_nothing_held(make_llm, field, everything, zero, some, tight_blocks):
    _, llm = remedy_engine(make_llm, **{field: some}, num_blocks=40, max_num_seqs=4)
    assert_chunks_unchanged_and_nothing_held(llm)


@pytest.mark.parametrize("field, everything, zero, some, tight_blocks", REMEDIES, ids=IDS)
def test_preempted_requests_answer_as_alone(make_llm, field, everything, zero, some, tight_blocks):
    """Requests whose private blocks (and a selection's block copies) are taken back mid-answer
    give the same tokens as alone."""
    _, roomy = remedy_engine(make_llm, **{field: some})
    _, tight = remedy_engine(make_llm, **{field: some}, num_blocks=tight_blocks, max_num_seqs=4)
    assert_preempted_requests_answer_as_alone(roomy, tight)


@pytest.mark.parametrize("config, remedy", [
    ({"recompute_chunk_head_tokens": 4}, "chunk_head_recompute"), ({"recompute_selective_ratio": 0.3}, "selective_recompute"),
    ({"chunk_attention_scaling": True, "chunk_attention_weight": 0.5}, "chunk_attention_scaling"), ({}, None)])
def test_the_stats_name_the_remedy(make_llm, config, remedy):
    """``RequestStats.remedy`` (and the stats line) say which remedy a request ran with."""
    from tests.recompute_case import FIRST, QUESTION

    _, llm = remedy_engine(make_llm, **config)
    stats = llm.generate(QUESTION, ["a", "b"], sampling=FIRST).stats
    recomputes = remedy in ("chunk_head_recompute", "selective_recompute")
    assert stats.remedy == remedy and (stats.num_recomputed_tokens > 0) == recomputes
