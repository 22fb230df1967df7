"""The cross-attention term of the workload and cost models (Wan: visual tokens self-attend
and cross-attend to a fixed-length text), the Wan mix, and `knapray simulate --model wan14b`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from knapray.cli import main
from knapray.coordinator.config import CoordinatorConfig, make_planning_model
from knapray.planning import Topology, WorkloadModel, plan_balance
from knapray.planning.costs.cost import MODEL_PRESETS, CostModel
from knapray.planning.shapes.mix import parse_code, parse_mix
from knapray.planning.simulation.sim import simulate_mix
from knapray.worker.step_planner import coordinator_config

LENS = np.array([1.0, 256.0, 1024.0, 21504.0, 48384.0])


@pytest.mark.parametrize("make", [
    lambda **kw: WorkloadModel(d_model=5120, **kw),
    lambda **kw: CostModel.from_dict({**MODEL_PRESETS["wan14b"], **kw}),
])
def test_cross_term_scales_with_text_and_self_with_visual_squared(make):
    base, double = make(attention_kind="cross", text_tokens=512), make(attention_kind="cross", text_tokens=1024)
    np.testing.assert_allclose(double.cross_attention(LENS), 2 * base.cross_attention(LENS), rtol=1e-15)
    np.testing.assert_allclose(base.self_attention(2 * LENS), 4 * base.self_attention(LENS), rtol=1e-15)
    np.testing.assert_array_equal(double.self_attention(LENS), base.self_attention(LENS))
    np.testing.assert_array_equal(double.linear(LENS), base.linear(LENS))  # text tokens are not updated
    np.testing.assert_allclose(base.attention(LENS), base.self_attention(LENS) + base.cross_attention(LENS))
    assert (base.cross_attention(LENS) > 0).all()
    # cross = pairs x T at the self-attention's per-pair rate + a per-sequence text K/V part
    per_pair = base.self_attention(1.0)
    kv = base.cross_attention(0.0)
    np.testing.assert_allclose(base.cross_attention(LENS), per_pair * LENS * 512 + kv, rtol=1e-12)
    assert float(kv) > 0
    joint = make(attention_kind="joint", text_tokens=512)
    np.testing.assert_array_equal(joint.cross_attention(LENS), 0.0)


def test_cost_cross_term_is_the_analytic_flop_count():
    m = CostModel.from_dict(MODEL_PRESETS["wan14b"])
    d, t, layers, f = 5120.0, 512.0, 40, m.passes / m.flops_per_s
    v = 21504.0
    want = layers * (4 * d * v * t + 4 * d * d * t) * f
    np.testing.assert_allclose(m.cross_attention(v), want, rtol=1e-12)
    np.testing.assert_allclose(m.linear(v), layers * 22.8 * d * d * v * f, rtol=1e-12)
    # a fitted per-token rate carries the text K/V part at the FLOP ratio
    fitted = m.replace(linear_s=1e-6, attn_s=1e-12)
    np.testing.assert_allclose(fitted.cross_attention(v), layers * (1e-12 * v * t + 1e-6 * 4 / 22.8 * t))
    # the cross part splits over a bag like self-attention: chunks sum to the whole
    g = 4
    chunks = m.chunk(np.full(g, v / g), np.full(g, v), np.full(g, g))
    np.testing.assert_allclose(chunks.sum(), m.compute(v), rtol=1e-12)


def test_joint_mode_is_unchanged_bit_for_bit():
    lens = np.array([0, 1, 77, 4096, 16384, 25600], dtype=np.float64)
    w = WorkloadModel(3072, 0.4)
    assert w.attention_kind == "joint"
    np.testing.assert_array_equal(w(lens), 24.0 * lens * 3072.0 ** 2 + 0.4 * 4.0 * lens * lens * 3072.0)
    np.testing.assert_array_equal(WorkloadModel(3072, 0.4, text_tokens=7)(lens), w(lens))
    c = CostModel()
    a = 24.0 * 3072.0 ** 2 * 4.0 / 400e12
    b = 4.0 * 3072.0 * 4.0 / 400e12
    np.testing.assert_array_equal(c.compute(lens), 57 * a * lens + 57 * b * lens * lens)
    np.testing.assert_array_equal(CostModel(text_tokens=99, text_kv_flops=9.0).compute(lens), c.compute(lens))


def test_bad_attention_kind_is_refused():
    with pytest.raises(ValueError, match="attention_kind"):
        WorkloadModel(attention_kind="joint+cross")
    with pytest.raises(ValueError, match="attention_kind"):
        CostModel(attention_kind="x")
    with pytest.raises(ValueError, match="text_tokens"):
        CostModel(text_tokens=-1)
    with pytest.raises(ValueError, match="attention_kind"):
        CoordinatorConfig(attention_kind="x")


def _rank_loads(plan, model) -> np.ndarray:
    per_chunk = model.chunk(plan.chunk_len.astype(np.float64), plan.seq_lens[plan.chunk_seq].astype(np.float64),
                            plan.bag_size_of_seq[plan.chunk_seq].astype(np.float64))
    return np.bincount(plan.chunk_rank, weights=per_chunk, minlength=plan.world_size)


@pytest.mark.parametrize("kind", ["workload", "cost"])
def test_the_plan_follows_the_cross_weights(kind):
    """One long clip and many short images: joint weights rank the long clip's rank the
    heavier at ~16 images beside it, cross weights (every image also pays 512 text tokens)
    at ~36. The cross plan balances cross work; the joint plan leaves it ~1.2x off."""
    if kind == "workload":
        joint, cross = WorkloadModel(5120), WorkloadModel(5120, attention_kind="cross")
    else:
        wan = {**MODEL_PRESETS["wan14b"], "ulysses_a2a_per_layer": 0, "route_a2a_per_step": 0}
        joint, cross = CostModel.from_dict({**wan, "attention_kind": "joint"}), CostModel.from_dict(wan)
    lens = [[8000] + [100] * 120, []]
    topo = Topology.parse("g1n2", world_size=2)
    p_joint, p_cross = plan_balance(lens, topo, joint), plan_balance(lens, topo, cross)
    beside = [int((p.chunk_rank == p.chunk_rank[p.chunk_seq == 0][0]).sum()) - 1 for p in (p_joint, p_cross)]
    assert beside[0] < 25 < beside[1], beside
    load_joint, load_cross = _rank_loads(p_joint, cross), _rank_loads(p_cross, cross)
    ideal = load_cross.sum() / 2
    assert load_cross.max() / ideal < 1.01
    assert load_joint.max() / ideal > 1.15


def test_wan_vae_codes_and_mix():
    c = parse_code("g1b1i512f81s2")
    assert (c.latent_frames, c.visual_tokens, c.code) == (21, 21504, "g1b1i512f81s2")
    assert parse_code("g1b1i512f1s2").latent_frames == 1
    assert parse_code("g1b1i512f85s1").latent_frames == 25  # the paper's 3.4 unchanged
    codes = parse_mix("wan")
    assert sum(c.ranks for c in codes) == 32
    assert {c.visual_tokens for c in codes} == {1024, 4096, 5120, 13312, 21504, 48384}


def test_simulated_wan_lengths_are_visual_tokens_only():
    r = simulate_mix("wan", "g8n4", 32, CostModel.from_dict(MODEL_PRESETS["wan14b"]), steps=1, history_steps=1)
    ideal = CostModel.from_dict(MODEL_PRESETS["wan14b"]).compute(
        np.repeat([c.visual_tokens for c in parse_mix("wan")], [c.ranks * c.batch for c in parse_mix("wan")])
    ).sum() / 32
    assert r["ideal_step_s"] == pytest.approx(ideal, rel=1e-12)


def test_simulate_wan14b_at_64_gpus(capsys):
    assert main(["simulate", "--model", "wan14b", "--mix", "wan", "--world-size", "64", "--steps", "1",
                 "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    m = out["modes"]
    assert out["world_size"] == 64 and len(m["knapray"]["rank_s"]) == 64
    assert m["knapray"]["step_s"] <= m["baseline"]["step_s"] / 3
    assert m["knapray"]["step_s"] <= m["greedy"]["step_s"]
    assert any(line.startswith("knapray vs greedy") for line in lines)
    # --cost overrides the preset
    assert main(["simulate", "--model", "wan14b", "--cost", "text_tokens=0", "--mix", "wan", "--world-size", "64",
                 "--steps", "1", "--json"]) == 0
    no_text = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert no_text["ideal_step_s"] < out["ideal_step_s"]


def test_the_trainer_plans_wan_with_cross_attention():
    """The run config's model section (its family's config class) tells the planner how
    the family attends to its text."""
    from knapray.config.run import load_config

    def cfg(family, planner):
        return load_config(None, [f"model.family={family}", "model.hidden_size=5120", "model.num_heads=40",
                                  "model.depth_single=40", "model.rope_axes_dim=[44,42,42]", f"balance.planner={planner}",
                                  "balance.topology=bags_of:8", "balance.gpus_per_node=8"])
    for planner in ("workload", "cost"):
        wan = make_planning_model(coordinator_config(cfg("wan", planner)))
        flux = make_planning_model(coordinator_config(cfg("mmdit", planner)))
        assert (wan.attention_kind, flux.attention_kind) == ("cross", "joint")
