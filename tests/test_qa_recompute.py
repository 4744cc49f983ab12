"""The EPIC-style recompute reference of the quality benchmark, on a tiny random model: with k = 0 it
is chunk reuse (the transformers oracle), with k >= every chunk's length it is a full prefill."""

import pytest
import torch

from benchmarks.qa_recompute import RecomputeReference
from tests.oracle import full_prefill_generate, oracle_generate
from tests.tiny import hf_and_ours, hf_config

HEAD = [10, 11, 12, 13, 14]
CHUNKS = [[20 + i for i in range(7)], [40 + i for i in range(19)], [60 + i for i in range(3)]]
TAIL = [100, 101, 102]
STEPS = 6


@pytest.fixture(scope="module")
def hf():
    model, _ = hf_and_ours(hf_config("llama"), seed=3)
    return model


def oracle_chunks(anchor: list[int]) -> list[tuple[list[int], list[int], int]]:
    """The oracle's ``(anchor, ids, global start)`` of HEAD then CHUNKS, each chunk after ``anchor``."""
    starts, pos = [], len(HEAD)
    for c in CHUNKS:
        starts.append(pos)
        pos += len(c)
    return [([], HEAD, 0)] + [(anchor, c, g) for c, g in zip(CHUNKS, starts)]


def test_k0_is_chunk_reuse(hf):
    ref = RecomputeReference.from_model(hf, eos_ids=set())
    expected, _ = oracle_generate(hf, oracle_chunks([]), TAIL, STEPS)
    assert ref.generate(HEAD, CHUNKS, TAIL, recompute_tokens=0, max_tokens=STEPS) == expected


def test_recomputing_whole_chunks_is_full_prefill(hf):
    ref = RecomputeReference.from_model(hf, eos_ids=set())
    prompt = HEAD + [t for c in CHUNKS for t in c] + TAIL
    expected, _ = full_prefill_generate(hf, prompt, STEPS)
    assert ref.generate(HEAD, CHUNKS, TAIL, recompute_tokens=max(map(len, CHUNKS)), max_tokens=STEPS) == expected
    reuse = ref.generate(HEAD, CHUNKS, TAIL, recompute_tokens=0, max_tokens=STEPS)
    assert reuse != expected  # the random model does notice independent encoding, so the two checks differ


def test_stops_at_eos_and_stop_callback(hf):
    ref = RecomputeReference.from_model(hf, eos_ids=set())
    free = ref.generate(HEAD, CHUNKS, TAIL, 2, max_tokens=STEPS)
    assert ref.generate(HEAD, CHUNKS, TAIL, 2, max_tokens=STEPS, stop=lambda ids: len(ids) == 2) == free[:2]
    ref.eos_ids = {free[1]}
    assert ref.generate(HEAD, CHUNKS, TAIL, 2, max_tokens=STEPS) == free[:1]
    with pytest.raises(ValueError):
        ref.generate(HEAD, [], TAIL, 0, max_tokens=STEPS)


def test_chunks_after_an_anchor_are_the_oracles_anchored_reuse(hf):
    ref = RecomputeReference.from_model(hf, eos_ids=set())
    anchor = [1]
    expected, _ = oracle_generate(hf, oracle_chunks(anchor), TAIL, STEPS)
    assert ref.generate(HEAD, CHUNKS, TAIL, 0, max_tokens=STEPS, anchor_ids=anchor) == expected
    assert expected != ref.generate(HEAD, CHUNKS, TAIL, 0, max_tokens=STEPS)  # the anchor does change the answer


def test_kv_transform_sees_each_chunk_alone_and_its_output_is_placed(hf):
    ref = RecomputeReference.from_model(hf, eos_ids=set())
    seen = []

    def identity(k, v, start):
        seen.append((k.shape[2], v.shape[2], start))
        return k, v

    plain = ref.first_token_logits(HEAD, CHUNKS, TAIL, 0, anchor_ids=[1])
    assert torch.equal(ref.first_token_logits(HEAD, CHUNKS, TAIL, 0, anchor_ids=[1], kv_transform=identity), plain)
    num_layers = hf.config.num_hidden_layers
    assert seen == [(len(c), len(c), 1) for c in CHUNKS] * num_layers  # per layer, each chunk's own tokens
    halved = ref.first_token_logits(HEAD, CHUNKS, TAIL, 0, anchor_ids=[1], kv_transform=lambda k, v, s: (k, v / 2))
    assert (halved - plain).abs().max() > 1e-3
    logits, tokens = ref.generate_with_first_logits(HEAD, CHUNKS, TAIL, 0, STEPS, anchor_ids=[1])
    assert torch.equal(logits, plain) and tokens == ref.generate(HEAD, CHUNKS, TAIL, 0, STEPS, anchor_ids=[1])


def test_a_prompt_run_again_reuses_its_chunks_encoding_and_gives_the_same_answer(hf):
    ref = RecomputeReference.from_model(hf, eos_ids=set())
    calls = []
    hook = hf.register_forward_hook(lambda module, args, kwargs_out: calls.append(1))
    try:
        first = ref.generate(HEAD, CHUNKS, TAIL, 0, max_tokens=STEPS, anchor_ids=[1])
        n = len(calls)
        assert ref.generate(HEAD, CHUNKS, TAIL, 0, max_tokens=STEPS, anchor_ids=[1]) == first
        assert len(calls) == 2 * n - 1  # every forward again but the chunks' encoding
        ref.generate(HEAD, CHUNKS, TAIL, 0, max_tokens=STEPS)  # another anchor: encoded anew
        assert len(calls) == 3 * n - 1
    finally:
        hook.remove()
