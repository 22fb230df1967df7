"""BalanceCoordinator: the pure class (no Ray), then the actor and client on a local Ray."""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import sys
import time

import numpy as np
import pytest
try:
    import ray
except ImportError:  # the GPU machine has no Ray: the ray-marked tests below skip there (conftest)
    ray = None

from knapray.coordinator import (
    BalanceCoordinator,
    CoordinatorClient,
    CoordinatorUnavailable,
    PlanTimeout,
    StepFailed,
    create_coordinator,
    plan_from_gathered,
)
from knapray.planning import Topology, WorkloadModel, plan_balance

MODEL = dict(d_model=256, gamma=0.4)
PLAN_FIELDS = ("seq_lens", "home_rank", "local_index", "bag", "chunk_seq", "chunk_rank", "chunk_start", "chunk_len")


def same_plan(a, b) -> bool:
    return a.topology == b.topology and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in PLAN_FIELDS)


def batch(step: int, rank: int) -> tuple[list[int], list[int]]:
    """Deterministic lengths and ids for (step, rank): uneven counts and lengths."""
    n = 1 + (step + 2 * rank) % 3
    lens = [64 * (1 + (7 * step + 3 * rank + 5 * k) % 40) for k in range(n)]
    return lens, [10_000 * step + 100 * rank + k for k in range(n)]


def submit_all(coord: BalanceCoordinator, step: int) -> list[list[int]]:
    lens_per_rank = []
    for r in range(coord.world_size):
        lens, ids = batch(step, r)
        coord.submit(step, r, lens, ids)
        lens_per_rank.append(lens)
    return lens_per_rank


def get_all(coord: BalanceCoordinator, step: int, timeout_s: float = 5.0):
    async def main():
        return await asyncio.gather(*(coord.get_plan(step, r, timeout_s) for r in range(coord.world_size)))

    return asyncio.run(main())


# ---- planning ---------------------------------------------------------------------------------


def test_plan_equals_plan_balance_and_is_shared():
    coord = BalanceCoordinator(world_size=8, topology="g2n2", **MODEL)
    lens = submit_all(coord, 0)
    replies = get_all(coord, 0)
    plan = replies[0][0]
    assert all(p is plan and done is False for p, done in replies)
    assert plan.topology == Topology((2, 2), num_groups=2)  # g2n2 replicated over 8 ranks
    ref = plan_balance(lens, Topology.parse("g2n2", world_size=8), WorkloadModel(**MODEL))
    assert same_plan(plan, ref)
    assert plan.imbalance <= plan.baseline_imbalance


def test_plan_from_gathered_normalizes_inputs():
    lens = [batch(3, r)[0] for r in range(4)]
    topo = Topology.parse("g2n2")
    as_arrays = plan_from_gathered([np.asarray(x, dtype=np.int32) for x in lens], topo, WorkloadModel(**MODEL))
    as_lists = plan_from_gathered(lens, topo, WorkloadModel(**MODEL))
    assert same_plan(as_arrays, as_lists)


def test_memory_budget_caps_every_rank_and_falls_back_with_a_warning(caplog):
    # Rank 0's one long sequence is worth many short ones (attention), so balancing work
    # alone gives the other ranks 2000 tokens each; a budget of 1800 must hold anyway.
    lens = [[1000], [20] * 100, [20] * 100, [20] * 100]
    model = dict(d_model=64, gamma=0.4)
    free = plan_from_gathered(lens, Topology.parse("g1n4"), WorkloadModel(**model))
    assert free.rank_tokens.max() == 2000  # the budget binds
    coord = BalanceCoordinator(world_size=4, topology="g1n4", max_tokens_per_gpu=1800, **model)
    for r, ls in enumerate(lens):
        coord.submit(0, r, ls, list(range(1000 * r, 1000 * r + len(ls))))
    plan, _ = get_all(coord, 0)[0]
    assert plan.rank_tokens.max() <= 1800 and plan.rank_tokens.sum() == 7000
    # More tokens than the world holds: planned without the budget, and said so.
    with caplog.at_level(logging.WARNING, logger="knapray.coordinator.steps"):
        over = plan_from_gathered(lens, Topology.parse("g1n4"), WorkloadModel(**model), max_tokens_per_gpu=1700)
    assert over.rank_tokens.sum() == 7000
    assert "does not fit this step" in caplog.text and "7000 tokens exceed the budget of 1700" in caplog.text
    with pytest.raises(ValueError, match="max_tokens_per_gpu must be a positive integer"):
        BalanceCoordinator(world_size=4, max_tokens_per_gpu=0)


def test_get_before_complete_waits_then_completes():
    coord = BalanceCoordinator(world_size=4, topology="g2n2", **MODEL)

    async def main():
        for r in range(3):
            coord.submit(0, r, *batch(0, r))
        waiter = asyncio.ensure_future(coord.get_plan(0, 2, timeout_s=5))
        await asyncio.sleep(0.02)
        assert not waiter.done()  # rank 3 has not submitted
        coord.submit(1, 0, *batch(1, 0))  # a prefetch for the next step does not complete step 0
        await asyncio.sleep(0.01)
        assert not waiter.done()
        coord.submit(0, 3, *batch(0, 3))
        plan, done = await asyncio.wait_for(waiter, 1)
        return plan, done

    plan, done = asyncio.run(main())
    assert done is False and plan.num_sequences == sum(len(batch(0, r)[0]) for r in range(4))


def test_get_times_out_naming_missing_ranks():
    coord = BalanceCoordinator(world_size=4, topology="g2n2", **MODEL)
    coord.submit(0, 0, *batch(0, 0))
    coord.submit(0, 2, *batch(0, 2))
    with pytest.raises(PlanTimeout, match=r"ranks \[1, 3\]"):
        asyncio.run(coord.get_plan(0, 0, timeout_s=0.05))


def test_bad_submission_fails_the_step_for_every_rank(monkeypatch):
    coord = BalanceCoordinator(world_size=2, topology="g1n2", **MODEL)
    coord.submit(0, 0, [100, 200], [1, 2])
    coord.submit(0, 0, [100, 200], [1, 2])  # an identical resend is fine
    with pytest.raises(StepFailed, match="rank 0 submitted twice"):
        coord.submit(0, 0, [100], [1])
    with pytest.raises(StepFailed, match="submitted twice"):
        asyncio.run(coord.get_plan(0, 1, timeout_s=1))  # fails fast instead of hanging
    with pytest.raises(StepFailed, match="2 sequence lengths but 1 sample ids"):
        coord.submit(1, 1, [100, 200], [7])
    with pytest.raises(StepFailed, match="exhausted=True"):
        coord.submit(2, 1, [100], [7], exhausted=True)
    # The solver's own errors reach every rank too.
    def refuse(*args, **kwargs):
        raise ValueError("sequence of length 100 is over the budget")

    monkeypatch.setattr("knapray.coordinator.steps.plan_balance", refuse)
    c2 = BalanceCoordinator(world_size=2, topology="g2n1", **MODEL)
    c2.submit(0, 0, [1], [1])
    with pytest.raises(StepFailed, match="planning failed: sequence of length 100 is over the budget"):
        c2.submit(0, 1, [100], [2])
    with pytest.raises(StepFailed, match="planning failed"):
        asyncio.run(c2.get_plan(0, 0, timeout_s=1))


def test_old_plans_are_evicted():
    coord = BalanceCoordinator(world_size=2, topology="g1n2", keep_steps=2, **MODEL)
    for t in range(4):
        submit_all(coord, t)
    assert get_all(coord, 3)[0][0].num_sequences > 0
    with pytest.raises(StepFailed, match="no longer held"):
        asyncio.run(coord.get_plan(0, 0))


def test_submit_before_world_size_is_known():
    coord = BalanceCoordinator(topology="bags_of:8", **MODEL)
    with pytest.raises(StepFailed, match="begin_run"):
        coord.submit(0, 0, [100], [1])
    assert coord.begin_run(4) == Topology((4,))
    coord.submit(0, 0, [100], [1])
    assert not coord.is_ready(0)


# ---- ledger -----------------------------------------------------------------------------------


def run_steps(coord: BalanceCoordinator, steps, commit: bool = True) -> None:
    for t in steps:
        submit_all(coord, t)
        assert get_all(coord, t)[0][1] is False
        if commit:
            coord.commit_step(t)


def rows_by_step(rows, steps):
    return [r for r in rows if r[0] in steps]


def test_ledger_commit_truncate_and_state_dict_round_trip(tmp_path):
    state_dir = str(tmp_path / "coordinator")
    coord = BalanceCoordinator(world_size=4, topology="g2n2", state_dir=state_dir, **MODEL)
    run_steps(coord, range(3), commit=False)
    assert coord.ledger_rows() == []  # planned but not yet trained
    coord.commit_step(1)  # cumulative: steps 0 and 1
    assert sorted({r[0] for r in coord.ledger_rows()}) == [0, 1]
    coord.commit_step(2)
    coord.commit_step(2)  # idempotent
    rows = coord.ledger_rows()
    expected = [(t, i, r, 0) for t in range(3) for r in range(4) for i in batch(t, r)[1]]
    assert rows == expected
    with pytest.raises(StepFailed, match="already committed"):
        coord.submit(2, 0, *batch(2, 0))

    run_steps(coord, range(3, 5))
    ckpt = pickle.loads(pickle.dumps(coord.state_dict()))  # rides in the training checkpoint
    assert "ledger" not in ckpt and len(pickle.dumps(ckpt)) < 400  # a position, not the rows
    run_steps(coord, range(5, 7))
    rows_at_6 = coord.ledger_rows()

    # The actor restarts: a new coordinator on the same directory has every committed row.
    coord.close()
    coord = BalanceCoordinator(world_size=4, topology="g2n2", state_dir=state_dir, **MODEL)
    assert coord.ledger_rows() == rows_at_6 and coord.committed_step == 6
    # Loading the checkpoint taken at step 4 goes back to it.
    coord.load_state_dict(ckpt)
    assert coord.ledger_rows() == rows_by_step(rows_at_6, range(5)) and coord.attempt == 0

    # The coordinator cuts back to that checkpoint: steps 5, 6 will be trained again.
    coord.truncate(4)
    assert coord.attempt == 1 and coord.committed_step == 4
    assert coord.ledger_rows() == rows_by_step(rows_at_6, range(5))
    run_steps(coord, range(5, 7))
    rows = coord.ledger_rows()
    assert {r[3] for r in rows_by_step(rows, range(5))} == {0}
    assert {r[3] for r in rows_by_step(rows, range(5, 7))} == {1}
    assert len(rows) == len(expected) + sum(len(batch(t, r)[1]) for t in range(3, 7) for r in range(4))

    # Restoring into a live coordinator never lowers its attempt counter.
    coord.load_state_dict(ckpt)
    assert coord.attempt == 1 and coord.ledger_rows() == rows_by_step(rows_at_6, range(5))


def test_begin_run_resume_from_checkpoint_state(tmp_path):
    state_dir = str(tmp_path / "coordinator")
    coord = BalanceCoordinator(world_size=2, topology="g1n2", state_dir=state_dir, **MODEL)
    run_steps(coord, range(3))
    ckpt = coord.state_dict()
    rows = coord.ledger_rows()
    coord.close()
    restarted = BalanceCoordinator(topology="g1n2", state_dir=state_dir, **MODEL)  # the actor, restarted
    assert restarted.begin_run(2, resume_step=2, state=ckpt) == Topology((1, 1))
    assert restarted.attempt == 1 and restarted.ledger_rows() == rows
    run_steps(restarted, [3])
    assert {r[3] for r in restarted.ledger_rows() if r[0] == 3} == {1}
    with pytest.raises(ValueError, match="resume_step"):
        restarted.begin_run(2, state=ckpt)
    restarted.begin_run(2)  # a fresh run starts the ledger over
    assert restarted.ledger_rows() == [] and restarted.attempt == 0


# ---- epoch end --------------------------------------------------------------------------------


def length_of(sample_id: int) -> int:
    return 32 * (1 + (sample_id * 37) % 50)


async def run_epoch(coord, shards, batch_size, start, epoch, plans):
    """Every rank iterates its shard; it submits step t+1 before getting step t's plan."""
    done_at: dict[int, int] = {}

    async def rank_loop(r: int) -> None:
        batches = [shards[r][i : i + batch_size] for i in range(0, len(shards[r]), batch_size)]

        def submit(t: int) -> None:
            k = t - start
            if k < len(batches):
                coord.submit(t, r, [length_of(i) for i in batches[k]], batches[k], False, epoch)
            else:
                coord.submit(t, r, [], [], True, epoch)

        t = start
        submit(t)
        while True:
            submit(t + 1)
            plan, done = await coord.get_plan(t, r, timeout_s=5)
            if done:
                done_at[r] = t
                return
            if r == 0:
                plans[t] = plan
            await asyncio.sleep(0)  # the step computes; the other ranks run meanwhile
            if r == 0:
                coord.commit_step(t)
            t += 1

    await asyncio.gather(*(rank_loop(r) for r in range(len(shards))))
    return done_at


def test_epoch_done_with_uneven_shards():
    coord = BalanceCoordinator(world_size=4, topology="g2n2", **MODEL)
    sizes = [9, 6, 2, 0]  # batches of 2: ranks run dry after 5, 3, 1 and 0 steps
    ids = iter(range(1000))
    shards = [[next(ids) for _ in range(n)] for n in sizes]
    plans: dict = {}
    done_at = asyncio.run(run_epoch(coord, shards, 2, 0, 0, plans))
    assert done_at == {r: 5 for r in range(4)}  # everyone leaves at the same step
    assert coord.epoch == 1
    ledger_ids = [row[1] for row in coord.ledger_rows()]
    all_ids = [i for s in shards for i in s]
    assert sorted(ledger_ids) == sorted(all_ids)  # nothing lost, nothing twice
    # Rank 3 never had data, yet it got work from the others whenever there were at least
    # as many sequences as bags (one sequence runs on one bag).
    assert all(p.seq_offsets[4] == p.seq_offsets[3] for p in plans.values())
    assert all(p.rank_work[3] > 0 for p in plans.values() if p.num_sequences >= 2)

    # The next epoch continues with the next step numbers; stale prefetches are dropped.
    shards2 = [[i + 1000 for i in s] for s in shards]
    done2 = asyncio.run(run_epoch(coord, shards2, 2, 6, 1, plans))
    assert done2 == {r: 11 for r in range(4)} and coord.epoch == 2
    assert sorted(row[1] for row in coord.ledger_rows()) == sorted(all_ids + [i for s in shards2 for i in s])


def test_epoch_end_found_even_if_the_prefetched_next_step_completes_first():
    coord = BalanceCoordinator(world_size=2, topology="g1n2", **MODEL)
    coord.submit(0, 0, [100], [1], epoch=0)
    coord.submit(0, 1, [200], [2], epoch=0)
    coord.submit(1, 0, [], [], exhausted=True, epoch=0)
    coord.submit(2, 0, [], [], exhausted=True, epoch=0)  # prefetches of step 2 arrive
    coord.submit(2, 1, [], [], exhausted=True, epoch=0)  # before rank 1's step 1
    coord.submit(1, 1, [], [], exhausted=True, epoch=0)
    assert [done for _, done in get_all(coord, 1)] == [True, True]
    assert coord.epoch == 1
    coord.submit(2, 0, [300], [3], epoch=1)  # the new epoch reuses step 2 cleanly
    coord.submit(2, 1, [400], [4], epoch=1)
    plan, done = get_all(coord, 2)[0]
    assert not done and plan.seq_lens.tolist() == [300, 400]


def test_next_epoch_reuses_the_end_step_number():
    """The trainer counts trained steps, so epoch 1's first step has the number epoch 0
    ended at. A slow rank still asking for that end step (with its old epoch) is told the
    epoch ended even after a fast rank started the new epoch's step under the same number;
    prefetches of the old epoch are dropped; a resume from the checkpoint just before the
    end keeps it."""
    coord = BalanceCoordinator(world_size=2, topology="g1n2", **MODEL)
    coord.submit(0, 0, [100], [1], epoch=0)
    coord.submit(0, 1, [200], [2], epoch=0)
    coord.submit(1, 0, [], [], exhausted=True, epoch=0)
    coord.submit(1, 1, [], [], exhausted=True, epoch=0)  # step 1 ends epoch 0
    coord.submit(2, 0, [], [], exhausted=True, epoch=0)  # rank 0's prefetch: stale now
    coord.commit_step(0)

    async def ranks():
        assert await coord.get_plan(1, 0, 1, epoch=0) == (None, True)
        coord.submit(1, 0, [300], [3], epoch=1)  # rank 0 starts epoch 1 at step 1
        assert await coord.get_plan(1, 1, 1, epoch=0) == (None, True)  # rank 1, late
        coord.submit(1, 1, [400], [4], epoch=1)
        return [await coord.get_plan(1, r, 1, epoch=1) for r in range(2)]

    plans = asyncio.run(ranks())
    assert [done for _, done in plans] == [False, False] and plans[0][0] is plans[1][0]
    assert plans[0][0].seq_lens.tolist() == [300, 400]
    coord.commit_step(1)
    cols = coord.ledger_columns()
    assert cols["step"].tolist() == [0, 0, 1, 1] and cols["epoch"].tolist() == [0, 0, 1, 1]
    assert coord.stats()["stale_submissions"] == 1 and coord.epoch == 1
    coord.submit(1, 0, [], [], exhausted=True, epoch=0)  # the end step resent: ignored
    with pytest.raises(StepFailed, match="ended at this step"):
        coord.submit(1, 0, [5], [5], epoch=0)
    with pytest.raises(StepFailed, match="after the end of epoch 0"):
        asyncio.run(coord.get_plan(2, 0, 1, epoch=0))

    # Back to a checkpoint at step 0 (taken before the end was seen): its epoch had all
    # its samples in step 0, so the end at step 1 stays and epoch 1 follows at step 1.
    coord.truncate(0)
    assert coord.epoch == 1 and coord.state_dict()["epoch_ends"] == {0: 1}
    coord.submit(1, 0, [], [], exhausted=True, epoch=0)  # a rank resumed in epoch 0
    assert asyncio.run(coord.get_plan(1, 0, 1, epoch=0)) == (None, True)


def test_conflicting_resend_of_a_planned_step_fails_it_for_every_rank():
    coord = BalanceCoordinator(world_size=2, topology="g1n2", **MODEL)
    coord.submit(0, 0, [100], [1], epoch=0)
    coord.submit(0, 1, [200], [2], epoch=0)
    with pytest.raises(StepFailed, match="different data after the step was planned"):
        coord.submit(0, 1, [999], [9], epoch=0)
    for r in range(2):
        with pytest.raises(StepFailed, match="rank 1 submitted different data"):
            asyncio.run(coord.get_plan(0, r, 1, epoch=0))
    # Ranks of one step in different epochs: a failure, not a plan.
    coord.submit(1, 0, [100], [1], epoch=0)
    with pytest.raises(StepFailed, match="for epoch 1, other ranks for epoch 0"):
        coord.submit(1, 1, [200], [2], epoch=1)


def test_a_rejected_submission_is_raised_by_the_trainer_not_taken_for_an_epoch_end(tmp_path):
    """The training side: the client's StepFailed (a rejected submission, or a step failed
    for everyone) becomes ``Fetched.error``, counted in the per-step all-reduce, and every
    rank raises the failing ranks' reasons (here a world of one)."""
    import torch

    from knapray.data import StepMeta
    from knapray.distributed.step_sync import StepSync
    from knapray.worker.ledger_keeper import LedgerKeeper
    from knapray.worker.step_planner import StepPlanner

    class RejectingClient:
        def set_epoch(self, epoch):
            self.epoch = epoch

        def submit_async(self, step, seq_lens, sample_ids, exhausted=False):
            pass

        def request_plan(self, step):
            pass

        def get_plan(self, step):
            raise StepFailed(f"step {step}: rank 0 submitted different data after the step was planned")

    client = RejectingClient()
    planner = StepPlanner(StepSync.build(torch.device("cpu")), Topology.parse("g1n1"), WorkloadModel(**MODEL),
                          "knapray", client, LedgerKeeper(0, client, str(tmp_path)))
    meta = StepMeta(0, (100,), (1,))
    planner.begin_epoch(23, 1, meta)
    fetched = planner.fetch(23, meta, meta)
    assert not fetched.have_plan and not fetched.epoch_done and "different data" in fetched.error
    with pytest.raises(StepFailed, match=r"step 23 cannot be trained: rank 0: step 23: rank 0 submitted different"):
        planner.raise_failed(23, fetched)


# ---- statistics -------------------------------------------------------------------------------


def test_speed_factors_from_timings():
    coord = BalanceCoordinator(world_size=4, topology="g1n4", **MODEL)
    for t in range(6):
        submit_all(coord, t)
        plan = get_all(coord, t)[0][0]
        for r in range(4):
            slow = 2.0 if r == 2 else 1.0  # rank 2 computes at half speed
            coord.report_timing(t, r, compute_s=slow * plan.rank_work[r] * 1e-12, comm_s=0.001, wait_plan_s=0.0005)
    np.testing.assert_allclose(coord.speed_factors(), [1.0, 1.0, 0.5, 1.0], rtol=1e-9)
    stats = coord.stats()
    assert stats["steps_planned"] == 6
    assert stats["mean_imbalance"] <= stats["mean_baseline_imbalance"]
    assert stats["plan_ms_p50"] > 0 and stats["wait_plan_s_mean"] == pytest.approx(0.0005)
    assert sum(stats["length_histogram"].values()) == sum(len(batch(t, r)[0]) for t in range(6) for r in range(4))
    with pytest.raises(ValueError, match="compute_s must be a finite number"):
        coord.report_timing(0, 0, compute_s=float("nan"), comm_s=0, wait_plan_s=0)


def test_length_histogram_bins_are_log2():
    coord = BalanceCoordinator(world_size=1, topology="g1n1", **MODEL)
    coord.submit(0, 0, [1, 2, 3, 4, 1023, 1024], list(range(6)))
    assert coord.stats()["length_histogram"] == {1: 1, 2: 2, 4: 1, 512: 1, 1024: 1}


# ---- topology ---------------------------------------------------------------------------------


def test_topology_for_concrete_spec_replicates_or_fails_clearly():
    coord = BalanceCoordinator(topology="g2n2", **MODEL)
    assert coord.topology_for(8) == Topology((2, 2), num_groups=2)
    with pytest.raises(ValueError, match=r"world size 6 does not fit topology 'g2n2' \(4 ranks"):
        coord.topology_for(6)
    with pytest.raises(ValueError, match="world size must be an integer >= 1"):
        coord.topology_for(0)


@pytest.mark.parametrize(
    "rule, gpus_per_node, world, bag",
    [
        ("bags_of:8", 0, 12, 4),
        ("bags_of:8", 0, 24, 8),
        ("bags_of:8", 0, 6, 2),
        ("bags_of:8", 0, 7, 1),
        ("bags_of:4", 0, 32, 4),
        ("bags_of:8", 4, 16, 4),
        ("bags_of:8", 6, 12, 2),
        ("auto", 0, 16, 8),  # no length history yet: one node's worth
    ],
)
def test_topology_for_rules(rule, gpus_per_node, world, bag):
    coord = BalanceCoordinator(topology=rule, gpus_per_node=gpus_per_node, **MODEL)
    assert coord.topology_for(world) == Topology((bag,) * (world // bag))


def test_auto_topology_uses_length_history(caplog):
    uniform = BalanceCoordinator(world_size=4, topology="auto", **MODEL)
    skewed = BalanceCoordinator(world_size=4, topology="auto", **MODEL)
    for t in range(4):
        for r in range(4):
            uniform.submit(t, r, [1024, 1024], [8 * t + 2 * r, 8 * t + 2 * r + 1])
            lens = [16384] if r == t else [256, 256]
            skewed.submit(t, r, lens, [10 * t + 2 * r + k for k in range(len(lens))])
    assert uniform.topology_for(8) == Topology((1,) * 8)  # already balanced: smallest bags
    # One 16k-token sequence per 4 ranks: g4 bags balance it perfectly, g8 is no better.
    chosen = skewed.topology_for(8)
    assert chosen == Topology((4, 4))
    with caplog.at_level(logging.INFO, logger="knapray.coordinator"):
        assert skewed.begin_run(8) == chosen
    assert any("topology changed" in m and "8" in m for m in caplog.messages)


def test_config_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="bags_of:N"):
        BalanceCoordinator(topology="bags_of:x")
    with pytest.raises(ValueError, match="'g8x4'"):
        BalanceCoordinator(topology="g8x4")
    with pytest.raises(ValueError, match=r"unknown coordinator config keys \['topo'\]; valid: world_size"):
        BalanceCoordinator(topo="g8n4")
    with pytest.raises(ValueError, match="unknown solver 'lpt'; valid: knapray"):
        BalanceCoordinator(solver="lpt")


# ---- Ray: the named actor and the client ------------------------------------------------------

NAMESPACE = "knapray-test"


@pytest.fixture(scope="module")
def ray_ns():
    """Local Ray for this module; reuses one that is already running (and leaves it up)."""
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    # Ship this module's functions by value: workers of a Ray started elsewhere may not
    # have the tests directory on their path.
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    yield NAMESPACE
    ray.cloudpickle.unregister_pickle_by_value(module)
    if started:
        ray.shutdown()


def rank_worker(name: str, namespace: str, rank: int, steps: int):
    """One training rank: prefetches step t+1 before asking for step t's plan."""
    client = CoordinatorClient(name, namespace, rank, timeout_s=20)
    client.submit_async(0, *batch(0, rank))
    plans = []
    for t in range(steps):
        if t + 1 < steps:
            client.submit_async(t + 1, *batch(t + 1, rank))
        plan, done = client.get_plan(t)
        plans.append((plan, done))
        client.report_timing_async(t, compute_s=0.01, comm_s=0.0, wait_plan_s=client.last_wait_s)
    if rank == 0:
        client.commit(steps - 1)
    return plans


@pytest.mark.ray
def test_ray_ranks_receive_identical_plans(ray_ns):
    name = f"coord-plans-{time.monotonic_ns()}"
    handle = create_coordinator(name, ray_ns, world_size=4, topology="g2n2", **MODEL)
    assert create_coordinator(name, ray_ns, world_size=4, topology="g2n2", **MODEL) is not None  # get_if_exists
    worker = ray.remote(num_cpus=1)(rank_worker)
    results = ray.get([worker.remote(name, ray_ns, r, 3) for r in range(4)], timeout=60)
    for t in range(3):
        lens = [batch(t, r)[0] for r in range(4)]
        ref = plan_from_gathered(lens, Topology.parse("g2n2"), WorkloadModel(**MODEL))
        for r in range(4):
            plan, done = results[r][t]
            assert done is False and same_plan(plan, ref)
    rows = ray.get(handle.ledger_rows.remote())
    assert sorted(row[1] for row in rows) == sorted(i for t in range(3) for r in range(4) for i in batch(t, r)[1])
    stats = ray.get(handle.stats.remote())
    assert stats["steps_planned"] == 3 and stats["topology"] == "g2n2"
    ray.kill(handle, no_restart=True)


@pytest.mark.ray
def test_ray_client_raises_unavailable_instead_of_hanging(ray_ns):
    name = f"coord-kill-{time.monotonic_ns()}"
    handle = create_coordinator(name, ray_ns, world_size=2, topology="g1n2", **MODEL)
    # The actor gives up at 0.9 x the client's timeout so that its message (which ranks are
    # missing) arrives first: 5 s leaves that answer 0.5 s, which a loaded machine needs (at
    # 1.5 s, 0.15 s was once too little under a full suite on two processes).
    timeout = 5.0
    client = CoordinatorClient(name, ray_ns, rank=0, timeout_s=timeout)

    # The coordinator's own errors come through as themselves.
    client.submit_async(0, [100, 200], [1])
    with pytest.raises(StepFailed, match="2 sequence lengths but 1 sample ids"):
        client.get_plan(0)

    # A step another rank never submits: unavailable within the timeout, naming the rank.
    client.submit_async(1, [100], [1])
    t0 = time.monotonic()
    with pytest.raises(CoordinatorUnavailable, match=r"ranks \[1\]"):
        client.get_plan(1)
    assert time.monotonic() - t0 < timeout + 10.0  # bounded, not hanging (the slack is for load)

    ray.kill(handle, no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(CoordinatorUnavailable):
        client.get_plan(2)
    assert time.monotonic() - t0 < timeout + 10.0  # bounded, not hanging (the slack is for load)
    with pytest.raises(CoordinatorUnavailable, match="no coordinator actor"):
        CoordinatorClient(name, ray_ns, rank=1, timeout_s=timeout).get_plan(2)


class _Planted:
    """Unpickling this creates a file: proof that something unpickled it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def until_up(call, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except (CoordinatorUnavailable, ray.exceptions.RayActorError):
            assert time.monotonic() < deadline, "the actor did not come back"
            time.sleep(0.2)


@pytest.mark.ray
def test_ray_actor_restart_restores_from_its_files_and_never_reads_the_old_pickle(ray_ns, tmp_path):
    marker = tmp_path / "was-unpickled"
    state = tmp_path / "ledger"
    state.mkdir()
    # Where earlier versions kept a pickled state, planted: it must never be read.
    (state / "coordinator-state.pkl").write_bytes(pickle.dumps(_Planted(str(marker))))
    name = f"coord-restart-{time.monotonic_ns()}"
    handle = create_coordinator(name, ray_ns, topology="g1n2", state_dir=str(state), **MODEL)
    clients = [CoordinatorClient(name, ray_ns, rank=r, timeout_s=20) for r in range(2)]
    clients[0].begin_run(2)
    for t in range(3):
        for r, c in enumerate(clients):
            c.submit_async(t, *batch(t, r))
        assert [c.get_plan(t)[1] for c in clients] == [False, False]
    clients[0].commit(1)  # step 2 is planned, not committed, when the actor dies
    ray.kill(handle, no_restart=False)  # Ray restarts it: __init__ restores from the state directory
    # Every handle's first call after the restart may fail ("may or may not have been
    # executed"); the training loop retries through the fallback, the test retries here.
    position = until_up(clients[0].state_dict)
    stats = until_up(lambda: ray.get(handle.stats.remote(), timeout=10))
    assert position["committed_step"] == 1 and stats["committed_step"] == 1 and stats["world_size"] == 2
    clients[0].commit(2)  # the restored in-flight step is covered by the next commit
    path = tmp_path / "ledger.jsonl"
    assert clients[0].write_ledger_jsonl(str(path)) == sum(len(batch(t, r)[1]) for t in range(3) for r in range(2))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(row["sample_id"] for row in rows) == sorted(i for t in range(3) for r in range(2) for i in batch(t, r)[1])
    assert clients[0].epoch_sample_ids(0).size == len(rows)
    assert (state / "run.json").exists() and not marker.exists()
    ray.kill(handle, no_restart=True)
