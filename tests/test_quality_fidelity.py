"""``benchmarks/quality.py``'s fidelity metrics (issue 20) end to end with the default model on the
CPU: the stored first-token KL and top-1 ids equal a direct computation from the engine's
``logprobs`` of the same prompts, and the summaries follow from them."""

import json

import numpy as np
import pytest

from lazyattn_rag.fidelity import kl_divergence
from benchmarks.quality import doc_ids_of, main, make_engine, parse_args
from benchmarks.qa_data import load_qa, passage_text

ROWS = [
    {"id": "q1", "question": "What is the capital of France?", "answers": ["Paris"],
     "passages": [{"title": "France", "text": "France is a country in Europe. Its capital is Paris."},
                  {"title": "Spain", "text": "Spain's capital is Madrid."}]},
    {"id": "q2", "question": "Who wrote Hamlet?", "answers": ["Shakespeare", "William Shakespeare"],
     "passages": [{"title": "Hamlet", "text": "Hamlet is a tragedy written by William Shakespeare."}]},
]


def test_first_token_kl_and_top1_match_a_direct_computation(tmp_path, smollm2_dir):
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "hotpotqa.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    out = tmp_path / "q.json"
    argv = ["--data", str(tmp_path), "--datasets", "hotpotqa", "--sample-size", "0", "--device", "cpu",
            "--modes", "reuse,full,reuse-k64", "--max-answer-tokens", "4", "--concurrency", "1", "--out", str(out)]
    results = main(argv)
    reuse = results["datasets"]["hotpotqa"]["modes"]["reuse"]
    assert reuse["first_token_kl"]["n"] == 2 and "first_token_kl" not in results["datasets"]["hotpotqa"]["modes"]["full"]

    from lazyattn_rag import SamplingParams

    args = parse_args(argv)
    llm = make_engine(args, "none")
    try:
        params = SamplingParams(max_tokens=1, logprobs=-1)
        kls, agree = [], []
        for ex in load_qa(tmp_path, "hotpotqa"):
            ids = doc_ids_of("hotpotqa", ex)
            llm.add_documents([(d, passage_text(t, x)) for d, (t, x) in zip(ids, ex.passages)])
            full = np.array(list(llm.complete(llm.plan(ex.question, ids).token_ids(), sampling=params).logprobs[0].values()))
            mode = np.array(list(llm.generate(ex.question, ids, sampling=params).logprobs[0].values()))
            stored = results["generations"]["hotpotqa"][ex.id]["first_token"]["reuse"]
            assert stored["kl_vs_full"] == pytest.approx(kl_divergence(full, mode), rel=1e-3, abs=1e-6)
            assert stored["top1"] == int(mode.argmax()) and stored["full_top1"] == int(full.argmax())
            assert results["generations"]["hotpotqa"][ex.id]["first_token"]["full"]["top1"] == int(full.argmax())
            kls.append(stored["kl_vs_full"])
            agree.append(100.0 * (stored["top1"] == stored["full_top1"]))
    finally:
        llm.shutdown()
    assert all(k > 0 for k in kls)  # reuse without an anchor is not full attention
    assert reuse["first_token_kl"]["mean"] == pytest.approx(np.mean(kls))
    assert reuse["first_token_top1_agreement"]["mean"] == pytest.approx(np.mean(agree))
    # k = 64 recomputes these whole passages: full attention, to float32 rounding
    whole = results["datasets"]["hotpotqa"]["modes"]["reuse-k64"]
    assert whole["first_token_kl"]["mean"] <= 1e-6 and whole["first_token_top1_agreement"]["mean"] == 100.0
    assert list(results["datasets"]["hotpotqa"]["modes"]) == ["full", "reuse", "reuse-k64"]
    assert json.loads(out.read_text())["datasets"]["hotpotqa"]["modes"]["reuse"]["first_token_kl"] == reuse["first_token_kl"]


def test_a_resumed_run_scores_its_new_modes_against_full(tmp_path, smollm2_dir):
    """``--resume`` with a new mode re-runs ``full`` for its distributions (they are not stored):
    selective recompute of every token (reuse-sel100) is full attention, KL ~ 0."""
    (tmp_path / "qa").mkdir()
    (tmp_path / "qa" / "hotpotqa.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    out = tmp_path / "q.json"
    base = ["--data", str(tmp_path), "--datasets", "hotpotqa", "--sample-size", "0", "--device", "cpu",
            "--max-answer-tokens", "4", "--concurrency", "1", "--out", str(out)]
    first = main(base + ["--modes", "full,reuse"])
    kl_reuse = first["datasets"]["hotpotqa"]["modes"]["reuse"]["first_token_kl"]
    resumed = main(base + ["--resume", "--modes", "full,reuse,reuse-sel100"])
    modes = resumed["datasets"]["hotpotqa"]["modes"]
    assert modes["reuse"]["first_token_kl"] == kl_reuse  # kept as it was
    assert modes["reuse-sel100"]["first_token_kl"]["n"] == 2 and modes["reuse-sel100"]["first_token_kl"]["mean"] <= 1e-5


def test_engine_modes_run_full_first_then_as_given():
    from benchmarks.quality_modes import engine_run_order

    assert engine_run_order(["reuse-bos-sel5", "recompute", "reuse-bos-k4", "full", "reuse-bos"]) == \
        ["full", "reuse-bos-sel5", "reuse-bos-k4", "reuse-bos"]
