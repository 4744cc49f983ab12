"""Cache modes compared by the serving benchmark: lazy, block_attention, prefix, full."""

import pytest

from lazyattn_rag import CacheConfig, EngineConfig, SamplingParams
from lazyattn_rag.llm import LazyAttention
from tests.oracle import oracle_generate
from tests.test_chunk_reuse import PROMPT
from tests.tiny import hf_and_ours, hf_config, word_tokenizer, words

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
REQUESTS = [("w1 w2", ["a", "b", "c"]), ("w3", ["c", "a"]), ("w1 w2", ["a", "b", "c"]), ("w4", ["b", "c", "a"])]


def run_mode(mode, num_blocks=256):
    hf, ours = hf_and_ours(hf_config("llama"))
    config = EngineConfig(device="cpu", dtype="float32", attention_backend="torch", prompt=PROMPT,
                          cache=CacheConfig(num_blocks=num_blocks, mode=mode))
    llm = LazyAttention.from_model(ours, word_tokenizer(), config)
    for name, n, start in (("a", 21, 0), ("b", 16, 40), ("c", 35, 80)):
        llm.add_document(name, words(n, start=start))
    outs = [llm.generate(q, ids, sampling=GREEDY) for q, ids in REQUESTS]
    llm.engine.cache.check_integrity()
    return hf, llm, outs


@pytest.fixture(scope="module")
def results():
    return {mode: run_mode(mode) for mode in ("lazy", "block_attention", "prefix", "full")}


def test_lazy_and_block_attention_compute_the_same_function(results):
    hf, llm, lazy = results["lazy"]
    _, _, block = results["block_attention"]
    assert [o.token_ids for o in lazy] == [o.token_ids for o in block]
    plan = llm.plan(*REQUESTS[1])
    tokens, _ = oracle_generate(hf, [([], list(c.token_ids), c.global_start) for c in plan.chunks],
                                list(plan.query_token_ids), GREEDY.max_tokens)
    assert lazy[1].token_ids == tokens


def test_prefix_and_full_compute_the_same_function(results):
    _, _, prefix = results["prefix"]
    _, _, full = results["full"]
    assert [o.token_ids for o in prefix] == [o.token_ids for o in full]


def test_prefix_mode_reuses_only_exact_prefixes(results):
    _, llm, prefix = results["prefix"]
    assert prefix[0].stats.num_cached_tokens == 0
    assert prefix[2].stats.num_cached_tokens >= prefix[2].stats.num_prompt_tokens - 16  # same prompt again
    assert prefix[1].stats.num_cached_tokens < 16  # "c" first: only the head's full blocks could match
    _, _, full = results["full"]
    assert all(o.stats.num_cached_tokens == 0 for o in full)


def test_block_attention_keeps_one_copy_per_offset_and_copies_on_new_offsets(results):
    _, llm, block = results["block_attention"]
    _, lazy_llm, lazy = results["lazy"]
    assert block[0].stats.docs_missed == ["a", "b", "c"]
    assert block[1].stats.docs_missed == ["c", "a"]  # new offsets: copies
    assert block[2].stats.docs_hit == ["a", "b", "c"]  # same offsets as the first request
    copies = llm.stats()["num_cached_chunks"] - 1
    assert copies == 3 + 2 + 3  # every (document, offset) pair seen
    assert lazy_llm.stats()["num_cached_chunks"] - 1 == 3  # one copy per document
    assert block[1].stats.num_computed_tokens == len(llm.plan(*REQUESTS[1]).query_token_ids)  # copied, not encoded
