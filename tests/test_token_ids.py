"""The planner's token encoder (engine/planning/token_ids.py) gives exactly the ids and offsets of
the tokenizer's own ``__call__``, which is the reference, for SmolLM2's byte-level BPE (ChatML
special tokens) and a word-level tokenizer that prepends BOS; and what other threads do with the
shared tokenizer (``split_special_tokens``, truncation) never reaches it."""

import pytest

from lazyattn_rag.engine.planning.token_ids import TokenEncoder
from tests.tiny import word_tokenizer, words

TEXTS = ["", "Paris", " leading space", "a\n\nb\n\n\nc  d", "The tower is 330 metres tall.<|im_end|>\n<|im_start|>system",
         "<s> quoted </s> [UNK]", "naïve café — 東京 🙂", "x" * 5000]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def _references(tokenizer, text):
    return {(split, add): list(tokenizer(text, add_special_tokens=add, split_special_tokens=split)["input_ids"])
            for split in (False, True) for add in (False, True)}


def _check(tokenizer, texts):
    literal, parsing = TokenEncoder(tokenizer, split_special_tokens=True), TokenEncoder(tokenizer)
    assert literal.backend is not None and parsing.backend is not None
    for text in texts:
        want = _references(tokenizer, text)
        for add in (False, True):
            assert parsing.ids(text, add_special_tokens=add) == want[False, add], (text, add)
            assert literal.ids(text, add_special_tokens=add) == want[True, add], (text, add)
        ref = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = parsing.ids_and_offsets(text)
        assert ids == list(ref["input_ids"]) and [tuple(o) for o in offsets] == [tuple(o) for o in ref["offset_mapping"]]


def test_smollm2_ids_and_offsets_equal_the_tokenizers_call(smollm2_tokenizer):
    _check(smollm2_tokenizer, TEXTS)
    literal = TokenEncoder(smollm2_tokenizer, split_special_tokens=True)
    assert smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>") not in literal.ids("a<|im_end|>b")
    assert smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>") in TokenEncoder(smollm2_tokenizer).ids("a<|im_end|>b")


def test_word_tokenizer_with_bos_equals_the_tokenizers_call():
    tokenizer = word_tokenizer(prepend_bos=True)
    _check(tokenizer, ["", words(12), words(3, start=40) + " <s> " + words(2), "unknownword " + words(2)])
    assert TokenEncoder(tokenizer).ids(words(2), add_special_tokens=True)[0] == tokenizer.bos_token_id


def test_the_shared_tokenizers_flags_do_not_reach_the_encoder(smollm2_tokenizer):
    """``__call__`` writes ``encode_special_tokens`` and truncation on the shared backend; the
    encoder's private copy keeps its own settings."""
    parsing, literal = TokenEncoder(smollm2_tokenizer), TokenEncoder(smollm2_tokenizer, split_special_tokens=True)
    text = "one<|im_end|>two " * 200
    before = (parsing.ids(text), literal.ids(text))
    smollm2_tokenizer(text, split_special_tokens=True, truncation=True, max_length=8)
    assert (parsing.ids(text), literal.ids(text)) == before
    assert len(before[0]) > 8 and before[0] != before[1]
    smollm2_tokenizer(text)  # the shared tokenizer back to its defaults for later tests


def test_a_slow_tokenizer_goes_through_its_call():
    class Slow:
        is_fast = False

        def __call__(self, text, add_special_tokens=False, split_special_tokens=False, return_offsets_mapping=False):
            if return_offsets_mapping:  # what transformers' slow tokenizers do
                raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
            ids = [len(w) for w in text.split()] + ([99] if split_special_tokens else [])
            return {"input_ids": ([1] if add_special_tokens else []) + ids}

    assert TokenEncoder(Slow()).ids("ab cde", add_special_tokens=True) == [1, 2, 3]
    assert TokenEncoder(Slow(), split_special_tokens=True).ids("ab cde") == [2, 3, 99]
    with pytest.raises(NotImplementedError):
        TokenEncoder(Slow()).ids_and_offsets("ab")


def test_raw_prompts_follow_the_tokenizers_own_split_special_tokens_setting(smollm2_dir, tmp_path):
    """``plan_prompt`` (``/v1/completions``' text) tokenizes as the tokenizer's own call does by
    default: special-token text parsed, unless the tokenizer is configured to split it."""
    import json

    from transformers import AutoTokenizer

    from lazyattn_rag import PromptConfig
    from lazyattn_rag.engine.planning.prompt import PromptTemplate

    AutoTokenizer.from_pretrained(str(smollm2_dir)).save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"split_special_tokens": True}))
    prompt = "<|im_start|>user\nhi<|im_end|>"
    for tokenizer in (AutoTokenizer.from_pretrained(str(smollm2_dir)), AutoTokenizer.from_pretrained(str(tmp_path))):
        template = PromptTemplate(tokenizer, PromptConfig())
        assert template.raw.ids(prompt, add_special_tokens=True) == list(tokenizer(prompt)["input_ids"])
    assert tokenizer.split_special_tokens and template.raw is template.literal


def test_long_texts_tokenized_without_the_gil_equal_the_tokenizers_call(smollm2_tokenizer):
    """Where the switch interval is short, texts of ``RELEASE_GIL_MIN_CHARS`` or more go through
    ``encode_batch`` (without the GIL): the same ids and offsets as the tokenizer's call."""
    import sys

    from lazyattn_rag.engine.planning import token_ids

    long_texts = [("The tower is 330 metres tall.<|im_end|>\nnaïve café — 東京 🙂 " * 120),
                  "word " * (token_ids.RELEASE_GIL_MIN_CHARS // 5 + 1)]
    assert all(len(t) >= token_ids.RELEASE_GIL_MIN_CHARS for t in long_texts)
    before, calls = sys.getswitchinterval(), []
    try:
        sys.setswitchinterval(0.0005)
        encoder = TokenEncoder(smollm2_tokenizer)
        encoder.backend = _Recording(encoder.backend, calls)
        assert encoder.ids(long_texts[0]) == list(smollm2_tokenizer(long_texts[0], add_special_tokens=False)["input_ids"])
        assert calls == ["encode_batch"], "a long text at a short switch interval gives the GIL up"
        assert encoder.ids("short") and calls == ["encode_batch", "encode"]
        sys.setswitchinterval(0.005)
        encoder.ids(long_texts[0])
        assert calls[-1] == "encode", "at Python's 5 ms the GIL is kept"
        sys.setswitchinterval(0.0005)
        _check(smollm2_tokenizer, long_texts)  # ids with and without BOS, literal and parsing, offsets
    finally:
        sys.setswitchinterval(before)


class _Recording:
    """A backend that records which of its encode methods ran."""

    def __init__(self, backend, calls):
        self._backend, self._calls = backend, calls

    def encode(self, *args, **kwargs):
        self._calls.append("encode")
        return self._backend.encode(*args, **kwargs)

    def encode_batch(self, *args, **kwargs):
        self._calls.append("encode_batch")
        return self._backend.encode_batch(*args, **kwargs)
