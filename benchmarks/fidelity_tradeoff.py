"""The fidelity / TTFT trade-off of the reuse remedies (issue 20): each remedy's pooled first-token
KL against full attention (``benchmarks/quality.py`` JSON) against its median TTFT on the
serving benchmark (``benchmarks/serving.py sweep`` JSON), in one plot and one table.

Quality modes map to serving modes: ``reuse-bos`` (or ``reuse``) -> ``lazy``, ``*-k<k>`` ->
``lazy+head<k>``, ``*-sel<r>`` -> ``lazy+sel<r>``. Several quality files may be given: a mode is
taken from the first that has its KL (e.g. a GPU run, then a CPU sample for the modes it lacks);
the table gives each point's source file and number of questions.

    python benchmarks/fidelity_tradeoff.py --quality benchmarks/results/quality_cuda_remedies.json \\
        --quality benchmarks/results/quality_cpu_remedies.json \\
        --serving benchmarks/results/serving_sweep_llama-3.1-8b_remedies.json \\
        --out docs/img/fidelity_vs_ttft.png
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer

app = typer.Typer(add_completion=False)
_REMEDY = re.compile(r"^reuse(?:-bos|-head)?(?:-k(\d+)|-sel(\d+))?$")


def serving_mode(quality_mode: str) -> str | None:
    """The serving benchmark's mode of a quality mode, or ``None`` (full, recompute, ...)."""
    m = _REMEDY.match(quality_mode)
    if m is None:
        return None
    k, r = m.groups()
    return f"lazy+head{k}" if k else f"lazy+sel{r}" if r else "lazy"


def fidelity_points(paths: list[Path]) -> dict[str, dict]:
    """Per quality mode: pooled first-token KL (mean, ci95, n) and its source file, from the
    first file that has it."""
    points: dict[str, dict] = {}
    for path in paths:
        pooled = json.loads(path.read_text())["all_datasets"]
        for mode, row in pooled.items():
            kl = row.get("first_token_kl")
            if mode in points or kl is None:
                continue
            points[mode] = {"kl": kl["mean"], "kl_ci95": kl["ci95"], "n": kl["n"], "source": path.name}
    return points


def ttft_ms(path: Path) -> dict[str, float]:
    """Median TTFT (ms) per serving mode (the sweep's summary: median over its repeats)."""
    return {row["mode"]: row["ttft_ms_median"] for row in json.loads(path.read_text())["summary"]}


@app.command()
def main(quality: list[Path] = typer.Option(..., help="quality.py JSON files, in order of preference"),
         serving: Path = typer.Option(..., help="serving.py sweep JSON with the lazy+* modes"),
         out: Path = typer.Option(Path("docs/img/fidelity_vs_ttft.png"), help="the plot (PNG)")) -> None:
    """Print the table and write the plot of every remedy measured in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, ttft = fidelity_points(quality), ttft_ms(serving)
    rows = [(mode, p, ttft[serving_mode(mode)]) for mode, p in points.items()
            if serving_mode(mode) in ttft]
    print("| mode | first-token KL (nats) | questions | source | median TTFT (ms) |\n|---|---:|---:|---|---:|")
    for mode, p, t in rows:
        print(f"| {mode} | {p['kl']:.3f} [{p['kl_ci95'][0]:.3f}, {p['kl_ci95'][1]:.3f}] | {p['n']} | "
              f"{p['source']} | {t:.0f} |")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sources = sorted({p["source"] for _, p, _ in rows})
    for source, marker in zip(sources, "os^D"):
        mine = [(m, p, t) for m, p, t in rows if p["source"] == source]
        ax.errorbar([t for _, _, t in mine], [p["kl"] for _, p, _ in mine],
                    yerr=[[p["kl"] - p["kl_ci95"][0] for _, p, _ in mine],
                          [p["kl_ci95"][1] - p["kl"] for _, p, _ in mine]],
                    fmt=marker, capsize=3, label=f"KL from {source}")
        for m, p, t in mine:
            ax.annotate(m, (t, p["kl"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel(f"median TTFT, ms ({serving.name})")
    ax.set_ylabel("first-token KL(full || mode), nats")
    ax.set_title("Reuse remedies: fidelity against TTFT")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    app()
