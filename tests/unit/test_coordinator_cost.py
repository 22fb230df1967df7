"""The coordinator planning with the cost model: automatic mixed topologies, and the live
re-fit of its coefficients and per-rank speeds (a slow rank gets less work; the fit
survives a restart)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from knapray.coordinator import BalanceConfig, BalanceCoordinator
from knapray.planning import PAPER_MIXES, parse_mix, sample_step
from knapray.planning.costs.cost import CostModel
from knapray.planning.fitting.livefit import MIN_STEPS, SKIP_STEPS, RankFeatures, predict


def _plan(coord, step, lens):
    for r, l in enumerate(lens):
        coord.submit(step, r, l, list(range(1000 * step + 100 * r, 1000 * step + 100 * r + len(l))))
    plan, done = asyncio.run(coord.get_plan(step, 0, 5.0))
    assert not done
    return plan


def test_auto_topology_with_the_cost_model_picks_mixed_bags():
    coord = BalanceCoordinator(topology="auto", planner="cost", gpus_per_node=8, cost={"num_heads": 24})
    assert isinstance(coord.model, CostModel)
    rng = np.random.default_rng(0)
    codes = parse_mix(PAPER_MIXES["image+video"])
    coord.begin_run(32)
    for step in range(3):
        _plan(coord, step, sample_step(codes, rng))
    topo = coord.topology_for(32)
    assert topo.world_size == 32
    assert len(set(topo.bags)) > 1, topo  # mixed bag sizes beat any g{k}n{32/k} here
    topo.check_node_placement(8)


SMALL = {"num_heads": 4, "d_model": 256, "double_blocks": 1, "single_blocks": 1}
TRUE = CostModel(**SMALL, linear_s=2e-6, attn_s=3e-10, seq_s=1e-4, layer_overhead_s=2e-3,
                 rank_speed=(1.0, 1.0, 0.5, 1.0))
"""The machine the reported times come from: rank 2 computes at half speed."""


def _lens(rng):
    return [rng.integers(50, 600, size=int(rng.integers(1, 4))).tolist() for _ in range(4)]


def _train(coord, steps, rng, start=0):
    """Plan and report ``steps`` steps timed by ``TRUE`` (as ranks would)."""
    for step in range(start, start + steps):
        plan = _plan(coord, step, _lens(rng))
        seconds = predict(TRUE, RankFeatures.of_plan(plan))
        for r in range(4):
            coord.report_timing(step, r, float(seconds[r]), 0.0, 0.0)


def test_live_fit_gives_a_slow_rank_less_work_and_predicts_its_time():
    coord = BalanceCoordinator(topology="g1n4", planner="cost", cost=SMALL)
    coord.begin_run(4)
    rng = np.random.default_rng(0)
    _train(coord, SKIP_STEPS + MIN_STEPS - 1, rng)
    assert coord._live_model() == coord.model  # not enough steps yet: the configured model
    _train(coord, 6, rng, start=SKIP_STEPS + MIN_STEPS - 1)
    speeds = coord.speed_factors()
    assert speeds[2] == pytest.approx(0.5, rel=0.02)
    live = coord._live_model()
    assert live.fixed_s == pytest.approx(TRUE.fixed_s, rel=0.02)
    assert live.linear_s == pytest.approx(TRUE.linear_s, rel=0.02)
    plan = _plan(coord, 100, [[300, 200, 100], [250, 250], [400], [150, 150, 200]])
    assert plan.model is not coord.model  # planned with the live model
    share = plan.rank_work / plan.rank_work.sum()
    assert share[2] < 0.7 * np.delete(share, 2).mean()
    measured = predict(TRUE, RankFeatures.of_plan(plan))
    np.testing.assert_allclose(plan.step_times().compute + plan.step_times().overhead, measured, rtol=0.02)
    assert coord.stats()["live_fit"]["fitted"]


def test_live_fit_survives_a_coordinator_restart(tmp_path):
    coord = BalanceCoordinator(topology="g1n4", planner="cost", cost=SMALL, state_dir=str(tmp_path))
    coord.begin_run(4)
    _train(coord, SKIP_STEPS + MIN_STEPS + 2, np.random.default_rng(1))
    fitted = coord._live_model()
    coord.begin_run(4)  # writes stats.json
    coord.close()
    again = BalanceCoordinator(topology="g1n4", planner="cost", cost=SMALL, state_dir=str(tmp_path))
    again.begin_run(4)
    assert again._live_model() == fitted
    with open(tmp_path / "stats.json") as f:
        assert json.load(f)["live_fit"]["fitted"] is True
    # Another model (here: more layers) does not take the saved fit.
    other = BalanceCoordinator(topology="g1n4", planner="cost", cost={**SMALL, "single_blocks": 2},
                               state_dir=str(tmp_path))
    other.begin_run(4)
    assert other._live_model() == other.model


def test_live_fit_off_plans_with_the_configured_model():
    coord = BalanceCoordinator(topology="g1n4", planner="cost", cost=SMALL, live_fit=False)
    coord.begin_run(4)
    _train(coord, SKIP_STEPS + MIN_STEPS + 2, np.random.default_rng(2))
    assert coord._live_model() == coord.model and "live_fit" not in coord.stats()


def test_unknown_planner_is_rejected():
    with pytest.raises(ValueError, match="unknown planner 'flops'; valid: workload, cost"):
        BalanceConfig(planner="flops")


def test_per_step_topology_planned_by_the_coordinator_as_by_the_ranks():
    from knapray.coordinator import plan_from_gathered

    with pytest.raises(ValueError, match="topology 'per-step' .* needs planner: cost, got planner 'workload'"):
        BalanceConfig(topology="per-step")
    coord = BalanceCoordinator(topology="per-step", planner="cost", gpus_per_node=4, live_fit=False,
                               cost={"num_heads": 4})
    base = coord.begin_run(4)
    steps = [[[256] * 4] * 4, [[16384], [256] * 3, [256] * 3, [256] * 3]]
    plans = [_plan(coord, t, lens) for t, lens in enumerate(steps)]
    assert [p.topology.bags for p in plans] == [[1, 1, 1, 1], [4]]
    for plan, lens in zip(plans, steps):  # the local fallback's plan is the same
        local = plan_from_gathered(lens, base, coord.model, per_step_node=4)
        assert local.topology == plan.topology and np.array_equal(local.chunk_rank, plan.chunk_rank)
    assert coord.stats()["topology"] == str(base)  # the run's static topology stays the base
