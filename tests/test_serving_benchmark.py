"""The serving benchmark end to end on a tiny random model (CPU): its equivalence gate, one row
per mode with consistent metrics, the step tally, and ``--resume`` running only missing runs."""

import json

import pytest
from typer.testing import CliRunner

serving = pytest.importorskip("benchmarks.serving")
# after the skip: these need the benchmark's dependencies too
from benchmarks import serving_results
from benchmarks.serving_setup import Bench, release
from benchmarks.serving_timing import ready_engine
from benchmarks.serving_workload import Workload

SMALL = ["--arch", "tiny", "--device", "cpu", "--dtype", "float32", "--num-docs", "6", "--doc-tokens", "32",
         "--num-requests", "6"]


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(serving_results, "RESULTS", tmp_path)
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

    plots = pytest.importorskip("benchmarks.serving_plots")
    result = CliRunner().invoke(plots.app, [str(results / "s.json"), "--img-dir", str(results / "img")])
    assert result.exit_code == 0, result.output
    assert (results / "img" / "serving_throughput_vs_budget.png").stat().st_size > 0


def test_rates_resume_skips_done_rates(results, tmp_path):
    out = tmp_path / "elsewhere" / "r.json"  # a path ending in .json: written there, parents made
    invoke("rates", *SMALL, "--budget-gb", "0.01", "--rate", "50", "--modes", "lazy", "--out", str(out))
    invoke("rates", *SMALL, "--budget-gb", "0.01", "--rate", "50", "--rate", "100", "--modes", "lazy", "--resume",
           "--out", str(out))
    data = json.loads(out.read_text())
    assert [(r["mode"], r["rate_per_s"]) for r in data["runs"]] == [("lazy", 50.0), ("lazy", 100.0)]
    assert all(r["num_requests"] == 6 for r in data["runs"])

    other = CliRunner().invoke(serving.app, ["rates", *SMALL, "--budget-gb", "0.5", "--rate", "50", "--resume",
                                             "--out", str(out)])  # another budget: its runs must not mix
    assert other.exit_code == 2 and "budget_gb: 0.01 there, 0.5 now" in other.output, other.output
    assert json.loads(out.read_text()) == data


def test_a_burst_over_shared_cold_documents_takes_one_prefill_step():
    """Requests that arrive together over shared cold documents (the start of a traffic burst)
    get their first tokens from the one step that encodes those documents, each document
    encoded once; every later step only decodes."""
    import queue

    from lazyattn_rag import SamplingParams

    bench = Bench.build("tiny", "cpu", "float32")
    workload = Workload(num_docs=4, doc_tokens=24, docs_per_request=3, num_requests=6, output_tokens=3)
    docs, trace = workload.documents(), workload.requests()
    llm, _ = ready_engine(bench, "lazy", 2**24, "cpu", 4096, 8, workload, docs, cuda_graphs=False)
    steps = []
    remove = llm.add_step_listener(lambda step: steps.append(step.output))
    sinks = [queue.SimpleQueue() for _ in trace]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    requests = llm.loop.call(lambda: [llm.engine.submit(llm.engine.planner.plan(q, ids), params, sink.put)
                                      for (q, ids), sink in zip(trace, sinks)])  # all queued before a step
    for sink in sinks:
        while not sink.get(timeout=120).finished:
            pass
    remove()  # waits for the last step's listeners, which run after its token was streamed
    first = steps[0]
    assert sorted(c.request.request_id for c in first.computes if c.sample) == sorted(r.request_id for r in requests)
    encoded = [e.key for e in first.chunk_prefills]
    assert len(encoded) == len(set(encoded))  # each chunk once, however many requests share it
    doc_keys = {c.key for q, ids in trace for c in llm.plan(q, ids).chunks if c.doc_id is not None}
    assert doc_keys <= set(encoded)
    assert all(not s.chunk_prefills and all(c.num_tokens == 1 for c in s.computes) for s in steps[1:])
    assert len(steps) == 3  # first tokens, then two decode steps
    release(llm)


@pytest.mark.parametrize("args, message", [
    (["--arch", "bogus", "--device", "cpu"], "unknown --arch 'bogus'"),
    (["--arch", "tiny", "--device", "cpu", "--modes", "lazy", "--modes", "lazy+ape100"], "'lazy+ape100'"),
    (["--arch", "tiny", "--device", "cpu", "--modes", "lazy+head0"], "'lazy+head0'"),
    (["--arch", "tiny", "--device", "cpu", "--modes", "lazy+sel101"], "'lazy+sel101'"),
    (["--arch", "tiny", "--device", "cuda"], "no CUDA device here"),
])
def test_bad_arch_or_missing_device_is_a_usage_error(results, args, message):
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(serving.app, ["sweep", *args, "--num-requests", "2"])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not list(results.iterdir())  # nothing written


def test_the_prerotated_mode_switches_the_triton_backend_and_refuses_another():
    from benchmarks.serving_setup import make_engine

    bench = Bench.build("tiny", "cpu", "float32", hash_weights=False)
    llm = make_engine(bench, "lazy+prerot", 8 << 20, "cpu", 256, 2, backend="triton", cuda_graphs=False)
    try:
        assert llm.engine.runner.backend.prerotate_queries is True
    finally:
        release(llm)
    with pytest.raises(ValueError, match="mode lazy\\+prerot needs the triton attention backend, not 'torch'"):
        make_engine(bench, "lazy+prerot", 8 << 20, "cpu", 256, 2, backend="torch")


def test_every_token_of_the_random_models_vocabulary_decodes_to_text():
    """A random-weight model samples any id of its vocabulary; each must decode to a word, or a
    streaming client's first content comes tokens after the first token (as it did when the
    word tokenizer stopped at 32,000 words under the 8B shape's 128,256)."""
    from benchmarks.serving_setup import word_tokenizer

    tokenizer = word_tokenizer(40_000)
    assert len(tokenizer) == 40_000
    for token_id in (3, 31_999, 32_000, 39_999):
        assert tokenizer.decode([token_id]) == f"t{token_id - 3}"
