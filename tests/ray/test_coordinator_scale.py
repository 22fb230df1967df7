"""The coordinator protocol at scale: one call per rank and step, the plan put into the
object store once and read by every rank, no concurrency limit a world can exhaust."""

from __future__ import annotations

import dataclasses
import pickle
import time

import numpy as np
import pytest
import torch

from knapray.coordinator import CoordinatorClient, create_coordinator, plan_from_gathered
from knapray.coordinator.actor import max_concurrency_for
from knapray.coordinator.wire import pack, unpack
from knapray.planning import Topology, WorkloadModel
from knapray.planning.shapes.mix import PAPER_MIXES, parse_mix, sample_step

PLAN_FIELDS = ("seq_lens", "home_rank", "local_index", "bag", "chunk_seq", "chunk_rank", "chunk_start", "chunk_len")


def test_concurrency_covers_every_rank_waiting_at_once():
    assert max_concurrency_for(None) >= max_concurrency_for(1 << 20) > 4 * (1 << 20)
    for world in (1, 960, 1024, 4096, 16384):
        assert max_concurrency_for(world) >= max(1000, 2 * world + 64)


@pytest.mark.parametrize("mix,world,topology", [
    ("image+video", 32, "g8n4"), ("image+video", 1024, "g8n128"), ("mixed-res", 32, "g1n16+g4n2+g8n1"),
    ("low-res", 64, "g2n8+g4n4+g8n4"), ("mixed-res", 64, "g4n4"),
])
def test_packed_plan_rebuilds_every_array_exactly_and_carries_no_cached_statistics(mix, world, topology):
    lens = sample_step(parse_mix(PAPER_MIXES[mix]), np.random.default_rng(world), world)
    topo = Topology.parse(topology).replicate_to(world)
    plan = plan_from_gathered(lens, topo, WorkloadModel())
    _ = plan.rank_work, plan.imbalance, plan.send_matrix, plan.seq_offsets  # what the coordinator's stats cache
    packed = pack(plan)
    assert packed.whole is None and not any(isinstance(v, np.ndarray) and v.size > world for v in vars(packed).values()
                                            if v is not packed.seq_lens and v is not packed.bag)
    rebuilt = unpack(packed)
    for f in PLAN_FIELDS:
        assert getattr(rebuilt, f).dtype == getattr(plan, f).dtype and np.array_equal(getattr(rebuilt, f), getattr(plan, f))
    assert rebuilt.topology == plan.topology and rebuilt.model == plan.model and rebuilt.stats == plan.stats
    assert not {"rank_work", "send_matrix", "seq_offsets", "seq_work"} & set(vars(rebuilt))
    assert len(pickle.dumps(packed)) < len(pickle.dumps(plan)) / 4


def test_a_plan_that_does_not_rebuild_travels_whole():
    lens = sample_step(parse_mix(PAPER_MIXES["image+video"]), np.random.default_rng(0))
    plan = plan_from_gathered(lens, Topology.parse("g8n4"), WorkloadModel())
    odd = dataclasses.replace(plan, chunk_len=plan.chunk_len.copy(), chunk_start=plan.chunk_start.copy())
    odd.chunk_len[[0, 1]] += [1, -1]  # another (valid) cut of sequence 0
    odd.chunk_start[1] += 1
    packed = pack(odd)
    assert packed.whole is not None
    rebuilt = unpack(packed)
    assert all(np.array_equal(getattr(rebuilt, f), getattr(odd, f)) for f in PLAN_FIELDS)


def _same_route_plan(a, b) -> bool:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        same = torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
        if not same:
            return False
    return True


@pytest.mark.ray
def test_plan_read_from_the_object_store_executes_exactly_as_the_coordinators(ray_session):
    """Every rank's plan, read through the reference the actor hands out, gives the same
    routing, Ulysses order, text masks and work as the plan the coordinator computed."""
    from knapray.distributed.router import RoutePlan
    from knapray.worker.balanced import routed_text_mask

    world = 32
    name = f"coord-share-{time.monotonic_ns()}"
    handle = create_coordinator(name, "knapray-test", world_size=world, topology="g8n2")  # two balance groups
    topo = ray_session.get(handle.topology.remote())
    assert topo.num_groups == 2
    rng = np.random.default_rng(1)
    clients = [CoordinatorClient(name, "knapray-test", rank=r, timeout_s=30) for r in range(world)]
    for step in range(2):
        lens = sample_step(parse_mix(PAPER_MIXES["image+video"]), rng)
        for r, c in enumerate(clients):
            if step:
                c.report_timing_async(step - 1, 0.1, 0.0, 0.0)
            c.submit_async(step, lens[r], [1000 * step + 100 * r + k for k in range(len(lens[r]))])
        reply = ray_session.get(clients[0]._requested[step])
        assert isinstance(reply[0], ray_session.ObjectRef) and reply[1] is False  # a reference, not the plan
        received = [c.get_plan(step) for c in clients]
        whole = plan_from_gathered(lens, topo, WorkloadModel())
        text = np.minimum(rng.integers(0, 393, whole.num_sequences), whole.seq_lens)
        for r, (plan, done) in enumerate(received):
            assert done is False and plan.topology == whole.topology
            assert all(np.array_equal(getattr(plan, f), getattr(whole, f)) and getattr(plan, f).dtype ==
                       getattr(whole, f).dtype for f in PLAN_FIELDS)
            assert _same_route_plan(RoutePlan.build(plan, r), RoutePlan.build(whole, r))
            peers = tuple(topo.group_ranks(r // topo.group_size))  # the routing group
            assert _same_route_plan(RoutePlan.build(plan, r, peers), RoutePlan.build(whole, r, peers))
            assert np.array_equal(routed_text_mask(plan, r, text), routed_text_mask(whole, r, text))
            assert np.array_equal(plan.rank_work, whole.rank_work)
            assert np.array_equal(plan.recv_chunks(r), whole.recv_chunks(r))
    stats = ray_session.get(handle.stats.remote())
    assert stats["steps_planned"] == 2 and stats["wait_plan_s_mean"] is not None  # timings came with the exchange
    ray_session.kill(handle, no_restart=True)


@pytest.mark.ray
def test_over_a_thousand_ranks_never_fall_back(ray_session):
    """1152 simulated ranks (more than Ray's default 1000 concurrent calls of an async
    actor, which stalled every step at 1024 ranks): every rank gets every plan in time."""
    from knapray.benchmarks import coordinator as bench

    r = bench._measure(1152, steps=3, drivers=2, codes=parse_mix(PAPER_MIXES["image+video"]), ranks_per_call=1,
                       timeout_s=30.0, seed=0)
    assert r["fallbacks"] == 0
    assert r["latency_ms_max"] < 15_000  # no step waits for a timeout
    assert r["calls_per_step"] == 1152 + 1  # one per rank (submission, timing, plan), rank 0's commit
    assert r["reply_bytes_per_rank"] < 1024


@pytest.mark.ray
def test_node_relay_batches_a_nodes_ranks_and_keeps_the_protocols_errors(ray_session):
    """Ranks of one node (node_ranks=4) submit through the node's relay: the same plans,
    a late rank still answered (its own batch), a rejection and a dead coordinator reach
    every rank as ``StepFailed`` / ``CoordinatorUnavailable``."""
    from knapray.coordinator import CoordinatorUnavailable, StepFailed

    world, ns = 4, "knapray-test"
    name = f"coord-relay-{time.monotonic_ns()}"
    handle = create_coordinator(name, ns, world_size=world, topology="g2n2")
    clients = [CoordinatorClient(name, ns, rank=r, timeout_s=20, node_ranks=world) for r in range(world)]
    lens = [[100, 50], [300], [20, 30, 40], [700]]
    for step in range(2):
        order = range(world) if step == 0 else (0, 1, 2)
        for r in order:
            clients[r].submit_async(step, lens[r], [1000 * step + 10 * r + k for k in range(len(lens[r]))])
        if step == 1:
            time.sleep(0.3)  # past the relay's linger: rank 3 comes in a batch of its own
            clients[3].submit_async(step, lens[3], [1000 * step + 30])
        whole = plan_from_gathered(lens, Topology.parse("g2n2"), WorkloadModel())
        for c in clients:
            plan, done = c.get_plan(step)
            assert done is False and all(np.array_equal(getattr(plan, f), getattr(whole, f)) for f in PLAN_FIELDS)
    assert clients[0]._relay_handle is not None  # the relay, not the coordinator, took the submissions

    # A rejected submission fails the step for every rank of the batch.
    for r, c in enumerate(clients):
        c.submit_async(2, [100, 200] if r == 1 else [100], [1000 + r])
    for c in clients:
        with pytest.raises(StepFailed, match="2 sequence lengths but 1 sample ids"):
            c.get_plan(2)

    # The coordinator gone: every rank hears CoordinatorUnavailable within its timeout.
    ray_session.kill(handle, no_restart=True)
    for r, c in enumerate(clients):
        c.timeout_s = 3.0
        c.submit_async(3, [100], [2000 + r])
    t0 = time.monotonic()
    for c in clients:
        with pytest.raises(CoordinatorUnavailable):
            c.get_plan(3)
    assert time.monotonic() - t0 < 3.0 * world + 2.0
