"""Pictures people would rather see than read (matplotlib, headless)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rank_work(
    path: str,
    baseline_rank_work: Sequence[np.ndarray],
    rank_work: Sequence[np.ndarray],
    baseline_imbalance: Sequence[float],
    imbalance: Sequence[float],
    greedy_imbalance: Sequence[float] | None = None,
    title: str = "",
    run_label: str = "balanced (knapray plan)",
    measured_compute: Sequence[np.ndarray] | None = None,
) -> str:
    """Per-rank work before/after balancing (averaged over steps, relative to the ideal),
    with the measured per-rank compute beside it when given, and the imbalance (max/mean)
    per step. ``run_label`` names what the run did (an unbalanced run is labelled so)."""
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    base = np.mean([w / w.mean() if w.mean() > 0 else np.ones_like(w) for w in baseline_rank_work], axis=0)
    bal = np.mean([w / w.mean() if w.mean() > 0 else np.ones_like(w) for w in rank_work], axis=0)
    ranks = np.arange(base.size)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [3, 2]})
    bars = [(base, "#b0b0b0", "planned work, each rank its own data"),
            (bal, "#2a6fdb", f"planned work, {run_label}")]
    if measured_compute:
        meas = np.mean([c / c.mean() for c in measured_compute if c.mean() > 0], axis=0)
        bars.append((meas, "#2aa06f", "measured compute, this run"))
    width = 0.8 / len(bars)
    for i, (values, color, label) in enumerate(bars):
        ax1.bar(ranks + (i - (len(bars) - 1) / 2) * width, values, width, color=color, label=label)
    ax1.axhline(1.0, color="k", lw=0.8, ls="--", label="ideal (mean)")
    ax1.set_xlabel("rank")
    if base.size <= 32:
        ax1.set_xticks(ranks)
    else:
        ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_ylabel("over the mean (avg over steps)\nclose to 1 is better")
    # Legends beside the axes, never over the tallest bars.
    ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax1.set_title(title or "per-rank work before and after balancing", fontsize=10)
    # Excess over the ideal on a log scale: 1.0007 and 1.00006 look alike on a linear one.
    steps = np.arange(len(imbalance))

    def excess(v: Sequence[float]) -> np.ndarray:
        return np.maximum((np.asarray(v) - 1.0) * 100.0, 1e-5)

    ax2.plot(steps, excess(baseline_imbalance), color="#808080", label="each rank its own data")
    if greedy_imbalance:
        ax2.plot(steps, excess(greedy_imbalance), color="#e08020", label="greedy (KnapFormer)")
    ax2.plot(steps, excess(imbalance), color="#2a6fdb", label=run_label)
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("slowest rank over mean, %\n(log; lower is better)")
    ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
