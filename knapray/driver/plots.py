"""Pictures people would rather see than read (matplotlib, headless).

Every figure shows the numbers the tables print, per step: the slowest rank over the mean
(max/mean) each step, with the run's mean over those steps in the legend (what the table
says), and below it every rank at every step (work or compute over that step's mean), so
that a straggler stays visible instead of being averaged away with the other steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def over_mean(per_step: Sequence[np.ndarray]) -> np.ndarray:
    """(steps, ranks): each rank's value over its step's mean (1 where a step is empty)."""
    rows = [np.asarray(v, dtype=float) for v in per_step]
    return np.stack([v / v.mean() if v.mean() > 0 else np.ones_like(v) for v in rows]) if rows else np.zeros((0, 0))


@dataclass(frozen=True)
class Line:
    """One max/mean series: ``values[i]`` belongs to step ``steps[i]``."""

    label: str
    steps: Sequence[int]
    values: Sequence[float]
    color: str
    dashed: bool = False

    def legend(self) -> str:
        """The label with the mean over the steps, as the tables print it (5 decimals near 1)."""
        mean = float(np.mean(np.asarray(self.values, dtype=float)))
        return f"{self.label}: mean {mean:.{5 if mean < 1.01 else 4}f}"


@dataclass(frozen=True)
class Grid:
    """Per-rank values over their step's mean, (steps, ranks); row i is step ``steps[i]``."""

    label: str
    steps: Sequence[int]
    ratios: np.ndarray


def imbalance_figure(path: str, title: str, lines: Sequence[Line], grids: Sequence[Grid], note: str = "") -> str:
    """Top: every line's max/mean per step, its mean in the legend. Below: one heat map per
    grid, ranks across, steps down, on one colour scale centred on the mean (white);
    red cells are ranks above the mean (stragglers), blue ones below."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    n = max(len(grids), 1)
    fig = plt.figure(figsize=(max(11.0, 4.2 * n), 8.4))
    spec = fig.add_gridspec(2, n, height_ratios=[1.0, 1.25], hspace=0.42, wspace=0.22)
    top = fig.add_subplot(spec[0, :])
    for line in lines:
        top.plot(np.asarray(line.steps), np.asarray(line.values, dtype=float), color=line.color, lw=1.6,
                 ls="--" if line.dashed else "-", marker="o", ms=2.5, label=line.legend())
    top.axhline(1.0, color="k", lw=0.7, ls=":")
    top.set_ylim(bottom=min(0.98, top.get_ylim()[0]))
    top.set_xlabel("step")
    top.set_ylabel("slowest rank / mean rank\n(1 = perfectly balanced)")
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    top.set_title(title, fontsize=10, loc="left")
    if grids:
        hi = max(float(np.max(g.ratios)) for g in grids if g.ratios.size)
        norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(hi, 1.05))
        for i, g in enumerate(grids):
            ax = fig.add_subplot(spec[1, i])
            first, last = g.steps[0], g.steps[-1]
            im = ax.imshow(g.ratios, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest",
                           extent=(-0.5, g.ratios.shape[1] - 0.5, last + 0.5, first - 0.5))
            worst = float(g.ratios.max()) if g.ratios.size else 1.0
            ax.set_title(f"{g.label}\nhighest cell {worst:.2f}x the step's mean", fontsize=9)
            ax.set_xlabel("rank")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            if i == 0:
                ax.set_ylabel("step")
        fig.colorbar(im, ax=fig.axes[1:], shrink=0.9, pad=0.02, label="rank / step's mean")
    if note:
        fig.text(0.01, 0.005, note, fontsize=7.5, color="#555555")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


GREY, BLUE, ORANGE, GREEN, RED = "#7a7a7a", "#2a6fdb", "#e08020", "#2aa06f", "#c0392b"


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
    steps: Sequence[int] | None = None,
    note: str = "",
) -> str:
    """Planned work per step before and after balancing (``knapray plan --plot``; a run's
    ``rank_work.png`` with its measured per-rank compute too). ``run_label`` names what the
    run did; an unbalanced run passes the same work as both, drawn once."""
    steps = list(range(len(imbalance))) if steps is None else list(steps)
    same = len(baseline_rank_work) == len(rank_work) and all(
        np.array_equal(a, b) for a, b in zip(baseline_rank_work, rank_work))
    lines = [] if same else [Line("planned work, each rank its own data", steps, baseline_imbalance, GREY)]
    if greedy_imbalance:
        lines.append(Line("planned work, greedy (KnapFormer)", steps, greedy_imbalance, ORANGE))
    lines.append(Line(f"planned work, {run_label}", steps, imbalance, GREY if same else BLUE))
    grids = [] if same else [Grid("planned work, each rank its own data", steps, over_mean(baseline_rank_work))]
    grids.append(Grid(f"planned work, {run_label}", steps, over_mean(rank_work)))
    if measured_compute is not None:
        ratios = over_mean(measured_compute)
        lines.append(Line("measured compute, this run", steps, ratios.max(axis=1), GREEN))
        grids.append(Grid("measured compute, this run", steps, ratios))
    return imbalance_figure(path, title or "per-step imbalance before and after balancing", lines, grids, note)


def plot_run_comparison(path: str, runs: Sequence[tuple[str, Sequence[dict]]], title: str, note: str = "") -> str:
    """Runs side by side from their ``metrics.jsonl`` records (the same steps): each run's
    planned and measured max/mean per step, and its measured per-rank compute."""
    colors = [BLUE, RED, GREEN, ORANGE]
    lines, grids = [], []
    for (label, records), color in zip(runs, colors):
        steps = [r["step"] for r in records]
        measured = over_mean([r["compute_s"] for r in records])
        lines.append(Line(f"{label}: measured compute", steps, measured.max(axis=1), color))
        lines.append(Line(f"{label}: planned work", steps, [r["imbalance_planned"] for r in records], color,
                          dashed=True))
        grids.append(Grid(f"{label}: measured compute per rank", steps, measured))
    return imbalance_figure(path, title, lines, grids, note)
