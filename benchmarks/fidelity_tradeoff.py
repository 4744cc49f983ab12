"""The fidelity / TTFT trade-off of the reuse remedies (issue 20): each remedy's pooled first-token
KL against full attention (``benchmarks/quality.py`` JSON) against its median TTFT on the
serving benchmark (``benchmarks/serving.py sweep`` JSON), in one plot and one table.

Quality modes map to serving modes: ``reuse-bos`` (or ``reuse``) -> ``lazy``, ``*-k<k>`` ->
``lazy+head<k>``, ``*-sel<r>`` -> ``lazy+sel<r>``. Several quality files may be given: a mode is
taken from the first that has its KL (e.g. a GPU run, then a CPU sample for the modes it lacks);
the table gives each point's source file and number of questions. Several serving files may be
given likewise (a mode's TTFT from the first that has it).

    python benchmarks/fidelity_tradeoff.py --quality benchmarks/results/quality_cuda_remedies.json \\
        --quality benchmarks/results/quality_cpu_head_recompute.json \\
        --serving benchmarks/results/serving_sweep_llama-3.1-8b_remedies.json \\
        --out docs/img/fidelity_vs_ttft.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import typer

from benchmarks.quality_modes import EngineSetting, engine_setting

app = typer.Typer(add_completion=False)


def serving_mode(quality_mode: str) -> str | None:
    """The serving benchmark's mode of a quality mode, or ``None`` (full, recompute, ...)."""
    setting = engine_setting(quality_mode)
    if setting is None or quality_mode.startswith("full"):
        return None
    if setting.recompute_tokens:
        return f"lazy+head{setting.recompute_tokens}" + ("" if setting.first_head else "rest")
    if setting.selective_ratio:
        return f"lazy+sel{round(setting.selective_ratio * 100)}"
    if setting.scope == "head":
        return f"lazy+sink{round(setting.weight * 100)}"
    if (setting.temperature, setting.weight) != (1.0, 1.0):
        weight = f"w{round(setting.weight * 100)}" if setting.weight != 1.0 else ""
        return f"lazy+ape{round(setting.temperature * 100)}{weight}"
    return "lazy"


def baseline_mode(quality_mode: str) -> str:
    """The plain reuse mode of the same anchor (``reuse-bos-k16`` -> ``reuse-bos``)."""
    setting = engine_setting(quality_mode)
    plain = setting is None or setting == EngineSetting(setting.anchor)
    return quality_mode if plain else quality_mode.rsplit("-", 1)[0]


def fidelity_points(paths: list[Path]) -> dict[str, dict]:
    """Per quality mode: pooled first-token KL (mean, ci95, n), its source file and its ratio to
    the KL of plain reuse of the same anchor in that file over the same questions (``None``
    without it; the ratio is what compares points from files over different questions), from the
    first file that has it."""
    points: dict[str, dict] = {}
    for path in paths:
        results = json.loads(path.read_text())
        for mode, row in results["all_datasets"].items():
            kl = row.get("first_token_kl")
            if mode in points or kl is None:
                continue
            points[mode] = {"kl": kl["mean"], "kl_ci95": kl["ci95"], "n": kl["n"], "source": path.name,
                            "vs_reuse": _ratio_on_common_questions(results, mode, baseline_mode(mode))}
    return points


def _ratio_on_common_questions(results: dict, mode: str, base: str) -> float | None:
    """Mean first-token KL of ``mode`` over the mean of ``base``'s, over the questions both have."""
    pairs = []
    for questions in results.get("generations", {}).values():
        for q in questions.values():
            first = q.get("first_token", {})
            a, b = (first.get(m, {}).get("kl_vs_full") for m in (mode, base))
            if a is not None and b is not None:
                pairs.append((a, b))
    total_base = sum(b for _, b in pairs)
    return sum(a for a, _ in pairs) / total_base if pairs and total_base > 0 else None


def ttft_ms(path: Path) -> dict[str, float]:
    """Median TTFT (ms) per serving mode (the sweep's summary: median over its repeats)."""
    return {row["mode"]: row["ttft_ms_median"] for row in json.loads(path.read_text())["summary"]}


@app.command()
def main(quality: list[Path] = typer.Option(..., help="quality.py JSON files, in order of preference"),
         serving: list[Path] = typer.Option(..., help="serving.py sweep JSON files with the lazy+* modes, in "
                                                     "order of preference"),
         out: Path = typer.Option(Path("docs/img/fidelity_vs_ttft.png"), help="the plot (PNG)")) -> None:
    """Print the table and write the plot of every remedy measured in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, ttft = fidelity_points(quality), {}
    for path in serving:  # the first file that has a mode gives its TTFT
        for mode, ms in ttft_ms(path).items():
            ttft.setdefault(mode, (ms, path.name))
    rows = [(mode, p, ttft[serving_mode(mode)][0]) for mode, p in points.items()
            if serving_mode(mode) in ttft]
    print("| mode | first-token KL (nats) | vs plain reuse, same file | questions | KL from | median TTFT (ms) | "
          "TTFT from |\n|---|---:|---:|---:|---|---:|---|")
    for mode, p, t in rows:
        ratio = "–" if p["vs_reuse"] is None else f"{p['vs_reuse']:.2f}"
        print(f"| {mode} | {p['kl']:.3f} [{p['kl_ci95'][0]:.3f}, {p['kl_ci95'][1]:.3f}] | {ratio} | {p['n']} | "
              f"{p['source']} | {t:.0f} | {ttft[serving_mode(mode)][1]} |")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    shown = [(m, p, t) for m, p, t in rows if p["vs_reuse"] is not None]
    for source, marker in zip(sorted({p["source"] for _, p, _ in shown}), "os^D"):
        mine = [(m, p, t) for m, p, t in shown if p["source"] == source]
        ax.plot([t for _, _, t in mine], [p["vs_reuse"] for _, p, _ in mine], marker, label=f"KL from {source}")
        for m, p, t in mine:
            ax.annotate(m, (t, p["vs_reuse"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(0.5, color="grey", linestyle=":", linewidth=1)  # the rule's "halves the KL"
    ax.axhline(1.0, color="grey", linestyle="-", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("median TTFT, ms (serving sweep, 8B shape)")
    ax.set_ylabel("first-token KL / KL of plain reuse")
    ax.set_title("Reuse remedies: fidelity against TTFT")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    app()
