"""`knapray plan` / `knapray bench planner` as a user runs them (in-process)."""

from __future__ import annotations

import json

import pytest

from knapray.cli import main
from knapray.planning import PAPER_MIXES

KEYS = {
    "topology", "world_size", "steps", "baseline_imbalance_mean", "imbalance_mean",
    "imbalance_max", "moved_token_fraction_mean", "plan_ms_p50",
}


def test_plan_json_plot_export(tmp_path, capsys):
    plot, export = tmp_path / "w.png", tmp_path / "plans.json"
    rc = main([
        "plan", "--mix", PAPER_MIXES["mixed-res"], "--topology", "g8n4", "--steps", "6",
        "--seed", "1", "--plot", str(plot), "--export", str(export), "--json",
    ])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= out.keys()
    assert out["world_size"] == 32 and out["steps"] == 6
    assert out["imbalance_mean"] < out["baseline_imbalance_mean"]
    assert plot.stat().st_size > 10_000  # a real PNG, not an empty file
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plans = json.loads(export.read_text())
    assert len(plans["steps"]) == 6
    step = plans["steps"][0]
    assert step["topology"] == "g8n4" and len(step["bags"]) == 4
    for seq in step["sequences"]:
        assert sum(c["length"] for c in seq["chunks"]) == seq["length"]
        assert [c["rank"] for c in seq["chunks"]] == step["bags"][seq["bag"]]


def test_plan_lengths_file_and_human_table(tmp_path, capsys):
    f = tmp_path / "steps.json"
    f.write_text(json.dumps([[[300, 1200], [4096], [], [50]], [[10], [20], [30], [40, 5000]]]))
    assert main(["plan", "--lengths", str(f), "--topology", "g1n2+g2n1"]) == 0
    out = capsys.readouterr().out
    assert "imbalance knapray" in out and "tokens moved" in out and "plan time" in out


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["plan", "--mix", "g4b1i256f1s0", "--topology", "g3n1"], "not a positive multiple of 3"),
        (["plan", "--mix", "g4b1i256f1s0", "--topology", "g2x2"], "bad topology term 'g2x2'"),
        (["plan", "--mix", "g4b1i256"], "bad data code"),
    ],
)
def test_plan_bad_input_exits_2_with_message(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_plan_needs_exactly_one_source(capsys):
    assert main(["plan", "--topology", "g8n4"]) == 2
    assert "exactly one of --mix" in capsys.readouterr().err


def test_bench_planner_ranks_are_checked_before_anything_runs(capsys):
    assert main(["bench", "planner", "--ranks", "1024,1000"]) == 2
    err = capsys.readouterr().err
    assert "--ranks 1000: each world size must be a multiple of 8" in err


def test_bench_planner_scaling_rows_side_by_side(capsys):
    from knapray.benchmarks.planner import run_scaling
    from knapray.planning import WorkloadModel, plan_balance

    rows = run_scaling([32], 1, 0, WorkloadModel(), reference=plan_balance)
    assert [r["mix"] for r in rows] == ["image+video", "mixed-res", "low-res"]
    for r in rows:
        assert r["steps_worse_than_greedy"] == 0 and r["imbalance_mean"] <= r["greedy_imbalance_mean"] * (1 + 1e-12)
        assert r["same_plans_as_reference"] is True  # the same solver twice
        assert min(r["greedy_cpu_ms_p50"], r["cpu_ms_p50"], r["cost_cpu_ms_p50"]) >= 0
    out = capsys.readouterr().out
    assert "against the reference solver" in out and out.count(" yes") == 3
