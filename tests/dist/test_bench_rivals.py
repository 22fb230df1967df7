"""`knapray bench rivals`: the planners knapray can execute, measured side by side on gloo
ranks; every plan computes the unbalanced step's loss and gradients."""

from __future__ import annotations

import json

import pytest

from knapray.cli import main

# Rank 0: two video-like sequences; ranks 1-3: small images. Unbalanced, rank 0 does ~3x the
# mean; a bag of two splits each video.
MIX = "g1b2i512f34s1,g3b4i256f1s0"


@pytest.mark.dist
def test_every_executable_planner_runs_and_computes_the_same_math(capsys):
    rc = main(["bench", "rivals", "--world-size", "4", "--steps", "2", "--mix", MIX, "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    rows = {row["planner"]: row for row in r["rows"]}
    assert {"unbalanced", "knapray_auto", "knapray_per_step", "knapray_overlap", "knapformer", "dynamic_cp"} <= set(rows)
    assert r["math_ok"] and r["math_rel_max"] <= 1e-4  # a plan moves work, never changes the result
    # Measured thread time follows the plans: every balancer evens the skewed mix out.
    assert rows["unbalanced"]["measured_max_over_mean"] > 1.5
    for name in ("knapray_auto", "knapray_per_step", "knapray_overlap", "knapformer", "dynamic_cp"):
        assert rows[name]["measured_max_over_mean"] < 1.25, name
        assert rows[name]["speedup_vs_unbalanced"] > 1.5, name
        assert rows[name]["steps"] == 1
    best = min(rows[n]["predicted_step_ratio"] for n in ("knapray_auto", "knapray_per_step", "knapray_overlap"))
    assert best == pytest.approx(1.0) and rows["knapray_overlap"]["predicted_step_ratio"] == pytest.approx(1.0)
    assert any(line.startswith("knapray per-step") for line in out)


def test_bench_rivals_rejects_bad_setups_before_spawning(capsys):
    assert main(["bench", "rivals", "--steps", "1"]) == 2
    assert "must be larger than warmup" in capsys.readouterr().err
    assert main(["bench", "rivals", "--scale", "64"]) == 2
    assert "without a visual token" in capsys.readouterr().err


def test_a_planner_that_changes_the_math_fails_the_run(monkeypatch, capsys):
    import knapray.benchmarks.rivals as rivals

    records = [
        {"step": 0, "planner": p, "rank": k, "layout": "g1", "compute_s": 1.0 + k, "predicted_s": 1.0,
         "predicted_step_s": 2.0, "loss": loss, "grad_norm": 1.0, "tokens": 1}
        for p, loss in (("unbalanced", 1.0), ("knapray_auto", 1.0), ("dynamic_cp", 1.01)) for k in range(2)
    ]
    rows = rivals.summarize(records, world=2, warmup=0)
    by = {r["planner"]: r for r in rows}
    assert by["knapray_auto"]["math_rel"] == 0.0 and by["dynamic_cp"]["math_rel"] == pytest.approx(0.01)
    assert by["knapray_auto"]["measured_max_over_mean"] == pytest.approx(2.0 / 1.5)
    assert "flexsp" not in by  # a planner that never ran has no row

    def fake_run(**kwargs):
        return {"rows": rows, "math_rel_max": 0.01, "math_tol": rivals.LOSS_TOL, "math_ok": False,
                "meta": {"world_size": 2, "steps": 1, "warmup": 0, "mix": "m", "scale": 1, "hidden": 8,
                         "heads": 1, "depth": 1, "seed": 0, "seconds": 1.0}}

    monkeypatch.setattr(rivals, "run_rivals_bench", fake_run)
    assert main(["bench", "rivals"]) == 1
    assert "a planner's step computes different math: relative loss / grad norm difference 1.00e-02" in (
        capsys.readouterr().err)
