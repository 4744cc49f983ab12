"""Sampling parameters: validation, penalties (against a direct computation), top-k/top-p."""

import math

import pytest
import torch

from lazyattn_rag.engine.output.sampler import apply_penalties, sample
from lazyattn_rag.types.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=1.5), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
    (dict(top_k=True), "top_k"),
    (dict(temperature=math.nan), "temperature"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3), "presence_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p="0.1"), "min_p"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_penalties_match_direct_computation():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, params, prompt_ids=[0], output_ids=[1, 3, 3])
    expected = torch.tensor([2.0 / 2, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 2 * 0.5 - 0.25, -2.0])
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))  # input untouched


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    g = torch.Generator().manual_seed(0)
    assert all(sample(logits, SamplingParams(temperature=1.0, top_k=1), g) == 1 for _ in range(20))
    picks = {sample(logits, SamplingParams(temperature=1.0, top_p=0.6), g) for _ in range(200)}
    assert picks <= {1, 2} and picks == {1, 2}  # the two top tokens hold ~0.99 of the mass, each < 0.6


def test_min_p_drops_tokens_below_its_share_of_the_most_likely():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # at temperature 1 these are the probabilities
    g = torch.Generator().manual_seed(0)
    picks = [sample(logits, SamplingParams(temperature=1.0, min_p=0.5), g) for _ in range(400)]
    assert set(picks) == {0, 1}  # 0.15 < 0.5 * 0.5: dropped; 0.3 kept
    assert 0.5 < picks.count(0) / len(picks) < 0.75  # 0.5 / 0.8 of the mass renormalized
    assert {sample(logits, SamplingParams(temperature=1.0, min_p=1.0), g) for _ in range(50)} == {0}
    everything = {sample(logits, SamplingParams(temperature=1.0, min_p=0.0), g) for _ in range(400)}
    assert everything == {0, 1, 2, 3}


def test_engine_applies_penalties_before_greedy_choice(make_llm):
    from tests.tiny import words

    _, llm = make_llm(anchor="none")
    llm.add_document("a", words(12))
    base = llm.generate("w3", ["a"], sampling=SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    same = llm.generate("w3", ["a"], sampling=SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.0))
    assert same.token_ids == base
    penalized = llm.generate("w3", ["a"], sampling=SamplingParams(max_tokens=12, ignore_eos=True,
                                                                   frequency_penalty=2.0, presence_penalty=2.0,
                                                                   repetition_penalty=50.0)).token_ids
    assert penalized != base and len(set(penalized)) == len(penalized)  # no token generated twice


def test_logprobs_are_the_models_distribution(make_llm):
    """``SamplingParams.logprobs``: the model's own log-probabilities (transformers' forward as the
    reference, 1e-4 fp32) before penalties; top-N plus the picked token; -1 the whole vocabulary."""
    hf, llm = make_llm()
    prompt = list(range(5, 40))
    full = llm.complete(prompt, sampling=SamplingParams(max_tokens=3, logprobs=-1, repetition_penalty=1.5))
    top = llm.complete(prompt, sampling=SamplingParams(max_tokens=3, logprobs=2, repetition_penalty=1.5))
    assert len(full.logprobs) == len(top.logprobs) == 3 and full.token_ids == top.token_ids
    with torch.no_grad():
        expected = torch.log_softmax(hf(input_ids=torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    first = torch.tensor([full.logprobs[0][i] for i in range(hf.config.vocab_size)])
    assert (first - expected).abs().max().item() <= 1e-4
    for dense, few, token in zip(full.logprobs, top.logprobs, top.token_ids):
        best = sorted(dense, key=dense.get, reverse=True)[:2]
        assert set(few) == set(best) | {token}  # the two most likely and the one picked
        assert all(abs(few[t] - dense[t]) <= 1e-6 for t in few)
    assert llm.complete(prompt, sampling=SamplingParams(max_tokens=2)).logprobs is None
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)


def test_a_request_that_stops_first_still_reports_that_steps_logprobs(make_llm):
    _, llm = make_llm()
    prompt = list(range(5, 40))
    first = llm.complete(prompt, sampling=SamplingParams(max_tokens=1)).token_ids[0]
    out = llm.complete(prompt, sampling=SamplingParams(max_tokens=3, logprobs=2, stop_token_ids=(first,)))
    assert out.token_ids == [] and out.finish_reason == "stop"
    assert len(out.logprobs) == 1 and first in out.logprobs[0]  # the stop token's step, on the final delta


def test_logprobs_are_refused_where_they_are_not_carried():
    from lazyattn_rag.integrations.call_options import call_sampling, default_sampling
    from lazyattn_rag.serve.protocol import ChatCompletionRequest
    from lazyattn_rag.types.wire import sampling_to_body

    with pytest.raises(ValueError, match="not returned over HTTP"):
        sampling_to_body(SamplingParams(logprobs=1))
    with pytest.raises(ValueError, match="framework wrappers"):
        call_sampling(SamplingParams(), {"sampling": SamplingParams(logprobs=3)}, "ChatLazyAttention")
    with pytest.raises(TypeError, match="logprobs"):
        call_sampling(SamplingParams(), {"logprobs": 3}, "ChatLazyAttention")
    with pytest.raises(ValueError, match="logprobs"):
        default_sampling(0.0, 16, 1.0, [], {"logprobs": 2})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for extra in ({"top_logprobs": 3}, {"logprobs": False, "top_logprobs": 3}, {"logprobs": True, "top_logprobs": -2}):
        with pytest.raises(ValueError, match="top_logprobs"):
            ChatCompletionRequest.model_validate(body | extra)
    # the server returns them (OpenAI's shape; tests/test_serve_plain_prompts.py): the engine's count
    assert ChatCompletionRequest.model_validate(body | {"logprobs": False}).num_logprobs is None
    assert ChatCompletionRequest.model_validate(body | {"logprobs": True}).num_logprobs == 0
    assert ChatCompletionRequest.model_validate(body | {"logprobs": True, "top_logprobs": 5}).sampling_body()[
        "logprobs"] == 5


def test_skip_special_tokens_reaches_the_detokenizer(make_llm):
    """vLLM's ``skip_special_tokens``: a JSON boolean in the body, carried by SamplingParams (and
    the HTTP client's body) to each answer's detokenizer; unset keeps the default, ``True``."""
    from pydantic import ValidationError

    from lazyattn_rag.serve.protocol import ChatCompletionRequest
    from lazyattn_rag.types.wire import sampling_from_body, sampling_to_body

    body = {"messages": [{"role": "user", "content": "hi"}]}
    asked = sampling_from_body(ChatCompletionRequest.model_validate(body | {"skip_special_tokens": False})
                               .sampling_body(), SamplingParams())
    assert asked.skip_special_tokens is False
    assert sampling_from_body(ChatCompletionRequest.model_validate(body).sampling_body(),
                              SamplingParams()).skip_special_tokens is True
    assert sampling_from_body(sampling_to_body(asked), SamplingParams()) == asked
    with pytest.raises(ValidationError, match="skip_special_tokens"):
        ChatCompletionRequest.model_validate(body | {"skip_special_tokens": "false"})
    with pytest.raises(ValueError, match="skip_special_tokens must be a bool"):
        SamplingParams(skip_special_tokens=0)
    _, llm = make_llm()
    engine = llm.engine
    states = [engine._output_state(SamplingParams(skip_special_tokens=flag), lambda delta: True) for flag in (False, True)]
    assert [s.detokenizer.skip_special_tokens for s in states] == [False, True]


@pytest.mark.parametrize("extra, field", [
    ({"n": "2"}, "n"), ({"max_tokens": True}, "max_tokens"), ({"max_completion_tokens": 2.0}, "max_completion_tokens"),
    ({"stream": "true"}, "stream"), ({"seed": "7"}, "seed"), ({"logprobs": 1}, "logprobs"),
    ({"logprobs": True, "top_logprobs": False}, "top_logprobs"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids"), ({"stream": True, "stream_options": {"include_usage": "true"}},
                                                     "stream_options"),
])
def test_counts_and_flags_take_json_integers_and_booleans_only(extra, field):
    """As OpenAI's API: a string, float or boolean where a count or a flag goes is a 400 naming the
    field, not coerced (pydantic's lax mode made "2" two choices and true one token)."""
    from pydantic import ValidationError

    from lazyattn_rag.serve.protocol import ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate(body | extra)
    assert [e["loc"][0] for e in error.value.errors()] == [field]
    request = ChatCompletionRequest.model_validate(body | {"n": 2, "max_tokens": 3, "stream": True, "seed": 0})
    assert (request.n, request.max_tokens, request.stream, request.seed) == (2, 3, True, 0)


def test_ignored_fields_are_named_in_the_log_once_per_set(caplog):
    from lazyattn_rag.serve.protocol import ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "hi"}], "user": "u1", "zz_unknown_field": 1}
    with caplog.at_level("WARNING", logger="lazyattn_rag.serve"):
        for _ in range(3):
            ChatCompletionRequest.model_validate(body)
    logged = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert logged == ["ChatCompletionRequest: fields present in the request but ignored: 'user', 'zz_unknown_field'"]
    # a break-it trial's names: a megabyte long, a forged log line; shown cut and escaped
    caplog.clear()
    hostile = {"x" * (1 << 20): 1, "x\nERROR forged: admin logged in": 2}
    many = {f"f{i:02}": i for i in range(20)}
    with caplog.at_level("WARNING", logger="lazyattn_rag.serve"):
        ChatCompletionRequest.model_validate(body | hostile)
        ChatCompletionRequest.model_validate(body | many)
    first, second = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert "\n" not in first and len(first) < 300 and "'x\\nERROR forged" in first and "'xxxx" in first
    assert second.endswith("'f07' and 14 more")  # 22 names: 8 shown


def test_vllm_fields_that_change_the_answer_are_refused_by_name():
    from lazyattn_rag.serve.protocol import ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "hi"}]}
    for field, value in (("min_tokens", 4), ("include_stop_str_in_output", True)):
        with pytest.raises(ValueError, match=f"not supported by this server: {field}"):
            ChatCompletionRequest.model_validate(body | {field: value})
    ChatCompletionRequest.model_validate(body | {"min_tokens": 0, "include_stop_str_in_output": False})


def test_strict_max_tokens_refuses_what_the_context_cannot_hold(make_llm):
    from lazyattn_rag import PromptTooLongError
    from tests.tiny import words

    _, llm = make_llm(max_model_len=64)
    llm.add_document("a", words(20))
    loose = llm.generate("w1", ["a"], sampling=SamplingParams(max_tokens=500, ignore_eos=True))
    assert loose.finish_reason == "length" and loose.stats.num_prompt_tokens + len(loose.token_ids) == 64
    prompt = loose.stats.num_prompt_tokens
    with pytest.raises(PromptTooLongError, match=rf"asks for {prompt + 500} \({prompt} in the prompt, max_tokens=500\)"):
        llm.generate("w1", ["a"], sampling=SamplingParams(max_tokens=500, strict_max_tokens=True))
    fits = llm.generate("w1", ["a"], sampling=SamplingParams(max_tokens=64 - prompt, strict_max_tokens=True,
                                                             ignore_eos=True))
    assert len(fits.token_ids) == 64 - prompt
