"""QA metrics of the quality benchmark: SQuAD normalisation, EM, contains-gold, F1, bootstrap."""

import json

import numpy as np
import pytest

from benchmarks.qa_data import load_qa, passage_text
from benchmarks.qa_metrics import (
    answer_contains_gold,
    bootstrap_ci,
    exact_match,
    scored_answer,
    scored_answer_complete,
    normalize_answer,
    same_answer,
    summarize,
    token_f1,
)
from benchmarks.quality import shuffled
from benchmarks.quality_results import score_mode


@pytest.mark.parametrize("text, expected", [
    ("The Eiffel Tower", "eiffel tower"),
    ("  an   apple, a pear; THE end. ", "apple pear end"),
    ("U.S.A.", "usa"),
    ("theatre another", "theatre another"),  # articles only as whole words
    ("", ""),
    ("!!!", ""),
])
def test_normalize_answer_follows_squad(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_uses_best_alias():
    assert exact_match("the Beatles!", ["Rolling Stones", "Beatles"]) == 1.0
    assert exact_match("The Beatles were a band", ["Beatles"]) == 0.0


def test_answer_contains_gold_is_substring_after_normalisation():
    assert answer_contains_gold("It was completed in 1889, by Eiffel.", ["1889"]) == 1.0
    assert answer_contains_gold("The answer is: Jesse Bennett", ["Dr. Jesse Bennett", "Jesse Bennett"]) == 1.0
    assert answer_contains_gold("The answer is: Jesse Bennett", ["Dr. Jesse Bennett"]) == 0.0
    assert answer_contains_gold("anything", ["the", "!!"]) == 0.0  # empty after normalisation never matches


def test_token_f1_values():
    # pred {new, york, city}, gold {new, york}: precision 2/3, recall 1 -> F1 0.8
    assert token_f1("New York City", ["new york"]) == pytest.approx(0.8)
    assert token_f1("Paris", ["London", "Paris France"]) == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert token_f1("x b b", ["b b c"]) == pytest.approx(2 / 3)  # multiset overlap: 2 of 3 each way
    assert token_f1("a b b", ["b b c"]) == pytest.approx(0.8)  # "a" is an article: P 1, R 2/3
    assert token_f1("nothing shared", ["other"]) == 0.0
    assert token_f1("", [""]) == 1.0 and token_f1("x", [""]) == 0.0


def test_scored_answer_and_same_answer():
    assert scored_answer("\n\n  Paris.\nBecause...") == "Paris."
    assert scored_answer("   \n") == ""
    assert scored_answer("The answer is:\n\nAubrieta.\nAubrieta is a genus") == "The answer is: Aubrieta."
    assert scored_answer("The answer to this question is:") == "The answer to this question is:"
    assert same_answer("The Paris", "paris!") == 1.0 and same_answer("Paris", "Lyon") == 0.0


@pytest.mark.parametrize("full", ["\nParis.\nmore", "Paris\nmore", "The answer is:\n\nParis\nmore",
                                  "Answer:\nParis", "Paris"])
def test_scored_answer_complete_means_the_rest_cannot_matter(full):
    """At the first prefix where generation may stop, the scored answer is already final."""
    stops = [i for i in range(len(full) + 1) if scored_answer_complete(full[:i])]
    if stops:
        assert scored_answer(full[: stops[0]]) == scored_answer(full)
    else:  # never complete: generation runs to its token limit
        assert full in ("Answer:\nParis", "Paris")


def test_scored_answer_complete_cases():
    assert not scored_answer_complete("") and not scored_answer_complete("\n\n  ")
    assert not scored_answer_complete("Paris") and not scored_answer_complete("\n\nParis")
    assert not scored_answer_complete("The answer is:\n") and not scored_answer_complete("The answer is:\nPar")
    assert scored_answer_complete("\nParis.\n") and scored_answer_complete("The answer is:\nParis\n")


def test_bootstrap_ci_brackets_mean_and_shrinks_with_n():
    rng = np.random.default_rng(1)
    small = rng.random(50) < 0.3
    large = rng.random(5000) < 0.3
    lo_s, hi_s = bootstrap_ci(small, seed=0)
    lo_l, hi_l = bootstrap_ci(large, seed=0)
    assert lo_s <= small.mean() <= hi_s and lo_l <= large.mean() <= hi_l
    # binomial standard error sqrt(p(1-p)/n) = 0.0065 at n = 5000: the 95% width is about 4 of them
    assert hi_l - lo_l == pytest.approx(2 * 1.96 * np.sqrt(0.3 * 0.7 / 5000), rel=0.15)
    assert hi_s - lo_s > 5 * (hi_l - lo_l)
    assert bootstrap_ci([1.0, 1.0, 1.0]) == (1.0, 1.0)
    assert bootstrap_ci(small, seed=3) == bootstrap_ci(small, seed=3)


def test_bootstrap_ci_rejects_bad_arguments():
    with pytest.raises(ValueError):
        bootstrap_ci([])
    with pytest.raises(ValueError):
        bootstrap_ci([1.0], confidence=1.0)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0], num_resamples=0)


def test_summarize_reports_percent():
    s = summarize([1, 0, 0, 1])
    assert s["mean"] == 50.0 and s["n"] == 4 and 0 <= s["ci95"][0] <= 50 <= s["ci95"][1] <= 100


def test_load_qa_samples_deterministically(tmp_path):
    (tmp_path / "qa").mkdir()
    rows = [{"id": f"q{i}", "question": f"question {i}?", "answers": [f"a{i}"],
             "passages": [{"title": "T", "text": f"text {i}", "is_supporting": True}]} for i in range(10)]
    rows.append({"id": "empty", "question": "no passages?", "answers": ["x"], "passages": []})
    (tmp_path / "qa" / "musique.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    everything = load_qa(tmp_path, "musique")
    assert [e.id for e in everything] == [f"q{i}" for i in range(10)]  # the passage-less question is skipped
    a, b = load_qa(tmp_path, "musique", 4, seed=7), load_qa(tmp_path, "musique", 4, seed=7)
    assert a == b and len(a) == 4 and [e.id for e in a] == sorted((e.id for e in a), key=lambda s: int(s[1:]))
    assert a[0].passages == (("T", f"text {a[0].id[1:]}"),) and a[0].answers == (f"a{a[0].id[1:]}",)
    with pytest.raises(ValueError):
        load_qa(tmp_path, "squad")


def test_passage_text_has_no_position_number():
    assert passage_text("Paris", "Capital of France.") == "Title: Paris\nCapital of France."


def test_shuffled_is_fixed_per_question_and_a_permutation():
    items = list(range(10))
    assert shuffled(items, 0, "q1") == shuffled(items, 0, "q1")
    assert sorted(shuffled(items, 0, "q1")) == items
    assert shuffled(items, 0, "q1") != items and shuffled(items, 0, "q1") != shuffled(items, 0, "q2")


def test_score_mode_paired_difference_and_agreement(tmp_path):
    (tmp_path / "qa").mkdir()
    rows = [{"id": f"q{i}", "question": "?", "answers": ["Paris"], "passages": [{"title": "", "text": "t"}]}
            for i in range(4)]
    (tmp_path / "qa" / "hotpotqa.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    examples = load_qa(tmp_path, "hotpotqa")
    full = {"q0": "Paris", "q1": "It is Paris.\nmore", "q2": "Lyon", "q3": "Paris"}
    reuse = {"q0": "Paris", "q1": "Lyon", "q2": "Lyon", "q3": "\nParis"}
    s = score_mode(examples, reuse, full, seed=0)
    assert s["contains_gold"]["mean"] == 50.0
    assert s["same_as_full"]["mean"] == 75.0  # q0, q2, q3 agree after normalisation
    assert s["contains_gold_minus_full"]["mean"] == -25.0  # q1 lost
    assert s["em"]["mean"] == 50.0
    assert "same_as_full" not in score_mode(examples, full, None, seed=0)


def test_resume_keeps_previous_answers_and_rejects_other_questions(tmp_path):
    from benchmarks.quality_results import resume_from

    (tmp_path / "qa").mkdir()
    rows = [{"id": f"q{i}", "question": "?", "answers": ["Paris"], "passages": [{"title": "", "text": "t"}]}
            for i in range(3)]
    (tmp_path / "qa" / "hotpotqa.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    examples = {"hotpotqa": load_qa(tmp_path, "hotpotqa")}

    def empty():
        return {"datasets": {"hotpotqa": {"seconds": {}, "modes": {}}},
                "generations": {"hotpotqa": {f"q{i}": {"answers": ["Paris"], "modes": {}} for i in range(3)}}}

    prior = empty()
    for i, answer in enumerate(["Paris", "Lyon", "Paris"]):
        prior["generations"]["hotpotqa"][f"q{i}"]["modes"]["full"] = answer
    prior["datasets"]["hotpotqa"]["seconds"]["full"] = 1.5
    prior["datasets"]["musique"] = {"seconds": {}, "modes": {"full": {}}}
    prior["generations"]["musique"] = {"m0": {"answers": ["x"], "modes": {"full": "x"}}}
    results = empty()
    resume_from(results, prior, examples, seed=0)
    assert results["generations"]["hotpotqa"]["q1"]["modes"] == {"full": "Lyon"}
    assert results["datasets"]["hotpotqa"]["modes"]["full"]["contains_gold"]["mean"] == pytest.approx(200 / 3)
    assert results["generations"]["musique"]["m0"]["modes"]["full"] == "x"  # other datasets are kept
    del prior["generations"]["hotpotqa"]["q2"]
    with pytest.raises(ValueError):
        resume_from(empty(), prior, examples, seed=0)


def test_load_qa_rejects_repeated_ids(tmp_path):
    (tmp_path / "qa").mkdir()
    row = {"id": "q", "question": "?", "answers": ["a"], "passages": [{"title": "", "text": "t"}]}
    (tmp_path / "qa" / "nq_open_oracle.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="repeated"):
        load_qa(tmp_path, "nq_open_oracle")


def test_pool_scores_all_datasets_together():
    from benchmarks.quality_results import markdown_table, pool

    gens = {"a": {"q0": {"answers": ["Paris"], "modes": {"full": "Paris", "reuse": "Lyon"}}},
            "b": {"q0": {"answers": ["Rome"], "modes": {"full": "Rome", "reuse": "Rome", "reuse-head": "x"}},
                  "q1": {"answers": ["Oslo"], "modes": {"full": "no", "reuse": "Oslo", "reuse-head": "x"}}}}
    pooled = pool({"generations": gens}, seed=0)
    assert list(pooled) == ["full", "reuse"]  # reuse-head is missing from dataset a
    assert pooled["full"]["contains_gold"]["mean"] == pytest.approx(200 / 3)
    assert pooled["reuse"]["same_as_full"]["mean"] == pytest.approx(100 / 3)
    table = markdown_table({"datasets": {"a": {"num_questions": 1, "modes": {}}, "b": {"num_questions": 2, "modes": {}}},
                            "all_datasets": pooled})
    assert "**all datasets pooled** (3 questions)" in table and "| reuse | 66.7 [" in table


def test_kl_divergence_against_a_direct_computation():
    import math

    from benchmarks.qa_metrics import summarize_raw
    from lazyattn_rag.fidelity import kl_divergence

    p, q = [0.7, 0.2, 0.1], [0.5, 0.25, 0.25]
    expected = sum(a * math.log(a / b) for a, b in zip(p, q))
    assert kl_divergence([math.log(x) for x in p], [math.log(x) for x in q]) == pytest.approx(expected, rel=1e-12)
    assert kl_divergence([math.log(x) for x in p], [math.log(x) for x in p]) == 0.0
    assert kl_divergence([0.0, -math.inf], [-math.inf, 0.0]) == math.inf  # Q misses P's mass
    with pytest.raises(ValueError, match="tokens"):
        kl_divergence([0.0], [0.0, 0.0])
    s = summarize_raw([0.1, 0.3], num_resamples=50)
    assert s["mean"] == pytest.approx(0.2) and s["n"] == 2 and 0.1 <= s["ci95"][0] <= s["ci95"][1] <= 0.3
