"""``benchmarks/fidelity_tradeoff.py``: which serving mode a quality mode is timed by, which file
each point's KL comes from, and the table and plot it writes."""

import json

import pytest

from typer.testing import CliRunner

from benchmarks.fidelity_tradeoff import app, baseline_mode, fidelity_points, serving_mode
from benchmarks.quality_modes import EngineSetting, engine_setting


def test_quality_modes_map_to_serving_modes():
    assert serving_mode("reuse-bos") == serving_mode("reuse") == "lazy"
    assert serving_mode("reuse-bos-k16") == "lazy+head16" and serving_mode("reuse-bos-k4rest") == "lazy+head4rest"
    assert serving_mode("reuse-sel5") == serving_mode("reuse-bos-sel5") == "lazy+sel5"
    assert serving_mode("full") is None and serving_mode("recompute") is None
    assert serving_mode("reuse-bos-ape80") == "lazy+ape80"
    assert serving_mode("reuse-ape90w80") == "lazy+ape90w80"
    assert serving_mode("reuse-bos-sink50") == "lazy+sink50" and baseline_mode("reuse-bos-sink50") == "reuse-bos"
    assert baseline_mode("reuse-bos-ape80") == baseline_mode("reuse-bos-k4") == "reuse-bos"
    assert baseline_mode("reuse-bos") == "reuse-bos"


def test_chunk_scaling_modes_parse_to_their_engine_settings():
    assert engine_setting("reuse-bos-ape80") == EngineSetting("bos", temperature=0.8)
    assert engine_setting("reuse-ape90w80") == EngineSetting("none", temperature=0.9, weight=0.8)
    assert engine_setting("reuse-bos-ape100") is None  # T = W = 1 is no remedy (the config refuses it)
    assert engine_setting("reuse-bos-ape0") is None and engine_setting("reuse-bos-ape80w0") is None
    assert engine_setting("reuse-bos-sink25") == EngineSetting("bos", weight=0.25, scope="head")
    assert engine_setting("reuse-bos-k4rest") == EngineSetting("bos", recompute_tokens=4, first_head=False)
    assert engine_setting("reuse-bos-sink100") is None and engine_setting("reuse-bos-sink0") is None


def pooled(**kl):
    """A quality JSON: each mode's pooled KL ``mean`` over its first ``n`` of 4 questions, every
    question's own KL equal to that mean."""
    rows = {"full": {"contains_gold": {"mean": 20.0, "ci95": [10.0, 30.0], "n": 4}}}
    questions = {f"q{i}": {"first_token": {}} for i in range(4)}
    for name, (mean, n) in kl.items():
        mode = name.replace("_", "-")
        rows[mode] = {"contains_gold": {"mean": 20.0, "ci95": [10.0, 30.0], "n": 4},
                      "first_token_kl": {"mean": mean, "ci95": [mean / 2, mean * 2], "n": n}}
        for i in range(n):
            questions[f"q{i}"]["first_token"][mode] = {"kl_vs_full": mean}
    return {"all_datasets": rows, "generations": {"hotpotqa": questions}}


def test_points_come_from_the_first_file_that_has_them_and_the_plot_is_written(tmp_path):
    gpu, cpu = tmp_path / "gpu.json", tmp_path / "cpu.json"
    gpu.write_text(json.dumps(pooled(reuse_bos=(0.4, 4), reuse_bos_sel5=(0.15, 3))))
    cpu.write_text(json.dumps(pooled(reuse_bos=(0.3, 2), reuse_bos_k16=(0.2, 2))))
    points = fidelity_points([gpu, cpu])
    assert {m: (p["kl"], p["n"], p["source"]) for m, p in points.items()} == {
        "reuse-bos": (0.4, 4, "gpu.json"), "reuse-bos-sel5": (0.15, 3, "gpu.json"),
        "reuse-bos-k16": (0.2, 2, "cpu.json")}
    # each ratio is to plain reuse in its own file (the CPU file's 0.3, not the GPU's 0.4)
    assert points["reuse-bos-sel5"]["vs_reuse"] == pytest.approx(0.15 / 0.4)  # over its 3 questions
    assert points["reuse-bos-k16"]["vs_reuse"] == pytest.approx(0.2 / 0.3)
    serving = tmp_path / "sweep.json"
    serving.write_text(json.dumps({"summary": [{"mode": "lazy", "ttft_ms_median": 90.0},
                                               {"mode": "lazy+head16", "ttft_ms_median": 180.0}]}))
    older = tmp_path / "older.json"  # a mode's TTFT comes from the first sweep that has it
    older.write_text(json.dumps({"summary": [{"mode": "lazy", "ttft_ms_median": 70.0}]}))
    out = tmp_path / "plot.png"
    result = CliRunner().invoke(app, ["--quality", str(gpu), "--quality", str(cpu), "--serving", str(serving),
                                      "--serving", str(older), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "| reuse-bos | 0.400 [0.200, 0.800] | 1.00 | 4 | gpu.json | 90 | sweep.json |" in result.output
    assert "| reuse-bos-k16 | 0.200 [0.100, 0.400] | 0.67 | 2 | cpu.json | 180 | sweep.json |" in result.output
    assert "reuse-bos-sel5" not in result.output  # not timed in either sweep
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
