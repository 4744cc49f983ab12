"""Start-up (issue 15.3): what an engine's build costs, shown in its stats, and the cheaper ways
it loads: the model built around its state dict's tensors, a lazily committed KV cache, one
garbage collection per build, and imports that leave torch and triton out until needed."""

import gc
import json
import subprocess
import sys

import pytest
import torch

from lazyattn_rag import CacheConfig, EngineConfig, SamplingParams
from lazyattn_rag.engine.model import CausalLM, ModelArchConfig
from lazyattn_rag.engine.runner import zeros
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
        assert sum(parts.values()) <= stats["startup_ms"] <= sum(parts.values()) + 1000
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
    from lazyattn_rag.engine.model import UnsupportedModelError

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
