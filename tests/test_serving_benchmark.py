"""The serving benchmark end to end on a tiny random model (CPU): its equivalence gate, one row
per mode with consistent metrics, the step tally, and ``--resume`` running only missing runs."""

import json

import pytest
from typer.testing import CliRunner

serving = pytest.importorskip("benchmarks.serving")

SMALL = ["--arch", "tiny", "--device", "cpu", "--dtype", "float32", "--num-docs", "6", "--doc-tokens", "32",
         "--num-requests", "6"]


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "RESULTS", tmp_path)
    return tmp_path


def invoke(*args: str) -> None:
    result = CliRunner().invoke(serving.app, list(args))
    assert result.exit_code == 0, result.output + repr(result.exception)


def test_sweep_writes_one_row_per_mode_and_resume_fills_only_the_gaps(results):
    invoke("sweep", *SMALL, "--budget-gb", "0.01", "--concurrency", "3", "--output-tokens", "3",
           "--modes", "lazy", "--modes", "full", "--out", "s")
    data = json.loads((results / "s.json").read_text())
    assert data["equivalence"]["lazy_vs_block_attention"]["within_tolerance"]
    assert data["equivalence"]["prefix_vs_full"]["within_tolerance"]
    assert [r["mode"] for r in data["runs"]] == ["lazy", "full"]
    for row in data["runs"]:
        assert row["num_requests"] == 6
        assert row["setup_s"] >= row["engine_s"] + row["warm_up_s"]
        steps = row["steps"]
        # every output token but each request's first comes from a decode (or mixed) step
        assert sum(k["num_tokens"] for k in steps.values()) >= 6 * 2
        assert steps["decode"]["num_steps"] >= 2
        for kind in steps.values():
            assert kind["median_ms"] <= kind["max_ms"] <= 1e3 * kind["total_s"] + 1e-9
    full = data["runs"][1]
    assert full["doc_hit_ratio"] == 0.0 and "encode" not in full["steps"]  # full mode caches no documents

    invoke("sweep", *SMALL, "--budget-gb", "0.01", "--concurrency", "3", "--output-tokens", "3",
           "--modes", "lazy", "--modes", "full", "--modes", "prefix", "--resume", "--out", "s")
    data = json.loads((results / "s.json").read_text())
    assert [r["mode"] for r in data["runs"]] == ["lazy", "full", "prefix"]
    assert len(data["commands"]) == 2
    assert {(c["mode"], c["num_repeats"]) for c in data["summary"]} == {("lazy", 1), ("full", 1), ("prefix", 1)}


def test_rates_resume_skips_done_rates(results):
    invoke("rates", *SMALL, "--rate", "50", "--modes", "lazy", "--out", "r")
    invoke("rates", *SMALL, "--rate", "50", "--rate", "100", "--modes", "lazy", "--resume", "--out", "r")
    data = json.loads((results / "r.json").read_text())
    assert [(r["mode"], r["rate_per_s"]) for r in data["runs"]] == [("lazy", 50.0), ("lazy", 100.0)]
    assert all(r["num_requests"] == 6 for r in data["runs"])
