"""A topology every step: aligned power-of-two blocks of a node, the per-step search, and
the simulator's ``per-step`` mode and non-stationary mixes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knapray.cli import main
from knapray.planning import Topology, plan_balance
from knapray.planning.search.autotopo import search_topology
from knapray.planning.shapes.blocks import (
    aligned_blocks,
    block_sizes,
    check_aligned,
    is_aligned_layout,
    node_partitions,
)
from knapray.planning.costs.cost import CostModel
from knapray.planning.search.pertopo import plan_step
from knapray.planning.simulation.sim import parse_schedule, schedule_ranks, schedule_steps, simulate_mix


def test_aligned_blocks_of_nodes():
    assert block_sizes(8) == [1, 2, 4, 8]
    assert block_sizes(16, num_heads=24) == [1, 2, 4, 8]  # 16 does not divide 24 heads
    blocks = aligned_blocks(16, 8)
    assert len(blocks) == 2 * 15  # per node of 8: 1 + 2 + 4 + 8 blocks
    for start, g in blocks:
        assert start % g == 0 and start // 8 == (start + g - 1) // 8
    assert blocks[:3] == [(0, 8), (0, 4), (4, 4)]
    assert aligned_blocks(4, 8) == [(0, 4), (0, 2), (2, 2), (0, 1), (1, 1), (2, 1), (3, 1)]  # world < node
    # 1 + f(4)^2 with f(4) = 1 + f(2)^2 = 5: 26 partitions of a node of 8.
    parts = node_partitions(8, (1, 2, 4, 8))
    assert len(parts) == 26 and len(set(parts)) == 26
    assert all(sum(p) == 8 and is_aligned_layout(p, 8) for p in parts)
    assert (1, 1, 2, 4) in parts and (1, 2, 1, 4) not in parts
    with pytest.raises(ValueError, match="powers of two"):
        node_partitions(8, (3,))
    with pytest.raises(ValueError, match="world size 12 is not a multiple of 8"):
        aligned_blocks(12, 8)


def test_aligned_layout_check():
    assert is_aligned_layout([4, 2, 1, 1, 8], 8)
    assert is_aligned_layout([4, 2], 6)  # a 2 at offset 4 of a node of 6
    assert not is_aligned_layout([2, 4], 6)  # a 4 at offset 2
    assert not is_aligned_layout([1, 2, 1, 4], 8)  # a 2 at offset 1
    assert not is_aligned_layout([4, 8, 4], 8)  # an 8 across two nodes
    assert not is_aligned_layout([3, 3, 2], 8)  # not powers of two
    check_aligned(Topology((2, 2, 4)), 8)
    with pytest.raises(ValueError, match=r"bag 1 \(g2, ranks 1..2\)"):
        check_aligned(Topology((1, 2, 1, 4)), 8)


MIXES = {
    "images": "g8b8i256f1s0",
    "mixed": "g4b4i256f1s0,g2b2i1024f1s0,g1b1i2048f1s0,g1b1i512f85s1",
}


def _steps(mix: str, world: int, n: int, seed: int) -> list[list[list[int]]]:
    return schedule_steps(mix, n, seed, world)[1]


def test_plan_step_is_deterministic_and_valid():
    step = _steps("image+video", 32, 1, 3)[0]
    a, b = plan_step(step, CostModel()), plan_step([list(r) for r in step], CostModel())
    assert a.topology == b.topology and a.source == b.source and a.scores == b.scores
    for name in ("bag", "chunk_rank", "chunk_start", "chunk_len"):
        np.testing.assert_array_equal(getattr(a.plan, name), getattr(b.plan, name))
    check_aligned(a.topology, 8)
    assert a.predicted_step_s == pytest.approx(a.plan.predicted_step_time)
    assert a.predicted_step_s == min(a.scores.values())
    # Every chunk of every sequence lands in its bag, sequences whole.
    for s in range(a.plan.num_sequences):
        idx = np.flatnonzero(a.plan.chunk_seq == s)
        assert a.plan.chunk_len[idx].sum() == a.plan.seq_lens[s]
        assert list(a.plan.chunk_rank[idx]) == list(a.topology.bag_ranks(int(a.plan.bag[s])))


@st.composite
def worlds_and_steps(draw):
    gpn = draw(st.sampled_from([2, 4, 8]))
    nodes = draw(st.integers(1, 3))
    world = gpn * nodes
    heads = draw(st.sampled_from([8, 12, 24]))
    hi = draw(st.sampled_from([300, 5000, 40000]))
    step = [draw(st.lists(st.integers(1, hi), min_size=0, max_size=5)) for _ in range(world)]
    cost = CostModel(gpus_per_node=gpn, num_heads=heads, double_blocks=2, single_blocks=4)
    return step, cost


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds_and_steps())
def test_per_step_never_behind_static_auto_and_uses_aligned_blocks(inp):
    step, cost = inp
    world, gpn = len(step), cost.gpus_per_node
    static = search_topology([step], world, cost).topology
    static_s = plan_balance(step, static, cost).predicted_step_time
    ours = plan_step(step, cost, base=static, max_evals=12)
    assert ours.predicted_step_s <= static_s * (1 + 1e-12)
    assert ours.base_step_s == pytest.approx(static_s)
    # Without a base every bag is an aligned power-of-two block of a node that splits the heads.
    pure = plan_step(step, cost, max_evals=12)
    check_aligned(pure.topology, gpn)
    assert all(cost.num_heads % g == 0 for g in pure.topology.bags)
    # ... and never behind any homogeneous partition (they are all candidates).
    for g in block_sizes(min(world, gpn), cost.num_heads):
        homo = Topology((g,) * (world // g))
        assert pure.predicted_step_s <= plan_balance(step, homo, cost).predicted_step_time * (1 + 1e-12)
    again = plan_step(step, cost, base=static, max_evals=12)
    assert again.topology == ours.topology and np.array_equal(again.plan.bag, ours.plan.bag)


def test_per_step_picks_small_blocks_for_images_and_large_ones_for_video():
    cost = CostModel()
    images = plan_step(_steps("low-res", 32, 1, 0)[0], cost)
    assert images.topology.bags == [1] * 32
    video = plan_step(_steps("image+video", 32, 1, 0)[0], cost)
    assert max(video.topology.bags) >= 4


def test_schedule_notation():
    assert parse_schedule("low-res")[0][2] == 1
    parts = parse_schedule("alternate:low-res*3/image+video")
    assert [(n, k) for n, _, k in parts] == [("low-res", 3), ("image+video", 1)]
    labels, steps = schedule_steps("alternate:low-res*2/image+video", 6, 0, 32)
    assert labels == ["low-res", "low-res", "image+video"] * 2
    assert all(len(s) == 32 for s in steps)
    assert schedule_ranks("alternate:g4b1i256f1s0/g8b1i256f1s0") == 8
    for bad in ("alternate:low-res", "alternate:low-res*0/image+video", "alternate:low-res*x/image+video",
                "alternate:/low-res"):
        with pytest.raises(ValueError, match="alternate"):
            parse_schedule(bad)


def test_simulate_per_step_on_the_nonstationary_mix():
    r = simulate_mix("alternate:low-res/image+video", "per-step", 32, steps=4, seed=0)
    assert r["step_mix"] == ["low-res", "image+video"] * 2
    assert r["steps_behind_static_auto"] == 0 and r["per_step_ratio_min"] >= 1.0
    # Image-only steps leave the static topology's large bags: bags of one, >= 5% faster.
    for label, p in zip(r["step_mix"], r["per_step"]):
        if label == "low-res":
            assert p["topology"] == "g1n32" and p["static_auto_s"] / p["step_s"] >= 1.05
    assert r["speedup_vs_static_auto"] >= 1.02


def test_simulate_cli_per_step(capsys):
    assert main(["simulate", "--mix", "alternate:low-res/mixed-res", "--topology", "per-step", "--steps", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["modes"]["knapray"]["topology"] == "per-step" and "static_auto" in out["modes"]
    assert len(out["per_step"]) == 2 and out["steps_behind_static_auto"] == 0
    assert main(["simulate", "--mix", "alternate:low-res*0/mixed-res", "--topology", "per-step"]) == 2
    assert "MIX*K" in capsys.readouterr().err


def test_per_step_keeps_the_memory_budget_and_says_when_nothing_can():
    cost = CostModel(gpus_per_node=4)
    step = [[256, 256], [8192, 4096, 1024], [8192, 4096], [8192, 256, 256]]
    free = plan_step(step, cost)
    assert free.topology.bags == [1, 1, 1, 1] and free.plan.rank_tokens.max() == 9984
    kept = plan_step(step, cost, max_tokens_per_gpu=8705)
    assert kept.plan.rank_tokens.max() <= 8705 and kept.topology.bags == [4]
    assert kept.scores["g1n4"] == np.inf  # the unbudgeted winner was left out
    assert kept.predicted_step_s >= free.predicted_step_s
    with pytest.raises(ValueError, match="no layout of .* keeps the memory budget of 4000 tokens per GPU"):
        plan_step([[16384], [256], [256], [256]], cost, max_tokens_per_gpu=4000)


def test_rule_per_step_and_the_step_plan_both_paths_use():
    from knapray.coordinator import plan_from_gathered
    from knapray.planning.search.rules import parse_rule, per_step_node, resolve_rule
    from knapray.planning.costs.workload import WorkloadModel

    assert parse_rule("per-step") == ("per_step", None)
    assert per_step_node("per-step", 16, 8) == 8 and per_step_node("per-step", 4, 8) == 4
    assert per_step_node("per-step", 6, None) == 6 and per_step_node("auto", 16, 8) is None
    with pytest.raises(ValueError, match="world size 12 is not a multiple of gpus_per_node=8"):
        per_step_node("per-step", 12, 8)
    with pytest.raises(ValueError, match="needs the cost model"):
        resolve_rule("per-step", 8, model=WorkloadModel())
    cost = CostModel(gpus_per_node=4)
    steps = {"images": [[256] * 4] * 4, "video": [[16384], [256] * 3, [256] * 3, [256] * 3]}
    base = resolve_rule("per-step", 4, model=cost, history=list(steps.values())).topology
    for lens in steps.values():
        plan = plan_from_gathered(lens, base, cost, per_step_node=4)
        ref = plan_step(lens, cost, gpus_per_node=4, base=base).plan
        assert plan.topology == ref.topology and np.array_equal(plan.bag, ref.bag)
        assert plan.predicted_step_time <= plan_balance(lens, base, cost).predicted_step_time * (1 + 1e-12)
    assert {str(plan_from_gathered(s, base, cost, per_step_node=4).topology) for s in steps.values()} \
        == {"g1n4", "g4n1"}
    # A budget no layout keeps: planned without it (and warned), as on a static topology.
    over = plan_from_gathered(steps["video"], base, cost, max_tokens_per_gpu=4000, per_step_node=4)
    assert over.rank_tokens.max() > 4000
    with pytest.raises(ValueError, match="needs the cost model"):
        plan_from_gathered(steps["video"], base, WorkloadModel(), per_step_node=4)
