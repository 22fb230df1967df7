"""The worker side of the sample ledger (``LedgerKeeper``), without Ray or processes: a
coordinator client stand-in that can be away, and the run's own journal in a temporary
directory. What it decides: commit or carry at a step, settle or carry at a checkpoint,
hand over carried rows on a resume (resends ignored), skip what an epoch trained, and
leave the rows a coordinator gone for good never took for the driver to take over."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from knapray.coordinator import CoordinatorUnavailable
from knapray.data import StepMeta
from knapray.planning import Topology
from knapray.worker.checkpoint import TRAINER_STATE, read_trainer_state
from knapray.worker.ledger_files import read_ledger, take_over
from knapray.worker.ledger_keeper import (
    RECENT_STEPS,
    LedgerKeeper,
    carried_ids,
    hand_over,
    lost_rows,
    pending_of,
    rows_to_carry,
)
from knapray.worker.step_planner import Planned

TOPO = Topology.parse("g1n2")


class FakeClient:
    """The ledger calls of ``CoordinatorClient``, on a dict of the rows the coordinator has
    (a step's rows once: resends are ignored, as its ledger does). ``away``: every call
    raises ``CoordinatorUnavailable``; ``refuse``: steps whose rows it does not take."""

    def __init__(self, away: bool = False, refuse=()) -> None:
        self.away, self.refuse = away, set(refuse)
        self.rows: dict[int, tuple[list[int], list[int], int]] = {}
        self.committed = -1
        self.calls: list[tuple] = []
        self.experts: dict[int, int] = {}
        self.sent_experts: list = []

    def _check(self, what: str) -> None:
        if self.away:
            raise CoordinatorUnavailable(f"{what}: away")

    def record_external(self, step, sample_ids, home_ranks, epoch=None, expert=0):
        self.calls.append(("record", step))
        self._check(f"rows of step {step}")
        if step in self.refuse:
            raise CoordinatorUnavailable(f"rows of step {step}: refused")
        self.rows.setdefault(step, (list(sample_ids), list(home_ranks), epoch))
        self.experts[step] = expert

    def commit_async(self, step, experts=None):
        self.calls.append(("commit_async", step))
        self.sent_experts.append(experts)
        if not self.away:
            self.committed = max(self.committed, step)

    def commit(self, step, experts=None):
        self.calls.append(("commit", step))
        self.sent_experts.append(experts)
        self._check(f"commit of step {step}")
        self.committed = max(self.committed, step)

    def state_dict(self):
        self._check("state_dict")
        return {"ledger_id": 7, "records": len(self.rows), "committed_step": self.committed, "attempt": 0}

    def begin_run(self, world_size, resume_step=None, state=None, node_sizes=None):
        self.calls.append(("begin_run", resume_step, state))
        self._check("begin_run")
        return TOPO


def local(step: int, ids, home) -> Planned:
    return Planned(plan=None, epoch_done=False, planned_by="local", wait_s=0.0, rows=(list(ids), list(home)))


COORDINATOR = Planned(plan=None, epoch_done=False, planned_by="coordinator", wait_s=0.0)


def meta(ids) -> StepMeta:
    return StepMeta(index=0, seq_lens=tuple(16 for _ in ids), sample_ids=tuple(ids))


# ---- decisions on rows ------------------------------------------------------------------------

def test_carried_rows_are_json_data_by_step_and_come_back_as_the_same_rows():
    pending = {5: ([np.int64(50), 51], [1, np.int32(0)], 0, 1), 2: ([20], [0], 1, 0)}
    rows = rows_to_carry(pending)
    assert rows == [{"step": 2, "epoch": 1, "sample_ids": [20], "home_ranks": [0], "expert": 0},
                    {"step": 5, "epoch": 0, "sample_ids": [50, 51], "home_ranks": [1, 0], "expert": 1}]
    assert json.loads(json.dumps(rows)) == rows  # plain ints: trainer.json takes them as they are
    assert pending_of(rows) == {2: ([20], [0], 1, 0), 5: ([50, 51], [1, 0], 0, 1)}
    assert pending_of(rows + [{"step": 2, "epoch": 1, "sample_ids": [99], "home_ranks": [0]}])[2] == ([20], [0], 1, 0)
    # a checkpoint written before rows carried their expert: expert 0
    assert pending_of([{"step": 3, "epoch": 0, "sample_ids": [7], "home_ranks": [0]}]) == {3: ([7], [0], 0, 0)}


def test_lost_rows_join_every_ranks_recent_ids_in_rank_order():
    recents = [{3: (0, [30, 31]), 4: (0, [40])}, {3: (0, [32])}, {4: (1, [41, 42])}]
    assert lost_rows(recents) == {3: ([30, 31, 32], [0, 0, 1], 0, 0), 4: ([40, 41, 42], [0, 2, 2], 0, 0)}
    assert lost_rows(recents, {4: 1})[4] == ([40, 41, 42], [0, 2, 2], 0, 1)  # rank 0's expert of each step
    assert lost_rows([{}, {}]) == {}


def test_carried_ids_are_one_epochs_sorted_and_unique():
    rows = [{"step": 1, "epoch": 0, "sample_ids": [9, 3], "home_ranks": [0, 1]},
            {"step": 2, "epoch": 1, "sample_ids": [4], "home_ranks": [0]},
            {"step": 3, "epoch": 0, "sample_ids": [3, 1], "home_ranks": [0, 1]}]
    assert carried_ids(rows, 0).tolist() == [1, 3, 9]
    assert carried_ids(rows, 2).dtype == np.int64 and carried_ids(rows, 2).size == 0


def test_hand_over_stops_at_the_first_row_the_coordinator_does_not_take():
    rows = rows_to_carry({1: ([1], [0], 0, 0), 2: ([2], [0], 0, 0), 3: ([3], [0], 0, 0)})
    client = FakeClient(refuse={2})
    assert hand_over(client, rows) == rows[1:]
    assert sorted(client.rows) == [1]
    assert hand_over(FakeClient(), rows) == []


# ---- per step ---------------------------------------------------------------------------------

def test_rank_0_commits_coordinator_steps_and_holds_local_ones_until_the_coordinator_takes_them():
    client = FakeClient(away=True)
    keeper = LedgerKeeper(0, client, "unused")
    keeper.committed(0, 0, COORDINATOR, meta([1, 2]))
    keeper.committed(1, 0, local(1, [3, 4, 5], [0, 0, 1]), meta([3, 4]))
    assert client.calls == [("commit_async", 0)]
    keeper.flush()  # still away: kept
    assert client.rows == {}
    client.away = False
    keeper.flush()
    assert client.rows == {1: ([3, 4, 5], [0, 0, 1], 0)}
    keeper.settle(1)
    assert keeper.state_dict()["ledger_rows"] == []  # nothing left to carry


def test_every_path_a_step_takes_to_the_ledger_carries_its_expert(tmp_path):
    """A run of two experts: a coordinator commit carries rank 0's recent steps' experts
    (nothing more for a run of one model), a locally planned step's rows carry theirs, and
    without a coordinator the journal gets them."""
    client = FakeClient()
    keeper = LedgerKeeper(0, client, "unused")
    keeper.committed(0, 0, COORDINATOR, meta([1]))
    assert client.sent_experts == [None]  # all expert 0: the commit is as it was
    keeper.committed(1, 0, COORDINATOR, meta([2]), expert=1)
    keeper.committed(2, 0, local(2, [3], [0]), meta([3]), expert=1)
    assert client.sent_experts[-1] == {0: 0, 1: 1}
    keeper.flush()
    assert client.experts == {2: 1}
    keeper.settle(2)
    assert client.sent_experts[-1] == {0: 0, 1: 1, 2: 1}
    for step in range(3, 3 + RECENT_STEPS):
        keeper.committed(step, 0, COORDINATOR, meta([step]), expert=step % 2)
    assert len(client.sent_experts[-1]) == RECENT_STEPS  # bounded: the recent steps only

    run = str(tmp_path)
    alone = LedgerKeeper(0, None, run)
    alone.open(None)
    for step, expert in enumerate([1, 0, 1]):
        alone.committed(step, 0, local(step, [step], [0]), meta([step]), expert=expert)
    alone.close()
    assert read_ledger(run).columns()["expert"].tolist() == [1, 0, 1]


def test_other_ranks_only_remember_their_recent_steps():
    client = FakeClient()
    keeper = LedgerKeeper(1, client, "unused")
    for step in range(RECENT_STEPS + 3):
        keeper.committed(step, step // 10, COORDINATOR if step % 2 else local(step, [step], [1]), meta([step, -step]))
    assert client.calls == []
    assert sorted(keeper.recent) == list(range(3, RECENT_STEPS + 3))
    assert keeper.recent[12] == (1, [12, -12])
    keeper.resend([keeper.recent])  # only rank 0 re-sends
    keeper.settle(5)
    assert client.calls == [] and keeper.state_dict() == {"ledger": None, "ledger_rows": []}


def test_a_local_step_re_sends_what_a_lost_coordinator_may_have_dropped_each_step_once():
    client = FakeClient()
    keeper = LedgerKeeper(0, client, "unused")
    keeper.committed(4, 0, local(4, [40, 41], [0, 1]), meta([40]))
    # Every rank's recent ids (gathered by the local plan): step 4 again with other rows,
    # and step 3, which the restarted coordinator may have lost.
    keeper.resend([{3: (0, [30]), 4: (0, [40])}, {3: (0, [31]), 4: (0, [99])}])
    keeper.flush()
    assert client.rows == {3: ([30, 31], [0, 1], 0), 4: ([40, 41], [0, 1], 0)}  # step 4's own rows kept
    assert [c for c in client.calls if c[0] == "record"] == [("record", 3), ("record", 4)]  # in step order
    keeper.resend([{3: (0, [30])}, {3: (0, [31])}])  # rows the coordinator has: a resend it ignores
    keeper.flush()
    assert client.rows[3] == ([30, 31], [0, 1], 0)


def test_without_a_coordinator_nothing_is_resent():
    keeper = LedgerKeeper(0, None, "unused")
    keeper.resend([{3: (0, [30])}])
    keeper.flush()  # nothing pending: no client needed
    keeper.finish(3)


# ---- checkpoints ------------------------------------------------------------------------------

def test_a_checkpoint_with_every_row_taken_records_the_coordinators_position_after_a_commit():
    client = FakeClient()
    keeper = LedgerKeeper(0, client, "unused")
    keeper.committed(2, 0, local(2, [20], [0]), meta([20]))
    keeper.settle(2)
    assert client.calls == [("record", 2), ("commit", 2)]  # rows first, then the commit
    assert keeper.state_dict() == {"ledger": client.state_dict(), "ledger_rows": []}
    assert keeper.state_dict()["ledger"]["committed_step"] == 2


def test_a_checkpoint_carries_the_rows_the_coordinator_does_not_take_and_no_position(caplog):
    client = FakeClient(refuse={2})
    keeper = LedgerKeeper(0, client, "unused")
    keeper.committed(1, 0, local(1, [10], [0]), meta([10]))
    keeper.committed(2, 0, local(2, [20, 21], [0, 1]), meta([20]))
    with caplog.at_level(logging.WARNING, logger="knapray.worker.ledger_keeper"):
        keeper.settle(2)
    assert ("commit", 2) not in client.calls  # a commit would claim steps the coordinator lacks
    assert keeper.state_dict() == {"ledger": None, "ledger_rows": [
        {"step": 2, "epoch": 0, "sample_ids": [20, 21], "home_ranks": [0, 1], "expert": 0}]}
    assert "checkpoint at step 2: the coordinator has not taken the rows of locally planned steps [2]; " \
           "the checkpoint carries them" in caplog.text
    with pytest.raises(CoordinatorUnavailable, match=r"ledger rows of steps \[2\] could not be handed over"):
        keeper.finish(2)
    client.refuse.clear()
    keeper.finish(3)
    assert client.rows[2] == ([20, 21], [0, 1], 0) and client.calls[-1] == ("commit", 3)


def test_an_unconfirmed_commit_records_no_position(caplog):
    client = FakeClient(away=True)
    keeper = LedgerKeeper(0, client, "unused")
    keeper.committed(0, 0, COORDINATOR, meta([1]))
    with caplog.at_level(logging.WARNING, logger="knapray.worker.ledger_keeper"):
        keeper.settle(0)
    assert keeper.state_dict() == {"ledger": None, "ledger_rows": []}
    assert "checkpoint at step 0: coordinator commit not confirmed (commit of step 0: away)" in caplog.text


def test_without_a_coordinator_rank_0_journals_every_step_and_a_checkpoint_records_its_position(tmp_path):
    run = str(tmp_path)
    keeper = LedgerKeeper(0, None, run)
    keeper.open(None)  # a fresh run: a new, empty journal
    for step in range(3):
        keeper.committed(step, 0, local(step, [10 * step, 10 * step + 1], [0, 1]), meta([10 * step]))
    keeper.settle(2)
    state = keeper.state_dict()
    assert state["ledger"]["committed_step"] == 2 and state["ledger_rows"] == []
    keeper.close()
    keeper.close()  # idempotent
    assert read_ledger(run).columns()["sample_id"].tolist() == [0, 1, 10, 11, 20, 21]
    other = LedgerKeeper(1, None, run)
    other.open(None)  # only rank 0 writes it
    assert other.journal is None


# ---- resume -----------------------------------------------------------------------------------

def _checkpoint(tmp_path, step: int, epoch: int, ledger: dict) -> str:
    """A checkpoint directory holding only ``trainer.json`` as the trainer writes it."""
    path = tmp_path / "checkpoints" / f"step_{step:08d}"
    os.makedirs(path)
    with open(path / TRAINER_STATE, "w") as f:
        json.dump({"step": step, "epoch": epoch, "world_size": 2, "topology": "g1n2", **ledger}, f)
    return str(path)


def test_a_resume_hands_the_carried_rows_over_before_begin_run_and_keeps_what_is_not_taken(tmp_path):
    rows = rows_to_carry({1: ([10], [0], 0, 0), 2: ([20, 21], [0, 1], 0, 1)})
    path = _checkpoint(tmp_path, 2, 0, {"ledger": None, "ledger_rows": rows})  # as written before the keeper
    client = FakeClient(refuse={2})
    keeper = LedgerKeeper(0, client, str(tmp_path))
    keeper.load_state_dict(read_trainer_state(path, required=("step", "epoch", "ledger")))
    assert keeper.begin_run(2, (2,)) is TOPO
    assert client.calls[:3] == [("record", 1), ("record", 2), ("begin_run", 2, None)]
    assert sorted(client.rows) == [1]
    keeper.settle(3)  # step 2 still refused: the next checkpoint carries it on
    assert [r["step"] for r in keeper.state_dict()["ledger_rows"]] == [2]
    client.refuse.clear()
    keeper.flush()
    assert client.rows[2] == ([20, 21], [0, 1], 0) and client.experts == {1: 0, 2: 1}  # the expert travels too
    # Every rank skips the carried rows' samples for their epoch (the ledger has no journal here).
    assert LedgerKeeper(1, client, str(tmp_path)).trained_ids(0, None).size == 0
    other = LedgerKeeper(1, client, str(tmp_path))
    other.load_state_dict({"step": 2, "ledger": None, "ledger_rows": rows})
    assert other.begin_run(2, (2,)) is None and other.trained_ids(0, through_step=None).tolist() == [10, 20, 21]
    assert other.trained_ids(1, through_step=None).size == 0


def test_a_resume_with_the_coordinator_away_plans_locally_and_hands_the_rows_over_later(tmp_path):
    rows = rows_to_carry({4: ([40], [1], 1, 0)})
    client = FakeClient(away=True)
    keeper = LedgerKeeper(0, client, str(tmp_path))
    keeper.load_state_dict({"step": 4, "epoch": 1, "ledger": None, "ledger_rows": rows})
    assert keeper.begin_run(1, (1,)) is None  # the trainer then chooses the topology itself
    client.away = False
    keeper.flush()
    assert client.rows == {4: ([40], [1], 1)}


def test_begin_run_passes_the_checkpoints_step_and_position(tmp_path):
    position = {"ledger_id": 7, "records": 3, "committed_step": 5, "attempt": 0}
    client = FakeClient()
    keeper = LedgerKeeper(0, client, str(tmp_path))
    keeper.load_state_dict({"step": 5, "epoch": 0, "ledger": position})  # no ledger_rows: an older checkpoint
    assert keeper.carried == []
    keeper.begin_run(4, (2, 2))
    assert client.calls == [("begin_run", 5, position)]
    fresh = LedgerKeeper(0, client, str(tmp_path))
    fresh.begin_run(4, (2, 2))
    assert client.calls[-1] == ("begin_run", None, None)


def test_a_resumed_epoch_skips_the_journals_rows_up_to_the_checkpoint_and_the_carried_rows(tmp_path):
    run = str(tmp_path)
    first = LedgerKeeper(0, None, run)
    first.open(None)
    for step in range(4):
        first.committed(step, 0, local(step, [step], [0]), meta([step]))
        if step == 2:
            first.settle(2)
            saved = first.state_dict()
    first.close()
    path = _checkpoint(tmp_path, 2, 0, saved)
    resumed = LedgerKeeper(0, None, run)
    resumed.load_state_dict(read_trainer_state(path, required=("step", "epoch", "ledger")))
    resumed.open(path)  # checked against the checkpoint, then cut back to step 2
    assert resumed.trained_ids(0, through_step=2).tolist() == [0, 1, 2]
    resumed.committed(3, 0, local(3, [33], [0]), meta([33]))
    resumed.close()
    cols = read_ledger(run).columns()
    assert cols["sample_id"].tolist() == [0, 1, 2, 33] and cols["attempt"].tolist() == [0, 0, 0, 1]


# ---- the coordinator gone for good ------------------------------------------------------------

def test_rows_a_coordinator_gone_for_good_never_took_reach_the_journal_once_through_the_checkpoint(tmp_path):
    """The coordinator dies for good after taking step 0's rows: steps 1 and 2 (planned
    locally) travel in the last checkpoint, and the driver appends them to the journal
    (``take_over``); a second take-over adds nothing."""
    run = str(tmp_path)
    journal = LedgerKeeper(0, None, run)
    journal.open(None)  # the journal the coordinator wrote (step 0)
    journal.committed(0, 0, local(0, [1, 2], [0, 1]), meta([1]))
    journal.close()

    client = FakeClient()
    keeper = LedgerKeeper(0, client, run)
    keeper.committed(0, 0, COORDINATOR, meta([1]))
    client.away = True  # gone for good
    keeper.committed(1, 0, local(1, [3, 4], [0, 1]), meta([3]))
    keeper.resend([keeper.recent, {0: (0, [2])}])  # step 0 again: the journal has it
    keeper.committed(2, 0, local(2, [5, 6], [0, 1]), meta([5]))
    keeper.settle(2)
    saved = keeper.state_dict()
    assert saved["ledger"] is None and [r["step"] for r in saved["ledger_rows"]] == [0, 1, 2]
    with pytest.raises(CoordinatorUnavailable):
        keeper.finish(2)

    path = _checkpoint(tmp_path, 2, 0, saved)
    assert take_over(run, path) == [1, 2]  # step 0 is the journal's already
    assert take_over(run, path) == []
    cols = read_ledger(run).columns()
    assert cols["step"].tolist() == [0, 0, 1, 1, 2, 2] and cols["sample_id"].tolist() == [1, 2, 3, 4, 5, 6]
