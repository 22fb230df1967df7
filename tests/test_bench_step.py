"""`knapray bench step`: measured per-rank compute, balanced vs unbalanced, on gloo ranks."""

from __future__ import annotations

import json

import pytest

from knapray.cli import main

# Rank 0: two video-like sequences (~970 tokens each); rank 1: four tiny images (~15-45
# tokens, mostly text). Predicted max/mean work unbalanced ~1.96 of a possible 2; a bag of
# both ranks (g2n1) gives each rank half of every sequence.
MIX = "g1b2i256f51s1,g1b4i128f1s0"


@pytest.mark.dist
def test_bench_step_balances_measured_compute(tmp_path, capsys):
    plot = tmp_path / "ranks.png"
    rc = main([
        "bench", "step", "--world-size", "2", "--topology", "g2n1", "--mix", MIX, "--scale", "2",
        "--max-text-tokens", "64", "--hidden", "64", "--heads", "4", "--depth", "1",
        "--steps", "3", "--plot", str(plot), "--json",
    ])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("projected speedup") for line in lines)
    r = json.loads(lines[-1])
    for mode in ("balanced", "unbalanced"):
        m = r[mode]
        assert m["steps"] == 2  # warm-up step left out
        assert len(m["rank_compute_s"]) == 2 and min(m["rank_compute_s"]) > 0
        assert m["compute_max_over_mean"] >= 1.0
        assert m["comm_wall_mean_s"] >= 0 and m["comm_isolated_s"] >= 0
    assert r["balanced"]["comm_calls"] > 0 and r["unbalanced"]["comm_calls"] == 0  # identity plan: no routing
    assert r["unbalanced"]["planned_imbalance"] > 1.5
    assert r["balanced"]["planned_imbalance"] < 1.05
    assert r["balanced_compute_max_over_mean"] == r["balanced"]["compute_max_over_mean"]
    # Measured, not planned: thread CPU time per rank follows the plan.
    assert r["balanced_compute_max_over_mean"] < 1.2
    assert r["unbalanced_compute_max_over_mean"] > 1.4
    assert r["balanced_compute_max_over_mean"] < r["unbalanced_compute_max_over_mean"]
    assert r["projected_speedup"] > 0 and r["compute_only_speedup"] > 1.0
    assert r["meta"]["world_size"] == 2 and r["meta"]["topology"] == "g2n1"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_step_rejects_bad_setups_before_spawning(capsys):
    assert main(["bench", "step", "--topology", "g8n1"]) == 2
    assert "not a positive multiple of 8" in capsys.readouterr().err
    assert main(["bench", "step", "--steps", "1"]) == 2
    assert "must be larger than warmup" in capsys.readouterr().err
    assert main(["bench", "step", "--scale", "64"]) == 2
    assert "without a visual token" in capsys.readouterr().err
