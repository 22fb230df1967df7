"""The rivals in the simulator (knapray.planning.simulation.rivals): every planner predicts a valid step
under the same cost model, knapray's per-step never trails the planners whose layouts its
search covers, and the table runs."""

from __future__ import annotations

import numpy as np
import pytest

from knapray.planning import Topology
from knapray.planning.costs.cost import MODEL_PRESETS, CostModel
from knapray.planning.simulation.rivals import (
    KNAPRAY,
    PLANNERS,
    divisor_sizes,
    dynamic_cp,
    knapformer_topology,
    rivals_markdown,
    rivals_step,
    random_cases,
    rivals_table,
    steps_at,
    zellige_times,
)
from knapray.planning.shapes.mix import PAPER_MIXES


def _step(world: int = 32, seed: int = 0):
    return steps_at("image+video", world, 1, seed, 392)[0]


def test_zellige_places_every_sequence_once_and_overlaps_groups():
    """Its compute is the cost model's: whole sequences in full, sharded ones in chunks whose
    per-sequence part every GPU of the group pays."""
    cost = CostModel()
    step = _step()
    lens = np.asarray([x for r in step for x in r])
    times, layout = zellige_times(step, cost, target=cost.ideal_step_time(lens, 32) - cost.fixed_s)
    assert "group(s) of" in layout
    assert times.compute.sum() >= cost.compute(lens).sum() * (1 - 1e-9)  # nothing dropped
    assert times.step_time >= cost.ideal_step_time(lens, 32)
    # A target no sequence exceeds: everything whole, no Ulysses.
    whole, layout = zellige_times(step, cost, target=1e9)
    assert layout == "overlapping: every sequence whole" and not whole.ulysses.any()
    assert whole.compute.sum() == pytest.approx(cost.compute(lens).sum())


def test_per_step_never_trails_the_layouts_its_search_covers():
    """per-step tries every homogeneous partition (dynamic CP's whole choice) and the static
    auto topology: it is never predicted slower than either, nor than KnapFormer's greedy."""
    cost = CostModel()
    history = steps_at("image+video", 32, 2, 1000, 392)
    from knapray.planning.search.autotopo import search_topology

    auto = search_topology(history, 32, cost, 8).topology
    fixed = knapformer_topology(history, cost)
    for seed in range(3):
        p = rivals_step(_step(seed=seed), cost, auto, fixed)
        assert set(p) == set(PLANNERS)
        best = p["knapray_per_step"].step_s
        assert best <= p["dynamic_cp"].step_s * (1 + 1e-9)
        assert best <= p["knapray_auto"].step_s * (1 + 1e-9)
        assert best <= p["knapformer"].step_s * (1 + 1e-9)
        assert p["flexsp"].step_s <= p["dynamic_cp"].step_s * (1 + 1e-9)  # its one-size layouts are tried too
        for name in ("knapray_auto", "knapray_per_step", "knapformer", "dynamic_cp", "flexsp"):
            assert p[name].plan is not None and p[name].plan.topology.world_size == 32
        assert p["zellige"].plan is None  # overlapping groups: no BalancePlan
        assert all(0 <= x.comm_share < 1 for x in p.values())


def test_flexsp_groups_take_any_divisor_of_the_heads():
    assert divisor_sizes(8, 24) == [1, 2, 3, 4, 6, 8] and divisor_sizes(8, 40) == [1, 2, 4, 5, 8]
    cost = CostModel(**MODEL_PRESETS["wan14b"])
    assert dynamic_cp(steps_at("wan", 32, 1, 0, 0)[0], cost).layout.startswith("g")


def test_a_mix_on_fewer_gpus_deals_its_batches():
    big = steps_at("image+video", 32, 1, 0, 392)[0]
    small = steps_at("image+video", 8, 1, 0, 392)[0]
    assert len(small) == 8 and sorted(x for r in small for x in r) == sorted(x for r in big for x in r)
    assert len(steps_at("alternate:low-res/image+video", 64, 2, 0, 392)[1]) == 64
    with pytest.raises(ValueError, match="neither a multiple nor a divisor"):
        steps_at("image+video", 12, 1, 0, 392)


def test_the_table_has_every_planner_and_its_ratio_to_knapray():
    rows = rivals_table([("image+video", "flux")], worlds=(8,), steps=1)
    (row,) = rows
    assert set(row["ratios"]) == set(PLANNERS) and min(row["ratios"][n] for n in KNAPRAY) == pytest.approx(1.0)
    text = rivals_markdown(rows, "knapray simulate --rivals --worlds 8 --steps 1")
    assert "| image+video (flux) | 8 |" in text and "Zellige-style" in text
    assert PAPER_MIXES["image+video"]  # the paper's mix, by name


def test_simulate_rivals_on_random_mixes(capsys):
    """``knapray simulate --rivals --random N --seed S``: a row per mix drawn, the worst case
    named; the same mixes for the same seed."""
    import json

    from knapray.cli import main

    assert main(["simulate", "--rivals", "--random", "3", "--seed", "5", "--json"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    assert [(r["mix"], r["model"], r["world_size"]) for r in rows] == [c[:3] for c in random_cases(3, 5)]
    assert "knapray simulate --rivals --random 3 --seed 5" in out and "the worst:" in out
    assert all(r["behind"] <= 1e-3 and set(r["ratios"]) == set(PLANNERS) for r in rows)
    assert main(["simulate", "--rivals", "--random", "0"]) == 2
    assert "--random 0: a number of mixes from 1 to 10000" in capsys.readouterr().err
    assert main(["simulate", "--random", "3"]) == 2
    assert "mixes drawn at random are for --rivals" in capsys.readouterr().err
