"""`knapray bench step`: measured per-rank compute, balanced vs unbalanced, on gloo ranks."""

from __future__ import annotations

import json
import math

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


@pytest.mark.dist
def test_bench_step_variants_side_by_side(capsys):
    rc = main([
        "bench", "step", "--world-size", "2", "--topology", "g2n1", "--mix", MIX, "--scale", "2",
        "--max-text-tokens", "64", "--hidden", "64", "--heads", "4", "--depth", "1", "--steps", "3",
        "--fsdp", "full", "--ac", "full", "--json",
    ])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("variant (balanced step)") for line in lines)
    r = json.loads(lines[-1])
    rows = {v["name"]: v for v in r["variants"]}
    # Compile is left out here: every compiled variant compiles each block on every rank
    # (~10 s of CPU each); tests/dist/test_parallelize.py covers compile and its recompiles.
    both = "fsdp full+ac full"
    assert list(rows) == ["balanced", "fsdp full", "ac full", both]
    base = rows["balanced"]
    # The baseline row is the old balanced mode, measured once.
    assert base["step_wall_s"] == r["balanced"]["step_wall_s"] and base["wall_ratio"] == 1.0
    for name, v in rows.items():
        assert v["steps"] == 2
        assert math.isfinite(v["step_wall_s"]) and v["step_wall_s"] > 0
        assert math.isfinite(v["compute_max_s"]) and v["compute_max_s"] > 0
        assert len(v["rank_compute_s"]) == 2 and min(v["rank_compute_s"]) > 0
        assert v["wall_ratio"] == pytest.approx(v["step_wall_s"] / base["step_wall_s"], rel=1e-12)
        assert v["compute_max_ratio"] == pytest.approx(v["compute_max_s"] / base["compute_max_s"], rel=1e-12)
        # Same weights, same batches, same plans: the same loss and gradients.
        assert v["loss_rel_max"] < 1e-5 and v["grad_norm_rel_max"] < 1e-5, name
    for name in rows:
        assert not rows[name]["compile"] and rows[name]["compiles"] == 0 == rows[name]["recompiles"]
    # What the features buy, measured on the same step: FSDP halves each of the 2 ranks'
    # parameters + gradients (its shards, plus padding) and leaves activations alone;
    # checkpointing keeps only block inputs and leaves the weights alone.
    assert base["saved_ratio"] == base["state_ratio"] == 1.0 and base["saved_mb"] > 0 and base["state_mb"] > 0
    assert 0.45 < rows["fsdp full"]["state_ratio"] < 0.6
    assert rows["fsdp full"]["saved_ratio"] == pytest.approx(1.0, rel=0.05)
    assert rows["ac full"]["saved_ratio"] < 0.5 and rows["ac full"]["state_ratio"] == 1.0
    assert rows[both]["saved_ratio"] < 0.5 and rows[both]["state_ratio"] < 0.6
    assert r["unbalanced"]["loss_rel_max"] < 1e-5
    assert r["math_ok"] and r["math_rel_max"] < 1e-5 and r["math_tol"] == 1e-4
    assert r["projected_speedup"] > 0  # the old keys are still there


def test_step_variants_each_alone_then_together():
    from knapray.benchmarks.step import step_variants

    assert step_variants() == []
    assert [v.name for v in step_variants(ac="every_k", ac_every=3)] == ["ac every_3"]
    vs = step_variants(fsdp="hybrid", gpus_per_node=2, world_size=4, compile=True)
    assert [v.name for v in vs] == ["fsdp hybrid", "compile inductor", "fsdp hybrid+compile inductor"]
    assert vs[0].describe() == {
        "name": "fsdp hybrid", "precision": "auto", "fsdp": "hybrid", "activation_checkpointing": "none",
        "ac_every": 2, "compile": False, "compile_backend": "inductor", "fp8": False, "fp8_scaling": "tensorwise",
        "gpus_per_node": 2,
    }
    assert (vs[2].parallel.fsdp, vs[2].parallel.compile, vs[2].gpus_per_node) == ("hybrid", True, 2)


def test_bench_step_rejects_bad_variants_before_spawning(capsys):
    assert main(["bench", "step", "--fsdp", "hybrid"]) == 2
    assert "fsdp hybrid shards within a node: it needs gpus_per_node" in capsys.readouterr().err
    assert main(["bench", "step", "--fsdp", "hybrid", "--gpus-per-node", "3"]) == 2
    assert "world size 4 is not a multiple of gpus_per_node=3" in capsys.readouterr().err


def test_bench_step_fails_when_a_variant_computes_other_math(monkeypatch, capsys):
    import knapray.benchmarks.step as step

    def fake_run(**kwargs):
        side = {"compute_max_over_mean": 1.0, "compute_mean_s": 1.0, "compute_max_s": 1.0, "comm_wall_mean_s": 0.0,
                "comm_isolated_s": 0.0, "step_wall_s": 1.0, "planned_imbalance": 1.0, "rank_compute_s": [1.0]}
        return {"balanced": side, "unbalanced": side, "projected_speedup": 1.0, "compute_only_speedup": 1.0,
                "fit": {"overhead_s": 0.0, "s_per_token": 0.0, "gamma": 0.0}, "variants": [],
                "math_rel_max": 3e-3, "math_tol": step.LOSS_TOL, "math_ok": False,
                "meta": {"world_size": 1, "hidden": 8, "heads": 1, "depth": [1, 1], "mix": "m", "scale": 1,
                         "sequences": 1, "tokens_per_step": 1.0, "topology": "g1n1", "gamma": 0.85, "steps": 2,
                         "warmup": 1, "seconds": 1.0}}

    monkeypatch.setattr(step, "run_step_bench", fake_run)
    assert main(["bench", "step", "--ac", "full"]) == 1
    assert "a variant computes different math: relative loss / grad norm difference 3.00e-03" in capsys.readouterr().err


def test_math_check_compares_global_loss_and_grad_norm_per_step():
    from knapray.benchmarks.step import _math_check

    recs = [
        {"mode": m, "step": s, "rank": k, "loss": loss, "grad_norm": 2.0}
        for m, per_rank in (("balanced", (1.0, 3.0)), ("v", (1.5, 2.5)), ("w", (1.0, 3.002)))
        for s in (0, 1) for k, loss in enumerate(per_rank)
    ]
    assert _math_check(recs, "v") == {"loss_rel_max": 0.0, "grad_norm_rel_max": 0.0}  # global loss: 4 == 4
    assert _math_check(recs, "w")["loss_rel_max"] == pytest.approx(0.002 / 4)
