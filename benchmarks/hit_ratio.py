"""Hit ratio of document KV caches at equal byte budgets: a trace-driven simulation.

Drives the engine's own chunk cache, block pool and eviction policies (no model, no GPU;
see ``benchmarks/hit_ratio_sim.py``) with a synthetic RAG trace, and compares, at the same
KV byte budget: prefix-only caching, a position-aware cache (Block-Attention: one copy per
document and offset) and ours (position-agnostic: one copy per document), each with every
eviction policy. Reports document- and token-level hit ratios in a table shaped like the
LazyAttention paper's (1 GB high / low skew, 10 and 50 GB mid skew, no limit), checks the
simulator against the closed form, and plots hit ratio vs budget.

    python -m benchmarks.hit_ratio                      # defaults: Llama-3.1-8B bf16, 128 KiB/token
    python -m benchmarks.hit_ratio --model-config /path/to/config.json --dtype-bytes 2

Writes ``benchmarks/results/hit_ratio.json`` and ``docs/img/hit_ratio.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm

from benchmarks.hit_ratio_sim import (
    CACHE_KINDS,
    LLAMA31_8B_BF16_BYTES_PER_TOKEN,
    Workload,
    budget_blocks,
    closed_form_check,
    kv_bytes_per_token_from_config,
    make_trace,
    simulate,
    unlimited_blocks,
)

GIB = 2**30
# The paper's table: (label, budget in GiB or None for no limit, skew)
PAPER_COLUMNS = (("1 GB, high skew", 1, "high"), ("1 GB, low skew", 1, "low"), ("10 GB, mid skew", 10, "mid"),
                 ("50 GB, mid skew", 50, "mid"), ("no limit, mid skew", None, "mid"))
# LazyAttention paper, document hit ratio (%), same columns
PAPER_VALUES = {"LazyAttention (paper)": (13.57, 3.47, 23.89, 28.44, 29.09),
                "Block-Attention (paper)": (7.27, 1.84, 21.13, 26.67, 27.38)}
KIND_LABELS = {"prefix": "prefix-only", "position_aware": "position-aware (Block-Attention)",
               "agnostic": "ours (position-agnostic)"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    kv = p.add_argument_group("KV size")
    kv.add_argument("--bytes-per-token", type=int, default=LLAMA31_8B_BF16_BYTES_PER_TOKEN,
                    help="K+V bytes per token over all layers (default Llama-3.1-8B bf16: 131072)")
    kv.add_argument("--model-config", type=Path, default=None,
                    help="HF config.json to compute bytes per token from (overrides --bytes-per-token)")
    kv.add_argument("--dtype-bytes", type=int, default=2, help="bytes per K/V element with --model-config")
    kv.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    w = p.add_argument_group("workload")
    w.add_argument("--num-docs", type=int, default=Workload.num_docs)
    w.add_argument("--doc-tokens-median", type=int, default=Workload.doc_tokens_median)
    w.add_argument("--doc-tokens-sigma", type=float, default=Workload.doc_tokens_sigma)
    w.add_argument("--docs-per-request", type=int, default=Workload.docs_per_request)
    w.add_argument("--num-positions", type=int, default=Workload.num_positions,
                   help="distinct positions (offsets) a document can take")
    w.add_argument("--num-requests", type=int, default=Workload.num_requests)
    w.add_argument("--alpha-high", type=float, default=2.1, help="Zipf α of the high-skew columns")
    w.add_argument("--alpha-mid", type=float, default=1.5, help="Zipf α of the mid-skew columns and the plot")
    w.add_argument("--alpha-low", type=float, default=1.1, help="Zipf α of the low-skew columns")
    w.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="lru,lfu,gdsf", help="engine eviction policies to simulate")
    p.add_argument("--plot-budgets-gb", default="0.25,0.5,1,2,5,10,20,50,100,200,500",
                   help="budgets (GiB) of the plot, plus no limit")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "hit_ratio.json")
    p.add_argument("--plot", type=Path,
                   default=Path(__file__).resolve().parents[1] / "docs" / "img" / "hit_ratio.png")
    p.add_argument("--plot-only", action="store_true", help="redraw the plot from an existing --out JSON")
    args = p.parse_args(argv)
    if args.model_config is not None:
        args.bytes_per_token = kv_bytes_per_token_from_config(json.loads(args.model_config.read_text()),
                                                              args.dtype_bytes)
    args.policies = [x for x in args.policies.split(",") if x]
    args.plot_budgets_gb = [float(x) for x in args.plot_budgets_gb.split(",") if x]
    return args


def workload(args, alpha: float) -> Workload:
    return Workload(num_docs=args.num_docs, doc_tokens_median=args.doc_tokens_median,
                    doc_tokens_sigma=args.doc_tokens_sigma, docs_per_request=args.docs_per_request,
                    num_positions=args.num_positions, zipf_alpha=alpha, num_requests=args.num_requests,
                    seed=args.seed)


def run_budget(trace, args, budget_gib: float | None, bar) -> dict:
    """Every cache kind x policy at one budget: ``{kind: {policy: SimResult dict}}``."""
    out = {}
    for kind in CACHE_KINDS:
        blocks = (unlimited_blocks(trace, kind, args.block_size) if budget_gib is None
                  else budget_blocks(budget_gib * GIB, args.bytes_per_token, args.block_size))
        out[kind] = {}
        for policy in args.policies:
            out[kind][policy] = simulate(trace, kind, policy, blocks, args.block_size).as_dict()
            bar.update()
    return out


def paper_table(columns: list[dict], policies: list[str]) -> str:
    """Markdown: rows = cache x policy, cells = document / token hit ratio (%), plus the paper's rows."""
    head = "| cache | policy | " + " | ".join(c["label"] for c in columns) + " |"
    lines = [head, "|---|---|" + "---:|" * len(columns)]
    for kind in CACHE_KINDS:
        for policy in policies:
            cells = [f"{100 * c['results'][kind][policy]['doc_hit_ratio']:.2f} / "
                     f"{100 * c['results'][kind][policy]['token_hit_ratio']:.2f}" for c in columns]
            lines.append(f"| {KIND_LABELS[kind]} | {policy} | " + " | ".join(cells) + " |")
    for name, values in PAPER_VALUES.items():
        lines.append(f"| {name} | – | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Hit ratio (document, token) vs budget of every cache x policy on the mid-skew sweep; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep, policies = results["budget_sweep"], results["config"]["policies"]
    budgets = sorted(sweep["budgets"], key=float)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), sharey=True)
    colors = {"prefix": "tab:gray", "position_aware": "tab:orange", "agnostic": "tab:blue"}
    styles = {"lru": ":", "lfu": "-", "gdsf": "--"}
    for ax, metric, title in ((axes[0], "doc_hit_ratio", "document hit ratio"),
                              (axes[1], "token_hit_ratio", "token hit ratio")):
        for kind in CACHE_KINDS:
            for policy in policies:
                ys = [100 * sweep["budgets"][b][kind][policy][metric] for b in budgets]
                ax.plot([float(b) for b in budgets], ys, styles.get(policy, "-"), color=colors[kind], marker="o",
                        markersize=3, label=f"{KIND_LABELS[kind]}, {policy}")
                ax.axhline(100 * sweep["unlimited"][kind][policy][metric], color=colors[kind], lw=0.6, alpha=0.4)
        ax.set_xscale("log")
        ax.set_xlabel("KV cache budget (GiB)")
        ax.set_title(f"{title} (thin lines: no limit)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("hit ratio (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    w = sweep["workload"]
    fig.suptitle(f"Zipf α={w['zipf_alpha']}, {w['num_docs']} docs (median {w['doc_tokens_median']} tokens), "
                 f"{w['docs_per_request']} docs/request at {w['num_positions']} positions, "
                 f"{w['num_requests']} requests, {results['config']['bytes_per_token'] // 1024} KiB/token", fontsize=9)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.plot)
        print(f"wrote {args.plot} from {args.out}")
        return {}
    start = time.perf_counter()
    alphas = {"high": args.alpha_high, "mid": args.alpha_mid, "low": args.alpha_low}
    traces = {skew: make_trace(workload(args, a)) for skew, a in alphas.items()}
    runs = len(CACHE_KINDS) * len(args.policies) * (len(PAPER_COLUMNS) + len(args.plot_budgets_gb) + 1)
    results = {
        "config": {"bytes_per_token": args.bytes_per_token, "block_size": args.block_size,
                   "budget_unit": "GiB (2^30 bytes)", "alphas": alphas, "policies": args.policies,
                   "model_config": str(args.model_config) if args.model_config else None},
        "host": platform.node(),
        "hit_ratio_definitions": {
            "doc_hit_ratio": "document placements served from the cache / all placements",
            "token_hit_ratio": "document tokens served from the cache / all document tokens placed"},
    }
    with tqdm(total=runs, desc="simulations") as bar:
        columns = []
        for label, gib, skew in PAPER_COLUMNS:
            columns.append({"label": label, "budget_gib": gib, "zipf_alpha": alphas[skew],
                            "results": run_budget(traces[skew], args, gib, bar)})
        mid = traces["mid"]
        sweep = {"workload": workload(args, args.alpha_mid).__dict__,
                 "budgets": {str(b): run_budget(mid, args, b, bar) for b in args.plot_budgets_gb},
                 "unlimited": run_budget(mid, args, None, bar)}
    results["workloads"] = {skew: workload(args, a).__dict__ for skew, a in alphas.items()}
    results["paper_table"] = columns
    results["paper_values_doc_hit_ratio_percent"] = {k: dict(zip([c[0] for c in PAPER_COLUMNS], v))
                                                     for k, v in PAPER_VALUES.items()}
    results["budget_sweep"] = sweep
    checks = []
    for alpha in (0.85, 1.1, 1.5):
        for policy in ("static_lfu", *args.policies):
            checks.append(closed_form_check(alpha=alpha, policy=policy, seed=args.seed))
    results["closed_form_check"] = checks
    results["seconds"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.plot)
    print(paper_table(columns, args.policies))
    print("\nclosed form (C=100, D=20): agnostic/aware hit-ratio ratio")
    print("| α | policy | simulated | closed form | error |\n|---:|---|---:|---:|---:|")
    for c in checks:
        print(f"| {c['alpha']} | {c['policy']} | {c['ratio_simulated']:.3f} | {c['ratio_closed_form']:.3f} | "
              f"{100 * c['relative_error']:+.1f}% |")
    print(f"\nwrote {args.out} and {args.plot} in {results['seconds']} s")
    return results


if __name__ == "__main__":
    main()
