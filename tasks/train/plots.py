"""The train stage's figures: a probe's calibration (reliability diagram) and the probe variants side by
side."""

from __future__ import annotations

import numpy as np

from semspec.tasks.train.metrics import ECE_BINS


def calibration_figure(pred: np.ndarray, y: np.ndarray, title: str):
    """Reliability diagram: mean observed semantic probability per predicted-probability bin."""
    import matplotlib  # imported here: the headless backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = np.minimum((pred * ECE_BINS).astype(int), ECE_BINS - 1)
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect")
    xs = [pred[bins == b].mean() for b in np.unique(bins)]
    ys = [y[bins == b].mean() for b in np.unique(bins)]
    counts = [(bins == b).sum() for b in np.unique(bins)]
    ax.scatter(xs, ys, s=[10 + 3 * c for c in counts], label="bins (size ~ count)")
    ax.plot(xs, ys)
    ax.set(
        xlabel="predicted semantic probability",
        ylabel="observed semantic probability",
        xlim=(0, 1),
        ylim=(0, 1),
        title=title,
    )
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig


def variant_figure(all_metrics: dict[str, dict[str, dict[str, float]]], pair: str):
    """The probe variants side by side: test MSE, AUROC and Spearman per variant (x) and role (bars)."""
    import matplotlib  # imported here: the headless backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = sorted(all_metrics)
    keys = sorted({k for r in roles for k in all_metrics[r]})
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, (metric, title) in zip(
        axes,
        (("mse", "test MSE (lower is better)"), ("auroc", "AUROC"), ("spearman", "Spearman")),
        strict=True,
    ):
        for j, role in enumerate(roles):
            ax.bar(
                [i + 0.8 * j / len(roles) for i in range(len(keys))],
                [all_metrics[role].get(k, {}).get(metric, float("nan")) for k in keys],
                width=0.8 / len(roles),
                label=role,
            )
        ax.set_xticks([i + 0.4 - 0.4 / len(roles) for i in range(len(keys))], keys, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{pair}: probe variants on held-out questions", fontsize=11)
    fig.tight_layout()
    return fig
