"""Plots of the serving benchmark's JSON results (matplotlib, no GPU needed).

    python benchmarks/serving_plots.py                       # the GPU runs in benchmarks/results/
    python benchmarks/serving_plots.py my_sweep.json --img-dir /tmp/plots

Writes ``serving_ttft_vs_rate.png`` (median TTFT vs Poisson arrival rate, one line per mode) and
``serving_throughput_vs_budget.png`` (request throughput and median TTFT vs KV budget, one line
per mode and Zipf alpha, one row per model) to ``--img-dir`` (default ``docs/img``, the
write-up's figures). Without file arguments it reads ``benchmarks/results/serving_{rates,sweep}_*.json``
measured on a GPU (CPU runs, e.g. a tiny test sweep, are left out of the write-up's figures).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import typer
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS, IMG = ROOT / "benchmarks" / "results", ROOT / "docs" / "img"
MODES = ("lazy", "block_attention", "prefix", "full")
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red")  # one per mode, in every plot
LINESTYLES = ("-", "--", ":", "-.")


def _runs(files: list[Path]) -> list[tuple[str, dict]]:
    """(arch, row) of every file: a sweep's per-cell medians over its repeats where it has them
    (``summary``), else its runs. Files of the two-step A/B (``prefill_with_encodes`` false)
    are left out: they are not the engine as it runs."""
    out = []
    for path in files:
        data = json.loads(path.read_text())
        if data.get("prefill_with_encodes", True):
            out += [(data["arch"], run) for run in data.get("summary") or data["runs"]]
    return out


def _gpu_results(pattern: str) -> list[Path]:
    return [p for p in sorted(RESULTS.glob(pattern)) if "gpu" in json.loads(p.read_text()).get("environment", {})]


def _hardware(files: list[Path]) -> str:
    envs = [json.loads(p.read_text()).get("environment", {}) for p in files]
    return ", ".join(sorted({e.get("gpu") or e.get("cpu") or "unknown hardware" for e in envs}))


def plot_rates(files: list[Path], img_dir: Path) -> Path | None:
    runs = _runs(files)
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for arch in sorted({a for a, _ in runs}):
        for colour, mode in zip(COLOURS, MODES):
            pts = sorted((r["rate_per_s"], r["ttft_ms_median"]) for a, r in runs if a == arch and r["mode"] == mode)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colour, label=f"{mode} ({arch})")
    rates = sorted({r["rate_per_s"] for _, r in runs})
    ax.set(xlabel="arrival rate (requests/s, Poisson)", ylabel="median TTFT (ms)", xscale="log", yscale="log",
           title=f"TTFT vs arrival rate ({_hardware(files)}; {_rates_setting(files)})")
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.minorticks_off()
    ax.legend(fontsize=8)
    return _save(fig, img_dir / "serving_ttft_vs_rate.png")


def plot_budgets(files: list[Path], img_dir: Path) -> Path | None:
    runs = _runs(files)
    if not runs:
        return None
    archs = sorted({a for a, _ in runs})
    fig, axes = plt.subplots(len(archs), 2, figsize=(11, 4 * len(archs)), squeeze=False)
    for (left, right), arch in zip(axes, archs):
        alphas = sorted({r["alpha"] for a, r in runs if a == arch}, reverse=True)
        for style, alpha in zip(LINESTYLES, alphas):  # colour = mode; line style = alpha
            for colour, mode in zip(COLOURS, MODES):
                rows = sorted((r["budget_gb"], r) for a, r in runs
                              if a == arch and r["alpha"] == alpha and r["mode"] == mode)
                if not rows:
                    continue
                kw = dict(color=colour, marker="o", markersize=4, linestyle=style, label=f"{mode}, alpha {alpha:g}")
                left.plot([b for b, _ in rows], [r["request_throughput_per_s"] for _, r in rows], **kw)
                right.plot([b for b, _ in rows], [r["ttft_ms_median"] for _, r in rows], **kw)
        budgets = sorted({r["budget_gb"] for a, r in runs if a == arch})
        left.set(xlabel="KV budget (GiB)", ylabel="requests/s", xscale="log", title=f"{arch}: throughput vs KV budget")
        right.set(xlabel="KV budget (GiB)", ylabel="median TTFT (ms)", xscale="log", yscale="log",
                  title=f"{arch}: TTFT vs KV budget")
        for ax in (left, right):
            ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        left.legend(fontsize=7, handlelength=3.5)
    return _save(fig, img_dir / "serving_throughput_vs_budget.png")


def _rates_setting(files: list[Path]) -> str:
    """Budget, alpha and trace length of the rates files (one setting expected)."""
    settings = set()
    for path in files:
        data = json.loads(path.read_text())
        lengths = {r["num_requests"] for r in data["runs"]}
        settings.add(f"{data['budget_gb']:g} GiB, Zipf {data['alpha']:g}, {'/'.join(map(str, sorted(lengths)))} requests")
    return "; ".join(sorted(settings))


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def main(files: list[Path] = typer.Argument(None, help="sweep/rates JSON files (default: GPU runs in benchmarks/results)"),
         img_dir: Path = typer.Option(IMG, help="where the PNG files go")) -> None:
    """Plot TTFT vs arrival rate and throughput/TTFT vs KV budget from serving-benchmark JSON."""
    if files:
        rates = [f for f in files if "rate_per_s" in (json.loads(f.read_text()).get("runs") or [{}])[0]]
        sweeps = [f for f in files if f not in rates]
    else:
        rates, sweeps = _gpu_results("serving_rates_*.json"), _gpu_results("serving_sweep_*.json")
    for made in (plot_rates(rates, img_dir), plot_budgets(sweeps, img_dir)):
        if made is None:
            print("nothing to plot for one of the figures (no matching runs)")


app = typer.Typer(add_completion=False)
app.command()(main)

if __name__ == "__main__":
    app()
