"""Structured output (issue 40): the constraint type, the token mask against an independent walk
over the vocabulary, and the default model's answers under each kind of constraint."""

import json
import re

import pytest
import torch
from pydantic import BaseModel, Field

from lazyattn_rag import SamplingParams, StructuredOutputParams
from lazyattn_rag.engine.output.grammar import GrammarCompiler, mask_rows


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=10**9)  # bounded: the small default model may repeat a digit forever


QUESTIONS = [f"Describe {c} as JSON: its name, its country and its population." for c in (
    "Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin", "Oslo",
    "Athens", "Cairo", "Tokyo", "Seoul", "Lima", "Quito", "Nairobi", "Ottawa", "Sydney", "Hanoi")]


@pytest.mark.parametrize("kwargs, message", [
    ({}, "got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "json must be a JSON schema"),
    ({"choice": []}, "1 to 1024 non-empty strings"),
    ({"choice": ["a", ""]}, "choice 1 is empty"),
    ({"choice": "ab"}, "list of strings"),
    ({"regex": " "}, "regex must be a non-empty string"),
    # what the mask cannot enforce is refused, wherever it sits in the schema
    ({"json": {"allOf": [{"type": "integer"}, {"maximum": 6}]}}, r"'allOf' of several schemas \(at \$\)"),
    ({"json": {"type": "array", "items": {"type": "array", "uniqueItems": True}}}, r"'uniqueItems' \(at \$\.items\)"),
    ({"json": {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}}, "required 'b'"),
    ({"json": {"$defs": {"X": {"properties": {"p": {"not": {"const": 1}}}}}, "$ref": "#/$defs/X"}},
     r"'not' \(at \$\.\$defs\.X\.properties\.p\)"),
])
def test_params_refuse_what_they_cannot_mean(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputParams(**kwargs)


def test_params_round_trip_and_keep_property_order():
    params = StructuredOutputParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert list(json.loads(params.json)["properties"]) == ["b", "a"]  # the order the answer's keys come in
    for p in (params, StructuredOutputParams(choice=["x", "y"]), StructuredOutputParams(json_object=True)):
        assert StructuredOutputParams.from_body(p.to_body()) == p
    with pytest.raises(ValueError, match="unknown structured output field"):
        StructuredOutputParams.from_body({"jsonschema": "{}"})
    with pytest.raises(ValueError, match="structured_output must be None or a StructuredOutputParams"):
        SamplingParams(structured_output={"regex": "a"})


@pytest.fixture(scope="module")
def compiler(smollm2):
    engine = smollm2.engine
    return GrammarCompiler(engine.tokenizer, engine.runner.model.config.vocab_size, engine.eos_token_ids)


@pytest.mark.parametrize("kwargs, field", [({"regex": "("}, "regex"), ({"grammar": "root ::= nothing"}, "grammar"),
                                           ({"json": '{"type": "no-such-type"}'}, "json")])
def test_what_does_not_compile_is_refused_by_name(compiler, kwargs, field):
    with pytest.raises(ValueError, match=f"structured output {field} does not compile: "):
        compiler.compile(StructuredOutputParams(**kwargs))


def test_mask_allows_exactly_the_tokens_that_continue_a_match(smollm2, compiler):
    """Reference: decode every vocabulary entry alone and test it against the regex (digits
    only, then one letter): at the start a token is allowed iff its whole text is a non-empty
    run of digits, or digits followed by one lowercase letter."""
    tokenizer, vocab_size = smollm2.engine.tokenizer, smollm2.engine.runner.model.config.vocab_size
    state = compiler.matcher(StructuredOutputParams(regex=r"[0-9]+[a-z]"))
    masked = mask_rows(torch.zeros(1, vocab_size), {0: state})[0]
    allowed = {i for i in range(vocab_size) if masked[i] == 0}
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    expected = {i for i, t in texts.items() if re.fullmatch(r"[0-9]+[a-z]?", t)}
    assert allowed == expected and len(expected) >= 10
    assert torch.isneginf(masked[sorted(set(range(vocab_size)) - allowed)]).all()
    state.accept(tokenizer.convert_tokens_to_ids("7"))
    with pytest.raises(RuntimeError, match="the grammar refuses it"):
        state.accept(tokenizer.convert_tokens_to_ids("{"))


def test_one_step_masks_only_its_constrained_rows(smollm2, compiler):
    """A step's rows: two grammars in different states and an unconstrained row. Each masked
    row allows exactly what its grammar alone allows (the regex reference above, by decoding);
    the unconstrained row and the input are left as they were."""
    tokenizer, vocab_size = smollm2.engine.tokenizer, smollm2.engine.runner.model.config.vocab_size
    digits, letters = (compiler.matcher(StructuredOutputParams(regex=r"[0-9]+[a-z]")) for _ in range(2))
    letters.accept(tokenizer.convert_tokens_to_ids("7"))  # now a digit or one letter, then the end
    logits = torch.randn(3, vocab_size)
    masked = mask_rows(logits, {0: digits, 2: letters})
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    for row, pattern in ((0, r"[0-9]+[a-z]?"), (2, r"[0-9]*[a-z]?")):
        allowed = {i for i in range(vocab_size) if torch.isfinite(masked[row, i])}
        assert allowed - set(tokenizer.all_special_ids) == {i for i, t in texts.items() if t and re.fullmatch(pattern, t)}
        assert torch.equal(masked[row, sorted(allowed)], logits[row, sorted(allowed)])
    assert torch.equal(masked[1], logits[1]) and torch.isfinite(logits).all()
    assert mask_rows(logits, {}) is logits


def assert_eight_schema_answers_at_once(llm) -> None:
    """Eight questions streamed at once under the City schema: each answer ends by itself and
    validates."""
    params = SamplingParams(max_tokens=64, structured_output=StructuredOutputParams(json=City.model_json_schema()))
    streams = [llm.stream_chat([{"role": "user", "content": q}], sampling=params) for q in QUESTIONS[:8]]
    for question, stream in zip(QUESTIONS, streams):
        deltas = list(stream)
        text = "".join(d.text for d in deltas)
        assert deltas[-1].finish_reason == "stop", (question, text)
        City.model_validate_json(text)


def test_json_schema_answers_parse_and_validate_for_eight_prompts_at_once(smollm2):
    """In process (the server's test asks all twenty)."""
    assert_eight_schema_answers_at_once(smollm2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_mask_applies_on_the_gpu_with_the_triton_backend(smollm2_dir):
    """The mask on CUDA logits, in batched decode steps of the fused kernels (bfloat16): eight
    answers at once parse and validate; a choice constraint yields only its options."""
    from lazyattn_rag import CacheConfig, EngineConfig, LazyAttention

    llm = LazyAttention(EngineConfig(model=str(smollm2_dir), device="cuda", dtype="bfloat16",
                                     attention_backend="triton", cache=CacheConfig(num_blocks=512)))
    try:
        assert_eight_schema_answers_at_once(llm)
        choice = SamplingParams(max_tokens=8, structured_output=StructuredOutputParams(choice=["yes", "no"]))
        assert llm.chat([("user", "Is Paris in France?")], sampling=choice).text in ("yes", "no")
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kwargs, check", [
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"choice": ["🗼 😀"]}, lambda t: t == "🗼 😀"),  # characters outside the BMP
    ({"regex": r"1[0-9]{3}"}, lambda t: re.fullmatch(r"1[0-9]{3}", t)),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ({"grammar": 'root ::= "The answer is " ("yes" | "no") "."'}, lambda t: t in ("The answer is yes.",
                                                                                 "The answer is no.")),
])
def test_each_kind_of_constraint_shapes_the_answer(smollm2, kwargs, check):
    question = "Is the Eiffel Tower in Paris? When was it built?"
    sampling = SamplingParams(max_tokens=40, temperature=0.8, seed=3,
                              structured_output=StructuredOutputParams(**kwargs))
    out = smollm2.chat([{"role": "user", "content": question}], sampling=sampling)
    assert out.finish_reason == "stop" and check(out.text), out.text


def test_a_grammar_that_raises_fails_its_own_request_only(smollm2, monkeypatch):
    """Three requests decode together; one's grammar raises on its third mask (as xgrammar does
    for a terminated matcher): that request's stream raises it, the other two answer whole."""
    from lazyattn_rag.engine.output.grammar import GrammarState

    fill, calls = GrammarState.fill, {}

    def failing_fill(self, bitmask, row):
        if getattr(self, "breaks", False):
            calls[id(self)] = calls.get(id(self), 0) + 1
            if calls[id(self)] == 3:
                raise RuntimeError("the grammar broke")
        fill(self, bitmask, row)

    matcher = type(smollm2.engine.grammars).matcher

    def marking_matcher(self, params):
        state = matcher(self, params)
        state.breaks = params.regex == "[0-9]{9}"
        return state

    monkeypatch.setattr(GrammarState, "fill", failing_fill)
    monkeypatch.setattr(type(smollm2.engine.grammars), "matcher", marking_matcher)
    question = [{"role": "user", "content": "Count from one to twenty."}]
    streams = [smollm2.stream_chat(question, sampling=SamplingParams(
        max_tokens=12, ignore_eos=True, structured_output=StructuredOutputParams(**kwargs) if kwargs else None))
        for kwargs in ({"regex": "[0-9]{9}"}, {"regex": "[a-z ]+"}, {})]
    with pytest.raises(RuntimeError, match="the grammar broke"):
        list(streams[0])
    letters, free = ("".join(d.text for d in s) for s in streams[1:])
    assert re.fullmatch("[a-z ]+", letters) and free


def test_logprobs_stay_the_models_own_and_bad_grammars_touch_nothing(smollm2):
    question = [{"role": "user", "content": "Name a colour."}]
    free = smollm2.chat(question, sampling=SamplingParams(max_tokens=1, logprobs=5))
    bound = smollm2.chat(question, sampling=SamplingParams(
        max_tokens=1, logprobs=5, structured_output=StructuredOutputParams(choice=["zebra"])))
    first_free, first_bound = free.logprobs[0], bound.logprobs[0]
    shared = set(first_free) & set(first_bound)
    assert len(shared) >= 5 and all(abs(first_free[t] - first_bound[t]) < 1e-4 for t in shared)
    assert bound.text and "zebra".startswith(bound.text) and not "zebra".startswith(free.text)
    before = smollm2.engine.counters.num_requests_finished
    with pytest.raises(ValueError, match="regex does not compile"):
        smollm2.chat(question, sampling=SamplingParams(structured_output=StructuredOutputParams(regex="[")))
    assert smollm2.chat(question, sampling=SamplingParams(max_tokens=2)).token_ids
    assert smollm2.engine.counters.num_requests_finished == before + 1



def test_llamaindex_structured_predict_enforces_the_schema(smollm2):
    import asyncio

    from llama_index.core.prompts import PromptTemplate

    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

    llm = LazyAttentionLLM(smollm2, SamplingParams(max_tokens=64))
    prompt = PromptTemplate("Describe {city} as JSON: its name, its country and its population.")
    assert isinstance(llm.structured_predict(City, prompt, city="Vienna"), City)
    assert isinstance(asyncio.run(llm.astructured_predict(City, prompt, city="Oslo")), City)
    assert isinstance(llm.as_structured_llm(City).complete("Describe Rome as JSON.").raw, City)


def test_a_slow_grammar_compile_holds_up_only_its_own_request(smollm2, monkeypatch):
    """Grammars compile in the client's grammar threads, not the planning thread every request
    goes through: while one schema's compile is held, a plain request and a plain-text chat (planned in
    the planning thread) still answer; the held one answers once its compile is let go."""
    import threading

    grammars, release, started = smollm2.engine.grammars, threading.Event(), threading.Event()
    compile_fn = grammars.compile

    def held_compile(params):
        if params.regex == "[0-9]+":  # this test's constraint only
            started.set()
            assert release.wait(60), "the test never let the compile go"
        return compile_fn(params)

    monkeypatch.setattr(grammars, "compile", held_compile)
    held = {}
    thread = threading.Thread(target=lambda: held.setdefault("out", smollm2.chat(
        [{"role": "user", "content": "A number?"}],
        sampling=SamplingParams(max_tokens=4, structured_output=StructuredOutputParams(regex="[0-9]+")))))
    thread.start()
    assert started.wait(60)
    plain = smollm2.chat([{"role": "user", "content": "Say hi."}], sampling=SamplingParams(max_tokens=3))
    assert plain.token_ids and "out" not in held  # answered while the compile is still held
    release.set()
    thread.join(60)
    assert held["out"].text.isdigit()
