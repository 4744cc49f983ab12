"""``lazyattn serve``'s vLLM flag names and ``--config FILE.yaml``: what each flag sets in the
``EngineConfig`` and ``ServeConfig`` the app starts with (the app's start itself is replaced by a
recorder here; the served app is tested in tests/test_serve*.py)."""

import pytest
from typer.testing import CliRunner

pytest.importorskip("ray.serve")

from lazyattn_rag.cli import app  # noqa: E402


@pytest.fixture
def started(monkeypatch):
    """The ``(engine_config, serve_config)`` of every ``run`` the command makes."""
    import lazyattn_rag.serve.app as serve_app

    calls = []
    monkeypatch.setattr(serve_app, "run", lambda engine, config, ready=None: calls.append((engine, config)))
    return calls


def invoke(*args):
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, ["serve", *args, "--no-disk-cache"])


def test_vllm_flag_names_set_the_engine_and_the_server(started, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = invoke(str(model), "--served-model-name", "rag", "--max-model-len", "4096", "--dtype", "bfloat16",
                    "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "12",
                    "--max-num-batched-tokens", "2048", "--log-level", "info", "--allowed-origins", '["https://a.b"]',
                    "--allowed-origins", "http://c.d", "--allowed-methods", "POST", "--recompute-chunk-head-tokens", "4",
                    "--switch-interval-ms", "0.25")
    assert result.exit_code == 0, result.output
    (engine, config), = started
    assert engine.model == str(model) and engine.max_model_len == 4096 and engine.dtype == "bfloat16"
    assert engine.cache.kv_cache_fraction == 0.5 and engine.cache.kv_cache_dtype == "fp8"
    assert engine.cache.recompute_chunk_head_tokens == 4
    assert engine.scheduler.max_num_seqs == 12 and engine.scheduler.max_num_batched_tokens == 2048
    assert config.served_model_name == "rag" and config.log_level == "INFO"
    assert config.allowed_origins == ("https://a.b", "http://c.d") and config.allowed_methods == ("POST",)
    assert config.allowed_headers == ("*",) and config.switch_interval_ms == 0.25


def test_a_config_file_gives_defaults_that_flags_override(started, tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max-model-len: 1024\nmax_num_seqs: 3\n--port: 8123\nserved-model-name: from-file\n")
    result = invoke("--config", str(path), "--served-model-name", "from-flag")
    assert result.exit_code == 0, result.output
    (engine, config), = started
    assert engine.max_model_len == 1024 and engine.scheduler.max_num_seqs == 3 and engine.model is None
    assert config.port == 8123 and config.served_model_name == "from-flag"
    assert config.allowed_origins == ()  # no CORS unless asked
    assert config.switch_interval_ms == 0.5  # the replicas' default (issue 36), not Python's 5 ms


@pytest.mark.parametrize("content, message", [
    ("max-modle-len: 10\n", "unknown key 'max-modle-len'"),
    ("- 1\n- 2\n", "must hold a mapping"),
])
def test_a_bad_config_file_is_named(started, tmp_path, content, message):
    path = tmp_path / "serve.yaml"
    path.write_text(content)
    result = invoke("--config", str(path))
    assert result.exit_code == 2 and message in result.output and started == []


def test_bad_values_are_named_before_anything_starts(started, tmp_path):
    result = invoke("--kv-cache-dtype", "int8")
    assert result.exit_code == 2 and "kv_cache_dtype must be one of ('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2')" \
        in result.output
    result = invoke("--gpu-memory-utilization", "1.5")
    assert result.exit_code == 2 and "--gpu-memory-utilization: Input should be less than 1" in result.output
    result = invoke("--switch-interval-ms", "0")
    assert result.exit_code == 2 and "--switch-interval-ms" in result.output
    result = invoke("a-model", "--model", "another")
    assert result.exit_code == 2 and "differ" in result.output
    assert started == []


def test_the_builder_args_carry_the_head_recompute_remedy():
    """Ray Serve's own tools (``serve run``/``serve deploy``) set it by the flag's name."""
    from pydantic import ValidationError

    from lazyattn_rag.serve.builder import ServeArgs

    assert ServeArgs(recompute_chunk_head_tokens=4).engine_config().cache.recompute_chunk_head_tokens == 4
    assert ServeArgs().engine_config().cache.recompute_chunk_head_tokens == 0
    with pytest.raises(ValidationError, match="recompute_chunk_head_tokens"):
        ServeArgs(recompute_chunk_head_tokens=-1)


def test_the_switch_interval_is_checked_and_carried_by_the_builder():
    from pydantic import ValidationError

    from lazyattn_rag.serve.builder import ServeArgs
    from lazyattn_rag.serve.config import ServeConfig

    assert ServeArgs(switch_interval_ms=2).serve_config().switch_interval_ms == 2
    for bad in (0, 0.001):
        with pytest.raises(ValidationError, match="switch_interval_ms"):
            ServeArgs(switch_interval_ms=bad)
    for bad in (0, 1e-321, 0.005, -1, 101, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match=r"switch_interval_ms must be in \[0.01, 100\] ms or None"):
            ServeConfig(switch_interval_ms=bad)
    assert ServeConfig(switch_interval_ms=None).switch_interval_ms is None
    assert ServeArgs(switch_interval_ms=None).serve_config().switch_interval_ms is None  # Python's own
