"""The quality benchmark's scores (``benchmarks/quality.py``): one mode's summaries against full
attention, first-token fidelity, the per-dataset and pooled tables, resuming an earlier output."""

from __future__ import annotations

import numpy as np

from benchmarks.qa_data import QAExample
from benchmarks.qa_metrics import (
    answer_contains_gold,
    exact_match,
    same_answer,
    scored_answer,
    summarize,
    summarize_raw,
    token_f1,
)
from benchmarks.quality_modes import mode_order
from lazyattn_rag.fidelity import kl_divergence


def score_mode(examples: list[QAExample], generations: dict[str, str], full: dict[str, str] | None,
               seed: int, first_token: dict[str, dict] | None = None) -> dict:
    """Summaries (percent, 95% bootstrap CI) of one mode's generations on one dataset.

    ``first_token``: per question id, ``{"top1": id, "kl_vs_full": nats, "full_top1": id}`` of the
    first answer token (see :func:`first_token_fidelity`); summarized when every question has it.
    """
    preds = [scored_answer(generations[ex.id]) for ex in examples]
    contains = [answer_contains_gold(p, ex.answers) for p, ex in zip(preds, examples)]
    result = {
        "contains_gold": summarize(contains, seed=seed),
        "f1": summarize([token_f1(p, ex.answers) for p, ex in zip(preds, examples)], seed=seed),
        "em": summarize([exact_match(p, ex.answers) for p, ex in zip(preds, examples)], seed=seed),
    }
    if full is not None:
        full_preds = [scored_answer(full[ex.id]) for ex in examples]
        full_contains = [answer_contains_gold(p, ex.answers) for p, ex in zip(full_preds, examples)]
        result["same_as_full"] = summarize([same_answer(p, q) for p, q in zip(preds, full_preds)], seed=seed)
        result["contains_gold_minus_full"] = summarize([a - b for a, b in zip(contains, full_contains)], seed=seed)
    ft = [f for f in (first_token.get(ex.id) for ex in examples) if f is not None and "kl_vs_full" in f] \
        if first_token else []
    if ft:  # over the questions that have them ("n"; all of them when full ran in the same invocation)
        result["first_token_kl"] = summarize_raw([f["kl_vs_full"] for f in ft], seed=seed)
        result["first_token_top1_agreement"] = summarize([float(f["top1"] == f["full_top1"]) for f in ft], seed=seed)
    fb = [f for f in (first_token.get(ex.id) for ex in examples) if f is not None and "kl_vs_base" in f] \
        if first_token else []
    if fb:  # an FP8 mode against its own mode over full-precision K/V
        result["first_token_kl_vs_base"] = summarize_raw([f["kl_vs_base"] for f in fb], seed=seed)
        result["first_token_top1_agreement_vs_base"] = summarize([float(f["top1"] == f["base_top1"]) for f in fb],
                                                                 seed=seed)
    return result


def first_token_fidelity(results: dict, dataset: str, mode: str, logprobs: dict[str, np.ndarray],
                         full_logprobs: dict[str, np.ndarray] | None,
                         base_logprobs: dict[str, np.ndarray] | None = None) -> None:
    """Store, per question, ``mode``'s first-token top-1 id and, with ``full``'s distributions of
    this run, its KL(full || mode) and full's top-1 id (``generations[..]["first_token"][mode]``);
    with ``base_logprobs`` (an FP8 mode's own mode over full-precision K/V, this run), also
    KL(base || mode) as ``kl_vs_base``."""
    for qid, lp in logprobs.items():
        if lp is None:
            continue
        entry = {"top1": int(np.argmax(lp))}
        ref = full_logprobs.get(qid) if full_logprobs else None
        if ref is not None:
            entry |= {"kl_vs_full": kl_divergence(ref, lp), "full_top1": int(np.argmax(ref))}
        base = base_logprobs.get(qid) if base_logprobs else None
        if base is not None:
            entry |= {"kl_vs_base": kl_divergence(base, lp), "base_top1": int(np.argmax(base))}
        results["generations"][dataset][qid].setdefault("first_token", {})[mode] = entry


def rescore(results: dict, dataset: str, examples: list[QAExample], seed: int) -> None:
    """Recompute the summaries of every mode that has answered all of ``dataset``'s questions."""
    gens = results["generations"][dataset]
    done = set.intersection(*(set(g["modes"]) for g in gens.values())) if gens else set()
    by_mode = {m: {qid: g["modes"][m] for qid, g in gens.items()} for m in done}
    d = results["datasets"][dataset]
    first = {m: {qid: g.get("first_token", {}).get(m) for qid, g in gens.items()} for m in done}
    d["modes"] = {m: score_mode(examples, by_mode[m], by_mode.get("full") if m != "full" else None, seed,
                                first[m] if m != "full" else None)
                  | {"seconds": d["seconds"].get(m)} for m in sorted(by_mode, key=mode_order)}


def pool(results: dict, seed: int) -> dict:
    """Summaries over the questions of all datasets together, for the modes every dataset has."""
    gens = results["generations"]
    modes = [set.intersection(*(set(g["modes"]) for g in d.values())) for d in gens.values() if d]
    common = set.intersection(*modes) if modes else set()
    examples = [QAExample(f"{d}/{qid}", "", tuple(g["answers"]), ()) for d, qs in gens.items() for qid, g in qs.items()]
    by_mode = {m: {f"{d}/{qid}": g["modes"][m] for d, qs in gens.items() for qid, g in qs.items()} for m in common}
    first = {m: {f"{d}/{qid}": g.get("first_token", {}).get(m) for d, qs in gens.items() for qid, g in qs.items()}
             for m in common}
    if not examples:
        return {}
    return {m: score_mode(examples, by_mode[m], by_mode.get("full") if m != "full" else None, seed,
                          first[m] if m != "full" else None)
            for m in sorted(by_mode, key=mode_order)}


def resume_from(results: dict, prior: dict, examples: dict[str, list[QAExample]], seed: int) -> None:
    """Copy a previous run's generations for the same questions into ``results`` (``--resume``).

    Raises:
        ValueError: a dataset of the previous run holds other questions (another seed or sample size).
    """
    for dataset, gens in prior.get("generations", {}).items():
        if dataset not in examples:  # not part of this run: kept as it was
            results["datasets"][dataset], results["generations"][dataset] = prior["datasets"][dataset], gens
            continue
        if set(gens) != {ex.id for ex in examples[dataset]}:
            raise ValueError(f"--resume: {dataset} in the previous output has other questions; use the same "
                             "--seed and --sample-size, or another --out")
        for qid, g in gens.items():
            results["generations"][dataset][qid]["modes"].update(g["modes"])
            if "first_token" in g:
                results["generations"][dataset][qid].setdefault("first_token", {}).update(g["first_token"])
        results["datasets"][dataset]["seconds"].update(prior["datasets"][dataset].get("seconds", {}))
        rescore(results, dataset, examples[dataset], seed)


def markdown_table(results: dict) -> str:
    """One table per dataset: mode, contains-gold, F1, EM, same-as-full, difference to full (95% CIs)."""
    lines = []
    datasets = dict(results["datasets"])
    if len(datasets) > 1 and results.get("all_datasets"):
        n = sum(d["num_questions"] for d in datasets.values())
        datasets["all datasets pooled"] = {"num_questions": n, "modes": results["all_datasets"]}
    fmt = lambda s: f"{s['mean']:.1f} [{s['ci95'][0]:.1f}, {s['ci95'][1]:.1f}]"  # noqa: E731
    for dataset, d in datasets.items():
        n = next(iter(d["modes"].values()))["contains_gold"]["n"] if d["modes"] else 0
        lines += [f"\n**{dataset}** ({n} questions)\n",
                  "| mode | contains gold % | token F1 % | EM % | same answer as full % "
                  "| contains gold − full (points) | first-token KL vs full (nats) | first-token top-1 = full % |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        kl_fmt = lambda s: f"{s['mean']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]"  # noqa: E731
        for mode, m in d["modes"].items():
            same = fmt(m["same_as_full"]) if "same_as_full" in m else "–"
            diff = fmt(m["contains_gold_minus_full"]) if "contains_gold_minus_full" in m else "–"
            kl = kl_fmt(m["first_token_kl"]) if "first_token_kl" in m else "–"
            top1 = fmt(m["first_token_top1_agreement"]) if "first_token_top1_agreement" in m else "–"
            lines.append(f"| {mode} | {fmt(m['contains_gold'])} | {fmt(m['f1'])} | {fmt(m['em'])} | {same} | {diff} "
                         f"| {kl} | {top1} |")
    return "\n".join(lines)
