"""The coordinator planning with the cost model: automatic mixed topologies and live
per-rank speeds (a slow rank gets less work)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from knapray.coordinator import BalanceCoordinator, CoordinatorConfig
from knapray.planning import PAPER_MIXES, parse_mix, sample_step
from knapray.planning.cost import CostModel


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


def test_live_speed_factors_give_a_slow_rank_less_work():
    coord = BalanceCoordinator(topology="g1n4", planner="cost", cost={"num_heads": 4, "d_model": 256,
                                                                    "double_blocks": 1, "single_blocks": 1})
    coord.begin_run(4)
    lens = [[300, 200, 100], [250, 250], [400], [150, 150, 200]]
    first = _plan(coord, 0, lens)
    # Rank 2 reports twice the time per unit of planned work than the others.
    for r in range(4):
        for _ in range(30):
            coord.report_timing(0, r, float(first.rank_work[r]) * (2.0 if r == 2 else 1.0), 0.0, 0.0)
    speeds = coord.speed_factors()
    assert speeds[2] == pytest.approx(0.5, rel=0.05)
    second = _plan(coord, 1, lens)
    share = second.rank_work / second.rank_work.sum()
    assert share[2] < 0.7 * np.delete(share, 2).mean()


def test_unknown_planner_is_rejected():
    with pytest.raises(ValueError, match="unknown planner 'flops'; valid: workload, cost"):
        CoordinatorConfig(planner="flops")
