"""The start-up self-check against transformers (``engine/self_check/checks.py``): a model whose
positions we would compute wrongly is refused, a correct one passes once and then reads its
cached verdict."""

import json

import pytest
import torch
from lazyattn_rag.kernels.rope import RotaryEmbedding

from lazyattn_rag import CacheConfig, EngineConfig, SamplingParams
from lazyattn_rag.engine.self_check import checks as self_check, logits as self_check_logits, rotary as self_check_rotary
from lazyattn_rag.types.errors import SelfCheckError
from lazyattn_rag.llm import LazyAttention
from tests.oracle import oracle_generate
from tests.tiny import hf_and_ours, hf_config, word_tokenizer, words

PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


def _save_model(path, rope: dict | None = None, **overrides):
    """A tiny random Llama (with sharpened attention, so position errors show in its logits)
    saved as a Hugging Face directory with the word tokenizer; ``rope`` replaces the
    ``rope_parameters`` written to config.json. Returns the HF model."""
    hf, _ = hf_and_ours(hf_config(**overrides))
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    hf.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    if rope is not None:
        config = json.loads((path / "config.json").read_text())
        config["rope_parameters"] = rope
        (path / "config.json").write_text(json.dumps(config))
    return hf


def _config(model_dir, tmp_path, **kwargs) -> EngineConfig:
    cache = kwargs.pop("cache", CacheConfig(num_blocks=64))
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
                        cache_dir=tmp_path / "cache", cache=cache, **kwargs)


def _verdicts(tmp_path) -> list:
    return sorted((tmp_path / "cache" / "self_check").glob("*.json"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    _save_model(path)
    return path


# --- (1) a correct model passes, once ---------------------------------------------------------
def test_directory_model_passes_and_second_load_reads_the_cached_verdict(model_dir, tmp_path, monkeypatch):
    llm = LazyAttention(_config(model_dir, tmp_path))
    llm.shutdown()
    [path] = _verdicts(tmp_path)
    verdict = json.loads(path.read_text())
    assert verdict["passed"] is True and verdict["key"]["check_version"] == self_check.CHECK_VERSION
    assert verdict["key"]["model"] == llm.engine.model_digest and verdict["key"]["backend"] == "torch"
    rotary, logits = verdict["report"]["rotary"], verdict["report"]["logits"]
    assert rotary["positions"] == [0, 1, 17, 4095, 16383, 2**20 - 1, 2**24 - 1]
    assert max(rotary["encode"].values()) <= 1e-6  # the same float32 angles as transformers
    [chunk] = logits["chunks"]
    assert chunk["delta"] == chunk["global_start"] > 0 and logits["chunk_served_from_cache"]
    assert len(logits["rows"]) == self_check_logits.PROBE_TOKENS
    assert logits["max_abs_diff"] <= 1e-5
    assert logits["offset_sensitivity"] > 100 * max(logits["tolerance"], logits["max_abs_diff"])
    mtime = path.stat().st_mtime_ns

    def must_not_run(*args, **kwargs):
        raise AssertionError("the self-check ran again despite a cached verdict")

    monkeypatch.setattr(self_check, "check_rotary", must_not_run)
    monkeypatch.setattr(self_check, "check_logits", must_not_run)
    llm = LazyAttention(_config(model_dir, tmp_path))
    try:
        out = llm.generate(words(3, 40), documents=[("d", words(20, 7))], sampling=SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()
    assert len(out.token_ids) == 2
    assert _verdicts(tmp_path) == [path] and path.stat().st_mtime_ns == mtime


def test_changed_check_version_runs_the_check_again(model_dir, tmp_path, monkeypatch):
    LazyAttention(_config(model_dir, tmp_path)).shutdown()
    monkeypatch.setattr(self_check, "CHECK_VERSION", self_check.CHECK_VERSION + 1)
    LazyAttention(_config(model_dir, tmp_path)).shutdown()
    assert len(_verdicts(tmp_path)) == 2


def test_self_check_false_skips_the_check(tmp_path):
    path = tmp_path / "model"
    _save_model(path, PARTIAL_ROPE)
    LazyAttention(_config(path, tmp_path, self_check=False)).shutdown()
    assert _verdicts(tmp_path) == []


def test_model_too_large_for_a_reference_skips_only_the_logits(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(self_check_logits, "reference_budget_bytes", lambda: 1000)
    LazyAttention(_config(model_dir, tmp_path)).shutdown()
    report = json.loads(_verdicts(tmp_path)[0].read_text())["report"]
    num_params = sum(p.numel() for p in hf_and_ours(hf_config())[1].parameters())
    assert report["rotary"]["passed"]
    assert report["logits"]["skipped"].startswith(f"{num_params:,} parameters: a float32 reference needs")


def test_an_fp8_cache_skips_only_the_logits_and_says_why(model_dir, tmp_path):
    LazyAttention(_config(model_dir, tmp_path, cache=CacheConfig(num_blocks=64, kv_cache_dtype="fp8"))).shutdown()
    report = json.loads(_verdicts(tmp_path)[0].read_text())["report"]
    assert report["rotary"]["passed"]
    assert report["logits"]["skipped"].startswith("kv_cache_dtype 'fp8': the cached K/V are FP8-rounded")


def test_probe_ignores_the_users_context_limit_and_skips_a_too_short_model(model_dir, tmp_path):
    LazyAttention(_config(model_dir, tmp_path / "a", max_model_len=16)).shutdown()  # the probe has 37 tokens
    logits = json.loads(_verdicts(tmp_path / "a")[0].read_text())["report"]["logits"]
    assert logits["passed"] and logits["num_prompt_tokens"] > 16 and logits["max_abs_diff"] <= 1e-5
    short = tmp_path / "short"
    _save_model(short, max_position_embeddings=24)
    LazyAttention(_config(short, tmp_path / "b")).shutdown()
    report = json.loads(_verdicts(tmp_path / "b")[0].read_text())["report"]
    assert report["rotary"]["passed"] and report["rotary"]["positions"][:4] == [0, 1, 17, 23]
    assert report["logits"]["skipped"].startswith("the probe does not fit the model's context")


# --- (2) rotary tables we would get wrong -----------------------------------------------------
def test_rope_config_we_would_mishandle_is_refused(tmp_path):
    """transformers' Llama ignores ``partial_rotary_factor`` (it rotates all 16 dimensions of a
    head); ours would rotate 8: every position but 0 would be wrong."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    path = tmp_path / "model"
    _save_model(path, PARTIAL_ROPE)
    loaded = AutoConfig.from_pretrained(str(path))
    assert loaded.rope_parameters["partial_rotary_factor"] == 0.5
    x = torch.ones(1, 1, 1, 16)  # [batch, heads, positions, head_dim]
    theirs, _ = apply_rotary_pos_emb(x, x, *LlamaRotaryEmbedding(loaded)(x, torch.tensor([[1]])))
    ours = RotaryEmbedding.from_hf_config(loaded).encode(x[0].transpose(0, 1), torch.tensor([1]))
    assert theirs[0, 0, 0, 8].item() == pytest.approx(torch.tensor(1.0).cos() + torch.tensor(1.0).sin())
    assert ours[0, 0, 8].item() == 1.0  # dimension 8 pairs with 0 in transformers; ours leaves it as is
    with pytest.raises(SelfCheckError) as info:
        LazyAttention(_config(path, tmp_path))
    message, report = str(info.value), info.value.report["rotary"]
    assert "rotary" in message and "partial_rotary_factor" in message and "self_check=False" in message
    assert "we rotate 8 of 16 dimensions with 4 frequencies, transformers has 8" in message
    assert report["encode"]["0"] == 0.0  # position 0 is the identity in both
    assert all(report["encode"][str(p)] > 0.1 for p in (1, 17, 4095, 16383))
    assert "logits" not in info.value.report
    assert _verdicts(tmp_path) == []  # a failure is never cached


def test_inv_freq_one_ulp_off_is_caught_at_large_offsets(tmp_path):
    """A frequency off by one float32 ulp agrees with transformers at small positions and is
    wrong by tenths of a radian near 2^20: the large probe offsets are what catch it."""
    cfg = hf_config()
    _, ours = hf_and_ours(cfg)
    rotary = ours.rotary
    ours.rotary = RotaryEmbedding(rotary.inv_freq * (1 + 2.0**-23), rotary.attention_scaling, rotary.head_dim,
                                  rotary.rotary_dim, rotary.interleaved, rotary.rope_type, rotary.params)
    report = self_check.check_rotary(ours.rotary, cfg)
    assert not report["passed"]
    assert all(report["encode"][str(p)] <= self_check_rotary.ROTARY_TOLERANCE for p in (0, 1, 17))
    assert report["encode"][str(2**20 - 1)] > 0.05
    with pytest.raises(SelfCheckError, match=r"positions \{4095: .*1048575: "):
        LazyAttention.from_model(ours, word_tokenizer(), EngineConfig(device="cpu", cache=CacheConfig(num_blocks=8)),
                                 hf_config=cfg)


def test_from_model_checks_rotary_only_with_an_hf_config(tmp_path):
    cfg = hf_config("llama", PARTIAL_ROPE)
    _, ours = hf_and_ours(hf_config())  # weights of a head_dim-16 model; the tampered config's rotary
    ours.rotary = RotaryEmbedding.from_hf_config(cfg)
    config = EngineConfig(device="cpu", cache=CacheConfig(num_blocks=8), cache_dir=tmp_path / "cache")
    with pytest.raises(SelfCheckError, match="rotary"):
        LazyAttention.from_model(ours, word_tokenizer(), config, hf_config=cfg)
    LazyAttention.from_model(ours, word_tokenizer(), config).shutdown()  # nothing to compare with
    assert _verdicts(tmp_path) == []  # from_model caches no verdict


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn"])
def test_supported_rope_scalings_pass_the_rotary_check(name):
    from tests.tiny import MODEL_CASES

    family, rope, overrides = MODEL_CASES[name]
    cfg = hf_config(family, rope, **overrides)
    report = self_check.check_rotary(RotaryEmbedding.from_hf_config(cfg), cfg)
    assert report["passed"], report
    assert max(report["encode"].values()) <= 1e-6


# --- (3) the logits of a cached chunk at a non-zero offset ------------------------------------
def test_reference_mask_equals_the_kv_shifting_oracle():
    """The 4D-mask reference (one forward, normal positions, the document attending only to
    itself) equals tests/oracle.py's construction (the document encoded alone, its K rotated
    by delta with transformers' rotate_half, concatenated into a cache), and differs from a
    plain causal forward."""
    hf, _ = hf_and_ours(hf_config())
    head, doc, tail = list(range(4, 11)), list(range(30, 53)), list(range(60, 66))
    ids = head + doc + tail
    span = (len(head), len(head) + len(doc), len(head))
    ours = self_check_logits.reference_logits(hf, ids, [span])
    _, first = oracle_generate(hf, [([], head, 0), ([], doc, len(head))], tail, 1)
    assert (ours[-1] - first).abs().max().item() <= 1e-5
    plain = self_check_logits.reference_logits(hf, ids, [])
    assert (plain[-1] - first).abs().max().item() > 1e-3


def test_logits_probe_refuses_an_ignored_offset(model_dir, tmp_path, monkeypatch):
    """A backend that ignores each cached block's delta computes exactly transformers' forward
    with the chunk at its local positions: the error equals the probe's offset sensitivity."""
    from lazyattn_rag.engine.worker.attention.torch_backend import TorchAttentionBackend

    monkeypatch.setattr(TorchAttentionBackend, "_rotate", lambda self, x, plan, name, deltas: x)
    with pytest.raises(SelfCheckError) as info:
        LazyAttention(_config(model_dir, tmp_path))
    report = info.value.report["logits"]
    assert info.value.report["rotary"]["passed"] and not report["passed"]
    assert report["max_abs_diff"] > 100 * report["tolerance"]
    assert report["max_abs_diff"] == pytest.approx(report["offset_sensitivity"], abs=1e-5)
    message = str(info.value)
    assert "logits of a probe request" in message and f"(delta {report['chunks'][0]['delta']})" in message
    assert "CacheConfig(mode='full')" in message and "self_check=False" in message
    assert _verdicts(tmp_path) == []


def test_logits_probe_refuses_an_offset_off_by_one(model_dir, tmp_path, monkeypatch):
    from lazyattn_rag.engine.scheduling import scheduler

    entries = scheduler.block_table_entries
    monkeypatch.setattr(scheduler, "block_table_entries",
                        lambda blocks, n, delta, bs, *flags: entries(blocks, n, delta + 1 if delta else 0, bs, *flags))
    with pytest.raises(SelfCheckError) as info:
        LazyAttention(_config(model_dir, tmp_path))
    report = info.value.report["logits"]
    assert report["max_abs_diff"] > 10 * report["tolerance"]


def test_reuse_off_probes_a_plain_prompt(model_dir, tmp_path, monkeypatch):
    """With chunk reuse off (mode 'full', the error's way to proceed) the probe has no chunk,
    so a broken delta path is not reached and the model starts."""
    from lazyattn_rag.engine.worker.attention.torch_backend import TorchAttentionBackend

    monkeypatch.setattr(TorchAttentionBackend, "_rotate", lambda self, x, plan, name, deltas: x)
    LazyAttention(_config(model_dir, tmp_path, cache=CacheConfig(num_blocks=64, mode="full"))).shutdown()
    logits = json.loads(_verdicts(tmp_path)[0].read_text())["report"]["logits"]
    assert logits["chunks"] == [] and logits["offset_sensitivity"] is None
    assert logits["max_abs_diff"] <= 1e-5


def test_a_verdict_that_cannot_be_saved_costs_only_the_cache(model_dir, tmp_path, caplog):
    """A file where the verdict folder should be: the model starts (the check passed), with a
    warning, and checks again next time."""
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "self_check").write_text("not a folder")
    with caplog.at_level("WARNING", logger="lazyattn_rag.engine.self_check.checks"):
        llm = LazyAttention(_config(model_dir, tmp_path))
    try:
        assert len(llm.generate(words(3), sampling=SamplingParams(max_tokens=2, ignore_eos=True)).token_ids) == 2
    finally:
        llm.shutdown()
    assert "verdict cannot be saved" in caplog.text and "will run again" in caplog.text


@pytest.mark.parametrize("remedy", [dict(chunk_attention_scaling=True, chunk_attention_temperature=0.5),
                                    dict(recompute_chunk_head_tokens=4), dict(recompute_selective_ratio=0.3)],
                         ids=["chunk-scaling", "head-recompute", "selective"])
def test_a_remedy_in_the_config_does_not_fail_the_first_start(model_dir, tmp_path, remedy):
    """The probe checks plain reuse against transformers' plain reuse, whatever remedy the
    user's requests will use (the probe engine drops it; an adversarial review found the
    first start of such an engine refused with a false SelfCheckError)."""
    llm = LazyAttention(_config(model_dir, tmp_path, cache=CacheConfig(num_blocks=64, **remedy)))
    assert [v.name for v in _verdicts(tmp_path)] and llm.engine.config.cache == CacheConfig(num_blocks=64, **remedy)
    llm.shutdown()
