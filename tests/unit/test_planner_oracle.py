"""The planner after its linear-time rewrite makes the plans it made before: sequence by
sequence the same bags and chunks as the frozen copy of the old solver
(tests/oracle_solver.py), so its imbalance is the old one at every step. Plus the pieces
that replace per-sequence loops, checked against those loops."""

from __future__ import annotations

import heapq

import numpy as np
import oracle_solver as oracle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knapray.planning import PAPER_MIXES, CostModel, Topology, WorkloadModel, plan_balance
from knapray.planning.balance.construct import least_loaded
from knapray.planning.shapes.lengths import flatten_lengths
from knapray.planning.simulation.runner import mix_steps

MODEL = WorkloadModel(d_model=3072, gamma=0.4)
SPECS = ["g1n4", "g2n2", "g4n1", "g8n1", "g2n4", "g1n2+g2n1", "g1n4+g2n2", "g2n1+g1n2+g4n1", "g1n8+g8n1"]


def _plan_or_error(plan_fn, *args, **kw):
    try:
        return plan_fn(*args, **kw)
    except ValueError as e:
        return str(e)


def _assert_same(new, old):
    if isinstance(old, str) or isinstance(new, str):
        assert new == old
        return
    for name in ("bag", "chunk_seq", "chunk_rank", "chunk_start", "chunk_len"):
        np.testing.assert_array_equal(getattr(new, name), getattr(old, name), err_msg=name)
    assert new.imbalance == old.imbalance


@st.composite
def steps(draw):
    topo = Topology.parse(draw(st.sampled_from(SPECS)))
    topo = topo.replicate_to(topo.world_size * draw(st.integers(1, 2)))
    # Few distinct lengths make ties in loads and weights, where tie-breaking shows.
    pool = draw(st.sampled_from([None, [300, 301, 4096], [5, 9, 64]]))
    length = st.integers(1, draw(st.sampled_from([64, 5000, 40000]))) if pool is None else st.sampled_from(pool)
    lens = [draw(st.lists(length, max_size=7)) for _ in range(topo.world_size)]
    if draw(st.booleans()):
        speeds = draw(st.lists(st.sampled_from([0.5, 0.8, 1.0]), min_size=topo.world_size, max_size=topo.world_size))
        model = CostModel(gpus_per_node=draw(st.sampled_from([2, 4, 8])), rank_speed=tuple(speeds) if draw(st.booleans()) else None)
    else:
        model = MODEL
    return topo, lens, model, draw(st.sampled_from(["knapray", "greedy"])), draw(st.floats(0.0, 1.2))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_same_plans_as_the_old_solver(inp):
    topo, lens, model, solver, frac = inp
    old = _plan_or_error(oracle.plan_balance, lens, topo, model, solver=solver)
    _assert_same(_plan_or_error(plan_balance, lens, topo, model, solver=solver), old)
    flat = [x for r in lens for x in r]
    if flat and not isinstance(old, str):
        # A token budget between the least any plan needs and what the free plan uses.
        least = max(-(-sum(flat) // topo.world_size), max(-(-x // max(topo.group_bags)) for x in flat))
        budget = max(1, least + int(frac * (int(old.rank_tokens.max()) - least)))
        _assert_same(
            _plan_or_error(plan_balance, lens, topo, model, solver=solver, max_tokens_per_gpu=budget),
            _plan_or_error(oracle.plan_balance, lens, topo, model, solver=solver, max_tokens_per_gpu=budget),
        )


@pytest.mark.parametrize("mix, world", [("image+video", 1024), ("mixed-res", 1024), ("low-res", 512)])
def test_same_plans_on_the_paper_mixes_at_scale(mix, world):
    # One balance group of bags of 8 (the planner benchmark's case), groups of g8n4, and
    # the cost model with a slow rank (its refinement by routing times included).
    lens = next(iter(mix_steps(PAPER_MIXES[mix], 1, 1, world_size=world)))
    for topo, model in [
        (Topology.parse(f"g8n{world // 8}", world_size=world), MODEL),
        (Topology.parse("g8n4", world_size=world), MODEL),
    ]:
        _assert_same(plan_balance(lens, topo, model), oracle.plan_balance(lens, topo, model))
    small = lens[:256]
    cost = CostModel(rank_speed=tuple([1.0] * 5 + [0.5] + [1.0] * 250))
    topo = Topology.parse("g8n32", world_size=256)
    _assert_same(plan_balance(small, topo, cost), oracle.plan_balance(small, topo, cost))


def test_work_that_does_not_grow_with_length_keeps_the_old_visit_order():
    # A cost model with only a per-sequence term prices every sequence the same: the
    # visit order cannot be read off the lengths.
    flat = CostModel(linear_s=0.0, attn_s=0.0, seq_s=1e-3)
    lens = [[5, 300], [40], [7, 7, 9], []]
    topo = Topology.parse("g1n2+g2n1")
    _assert_same(plan_balance(lens, topo, flat), oracle.plan_balance(lens, topo, flat))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([1.0, 2.0, 3.0, 0.5, 7.25]) | st.floats(0.01, 100.0), max_size=60),
    st.integers(1, 20),
    st.booleans(),
)
def test_least_loaded_replays_the_heap(weights, bags, start_loaded):
    """Rounds of bags in numpy give each item the bag the heap would: the least loaded,
    the lowest id on ties."""
    rng = np.random.default_rng(len(weights) * 31 + bags)
    w = np.sort(np.asarray(weights, dtype=np.float64))[::-1]
    ids = rng.permutation(40)[:bags]
    loads = rng.choice([0.0, 1.0, 2.5], size=bags) if start_loaded else np.zeros(bags)
    heap = [(float(x), int(b)) for x, b in zip(loads, ids)]
    heapq.heapify(heap)
    expect = []
    for x in w.tolist():
        load, b = heap[0]
        heapq.heapreplace(heap, (load + x, b))
        expect.append(b)
    assert least_loaded(w, ids, loads).tolist() == expect


@pytest.mark.parametrize(
    "lens",
    [
        [[5, 7], [], [3.0], [9]],  # whole floats are lengths
        [[5, True], [6], [7], [8]],  # True beside integers reads as 1, as numpy does per rank
        [np.array([5, 6], dtype=np.int32), np.array([7]), np.array([], dtype=np.int64), np.array([8])],
        [[2**40], [3], [1], [2]],
    ],
)
def test_flatten_reads_what_the_per_rank_check_reads(lens):
    topo = Topology.parse("g1n4")
    new, old = flatten_lengths(lens, topo), oracle._flatten(lens, topo)
    for a, b in zip(new, old):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.int64


@pytest.mark.parametrize(
    "lens",
    [[[True], [5], [5], [5]], [[5.5], [5], [5], [5]], [[5], [[5]], [5], [5]], [[5], ["5"], [5], [5]], [[5], [0], [5], [5]],
     [[5], [5], [float("nan")], [5]], [[5], [2**70], [5], [5]]],
)
def test_flatten_names_the_same_bad_value(lens):
    topo = Topology.parse("g1n4")
    with pytest.raises((ValueError, OverflowError)) as old:
        oracle._flatten(lens, topo)
    with pytest.raises(old.type, match=None) as new:
        flatten_lengths(lens, topo)
    assert str(new.value) == str(old.value)
