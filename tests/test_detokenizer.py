"""The incremental detokenizer (a short decode window per token) against decoding the whole
output at every token, the form it replaced: the same released pieces, the same final text, the
same stop-string cuts; on the default model's byte-level BPE tokenizer (multi-byte characters
split over tokens, special tokens) and on a word-level tokenizer."""

import random

import pytest

from lazyattn_rag.engine.output.detokenizer import REPLACEMENT, IncrementalDetokenizer
from tests.tiny import word_tokenizer


class WholeDecode:
    """The reference: decode every token so far at each step, release complete characters,
    cut before the earliest stop string in the text, hold back what could still become one."""

    def __init__(self, tokenizer, stop=(), skip_special_tokens=True):
        self.tokenizer, self.stop, self.ids, self.text, self.emitted = tokenizer, stop, [], "", 0
        self.skip_special_tokens = skip_special_tokens
        self.holdback, self.stopped = max((len(s) for s in stop), default=1) - 1, False

    def add(self, token_id):
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if full.endswith(REPLACEMENT):
            return ""
        starts = [i for s in self.stop if (i := full.find(s)) != -1]
        if starts:
            full, self.stopped = full[:min(starts)], True
        self.text = full
        end = len(full) if self.stopped else max(self.emitted, len(full) - self.holdback)
        delta, self.emitted = full[self.emitted:end], end
        return delta

    def flush(self):
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta


def stream(detok, ids):
    pieces = []
    for t in ids:
        pieces.append(detok.add(t))
        if detok.stopped:
            break
    return pieces + [detok.flush()]


@pytest.fixture(scope="module")
def bpe(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


TEXTS = ["The Eiffel Tower was completed in 1889. 東京タワー は高い 🗼🎉 and naïve café ☕ " * 8,
         "😀😃😄😁 emoji 漢字かな交じり文, then code: def f(x):\n    return x ** 2  # done\n" * 6]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_equal_whole_decoding_on_real_text(bpe, text):
    ids = bpe(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 100
    ours, ref = stream(IncrementalDetokenizer(bpe), ids), stream(WholeDecode(bpe), ids)
    assert ours == ref
    assert "".join(ours) == text
    assert all(REPLACEMENT not in p for p in ours)


def test_random_token_ids_with_special_tokens(bpe):
    """Random ids (bytes that form no character, special tokens between them): the released text
    and its pieces equal whole decoding, including the replacement characters it contains."""
    rng = random.Random(7)
    special = list(bpe.all_special_ids)
    for _ in range(20):
        ids = [rng.choice(special) if rng.random() < 0.05 else rng.randrange(bpe.vocab_size) for _ in range(120)]
        assert stream(IncrementalDetokenizer(bpe), ids) == stream(WholeDecode(bpe), ids)


def test_special_tokens_are_spelled_when_not_skipped(bpe):
    """``SamplingParams.skip_special_tokens=False`` (vLLM's field): the chat markup the model
    writes stays in the text, piece by piece as whole decoding gives it; skipped by default."""
    ids = bpe.apply_chat_template([{"role": "user", "content": "Où est la tour? 🗼"}], tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    kept = stream(IncrementalDetokenizer(bpe, skip_special_tokens=False), ids)
    assert kept == stream(WholeDecode(bpe, skip_special_tokens=False), ids)
    assert "".join(kept) == bpe.decode(ids, skip_special_tokens=False) and "<|im_start|>user" in "".join(kept)
    skipped = "".join(stream(IncrementalDetokenizer(bpe), ids))
    assert "<|im_start|>" not in skipped and "Où est la tour? 🗼" in skipped


@pytest.mark.parametrize("stop", [("Tower",), ("1889. 東京",), ("ナ", "café"), ("🎉",), ("x ** 2",), ("not there",)])
def test_stop_strings_cut_where_whole_decoding_cuts(bpe, stop):
    for text in TEXTS:
        ids = bpe(text, add_special_tokens=False)["input_ids"]
        ours, ref = IncrementalDetokenizer(bpe, stop), WholeDecode(bpe, stop)
        assert stream(ours, ids) == stream(ref, ids)
        assert (ours.stopped, ours.text) == (ref.stopped, ref.text)


def test_word_level_tokenizer():
    tok = word_tokenizer()
    ids = tok("w1 w2 w3 w4 w1 w2", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "w1 w2 w3 w4 w1 w2"
    for stop in ((), ("w3 w",), ("w2",)):
        ours, ref = IncrementalDetokenizer(tok, stop), WholeDecode(tok, stop)
        assert stream(ours, ids) == stream(ref, ids)
        assert ours.text == ref.text


@pytest.mark.parametrize(("stop", "expected"), [(("w4", "3 w"), "w1 w2 w1"), (("3 w", "w4"), "w1 w2 w1"),
                                               (("w4", "3 w", "w13 w"), "w1 w2 ")])
def test_two_stop_strings_completing_on_one_token_cut_at_the_earlier_in_the_text(stop, expected):
    """vLLM's bug of the same shape: "w4" and "3 w" both complete on the token "w4"; the
    answer ends before the one that starts first, whatever the list order, none of it left."""
    tok = word_tokenizer()
    ids = tok("w1 w2 w13 w4 w1", add_special_tokens=False)["input_ids"]
    ours, ref = IncrementalDetokenizer(tok, stop), WholeDecode(tok, stop)
    assert "".join(stream(ours, ids)) == ours.text == expected and ours.stopped
    assert "".join(stream(ref, ids)) == ref.text == expected
