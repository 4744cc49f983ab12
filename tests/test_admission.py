"""Capacity is checked at start-up and at submission, never part-way through a stream (issue 14, item 8)."""

import pytest

from lazyattn_rag import SamplingParams
from lazyattn_rag.types.errors import CacheCapacityError, PromptTooLongError
from tests.tiny import hf_and_ours, hf_config, word_tokenizer, words


@pytest.fixture(scope="module")
def model():
    return hf_and_ours(hf_config(max_position_embeddings=4096))[1]


@pytest.fixture
def new_llm(make_llm, model):
    """``new_llm(num_blocks, **config)``: an engine over the module's model (no anchor unless given)."""
    def new(num_blocks, **config):
        return make_llm(model=model, num_blocks=num_blocks, **{"anchor": "none", **config})[1]

    return new


def test_an_explicit_context_limit_the_cache_cannot_hold_fails_at_start_up(new_llm):
    with pytest.raises(CacheCapacityError, match=r"max_model_len=1000 needs 64 KV blocks .* has 10 blocks of 16 tokens"
                                                  r".*lower max_model_len to at most 144"):
        new_llm(10, max_model_len=1000)
    with pytest.raises(CacheCapacityError, match="1 of them held by the anchor.*at most 128"):
        new_llm(10, anchor="bos", max_model_len=1000)
    llm = new_llm(10, max_model_len=144)  # exactly what fits
    assert llm.max_model_len == 144
    llm.shutdown()


@pytest.mark.parametrize("anchor", ["none", "bos"])
def test_the_models_own_limit_is_lowered_to_what_the_cache_holds(new_llm, anchor):
    llm = new_llm(10, anchor=anchor)
    try:
        usable = 10 - (anchor == "bos")
        assert llm.max_model_len == (usable - 1) * 16 < 4096
        # the longest request the limit admits runs to its end: prompt + outputs = max_model_len
        question = words(llm.max_model_len - 20, 7)
        out = llm.generate(question, sampling=SamplingParams(max_tokens=1000, ignore_eos=True))
        assert out.finish_reason == "length"
        assert out.stats.num_prompt_tokens + len(out.token_ids) == llm.max_model_len
        with pytest.raises(PromptTooLongError):
            llm.generate(words(llm.max_model_len, 7))
    finally:
        llm.shutdown()


def test_a_request_that_can_never_fit_is_refused_at_submission_and_others_go_on(new_llm):
    """Documents each start a block: head 1 + 4 x 2 + tail and 40 outputs 3 = 12 blocks of 9
    usable; refused when submitted (no token streamed), naming prompt tokens and max_tokens."""
    llm = new_llm(10, anchor="bos")
    try:
        for i in range(4):
            llm.add_document(f"d{i}", words(17, 10 * i))
        running = llm.stream(words(3, 150), ["d0"], sampling=SamplingParams(max_tokens=30, ignore_eos=True))
        with pytest.raises(CacheCapacityError, match=r"needs 12 KV blocks for 77 prompt tokens \(4 documents\) and "
                                                      r"up to 40 output tokens \(max_tokens=40\)"):
            llm.stream(words(3, 150), [f"d{i}" for i in range(4)], sampling=SamplingParams(max_tokens=40))
        assert len(list(running)) == 30 + 1  # the running request is unaffected
        three = llm.generate(words(3, 150), ["d0", "d1", "d2"], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(three.token_ids) == 4
        llm.engine.cache.check_integrity()
    finally:
        llm.shutdown()


def test_a_document_that_can_never_fit_the_blocks_is_refused_at_registration(new_llm):
    """4 blocks of 16: the head (1 block), a 40-token document (3) and the tail (1) need 5, though
    the document is under the 48-token context limit; a 32-token one fits, warm included."""
    from lazyattn_rag.types.errors import DocumentTooLongError

    llm = new_llm(4)
    try:
        assert llm.max_model_len == 48
        with pytest.raises(DocumentTooLongError, match=r"'d' has 40 tokens; .* needs 5 KV blocks, but the cache has "
                                                       r"4 blocks of 16 tokens"):
            llm.add_document("d", words(40))
        llm.add_document("e", words(32))
        assert llm.warm(["e"]) == ["e"]
        out = llm.generate(words(2, 100), ["e"], sampling=SamplingParams(max_tokens=2, ignore_eos=True))
        assert out.stats.docs_hit == ["e"] and len(out.token_ids) == 2
    finally:
        llm.shutdown()


def test_a_document_that_tokenizes_to_nothing_is_refused(make_llm, model):
    from tokenizers import normalizers

    from lazyattn_rag.types.errors import EmptyInputError

    tokenizer = word_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Replace("x", "")  # "xxx" tokenizes to nothing
    _, llm = make_llm(model=model, tokenizer=tokenizer, num_blocks=None, anchor="bos")  # the default cache
    try:
        with pytest.raises(EmptyInputError, match="'d' has no tokens"):
            llm.add_document("d", "xxx")
    finally:
        llm.shutdown()


def test_a_cache_that_holds_no_request_says_so(new_llm):
    with pytest.raises(CacheCapacityError, match="it holds no request at all: give the cache more memory"):
        new_llm(2, anchor="bos")
