"""Simulator and automatic topology: the acceptance numbers at 32 GPUs (4 nodes of 8) and a
replicated 128-GPU case (the 1024-GPU table is in docs/simulate.md: too slow for a test)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from knapray.cli import main
from knapray.planning import PAPER_MIXES, Topology, plan_balance
from knapray.planning.search.autotopo import choose_topology, composition_spec, search_topology
from knapray.planning.costs.cost import CostModel
from knapray.planning.simulation.runner import mix_steps
from knapray.planning.simulation.sim import simulate_mix, table_markdown

# Paper mix -> (minimum ratio greedy step / auto step, minimum efficiency of auto).
ACCEPTANCE = {"low-res": (1.0, 0.95), "mixed-res": (1.02, 0.95), "image+video": (1.02, 0.95)}


@pytest.mark.parametrize("mix", list(PAPER_MIXES))
def test_auto_beats_best_fixed_greedy_at_32_gpus(mix):
    r = simulate_mix(mix, "auto", 32, steps=3, seed=0)
    ratio, eff = ACCEPTANCE[mix]
    assert r["speedup_vs_greedy"] >= ratio, r["greedy_by_topology"]
    assert r["modes"]["knapray"]["efficiency"] >= eff
    # The greedy side is the best of the four homogeneous topologies.
    assert set(r["greedy_by_topology"]) == {"g1n32", "g2n16", "g4n8", "g8n4"}
    best = min(v["step_s"] for v in r["greedy_by_topology"].values())
    assert r["modes"]["greedy"]["step_s"] == pytest.approx(best)
    # Auto's bags never cross a node.
    Topology.parse(r["auto"]["layout_full"]).check_node_placement(8)


@pytest.mark.parametrize("mix", ["mixed-res", "image+video"])
def test_auto_scales_from_a_sample_world(mix):
    # 128 GPUs: the search runs on 64-rank samples and scales the composition up.
    r = simulate_mix(mix, "auto", 128, steps=2, seed=1)
    assert r["auto"]["search_ranks"] == 64
    assert r["speedup_vs_greedy"] >= 1.02
    assert r["modes"]["knapray"]["efficiency"] >= 0.95


def test_slow_rank_costs_ours_little_and_doubles_greedy():
    mix = PAPER_MIXES["mixed-res"]
    history = list(mix_steps(mix, 2, 100, world_size=32))
    steps = list(mix_steps(mix, 2, 0, world_size=32))
    speeds = [1.0] * 32
    speeds[5] = 0.5
    equal, slow = CostModel(), CostModel(rank_speed=speeds)
    t = {}
    for name, cost in (("equal", equal), ("slow", slow)):
        topo = choose_topology(history, 32, cost)
        t[name] = np.mean([plan_balance(s, topo, cost).predicted_step_time for s in steps])
        fixed = Topology.parse("g4n8")
        t["greedy_" + name] = np.mean(
            [cost.step_times(plan_balance(s, fixed, cost, solver="greedy")).step_time for s in steps])
    assert t["slow"] <= 1.10 * t["equal"]
    assert t["greedy_slow"] >= 1.9 * t["greedy_equal"]
    # The slow rank sits in a bag of one (a bag runs at its slowest member's speed).
    topo = choose_topology(history, 32, slow)
    assert topo.bag_sizes[topo.bag_of_rank[5]] == 1


def test_choose_topology_inputs():
    cost = CostModel()
    # No history: the largest allowed bag that divides the world.
    assert choose_topology([], 16, cost).bags == [8, 8]
    # History of another world size is re-dealt batch by batch.
    hist = list(mix_steps(PAPER_MIXES["low-res"], 2, 0, world_size=32))
    topo = choose_topology(hist, 16, cost)
    assert topo.world_size == 16
    # Bag sizes must divide the heads and fit in a node.
    with pytest.raises(ValueError, match="must divide num_heads=24"):
        search_topology(hist, 32, cost, sizes=[1, 5])
    choice = search_topology(hist, 32, cost)
    assert composition_spec(choice.topology) == "g1n32" and choice.efficiency > 0.99


def test_simulate_cli_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "t.png"
    assert main(["simulate", "--mix", "image+video", "--world-size", "32", "--steps", "2",
                 "--plot", str(plot), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"world_size", "ideal_step_s", "modes", "greedy_by_topology", "speedup_vs_greedy", "auto"} <= out.keys()
    for mode in ("baseline", "greedy", "knapray"):
        m = out["modes"][mode]
        assert {"topology", "step_s", "efficiency", "rank_s", "rank_compute_s", "rank_ulysses_s",
                "rank_route_s"} <= m.keys()
        assert len(m["rank_s"]) == 32 and 0 < m["efficiency"] <= 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A fixed topology and a slow rank.
    assert main(["simulate", "--mix", "mixed-res", "--topology", "g8n4", "--rank-speed", "3=0.5",
                 "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["modes"]["greedy"]["topology"] == "g8n4" == out["modes"]["knapray"]["topology"]
    assert out["speedup_vs_greedy"] > 1.5
    assert main(["simulate", "--mix", "mixed-res", "--rank-speed", "40=0.5"]) == 2
    assert "0 <= RANK < 32" in capsys.readouterr().err


def test_plan_auto_export(tmp_path, capsys):
    export = tmp_path / "plans.json"
    assert main(["plan", "--mix", PAPER_MIXES["mixed-res"], "--topology", "auto", "--steps", "3",
                 "--export", str(export), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "g1n" in out["auto"]["topology"]  # short sequences get bags of one
    assert out["efficiency"] >= 0.95 and out["predicted_step_s_mean"] < out["greedy_predicted_step_s_mean"]
    plans = json.loads(export.read_text())
    assert len(plans["steps"]) == 3 and CostModel.from_dict(plans["cost_model"]) == CostModel()
    step = plans["steps"][0]
    for seq in step["sequences"]:
        assert sum(c["length"] for c in seq["chunks"]) == seq["length"]
        assert [c["rank"] for c in seq["chunks"]] == step["bags"][seq["bag"]]
    nodes = [{r // 8 for r in bag} for bag in step["bags"]]
    assert all(len(n) == 1 for n in nodes)  # no bag crosses a node
    # A small world from a lengths file (fewer ranks than a node).
    f = tmp_path / "steps.json"
    f.write_text(json.dumps([[[300, 1200], [4096], [], [50]], [[10], [20], [30], [40, 5000]]]))
    assert main(["plan", "--lengths", str(f), "--topology", "auto"]) == 0
    assert "auto topology" in capsys.readouterr().out


def test_table_markdown():
    row = {"mix": "mixed-res", "world_size": 32, "auto_topology": "g3n8+g1n8", "auto_num_groups": 1,
           "auto_efficiency": 0.964, "greedy_topology": "g4n8", "greedy_efficiency": 0.941,
           "baseline_efficiency": 0.4, "ratio": 1.024, "seconds": 0.5}
    text = table_markdown([row], "knapray simulate --paper-table", CostModel())
    assert "| mixed-res | 32 | `g3n8+g1n8` | 0.9640 | `g4n8` | 0.9410 | 0.4000 | 1.0240 | 0.5 |" in text
