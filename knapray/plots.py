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
) -> str:
    """Per-rank work before/after balancing (averaged over steps, relative to the ideal),
    and imbalance (max/mean) per step."""
    plt = _plt()
    base = np.mean([w / w.mean() for w in baseline_rank_work], axis=0)
    bal = np.mean([w / w.mean() for w in rank_work], axis=0)
    ranks = np.arange(base.size)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), gridspec_kw={"height_ratios": [3, 2]})
    width = 0.42
    ax1.bar(ranks - width / 2, base, width, color="#b0b0b0", label="unbalanced (each rank its own data)")
    ax1.bar(ranks + width / 2, bal, width, color="#2a6fdb", label="balanced (knapray plan)")
    ax1.axhline(1.0, color="k", lw=0.8, ls="--", label="ideal (mean)")
    ax1.set_xlabel("rank")
    if base.size <= 64:
        ax1.set_xticks(ranks[:: max(1, base.size // 32)])
    ax1.set_ylabel("work / mean work (avg over steps)")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(title or "per-rank work before and after balancing", fontsize=10)
    # Excess over the ideal on a log scale: 1.0007 and 1.00006 look alike on a linear one.
    steps = np.arange(len(imbalance))

    def excess(v: Sequence[float]) -> np.ndarray:
        return np.maximum((np.asarray(v) - 1.0) * 100.0, 1e-5)

    ax2.plot(steps, excess(baseline_imbalance), color="#808080", label="unbalanced")
    if greedy_imbalance:
        ax2.plot(steps, excess(greedy_imbalance), color="#e08020", label="greedy (KnapFormer)")
    ax2.plot(steps, excess(imbalance), color="#2a6fdb", label="knapray")
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_ylabel("slowest rank over mean, % (log)")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
