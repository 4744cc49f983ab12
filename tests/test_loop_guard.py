"""The loop guard (issue 38.2): an answer ends before it repeats a run of ``n`` tokens it already
produced; a stream never shows the start of the cut repeat; an answer that does not loop is the
same text with or without it."""

from __future__ import annotations

import random

import pytest

from lazyattn_rag import SamplingParams
from lazyattn_rag.engine.output.detokenizer import IncrementalDetokenizer
from lazyattn_rag.engine.output.loop_guard import LoopGuard
from tests.tiny import word_tokenizer


def ids_of(text: str) -> list[int]:
    return word_tokenizer()(text, add_special_tokens=False)["input_ids"]


def run(tokens: list[int], ngram: int | None, stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(word_tokenizer(), tuple(stop), ngram)
    pieces = []
    for t in tokens:
        pieces.append(detok.add(t))
        if detok.stopped:
            break
    if not detok.stopped:
        pieces.append(detok.flush())
    return pieces, detok


def naive_match(ids: list[int], cap: int) -> int:
    """The longest run (at most ``cap``) ending at the last token that also ends earlier."""
    best = 0
    for k in range(1, min(cap, len(ids) - 1) + 1):
        tail = ids[-k:]
        if any(ids[e - k + 1:e + 1] == tail for e in range(k - 1, len(ids) - 1)):
            best = k
    return best


def test_match_lengths_equal_a_naive_search():
    rng = random.Random(0)
    for _ in range(200):
        ngram = rng.randint(2, 6)
        guard, ids = LoopGuard(ngram), []
        for _ in range(rng.randint(1, 40)):
            ids.append(rng.randint(0, 3))
            assert guard.add(ids[-1]) == naive_match(ids, ngram), (ids, ngram)


def test_a_loop_is_cut_before_the_repeat_and_never_streamed():
    text = "w1 w2 w3 w4 w5 w6 w7 w1 w2 w3 w4 w5 w6 w7 w1 w2 w3"
    pieces, detok = run(ids_of(text), ngram=4)
    assert detok.text == "w1 w2 w3 w4 w5 w6 w7" and "".join(pieces) == detok.text
    assert detok.looped and detok.stopped
    once = "w1 w2 w3 w4 w5 w6 w7 w9 w1 w2 w3 w4 w5 w6 w7 w8"  # a 7-token run said twice, then on
    pieces, detok = run(ids_of(once), ngram=8)
    assert "".join(pieces) == once and not detok.looped
    pieces, detok = run(ids_of(once), ngram=7)
    assert detok.text == "w1 w2 w3 w4 w5 w6 w7 w9" and "".join(pieces) == detok.text


def test_a_short_repeat_passes_and_is_released_when_it_breaks():
    text = "w1 w2 w3 w9 w1 w2 w3 w8 w1 w2 w5"
    pieces, detok = run(ids_of(text), ngram=4)
    assert "".join(pieces) == text and not detok.looped
    assert pieces[5] == "" and pieces[6] == "" and pieces[7] == " w1 w2 w3 w8"  # held while it might loop


@pytest.mark.parametrize("seed", range(20))
def test_the_guarded_text_is_the_plain_text_up_to_the_first_repeat(seed):
    """Random word sequences (7 or 41 words: some repeat a 3-token run, some do not): with the
    guard the text is the plain decode of the tokens before the first repeated run, whole when
    there is none; the streamed pieces add up to it either way."""
    rng = random.Random(seed)
    vocab = 40 if seed % 2 else 6
    tokens = ids_of(" ".join(f"w{rng.randint(0, vocab)}" for _ in range(60)))
    guard_pieces, guarded = run(tokens, ngram=3)
    plain_pieces, plain = run(tokens, ngram=None)
    ends = [i for i in range(len(tokens)) if naive_match(tokens[:i + 1], 3) == 3]
    cut = ends[0] - 2 if ends else len(tokens)  # the first token of the first repeated run
    assert guarded.text == word_tokenizer().decode(tokens[:cut]) and guarded.looped == bool(ends)
    assert "".join(guard_pieces) == guarded.text and "".join(plain_pieces) == plain.text


def test_a_stop_string_and_the_guard_together():
    text = "w1 w2 w3 w4 w1 w2 w3 w4 w5"
    pieces, detok = run(ids_of(text), ngram=3, stop=("w3",))
    assert detok.text == "w1 w2 " and "".join(pieces) == detok.text and not detok.looped


def test_the_engine_ends_a_looping_answer(make_llm):
    """A random tiny model decoding greedily falls into a loop; with the guard its answer ends
    before the first repeated run of 3 tokens, ``finish_reason="stop"``, ``loop_stopped``."""
    _, llm = make_llm()
    plain = llm.generate("w5 w6", [], documents=[("d", "w1 w2 w3 w4")],
                         sampling=SamplingParams(max_tokens=96, ignore_eos=True))
    out_ids = ids_of(plain.text)
    assert any(naive_match(out_ids[:i + 1], 3) == 3 for i in range(len(out_ids))), "the model did not loop"
    guarded = llm.generate("w5 w6", [], documents=[("d", "w1 w2 w3 w4")],
                           sampling=SamplingParams(max_tokens=96, ignore_eos=True, loop_guard_ngram=3))
    assert guarded.stats.loop_stopped and guarded.finish_reason == "stop"
    assert plain.text.startswith(guarded.text) and len(guarded.text) < len(plain.text)
    assert not plain.stats.loop_stopped
    with pytest.raises(ValueError, match="loop_guard_ngram must be None or an integer >= 2"):
        SamplingParams(loop_guard_ngram=1)
