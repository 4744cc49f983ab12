"""Start-up (issue 15.3): what an engine's build costs, shown in its stats, and the cheaper ways
it loads: the model built around its state dict's tensors, a lazily committed KV cache, one
garbage collection per build, and imports that leave torch and triton out until needed."""

import dataclasses
import gc
import json
import subprocess
import sys

import pytest
import torch

from lazyattn_rag import CacheConfig, EngineConfig, SamplingParams
from lazyattn_rag.engine.model.transformer import CausalLM, ModelArchConfig
from lazyattn_rag.engine.kv.kv_pool import zeros
from lazyattn_rag.kernels.rope import RotaryEmbedding
from lazyattn_rag.llm import LazyAttention
from tests.tiny import hf_and_ours, hf_config, word_tokenizer, words

DIRECTORY_PARTS = ["import_transformers", "resolve_model", "config_tokenizer", "weights", "kv_cache", "engine_init",
                   "self_check", "collect_garbage"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    hf, _ = hf_and_ours(hf_config(tie_word_embeddings=True))
    hf.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def _config(model_dir, tmp_path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
                        cache_dir=tmp_path / "cache", cache=CacheConfig(num_blocks=64))


def test_stats_report_startup_parts_and_the_first_requests_own_ttft(model_dir, tmp_path):
    llm = LazyAttention(_config(model_dir, tmp_path))
    try:
        stats = llm.stats()
        assert stats["first_request_ttft_ms"] is None  # no request yet
        assert list(stats["startup_parts_ms"]) == DIRECTORY_PARTS
        assert stats["self_check"] == "ran"  # a fresh cache directory: the first start of this model
        parts = stats["startup_parts_ms"]
        assert all(ms >= 0 for ms in parts.values()) and parts["self_check"] > 0
        # The parts are laps of one clock that starts before the engine thread does.
        assert sum(parts.values()) - 1 <= stats["startup_ms"] <= sum(parts.values()) + 1000  # parts rounded to 0.1 ms
        llm.add_document("d", words(20, 7))
        first = llm.generate(words(3, 40), ["d"], sampling=SamplingParams(max_tokens=3)).stats
        second = llm.generate(words(3, 50), ["d"], sampling=SamplingParams(max_tokens=3)).stats
        stats = llm.stats()
        assert first.ttft_ms is not None and second.ttft_ms is not None
        assert stats["first_request_ttft_ms"] == first.ttft_ms  # the first request's own, not the latest
    finally:
        llm.shutdown()
    again = LazyAttention(_config(model_dir, tmp_path))  # same cache directory: the verdict is read
    try:
        stats = again.stats()
        assert stats["self_check"] == "cached"
        assert stats["startup_parts_ms"]["self_check"] < parts["self_check"]
    finally:
        again.shutdown()


def test_from_model_stats_name_its_own_parts():
    cfg = hf_config()
    _, ours = hf_and_ours(cfg)
    llm = LazyAttention.from_model(ours, word_tokenizer(), EngineConfig(device="cpu", dtype="float32",
                                                                        attention_backend="torch",
                                                                        cache=CacheConfig(num_blocks=64)),
                                   hf_config=cfg)
    try:
        stats = llm.stats()
        assert list(stats["startup_parts_ms"]) == ["weights_hash", "kv_cache", "engine_init", "self_check",
                                                   "collect_garbage"]
        assert stats["self_check"] == "rotary"  # no directory: the rotary part, every start
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tie", [False, True])
def test_model_built_around_the_state_dict_equals_the_copied_one(tie):
    cfg = hf_config(tie_word_embeddings=tie)
    hf, copied = hf_and_ours(cfg)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    built = CausalLM.from_hf_state_dict(ModelArchConfig.from_hf_config(cfg), RotaryEmbedding.from_hf_config(cfg),
                                        dict(state)).eval()
    assert all(p.device.type == "cpu" for p in built.parameters())  # nothing left on the meta device
    assert built.state_dict().keys() == copied.state_dict().keys()
    for name, tensor in copied.state_dict().items():
        assert torch.equal(built.state_dict()[name], tensor), name
    # Unfused parameters are the given tensors themselves (no copy); the embedding stays tied.
    assert built.model.layers[0].self_attn.o_proj.weight.data_ptr() == state["model.layers.0.self_attn.o_proj.weight"].data_ptr()
    assert built.model.embed_tokens.weight.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert (built.lm_head.weight is built.model.embed_tokens.weight) == tie


def test_model_built_around_a_state_dict_names_missing_weights():
    from lazyattn_rag.engine.model.transformer import UnsupportedModelError

    cfg = hf_config()
    hf, _ = hf_and_ours(cfg)
    state = dict(hf.state_dict())
    del state["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mlp.down_proj.weight"):
        CausalLM.from_hf_state_dict(ModelArchConfig.from_hf_config(cfg), RotaryEmbedding.from_hf_config(cfg), state)


def test_cpu_kv_tensors_are_zero_writable_and_free_their_memory():
    def mapped_kib() -> int:
        return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmSize")))

    before = mapped_kib()
    t = zeros((65, 16, 2, 64), torch.float32, torch.device("cpu"))  # [num_blocks + 1, block_size, kv_heads, head_dim]
    assert t.shape == (65, 16, 2, 64) and t.is_contiguous() and not t.any()
    t[3, 5] = 2.0
    assert t.view(-1, 2, 64)[3 * 16 + 5].eq(2.0).all() and t.sum() == 2.0 * 2 * 64
    assert zeros((0, 4), torch.bfloat16, torch.device("cpu")).shape == (0, 4)
    big = zeros((64, 2**20), torch.float32, torch.device("cpu"))  # 256 MiB, never touched
    assert mapped_kib() - before >= 256 * 1024
    del t, big
    assert mapped_kib() - before < 64 * 1024  # unmapped with the tensors


@pytest.mark.parametrize("enabled", [True, False])
def test_build_leaves_the_garbage_collector_as_it_found_it(model_dir, tmp_path, enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        LazyAttention(_config(model_dir, tmp_path)).shutdown()
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_importing_the_package_and_cli_loads_no_torch_and_the_engine_no_triton():
    code = ("import sys, json; import lazyattn_rag, lazyattn_rag.cli; a = 'torch' in sys.modules; "
            "import lazyattn_rag.llm; print(json.dumps([a, 'triton' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [False, False]


# --- transformers' config and tokenizer, memoized ----------------------------------------------
def _family_dir(path, family: str, rope: dict | None = None):
    hf, _ = hf_and_ours(hf_config(family, rope=rope))
    hf.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_memoized_config_and_tokenizer_build_the_same_engine(tmp_path, family):
    from lazyattn_rag.engine.model.model_config import ResolvedConfig, load_config_and_tokenizer

    path = _family_dir(tmp_path / "model", family)
    if family != "qwen2":  # AutoTokenizer picks Qwen2Tokenizer, whose byte-level pre-tokenizer finds no word
        digests, answers = [], []  # of the test vocabulary in a text: no document could be registered
        config = dataclasses.replace(_config(path, tmp_path), self_check=False)  # the next test has it
        for _ in range(2):  # the first loads through AutoConfig / AutoTokenizer and writes the memo
            llm = LazyAttention(config)
            try:
                digests.append(llm.engine.model_digest)  # weights, RoPE, tokenizer, chat template, ...
                answers.append(llm.generate(words(3, 40), documents=[("d", words(20, 7))],
                                            sampling=SamplingParams(max_tokens=4, ignore_eos=True)).token_ids)
            finally:
                llm.shutdown()
        assert digests[0] == digests[1] and answers[0] == answers[1]
        assert len(list((tmp_path / "cache" / "resolved").glob("*.json"))) == 1  # the second read it
    full_config, full_tokenizer = load_config_and_tokenizer(path, tmp_path / "fresh")
    config, tokenizer = load_config_and_tokenizer(path, tmp_path / "fresh")  # read back from the memo
    assert not isinstance(full_config, ResolvedConfig) and isinstance(config, ResolvedConfig)
    [memo] = (tmp_path / "fresh" / "resolved").glob("*.json")
    assert json.loads(memo.read_text())["tokenizer_class"] == f"{type(tokenizer).__module__}.{type(tokenizer).__name__}"
    assert ModelArchConfig.from_hf_config(config) == ModelArchConfig.from_hf_config(full_config)
    assert (RotaryEmbedding.from_hf_config(config).fingerprint()
            == RotaryEmbedding.from_hf_config(full_config).fingerprint())
    assert getattr(config, "sliding_window", None) == getattr(full_config, "sliding_window", None)
    assert type(tokenizer) is type(full_tokenizer)
    assert tokenizer.backend_tokenizer.to_str() == full_tokenizer.backend_tokenizer.to_str()
    assert tokenizer.all_special_ids == full_tokenizer.all_special_ids


def test_a_memoized_config_still_runs_the_self_check_with_transformers_own(tmp_path, monkeypatch):
    from lazyattn_rag.engine.model import model_config
    from lazyattn_rag.engine.self_check import checks as self_check

    path = _family_dir(tmp_path / "model", "llama")
    model_config.load_config_and_tokenizer(path, tmp_path / "cache")  # the memo, without a verdict
    checked = []
    real_check_rotary = self_check.check_rotary
    monkeypatch.setattr(self_check, "check_rotary", lambda rotary, cfg: checked.append(cfg) or real_check_rotary(rotary, cfg))
    llm = LazyAttention(_config(path, tmp_path))
    try:
        assert llm.stats()["self_check"] == "ran"
    finally:
        llm.shutdown()
    [cfg] = checked
    assert not isinstance(cfg, model_config.ResolvedConfig) and type(cfg).__name__ == "LlamaConfig"


def test_configs_are_not_memoized_when_transformers_computes_the_rope(tmp_path):
    from lazyattn_rag.engine.model.model_config import ResolvedConfig, load_config_and_tokenizer

    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    path = _family_dir(tmp_path / "model", "llama", rope=llama3)
    for _ in range(2):
        config, _ = load_config_and_tokenizer(path, tmp_path / "cache")
        assert not isinstance(config, ResolvedConfig)
    assert not (tmp_path / "cache" / "resolved").exists()


def test_a_changed_or_broken_memo_is_not_used(tmp_path):
    from lazyattn_rag.engine.model.model_config import ResolvedConfig, load_config_and_tokenizer

    path = _family_dir(tmp_path / "model", "llama")
    cache = tmp_path / "cache"
    load_config_and_tokenizer(path, cache)
    [memo] = (cache / "resolved").glob("*.json")
    memo.write_text("{not json")
    config, _ = load_config_and_tokenizer(path, cache)  # unreadable: loaded in full, memo rewritten
    assert not isinstance(config, ResolvedConfig) and isinstance(load_config_and_tokenizer(path, cache)[0],
                                                                  ResolvedConfig)
    data = json.loads((path / "config.json").read_text())
    data["rms_norm_eps"] = 1e-5
    (path / "config.json").write_text(json.dumps(data))  # another size or mtime: another key
    config, _ = load_config_and_tokenizer(path, cache)
    assert not isinstance(config, ResolvedConfig) and config.rms_norm_eps == 1e-5
    assert len(list((cache / "resolved").glob("*.json"))) == 2


def test_the_cli_fits_openmp_to_the_idle_cores_unless_told():
    from lazyattn_rag.cli_runtime import openmp_settings, others_running

    assert openmp_settings({}, 2, 0) == {}  # quiet: libgomp's defaults
    assert openmp_settings({}, 2, 1) == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_settings({}, 2, 5) == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_settings({}, 16, 3) == {"OMP_NUM_THREADS": "13", "OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_settings({"OMP_NUM_THREADS": "2"}, 2, 5) == {}  # the user's choice stands
    assert openmp_settings({"OMP_WAIT_POLICY": "ACTIVE"}, 2, 5) == {}
    assert others_running() >= 0
