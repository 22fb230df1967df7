"""CostModel terms (hand-computed), the solver with a cost model, node packing of bags."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knapray.planning import Topology, WorkloadModel, identity_plan, plan_balance
from knapray.planning.costs.cost import PROFILE_FORMAT, CostModel, rank_times
from knapray.planning.shapes.topology import pack_nodes

# Round numbers: d=100, 2 layers, 1 GFLOP/s, 4 passes, 200 bytes per token (bf16),
# 1 MB/s inside a node and 0.1 MB/s between nodes, 2 GPUs per node.
SMALL = CostModel(
    d_model=100, double_blocks=1, single_blocks=1, num_heads=4, flops_per_s=1e9,
    intra_node_bw=1e6, inter_node_bw=1e5, gpus_per_node=2,
)


def test_compute_terms_by_hand():
    # a = 24 d² x 4 passes / 1e9 = 9.6e-4 s per token per layer; b = 4 d x 4 / 1e9 = 1.6e-6.
    assert SMALL.passes == 4.0
    assert SMALL.linear_s_per_token == pytest.approx(9.6e-4)
    assert SMALL.attn_s_per_pair == pytest.approx(1.6e-6)
    # compute(10) = 2 layers x (9.6e-4 x 10 + 1.6e-6 x 100) = 0.01952 s.
    assert SMALL.compute(10) == pytest.approx(0.01952)
    np.testing.assert_allclose(SMALL.compute(np.array([10, 20])), [0.01952, 2 * (9.6e-3 * 2 + 6.4e-4)])
    # Fitted coefficients replace the FLOP estimate.
    fitted = SMALL.replace(linear_s=1e-3, attn_s=1e-6)
    assert fitted.compute(10) == pytest.approx(2 * (1e-2 + 1e-4))
    # Flux defaults: 57 layers, 24·3072²·4/400e12 s per token per layer.
    flux = CostModel()
    assert flux.layers == 57
    assert flux.linear_s_per_token == pytest.approx(24 * 3072**2 * 4 / 400e12)
    assert flux.attn_s_per_pair == pytest.approx(4 * 3072 * 4 / 400e12)


def test_the_flux2_preset_prices_the_models_flops(capsys):
    """``knapray simulate --model flux2``: FLUX.2 [dev]'s blocks at the FLOPs knapray.models.flops
    counts for it (a SwiGLU MLP of 3·d: 26·d² per token and layer, not Flux's 24)."""
    from knapray.cli import main
    from knapray.models.families.flux2 import Flux2Config
    from knapray.models.flops import model_flops
    from knapray.planning.costs.cost import MODEL_PRESETS

    m = CostModel.from_dict(MODEL_PRESETS["flux2"])
    assert (m.d_model, m.layers, m.num_heads, m.linear_flops) == (6144, 56, 48, 26.0)
    # the step's compute of a sequence of 4,608 tokens: 3 passes of the model's FLOPs, the
    # recompute a fourth forward, at flops_per_s
    n = 4608
    assert m.compute(n) == pytest.approx(model_flops([n], Flux2Config(), passes=m.passes) / m.flops_per_s)
    assert main(["simulate", "--model", "flux2", "--mix", "image+video", "--steps", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["modes"]["knapray"]["step_s"] <= r["modes"]["baseline"]["step_s"]


def test_ulysses_and_routing_terms_by_hand():
    # Bag of 2 inside a node: each of 12 all-to-alls per layer sends half of a token's
    # 200 bytes at 1 MB/s: 12 x 2 layers x 200 x (1/2) / 1e6 = 2.4e-3 s per chunk token.
    assert SMALL.ulysses_token_s(1) == 0.0
    assert SMALL.ulysses_token_s(2) == pytest.approx(2.4e-3)
    # Bag of 4 over 2 nodes: 1 peer on the node, 2 off it; the slower link sets the time:
    # max(1/4 / 1e6, 2/4 / 1e5) x 200 x 24 = 2.4e-2 s per chunk token.
    assert SMALL.ulysses_token_s(4, off_node_peers=2) == pytest.approx(2.4e-2)
    # A sequence of 40 on a bag of 4 spanning nodes: compute/4 + 10 tokens x 2.4e-2.
    assert SMALL.seq_cost(40, 4, 2) == pytest.approx(SMALL.compute(40) / 4 + 0.24)
    # Routing: 4 all-to-alls x 200 bytes per token.
    assert SMALL.route_token_s(False) == pytest.approx(8e-4)
    assert SMALL.route_token_s(True) == pytest.approx(8e-3)


def test_bag_comm_from_node_layout():
    topo = Topology.parse("g2n1+g4n1+g1n2")  # ranks: [0,1] [2..5] [6] [7]; nodes of 2
    np.testing.assert_array_equal(SMALL.off_node_peers(topo), [0, 2, 0, 0])
    misaligned = Topology((1, 2, 1))  # the bag of 2 (ranks 1, 2) straddles nodes 0 and 1
    assert SMALL.off_node_peers(misaligned).tolist() == [0, 1, 0]
    np.testing.assert_allclose(SMALL.bag_ulysses_token_s(misaligned)[1], 12 * 2 * 200 * 0.5 / 1e5)


def test_rank_times_by_hand():
    # 4 ranks, nodes of 2, bags [0,1] [2] [3]. Sequence 0 (L=10, home 3) on the bag of 2,
    # chunks 5 + 5; sequence 1 (L=4, home 2) stays on rank 2.
    topo = Topology((2, 1, 1))
    model = SMALL.with_rank_speed([1.0, 0.5, 1.0, 1.0])
    lens, home = np.array([10, 4]), np.array([3, 2])
    chunk_seq, chunk_rank, chunk_len = np.array([0, 0, 1]), np.array([0, 1, 2]), np.array([5, 5, 4])
    t = rank_times(model, topo, lens, home, chunk_seq, chunk_rank, chunk_len, np.array([2, 1]))
    a, b = 9.6e-4, 1.6e-6
    chunk0 = 2 * (a * 5 + b * 100 / 2)  # its tokens, half of the attention
    # The bag of ranks 0 and 1 runs at its slowest member's speed (0.5).
    np.testing.assert_allclose(t.compute, [chunk0 / 0.5, chunk0 / 0.5, SMALL.compute(4), 0.0])
    np.testing.assert_allclose(t.ulysses, [5 * 2.4e-3 / 0.5, 5 * 2.4e-3 / 0.5, 0, 0])
    # Rank 3 (node 1) sends 10 tokens to node 0; ranks 0 and 1 receive 5 each.
    np.testing.assert_allclose(t.route, [5 * 8e-3, 5 * 8e-3, 0, 10 * 8e-3])
    assert t.step_time == pytest.approx(float(t.total.max()))
    # Ideal: total compute over total speed.
    assert model.ideal_step_time(lens, 4) == pytest.approx(float(SMALL.compute(lens).sum()) / 3.5)


def test_per_sequence_term_and_fixed_cost_by_hand():
    # s = 1e-3 s per sequence per layer, paid in full by every GPU of a bag; the fixed cost
    # (0.5 + 2 layers x 0.01) is paid once per rank and step, never per sequence.
    model = SMALL.replace(seq_s=1e-3, layer_overhead_s=0.01, step_overhead_s=0.5)
    assert model.fixed_s == pytest.approx(0.52)
    assert model.compute(10) == pytest.approx(SMALL.compute(10) + 2e-3)
    assert model.seq_cost(40, 4) == pytest.approx(SMALL.compute(40) / 4 + 2e-3 + SMALL.ulysses(40, 4))
    np.testing.assert_allclose(model.chunk(np.array([5]), np.array([10]), np.array([2])),
                               SMALL.chunk(np.array([5]), np.array([10]), np.array([2])) + 2e-3)
    # Two sequences on a bag of 2 (one rank per node: no Ulysses peers off the node here).
    topo = Topology((2,))
    lens, home = np.array([10, 30]), np.array([0, 1])
    chunk_seq, chunk_rank, chunk_len = np.array([0, 0, 1, 1]), np.array([0, 1, 0, 1]), np.array([5, 5, 15, 15])
    t = rank_times(model, topo, lens, home, chunk_seq, chunk_rank, chunk_len, np.array([2, 2]))
    base = rank_times(SMALL, topo, lens, home, chunk_seq, chunk_rank, chunk_len, np.array([2, 2]))
    np.testing.assert_allclose(t.compute, base.compute + 2 * 2e-3)  # both sequences on both ranks
    assert t.overhead == pytest.approx(0.52) and base.overhead == 0.0
    assert model.ideal_step_time(lens, 2) == pytest.approx(float(model.compute(lens).sum()) / 2 + 0.52)
    # A packed batch: fixed cost once; the per-sequence term per sequence or per distinct length.
    assert model.batch_time([10, 10, 30]) == pytest.approx(0.52 + float(SMALL.compute(np.array([10, 10, 30])).sum())
                                                           + 3 * 2e-3)
    by_length = model.replace(seq_s_counts="lengths")
    assert by_length.batch_time([10, 10, 30]) == pytest.approx(model.batch_time([10, 10, 30]) - 2e-3)
    with pytest.raises(ValueError, match="seq_s_counts must be one of"):
        model.replace(seq_s_counts="calls")


def test_solver_charges_the_per_sequence_term_on_every_gpu_of_a_bag():
    # Many short sequences: with a large per-sequence cost, a bag of 4 saves nothing on it
    # (each of its GPUs pays it for every sequence), so the plan keeps them on bags of one.
    topo = Topology.parse("g1n4+g4n1", gpus_per_node=8)
    lens = [[200] * 20 for _ in range(8)]
    cheap = CostModel(num_heads=8)
    dear = cheap.replace(seq_s=cheap.linear_s_per_token * 2000)
    plan = plan_balance(lens, topo, dear)
    times = dear.step_times(plan)
    assert plan.predicted_step_time == pytest.approx(times.step_time)
    big = np.flatnonzero(topo.bag_sizes == 4)[0]
    assert (plan.bag == big).sum() < (plan_balance(lens, topo, cheap).bag == big).sum()


def test_config_round_trip_and_errors(tmp_path):
    model = CostModel(inter_node_bw=25e9, rank_speed=(1.0, 0.5))
    assert CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "cost_model": {"linear_s": 1e-6, "d_model": 64}}))
    loaded = CostModel.from_profile(str(path), gpus_per_node=4)
    assert loaded.linear_s == 1e-6 and loaded.d_model == 64 and loaded.gpus_per_node == 4
    # A single-sequence profile (format 1) is refused by name.
    path.write_text(json.dumps({"format": "knapray-cost-profile/1", "cost_model": {"linear_s": 1e-6}}))
    with pytest.raises(ValueError, match="profile format 'knapray-cost-profile/1' is not"):
        CostModel.from_profile(str(path))
    with pytest.raises(ValueError, match=r"unknown CostModel keys \['bandwidth'\]; valid: \['d_model'"):
        CostModel.from_dict({"bandwidth": 1})
    with pytest.raises(ValueError, match="intra_node_bw must be a positive number"):
        CostModel(intra_node_bw=0)
    with pytest.raises(ValueError, match="rank_speed must be a non-empty list of numbers > 0"):
        CostModel(rank_speed=(1.0, 0.0))
    with pytest.raises(ValueError, match="rank_speed lists 2 ranks, but the world has 4"):
        model.speeds(4)


# ---- the solver with a cost model ------------------------------------------------------------

SPECS = ["g1n4", "g2n2", "g4n1", "g1n2+g2n1", "g2n1+g1n2", "g1n4+g2n2", "g2n1+g1n2+g4n1"]


@st.composite
def cost_inputs(draw):
    spec = draw(st.sampled_from(SPECS))
    topo = Topology.parse(spec)
    topo = topo.replicate_to(topo.world_size * draw(st.integers(1, 2)))
    hi = draw(st.sampled_from([64, 5000, 40000]))
    lens = [draw(st.lists(st.integers(1, hi), min_size=0, max_size=6)) for _ in range(topo.world_size)]
    speeds = draw(st.one_of(st.none(), st.lists(
        st.sampled_from([0.5, 1.0, 1.0, 1.3]), min_size=topo.world_size, max_size=topo.world_size)))
    gpn = draw(st.sampled_from([2, 4, 8]))
    return topo, lens, CostModel(gpus_per_node=gpn, rank_speed=speeds)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cost_inputs())
def test_cost_model_plans_are_valid_and_never_slower_than_greedy(inp):
    topo, lens, model = inp
    ours = plan_balance(lens, topo, model)
    greedy = plan_balance(lens, topo, model, solver="greedy")
    assert ours.predicted_step_time <= model.step_times(greedy).step_time * (1 + 1e-12)
    # Every sequence is cut into its bag's chunks, tiling it exactly.
    flat = [x for r in lens for x in r]
    assert ours.chunk_len.sum() == sum(flat)
    assert np.all(np.bincount(ours.chunk_seq, minlength=len(flat)) == topo.bag_sizes[ours.bag])
    # Deterministic.
    again = plan_balance([list(r) for r in lens], topo, model)
    np.testing.assert_array_equal(ours.bag, again.bag)


def test_short_sequences_stay_on_bags_of_one_when_cheaper():
    # One node: four bags of 1 and one of 4. A long sequence needs the bag of 4; the short
    # ones cost 9% more there (Ulysses) than on a bag of 1, so the cost model keeps them off
    # it where the balance allows, and the step is predicted faster than the paper model's plan.
    topo = Topology.parse("g1n4+g4n1", gpus_per_node=8)
    rng = np.random.default_rng(0)
    lens = [[16000]] + [rng.integers(300, 700, size=12).tolist() for _ in range(7)]
    cost = CostModel()
    ours = plan_balance(lens, topo, cost)
    paper = plan_balance(lens, topo, WorkloadModel())
    big_bag = topo.num_bags - 1 if topo.bags[-1] == 4 else int(np.argmax(topo.bag_sizes))
    short = ours.seq_lens < 1000
    assert ours.bag[ours.seq_lens == 16000][0] == big_bag
    assert (ours.bag[short] == big_bag).sum() < (paper.bag[short] == big_bag).sum()
    assert ours.predicted_step_time < cost.step_times(paper).step_time
    assert ours.step_times().ulysses.sum() < cost.step_times(paper).ulysses.sum()


def test_slow_rank_gets_less_work():
    topo = Topology.parse("g1n8")
    lens = [[250] * 32 for _ in range(8)]
    speeds = [1.0] * 8
    speeds[3] = 0.5
    equal, slow = CostModel(), CostModel(rank_speed=speeds)
    ours = plan_balance(lens, topo, slow)
    tokens = np.bincount(ours.chunk_rank, weights=ours.chunk_len, minlength=8)
    assert tokens[3] < tokens[[0, 1, 2, 4, 5, 6, 7]].min()
    # The capacity lost is 0.5 of 8 ranks: ours slows by about 8/7.5; greedy ignores speeds.
    assert ours.predicted_step_time < 1.1 * plan_balance(lens, topo, equal).predicted_step_time
    greedy_equal = equal.step_times(plan_balance(lens, topo, equal, solver="greedy")).step_time
    greedy_slow = slow.step_times(plan_balance(lens, topo, slow, solver="greedy")).step_time
    assert greedy_slow > 1.95 * greedy_equal


def test_identity_plan_under_a_cost_model_has_no_communication():
    lens = [[500, 300], [4000], [], [20]]
    cost = CostModel(gpus_per_node=2)
    t = cost.step_times(identity_plan(lens, cost))
    assert not t.ulysses.any() and not t.route.any()
    np.testing.assert_allclose(t.compute, [cost.compute(np.array([500, 300])).sum(), cost.compute(4000), 0, cost.compute(20)])


# ---- node packing ------------------------------------------------------------------------------


def test_pack_nodes_and_non_power_of_two_bags():
    assert pack_nodes([3] * 8 + [1] * 8, 8) == [[3, 3, 1, 1]] * 4
    assert pack_nodes([6, 3, 3, 2, 1, 1], 8) == [[6, 2], [3, 3, 1, 1]]
    assert pack_nodes([4, 3, 3, 3, 3], 8) is None  # no two nodes of 8 hold them
    assert pack_nodes([2, 2], 8) == [[2, 2]]  # a partial (last) node
    topo = Topology.parse("g3n8+g1n8", gpus_per_node=8)
    assert topo.bags[:4] == [3, 3, 1, 1]
    topo.check_node_placement(8)
    with pytest.raises(ValueError, match="cannot be laid out in nodes of 8 GPUs"):
        Topology.parse("g4n1+g3n4", gpus_per_node=8)
