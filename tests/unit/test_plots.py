"""The imbalance pictures: per-step max/mean lines whose legend means are the numbers the
tables print, per-rank grids that keep a straggler visible, and each run titled by what
it ran on (an unbalanced run is not titled with the balanced topology)."""

from __future__ import annotations

import numpy as np

from knapray.driver.plots import Line, over_mean, plot_rank_work
from knapray.config.run import load_config
from knapray.driver.report import run_title, summarize, summary_steps


def _records(world: int, steps: int, topology: str) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for s in range(steps):
        work = rng.uniform(1, 2, world)
        work[s % world] *= 4  # a straggler that moves from rank to rank
        out.append({"step": s, "world_size": world, "topology": topology, "imbalance_planned": 1.01,
                    "baseline_imbalance_planned": float(work.max() / work.mean()), "baseline_rank_work": work.tolist(),
                    "rank_work": np.full(world, work.mean()).tolist(), "compute_s": work.tolist(),
                    "compute_max_over_mean": float(work.max() / work.mean())})
    return out


def test_per_rank_grid_keeps_the_straggler_an_average_hides(tmp_path):
    records = _records(4, 8, "g2n2")
    ratios = over_mean([r["baseline_rank_work"] for r in records])
    assert ratios.shape == (8, 4) and np.allclose(ratios.mean(axis=1), 1.0)
    assert ratios.max() > 2.0 > ratios.mean(axis=0).max()  # per step a straggler; averaged over steps none
    path = plot_rank_work(str(tmp_path / "w.png"), [np.asarray(r["baseline_rank_work"]) for r in records],
                          [np.asarray(r["rank_work"]) for r in records],
                          [r["baseline_imbalance_planned"] for r in records], [r["imbalance_planned"] for r in records],
                          measured_compute=[np.asarray(r["compute_s"]) for r in records])
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_legend_means_are_the_tables_numbers():
    records = _records(4, 10, "g2n2")
    body = summary_steps(records)
    s = summarize([dict(r, loss=1.0, tokens=1, step_s=1.0, wait_plan_frac=0.0, comm_s=[0.0], planned_by="actor")
                   for r in records])
    line = Line("unbalanced", [r["step"] for r in body], [r["baseline_imbalance_planned"] for r in body], "k")
    assert line.legend().endswith(f"{s['imbalance_planned_before']:.4f}")
    assert Line("balanced", [0, 1], [1.00004, 1.00008], "k").legend().endswith("1.00006")


def test_each_run_is_titled_by_what_it_ran_on():
    balanced = load_config(None, ["balance.topology=g2n2"])
    unbalanced = load_config(None, ["balance.topology=g2n2", "balance.enabled=false"])
    records = _records(4, 3, "g2n2")
    assert run_title(balanced, records) == "balanced on g2n2, 4 workers"
    title = run_title(unbalanced, records)
    assert "g2n2" not in title and "unbalanced" in title and "g1n4" in title
    mixed = records[:1] + [dict(r, topology="g1n4") for r in records[1:]]
    assert run_title(balanced, mixed) == "balanced on g1n4 (2 steps), g2n2 (1 steps), 4 workers"
