"""An evaluation's charts: pass@1 against latency per benchmark (the paper's Figure 3), throughput per method
and step acceptance against the probe ratio, one fixed colour per method."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from semspec.tasks.io import close_figure, save_figure_atomic


def write_plots(
    metrics: dict[str, Any], rows: dict[tuple[str, str], list[dict]], plots_dir: Path
) -> list[Path]:
    """pass@1 vs latency per benchmark (the paper's Figure 3), TPS per method, acceptance vs p/q."""
    import matplotlib  # imported here: the headless backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    metrics = {b: ms for b, ms in metrics.items() if not b.startswith("_")}
    figures = {f"pass_vs_latency-{bench}": _pass_vs_latency(plt, bench, ms) for bench, ms in metrics.items()}
    figures["tps"] = _throughput(plt, metrics)
    figures["acceptance_vs_ratio"] = _acceptance_vs_ratio(plt, rows)
    paths = []
    for name, fig in figures.items():
        fig.tight_layout()
        paths.append(save_figure_atomic(fig, plots_dir / f"{name}.png"))
        close_figure(fig)
    return paths


# one fixed colour per method in every chart, whichever methods a run has
METHOD_COLOURS = {
    "target": "black",
    "draft": "tab:gray",
    "specsampling": "tab:orange",
    "assisted": "tab:brown",
    "specreason": "tab:purple",
    "semanticspec-random": "tab:red",
    "semanticspec-last": "tab:cyan",
    "semanticspec-all": "tab:blue",
    "semanticspec-mix": "tab:green",
    "llamacpp": "tab:pink",
}


def method_style(label: str) -> dict[str, str]:
    """Colour (by method and probe variant) and marker (triangle for one domain's probes) of a label."""
    base, _, domain = label.partition("@")
    return {"color": METHOD_COLOURS.get(base, "tab:olive"), "marker": "^" if domain else "o"}


def _pass_vs_latency(plt: Any, bench: str, ms: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for label, m in ms.items():
        ax.scatter(m["latency_s"], m["pass@1"], s=40, label=label, **method_style(label))
    ax.set(
        xlabel="latency per problem (s)",
        ylabel="pass@1",
        ylim=(-0.05, 1.05),
        title=f"{bench}: accuracy vs latency",
    )
    ax.legend(fontsize=7, loc="best")
    return fig


def _throughput(plt: Any, metrics: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = sorted({label for ms in metrics.values() for label in ms})
    for j, bench in enumerate(metrics):
        ax.bar(
            [i + 0.8 * j / len(metrics) for i in range(len(labels))],
            [metrics[bench].get(label, {}).get("tps", 0) for label in labels],
            width=0.8 / len(metrics),
            label=bench,
        )
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    ax.set(ylabel="output tokens / s", title="throughput per method")
    ax.legend(fontsize=7)
    return fig


def _acceptance_vs_ratio(plt: Any, rows: dict[tuple[str, str], list[dict]]) -> Any:
    ratios = [
        (min(s["p"] / s["q"], 3.0) if s["q"] else 3.0, s["author"] == "draft")
        for rs in rows.values()
        for r in rs
        for s in r["steps"]
        if s["p"] is not None and s["q"] is not None
    ]
    fig, ax = plt.subplots(figsize=(5, 4))
    if ratios:
        ax.hist([r for r, a in ratios if a], bins=20, range=(0, 3), alpha=0.7, label="accepted")
        ax.hist(
            [r for r, a in ratios if not a], bins=20, range=(0, 3), alpha=0.7, label="rewritten by target"
        )
        ax.legend()
    ax.set(xlabel="p / q (clipped at 3)", ylabel="steps", title="acceptance vs probe ratio")
    return fig
