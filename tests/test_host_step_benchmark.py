"""benchmarks/host_step.py on a tiny workload: every part is timed in every run, and the
engine's methods are unwrapped afterwards."""

import json

import pytest
from typer.testing import CliRunner

host_step = pytest.importorskip("benchmarks.host_step")
from benchmarks import serving_results  # noqa: E402 - after the skip


def test_parts_are_timed_per_step_and_unwrapped_after(tmp_path, monkeypatch):
    monkeypatch.setattr(serving_results, "RESULTS", tmp_path)
    originals = {name: getattr(cls, attr) for name, (cls, attr) in host_step.PARTS.items()}
    result = CliRunner().invoke(host_step.app, ["--num-docs", "6", "--doc-tokens", "32", "--num-requests", "10",
                                                "--warm-up-requests", "4", "--concurrency", "3",
                                                "--output-tokens", "4", "--repeats", "2", "--out", "h"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads((tmp_path / "h.json").read_text())
    assert [r["repeat"] for r in data["runs"]] == [0, 1]
    for row in data["runs"]:
        assert row["num_steps"] >= 4  # 6 requests of 4 output tokens, at most 3 at a time
        assert all(row[f"{name}_ms_per_step"] > 0 for name in ("schedule", "input_prep", "output", "metadata"))
    assert {name: getattr(cls, attr) for name, (cls, attr) in host_step.PARTS.items()} == originals
    assert host_step.runner_module.build_attention_metadata.__name__ == "build_attention_metadata"
    refused = CliRunner().invoke(host_step.app, ["--num-requests", "4", "--warm-up-requests", "4"])
    assert refused.exit_code == 2 and "--warm-up-requests 4" in refused.output
