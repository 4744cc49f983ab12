"""Chunk reuse end to end on tiny random models against transformers-based oracles."""

import pytest
import torch

from lazyattn_rag import (
    CacheCapacityError,
    DocumentTooLongError,
    EmptyInputError,
    PromptTooLongError,
    SamplingParams,
    UnknownDocumentError,
)
from tests.observe import StepLog
from tests.oracle import full_prefill_generate, oracle_generate
from tests.tiny import words


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def oracle_for(llm, hf, question, doc_ids, num_tokens):
    plan = llm.engine.planner.plan(question, doc_ids)
    anchor = list(llm.engine.planner.anchor_ids)
    chunks = [([] if c.doc_id is None else anchor, list(c.token_ids), c.global_start) for c in plan.chunks]
    return plan, oracle_generate(hf, chunks, list(plan.query_token_ids), num_tokens)


@pytest.mark.parametrize("anchor", ["none", "bos", "head"])
def test_chunks_at_offsets_match_eager_oracle(make_llm, anchor):
    hf, llm = make_llm(anchor=anchor)
    lengths = [1, 15, 16, 17, 37]
    for i, n in enumerate(lengths):
        llm.add_document(f"d{n}", words(n, start=i * 30))
    question = "w5 w6 w7"
    for order in (["d37", "d1", "d16", "d15", "d17"], ["d17", "d37", "d17", "d1"]):  # a doc twice
        steps = StepLog(llm, logits=True)
        out = llm.generate(question, order, sampling=GREEDY)
        steps.remove()
        plan, (tokens, first_logits) = oracle_for(llm, hf, question, order, GREEDY.max_tokens)
        assert out.token_ids == tokens
        # the first sampled row: the last compute job of its step (the request's prefill)
        assert (steps.logits[-GREEDY.max_tokens][-1] - first_logits).abs().max().item() <= 1e-4
        assert out.stats.num_prompt_tokens == plan.num_prompt_tokens
    llm.engine.cache.check_integrity()


def test_single_chunk_at_delta_zero_equals_full_prefill(make_llm):
    """anchor=head, one document right after the head: delta = 0, so reuse == a full prefill."""
    hf, llm = make_llm(anchor="head")
    llm.add_document("doc", words(40, start=3))
    question = "w9 w10 w11"
    plan = llm.engine.planner.plan(question, ["doc"])
    assert [c.delta for c in plan.chunks] == [0, 0]
    steps = StepLog(llm, logits=True)
    out = llm.generate(question, ["doc"], sampling=SamplingParams(max_tokens=20, ignore_eos=True))
    tokens, first = full_prefill_generate(hf, plan.token_ids(), 20)
    assert (steps.logits[-20][-1] - first).abs().max().item() <= 1e-3
    assert out.token_ids == tokens


@pytest.mark.parametrize("anchor", ["none", "bos"])
@pytest.mark.parametrize("prefill_with_encodes", [True, False])
def test_cold_documents_and_the_query_prefill_share_one_step(make_llm, anchor, prefill_with_encodes):
    """A request whose documents are all missing samples its first token in the step that
    encodes them (one forward pass: each layer writes the documents' K/V before its attention),
    and matches the oracle; ``prefill_with_encodes=False`` runs the prefill a step later."""
    hf, llm = make_llm(anchor=anchor, prefill_with_encodes=prefill_with_encodes)
    llm.add_document("a", words(21, start=5))
    llm.add_document("b", words(40, start=60))
    log = StepLog(llm)
    plan = llm.engine.planner.plan("w5 w6", ["a", "b"])
    out = llm.generate("w5 w6", ["a", "b"], sampling=GREEDY)
    steps = log.outputs  # read once the last step's listeners ran (they run after its token was streamed)
    first = steps[0]
    assert {e.key for e in first.chunk_prefills} == {c.key for c in plan.chunks}  # the head and both documents
    assert {21, 40} <= {len(e.token_ids) for e in first.chunk_prefills}
    prefill = steps[0] if prefill_with_encodes else steps[1]
    assert [(c.request.request_id, c.sample) for c in prefill.computes] == [(out.stats.request_id, True)]
    assert len(steps) == GREEDY.max_tokens + (0 if prefill_with_encodes else 1)
    _, (tokens, _) = oracle_for(llm, hf, "w5 w6", ["a", "b"], GREEDY.max_tokens)
    assert out.token_ids == tokens
    llm.engine.cache.check_integrity()


def test_same_document_many_offsets_leaves_stored_kv_bit_identical(make_llm):
    hf, llm = make_llm(anchor="none")
    llm.add_document("hot", words(23, start=50))
    for i in range(4):
        llm.add_document(f"pad{i}", words(5 + 7 * i, start=i))
    llm.generate("w1", ["hot"], sampling=SamplingParams(max_tokens=2))
    entry = llm.engine.cache.lookup(llm.engine.documents["hot"].key)
    blocks = torch.tensor(entry.block_ids)
    snapshot = [(k[blocks].clone(), v[blocks].clone()) for k, v in llm.engine.runner.kv_pool.layers]
    offsets = set()
    for i in range(4):
        order = [f"pad{j}" for j in range(i + 1)] + ["hot"]
        plan = llm.engine.planner.plan("w2 w3", order)
        offsets.add(plan.chunks[-1].delta)
        out = llm.generate("w2 w3", order, sampling=SamplingParams(max_tokens=3))
        assert "hot" in out.stats.docs_hit
    assert len(offsets) == 4
    assert llm.engine.cache.lookup(llm.engine.documents["hot"].key).block_ids == entry.block_ids
    for (k, v), (k0, v0) in zip(llm.engine.runner.kv_pool.layers, snapshot):
        assert torch.equal(k[blocks], k0) and torch.equal(v[blocks], v0)


def test_second_question_computes_only_new_tokens_and_is_faster(make_llm):
    hf, llm = make_llm(anchor="none", num_blocks=512, model_config=dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32))
    for i in range(3):
        llm.add_document(f"doc{i}", words(400, start=i))
    first = llm.generate("w1 w2 w3", ["doc0", "doc1", "doc2"], sampling=SamplingParams(max_tokens=2))
    second = llm.generate("w4 w5 w6 w7", ["doc2", "doc0", "doc1"], sampling=SamplingParams(max_tokens=2))
    tail = len(llm.engine.planner.template.tail_token_ids("w4 w5 w6 w7"))
    assert first.stats.docs_missed == ["doc0", "doc1", "doc2"] and first.stats.docs_hit == []
    assert second.stats.docs_hit == ["doc2", "doc0", "doc1"] and second.stats.docs_missed == []
    assert second.stats.num_computed_tokens == tail
    assert second.stats.num_cached_tokens == second.stats.num_prompt_tokens - tail
    assert second.stats.ttft_ms < first.stats.ttft_ms


def test_changed_text_under_same_id_is_reencoded_and_stale_entry_dropped(make_llm):
    hf, llm = make_llm(anchor="none")
    llm.add_document("d", words(20))
    llm.generate("w1", ["d"], sampling=SamplingParams(max_tokens=1))
    n_entries = llm.engine.cache.num_entries
    assert llm.add_document("d", words(20)) is False  # same text: same key
    assert llm.add_document("d", words(21, start=7)) is True
    assert llm.engine.cache.num_entries == n_entries - 1  # old K/V dropped at once (unpinned)
    out = llm.generate("w1", ["d"], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.stats.docs_missed == ["d"]
    _, (tokens, _) = oracle_for(llm, hf, "w1", ["d"], 4)
    assert out.token_ids == tokens
    llm.remove_document("d")
    with pytest.raises(UnknownDocumentError, match="'d'"):
        llm.generate("w1", ["d"])
    llm.engine.cache.check_integrity()


def _assert_clean(llm):
    cache = llm.engine.cache
    cache.check_integrity()
    assert all(e.pin_count == 0 for e in cache.entries())
    assert cache.pool.num_free + cache.num_cached_blocks == cache.pool.num_blocks


def test_bad_input_gets_specific_errors_and_cache_stays_usable(make_llm):
    hf, llm = make_llm(anchor="none", model_config=dict(max_position_embeddings=256))
    llm.add_document("ok", words(30))
    with pytest.raises(UnknownDocumentError, match="'missing'"):
        llm.generate("w1", ["ok", "missing"])
    with pytest.raises(DocumentTooLongError, match="'huge'.*256"):
        llm.add_document("huge", words(300))
    assert not llm.has_document("huge")
    with pytest.raises(EmptyInputError, match="question is empty"):
        llm.generate("   ", ["ok"])
    with pytest.raises(EmptyInputError, match="'blank' is empty"):
        llm.add_document("blank", " \n")
    for i in range(5):
        llm.add_document(f"big{i}", words(60, start=i))
    with pytest.raises(PromptTooLongError, match="context limit is 256"):
        llm.generate("w1", [f"big{i}" for i in range(5)])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    _assert_clean(llm)
    out = llm.generate("w1 w2", ["ok"], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    _, (tokens, _) = oracle_for(llm, hf, "w1 w2", ["ok"], 4)
    assert out.token_ids == tokens
    _assert_clean(llm)


def test_eviction_under_small_cache_and_request_too_big_for_cache(make_llm):
    hf, llm = make_llm(anchor="none", num_blocks=8)  # 128 slots
    for i in range(4):
        llm.add_document(f"d{i}", words(30, start=i * 9))  # 2 blocks each
    llm.generate("w1", ["d0", "d1"], sampling=SamplingParams(max_tokens=2))
    out = llm.generate("w1", ["d2", "d3"], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm.engine.cache.num_evictions > 0
    _, (tokens, _) = oracle_for(llm, hf, "w1", ["d2", "d3"], 4)
    assert out.token_ids == tokens
    # the context limit is what one request can hold: 8 blocks less one (head/tail boundary)
    assert llm.max_model_len == llm.engine.max_model_len == (8 - 1) * 16
    with pytest.raises(DocumentTooLongError, match="context limit of 112 tokens"):
        llm.add_document("long", words(150))
    # five 17-token documents fit the context but not the blocks (each starts a block of its own):
    # head 1 + 5 x 2 + tail 1 = 12 blocks
    for i in range(5):
        llm.add_document(f"s{i}", words(17, start=100 + i))
    with pytest.raises(CacheCapacityError, match=r"needs 12 KV blocks for 92 prompt tokens \(5 documents\) and up to 2 output"):
        llm.stream("w1", [f"s{i}" for i in range(5)], sampling=SamplingParams(max_tokens=2))  # at the call
    _assert_clean(llm)
    again = llm.generate("w1", ["d2", "d3"], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    assert again.token_ids == tokens


def test_capacity_error_names_the_blocks_the_anchor_holds(make_llm):
    hf, llm = make_llm(anchor="bos", num_blocks=8)
    for i in range(4):
        llm.add_document(f"s{i}", words(17, start=100 + i))
    with pytest.raises(CacheCapacityError, match=r"has 8 blocks of 16 tokens, 1 of them held by the anchor"):
        llm.generate("w1", [f"s{i}" for i in range(4)], sampling=SamplingParams(max_tokens=2))


def test_stream_concatenates_to_generate_and_inline_documents(make_llm):
    from lazyattn_rag import Document

    hf, llm = make_llm(anchor="none")
    docs = [Document("a", words(12)), Document("b", words(9, start=40))]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    pieces = list(llm.stream("w3", documents=docs, sampling=params))
    assert pieces[-1].finished and pieces[-1].finish_reason == "length"
    assert sum(1 for p in pieces if p.text) >= 2
    full = llm.generate("w3", ["a", "b"], sampling=params)
    assert "".join(p.text for p in pieces) == full.text
    assert full.stats.docs_hit == ["a", "b"]


def test_stop_strings_and_seeded_sampling(make_llm):
    hf, llm = make_llm(anchor="none")
    llm.add_document("a", words(12))
    base = llm.generate("w3", ["a"], sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    stop_word = base.text.split()[2]
    cut = llm.generate("w3", ["a"], sampling=SamplingParams(max_tokens=8, ignore_eos=True, stop=[stop_word]))
    assert cut.finish_reason == "stop" and base.text.startswith(cut.text) and stop_word not in cut.text
    stop_tok = llm.generate("w3", ["a"], sampling=SamplingParams(max_tokens=8, ignore_eos=True,
                                                                    stop_token_ids=[base.token_ids[1]]))
    assert stop_tok.token_ids == base.token_ids[:1] and stop_tok.finish_reason == "stop"
    sampled = [llm.generate("w3", ["a"], sampling=SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9,
                                                                  top_k=20, seed=s, ignore_eos=True)).token_ids
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]
    top1 = llm.generate("w3", ["a"], sampling=SamplingParams(max_tokens=8, temperature=0.7, top_k=1, seed=3,
                                                              ignore_eos=True))
    assert top1.token_ids == base.token_ids


def test_plain_prompt_completion_equals_full_prefill(make_llm):
    hf, llm = make_llm(anchor="none")
    prompt_ids = llm.tokenizer(words(25, start=11))["input_ids"]
    out = llm.complete(prompt_ids, SamplingParams(max_tokens=6, ignore_eos=True))
    tokens, _ = full_prefill_generate(hf, prompt_ids, 6)
    assert out.token_ids == tokens
    assert out.stats.num_computed_tokens == len(prompt_ids) and out.stats.num_cached_tokens == 0
    # exact-prefix caching (CacheConfig.prefix_caching): its one full block, nothing else
    assert llm.engine.cache.num_entries == len(prompt_ids) // 16 == 1
    again = llm.complete(prompt_ids, SamplingParams(max_tokens=6, ignore_eos=True))
    assert again.token_ids == tokens  # the cached block read back gives the full prefill's answer
    assert again.stats.num_exact_prefix_tokens == 16 and again.stats.num_computed_tokens == len(prompt_ids) - 16
    with pytest.raises(EmptyInputError):
        llm.complete([])


@pytest.mark.parametrize("rotation", ["key", "query"])
def test_both_rotation_forms_of_the_torch_backend_match_the_oracle(make_llm, rotation):
    hf, llm = make_llm(anchor="none")
    llm.engine.runner.backend.rotation = rotation
    for i, n in enumerate((15, 16, 17)):
        llm.add_document(f"d{n}", words(n, start=i * 30))
    for question in ("w5 w6 w7", "w1"):
        out = llm.generate(question, ["d17", "d15", "d16"], sampling=GREEDY)
        _, (tokens, _) = oracle_for(llm, hf, question, ["d17", "d15", "d16"], GREEDY.max_tokens)
        assert out.token_ids == tokens
