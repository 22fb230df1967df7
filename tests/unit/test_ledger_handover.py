"""A checkpoint after a locally planned step, then the group lost before the step's ledger
rows reached the coordinator (CI once caught this in the elastic grow run: step 7 missing
from the ledger, its samples trained again after the resize).

The trainer runs in this process on one gloo rank with a real ``BalanceCoordinator``
behind an in-process client that can be "away" for a step (its submission is lost, its
plan never comes: the ranks plan locally) and can "lose the group" at a later step (an
exception no training code catches). A second trainer then resumes from the latest
checkpoint against the same coordinator, as Ray Train restarts a group. The ledger must
hold every step the run trained, each sample once, and the step planned locally with the
attempt that trained it.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

import pyarrow.parquet as pq
from dist_utils import TINY_MMDIT, build_tiny_corpus, local_config, local_trainer
from knapray.coordinator import BalanceCoordinator, CoordinatorUnavailable
from knapray.corpus.writer import shard_paths
from knapray.worker.ledger_files import ledger_dir, read_ledger
from knapray.worker.step_planner import coordinator_config


class GroupLost(BaseException):
    """The worker group dies here (a BaseException: no training code handles it)."""


class InProcessClient:
    """``CoordinatorClient``'s calls the trainer makes, on a ``BalanceCoordinator`` in this
    process. ``away``: steps whose submission is lost and whose plan never comes;
    ``refuse_rows``: the coordinator does not take handed-over rows (still away for them);
    ``lose_group_at``: the step whose plan request kills the group."""

    def __init__(self, coord: BalanceCoordinator, away=(), refuse_rows=False, lose_group_at=None) -> None:
        self.coord, self.away, self.refuse_rows, self.lose_group_at = coord, set(away), refuse_rows, lose_group_at
        self.epoch = 0
        self.handed_over: list[int] = []

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def submit_async(self, step, seq_lens, sample_ids, exhausted=False):
        if step not in self.away:
            self.coord.submit(step, 0, seq_lens, sample_ids, exhausted, self.epoch)

    def request_plan(self, step):
        pass

    def get_plan(self, step):
        if step == self.lose_group_at:
            raise GroupLost(f"group lost at step {step}")
        if step in self.away:
            raise CoordinatorUnavailable(f"step {step}: away")
        plan, done = asyncio.run(self.coord.get_plan(step, 0, 5.0, self.epoch))
        if done:
            self.epoch += 1
        return plan, done

    def forget_requests(self):
        pass

    def record_external(self, step, sample_ids, home_ranks, epoch=None, expert=0):
        if self.refuse_rows:
            raise CoordinatorUnavailable(f"rows of step {step}: away")
        self.coord.record_external(step, sample_ids, home_ranks, epoch, expert)
        self.handed_over.append(step)

    def commit_async(self, step, experts=None):
        self.coord.commit_step(step, experts)

    def commit(self, step, experts=None):
        self.coord.commit_step(step, experts)

    def report_timing_async(self, step, compute_s, comm_s, wait_plan_s):
        pass

    def begin_run(self, world_size, resume_step=None, state=None, node_sizes=None):
        return self.coord.begin_run(world_size, resume_step, state, node_sizes)

    def state_dict(self):
        return self.coord.state_dict()


@pytest.mark.parametrize("refuse_rows", [False, True], ids=["handed-over-at-checkpoint", "carried-in-checkpoint"])
def test_a_locally_planned_step_is_in_the_ledger_after_the_group_is_lost(tmp_path, monkeypatch, refuse_rows):
    import knapray.worker.trainer as trainer_module

    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b2i64f1s0", steps=6, seed=5)
    overrides = [*TINY_MMDIT, "balance.coordinator=true", "balance.topology=g1n1", "checkpoint.every=1", "data.epochs=1"]
    cfg = local_config(corpus, str(tmp_path / "runs"), "handover", overrides)
    coord = BalanceCoordinator(coordinator_config(cfg, state_dir=ledger_dir(cfg.run_dir)))

    def trainer(client):
        monkeypatch.setattr(trainer_module, "CoordinatorClient", lambda *a, **k: client)
        return local_trainer(0, 1, corpus, str(tmp_path / "runs"), "handover", overrides)

    # Step 2 is planned locally (the coordinator is away for it); the group is lost at step 3.
    client = InProcessClient(coord, away={2}, refuse_rows=refuse_rows, lose_group_at=3)
    first = trainer(client)
    with pytest.raises(GroupLost):
        first.train()
    with open(os.path.join(first.checkpointer.latest(), "trainer.json")) as f:
        state = json.load(f)
    assert state["step"] == 2  # the checkpoint after the locally planned step
    if refuse_rows:
        # The coordinator did not take step 2's rows: the checkpoint carries them, no position.
        assert [r["step"] for r in state["ledger_rows"]][-1] == 2 and state["ledger"] is None
        assert client.handed_over == []
    else:
        # Handed over before the commit: the position the checkpoint records covers step 2.
        assert state["ledger_rows"] == [] and state["ledger"]["committed_step"] == 2
        assert 2 in client.handed_over  # (with steps 0 and 1, resent in case a lost coordinator dropped them)

    # Ray Train restarts the group from the latest checkpoint; the coordinator lived on.
    second = trainer(InProcessClient(coord))
    summary = second.train()
    assert summary["records"][0]["step"] == 3
    cols = read_ledger(cfg.run_dir).columns()
    steps, ids, attempts = cols["step"].tolist(), cols["sample_id"].tolist(), cols["attempt"].tolist()
    last = summary["records"][-1]["step"]
    assert sorted(set(steps)) == list(range(last + 1)), steps  # every trained step, step 2 included
    assert len(ids) == len(set(ids)), ids  # each sample once...
    corpus_ids = [i for p in shard_paths(corpus) for i in pq.read_table(p, columns=["sample_id"])["sample_id"].to_pylist()]
    assert sorted(ids) == sorted(corpus_ids)  # ...the whole corpus
    # Steps up to the checkpoint by the attempt that trained them, the rest by the resumed one.
    assert {a for s, a in zip(steps, attempts) if s <= 2} == {0}
    assert {a for s, a in zip(steps, attempts) if s > 2} == {1}
