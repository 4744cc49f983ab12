"""Loading a local model directory: the stop ids it declares (config.json, generation_config.json,
the tokenizer) and the default model's converted directory."""

import json

import pytest

from lazyattn_rag import EngineConfig, LazyAttention, SamplingParams
from lazyattn_rag.types.config import CacheConfig
from lazyattn_rag.engine.model.model_loading import declared_eos_token_ids
from tests.tiny import save_model_dir, words


def _engine(path, tmp_path):
    return LazyAttention(EngineConfig(model=str(path), device="cpu", dtype="float32", attention_backend="torch",
                                      cache_dir=tmp_path / "cache", cache=CacheConfig(num_blocks=64, block_size=16)))


def test_declared_eos_ids_are_the_union_of_both_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [3, 25], "text_config": {"eos_token_id": 7}}))
    assert declared_eos_token_ids(tmp_path) == {3, 7, 25}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 40}))
    assert declared_eos_token_ids(tmp_path) == {3, 7, 25, 40}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert declared_eos_token_ids(tmp_path) == {3, 7, 25}


def test_generation_stops_on_every_eos_id_config_json_declares(tmp_path):
    """config.json with ``eos_token_id: [3, t]`` and no generation_config.json: generation stops
    on ``t`` (it ran to the length limit when only generation_config.json was read)."""
    question = words(4, 30)
    path = save_model_dir(tmp_path / "model", [3])
    llm = _engine(path, tmp_path)
    try:
        first = llm.generate(question, sampling=SamplingParams(max_tokens=6, ignore_eos=True)).token_ids
    finally:
        llm.shutdown()
    stop = next(t for t in first if t != 3)  # the first token the greedy model emits that is not 3
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = [3, stop]
    (path / "config.json").write_text(json.dumps(config))
    llm = _engine(path, tmp_path)
    try:
        assert llm.engine.eos_token_ids == {3, stop}
        out = llm.generate(question, sampling=SamplingParams(max_tokens=6))
    finally:
        llm.shutdown()
    assert out.finish_reason == "stop"
    assert out.token_ids == first[:first.index(stop)]


def test_converted_default_model_carries_its_generation_config(smollm2_dir):
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    assert declared_eos_token_ids(smollm2_dir) == {config["eos_token_id"]}


def test_generation_defaults_follow_transformers_do_sample_rule(tmp_path):
    from lazyattn_rag.engine.model.model_loading import generation_defaults

    assert generation_defaults(tmp_path) == {}
    cfg = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))  # no do_sample: greedy, penalty kept
    assert generation_defaults(tmp_path) == {"repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({**cfg, "do_sample": True, "top_p": "x"}))
    assert generation_defaults(tmp_path) == {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05}


def test_calls_without_sampling_use_the_models_generation_config(tmp_path):
    from lazyattn_rag.types.sampling_params import SamplingParams as Params

    path = save_model_dir(tmp_path / "model", 3)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.5, "top_k": 7}))
    llm = _engine(path, tmp_path)
    try:
        assert llm.default_sampling == Params(temperature=0.5, top_k=7)
        assert llm.info()["default_sampling"] == {"temperature": 0.5, "top_k": 7}
    finally:
        llm.shutdown()
    import dataclasses

    config = dataclasses.replace(llm.config, generation_config="none")
    llm = LazyAttention(config)
    try:
        assert llm.default_sampling == Params()
    finally:
        llm.shutdown()


def test_converted_default_model_recommends_its_model_cards_sampling(smollm2_dir):
    from lazyattn_rag.engine.model.model_loading import DEFAULT_MODEL_SAMPLING, generation_defaults

    assert generation_defaults(smollm2_dir) == {"temperature": 0.2, "top_p": 0.9}
    assert DEFAULT_MODEL_SAMPLING["do_sample"] is True


def test_a_gguf_file_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    """``--model file.gguf`` goes through the same one-time conversion as the default model
    (the conversion itself is exercised by the default model's tests)."""
    from lazyattn_rag.engine.model import model_loading

    gguf = tmp_path / "Tiny-Q4.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    calls = []

    def fake_convert(path, out_dir, sampling=None):
        calls.append((path, out_dir, sampling))
        out_dir.mkdir(parents=True)
        (out_dir / "lazyattn_source.json").write_text("{}")

    monkeypatch.setattr(model_loading, "convert_gguf", fake_convert)
    cache = tmp_path / "cache"
    first = model_loading.resolve_model(str(gguf), cache)
    second = model_loading.resolve_model(str(gguf), cache)
    assert first == second and len(calls) == 1 and calls[0][2] is None  # no default sampling for others
    import hashlib

    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert first.path == cache / "models" / f"Tiny-Q4-{sha[:16]}" and first.weights_sha256 == sha
    assert first.name == "Tiny-Q4"
    with pytest.raises(model_loading.ModelNotFoundError, match="not a GGUF file or a local model directory"):
        model_loading.resolve_model(str(tmp_path / "missing.gguf"), cache)


def test_local_model_candidates_and_the_chat_hint(tmp_path):
    from lazyattn_rag.integrations.chatbot import better_model_hint
    from lazyattn_rag.engine.model.model_loading import local_model_candidates

    hub = tmp_path / "hub"
    good = hub / "models--org--Llama-3.2-1B-Instruct" / "snapshots" / "abc"
    other = hub / "models--org--bert" / "snapshots" / "def"
    for path, model_type in ((good, "llama"), (other, "bert")):
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps({"model_type": model_type}))
        (path / "model.safetensors").write_bytes(bytes(10))
    (hub / "small.gguf").write_bytes(bytes(5))
    (hub / "big.gguf").write_bytes(bytes(50))
    found = local_model_candidates([hub, tmp_path / "absent"])
    assert found == [hub / "big.gguf", good, hub / "small.gguf"]  # largest first; bert left out
    assert local_model_candidates([hub], limit=1) == [hub / "big.gguf"]
    hint = better_model_hint(found)
    assert "pass --model" in hint and f"  --model {good}" in hint.splitlines()
    assert better_model_hint([]).endswith("or a .gguf file.")
