"""The sample ledger on the worker side: which samples every trained step took.

The run's ledger is the coordinator's (``knapray.coordinator.ledger``); a worker tells it
what was trained and loses nothing while it is away. ``LedgerKeeper`` does all of that
for one rank, and nothing else does:

- after each optimizer step, ``committed``: every rank remembers the step's sample ids
  (a restarted coordinator may have dropped steps it was told of: the next locally planned
  step re-sends them, ``resend``); rank 0 commits the step to the coordinator, or, for a
  step planned locally, keeps its rows until the coordinator takes them (``flush``), or,
  without a coordinator, appends them to the run's own journal (``LocalLedger``);
- before a checkpoint, ``settle``: rank 0 hands over every row the coordinator takes now
  and commits the checkpoint's step, so the position the checkpoint records covers every
  step it does; rows the coordinator cannot take travel in the checkpoint instead
  (``ledger_rows``), and if it is gone for good the driver appends them to the journal
  (``ledger_files.take_over``);
- on a resume, the checkpoint's position and carried rows (``load_state_dict``): rank 0
  hands the carried rows over before ``begin_run`` cuts the ledger back and keeps those the
  coordinator did not take; every rank skips the samples the ledger and the carried rows
  hold for the epoch (``trained_ids``).

The decisions on rows are plain functions (``rows_to_carry``, ``pending_of``,
``lost_rows``, ``carried_ids``); the keeper only calls the client and the journal.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from knapray.coordinator import CoordinatorClient, CoordinatorUnavailable
from knapray.data import StepMeta
from knapray.planning import Topology

from knapray.worker.ledger_files import LocalLedger, committed_ids

logger = logging.getLogger(__name__)

RECENT_STEPS = 32
"""Steps whose sample ids each rank keeps, to re-record steps a lost coordinator dropped."""

class PlannedStep(Protocol):
    """What the keeper reads of a step's plan (``step_planner.Planned``)."""

    planned_by: str
    """``coordinator`` or ``local``."""
    rows: tuple[list[int], list[int]] | None
    """(sample ids, home ranks) of a locally planned step's samples, on rank 0."""


Row = tuple[list[int], list[int], int, int]
"""One step's ledger row as rank 0 holds it: (sample ids, home ranks, epoch, expert)."""

Recent = dict[int, tuple[int, list[int]]]
"""One rank's recent steps: step -> (epoch, this rank's sample ids)."""


# ---- decisions on rows (pure) ----------------------------------------------------------------

def rows_to_carry(pending: dict[int, Row]) -> list[dict]:
    """``ledger_rows`` of a checkpoint: the rows the coordinator has not taken, by step,
    as JSON data (``checkpoint.read_trainer_state`` checks them on read)."""
    return [{"step": int(t), "epoch": int(e), "sample_ids": [int(i) for i in ids], "home_ranks": [int(h) for h in home],
             "expert": int(x)} for t, (ids, home, e, x) in sorted(pending.items())]


def pending_of(rows: list[dict]) -> dict[int, Row]:
    """Carried ``ledger_rows`` back as rows to hand over (the first of a step wins)."""
    pending: dict[int, Row] = {}
    for r in rows:
        pending.setdefault(int(r["step"]), (list(r["sample_ids"]), list(r["home_ranks"]), int(r["epoch"]),
                                            int(r.get("expert", 0))))
    return pending


def lost_rows(recents: list[Recent], experts: dict[int, int] | None = None) -> dict[int, Row]:
    """Rows of the steps any rank still remembers (``recents``: every rank's, in rank
    order), which a lost coordinator may never have committed: the ids in rank order, each
    with its home rank, the epoch of the first rank that has the step, and its expert
    (``experts``: step -> expert, rank 0's; 0 where not there)."""
    steps = sorted(set().union(*recents))
    experts = experts or {}
    return {t: ([sid for r in recents for sid in r.get(t, (None, ()))[1]],
                [rank for rank, r in enumerate(recents) for _ in r.get(t, (None, ()))[1]],
                next(r[t][0] for r in recents if t in r), experts.get(t, 0))
            for t in steps}


def carried_ids(rows: list[dict], epoch: int) -> np.ndarray:
    """Ids of carried rows of ``epoch`` (sorted, unique): trained, though the ledger may not
    have them yet."""
    return np.unique(np.asarray([i for r in rows if r["epoch"] == epoch for i in r["sample_ids"]], dtype=np.int64))


def hand_over(client: CoordinatorClient, rows: list[dict]) -> list[dict]:
    """Rank 0 of a resumed run, before ``begin_run`` cuts the ledger back: the rows its
    checkpoint carried, recorded with the attempt that trained them (resends of rows the
    coordinator has are ignored). Returns those it did not take (it is away): the keeper
    keeps trying (``flush``)."""
    for i, r in enumerate(rows):
        try:
            client.record_external(r["step"], r["sample_ids"], r["home_ranks"], r["epoch"], r.get("expert", 0))
        except CoordinatorUnavailable:
            return rows[i:]
    return []


# ---- the keeper --------------------------------------------------------------------------------

class LedgerKeeper:
    """One rank's side of the run's sample ledger (see the module docstring).

    ``client``: the coordinator's, or None (rank 0 then writes the journal itself).
    ``run_dir``: the run's directory (its journal, read to skip trained samples)."""

    def __init__(self, rank: int, client: CoordinatorClient | None, run_dir: str) -> None:
        self.rank, self.client, self.run_dir = rank, client, run_dir
        self.journal: LocalLedger | None = None
        """Rank 0's ledger journal when there is no coordinator (``open``)."""
        self.resume_step: int | None = None
        self.resumed_position: dict | None = None
        """Where the ledger stood at the checkpoint resumed from (the coordinator checks it)."""
        self.carried: list[dict] = []
        """Ledger rows of locally planned steps the checkpoint resumed from covers but the
        coordinator had not taken when it was written (``settle``)."""
        self.recent: Recent = {}
        """This rank's recent steps (a lost coordinator drops commits): each local plan's
        all-gather carries them (``resend``)."""
        self.experts: dict[int, int] = {}
        """The expert that trained each recent step (``recent``'s steps; a run of two
        experts): every commit carries them, so a commit that covers a lost one records its
        steps' experts too."""
        self._pending: dict[int, Row] = {}
        """Rank 0: rows of locally planned steps the coordinator has not taken yet (and of
        steps a lost coordinator may have dropped)."""
        self._to_save: tuple[dict | None, list[dict]] = (None, [])
        """(ledger position, carried rows) for the checkpoint being written (``settle``)."""

    # ---- resume ------------------------------------------------------------------------------

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's part of the ledger (``trainer.json``): its step, its position
        (``ledger``) and the rows it carried (``ledger_rows``)."""
        self.resume_step = int(state["step"])
        self.resumed_position = state.get("ledger")
        self.carried = state.get("ledger_rows") or []

    def state_dict(self) -> dict:
        """The checkpoint's ``ledger`` (position, or None) and ``ledger_rows`` (``settle``)."""
        position, rows = self._to_save
        return {"ledger": position, "ledger_rows": rows}

    def open(self, checkpoint: str | None) -> None:
        """Rank 0 without a coordinator: the run's journal (a fresh run's new and empty; a
        resumed one's checked against ``checkpoint``, then cut back to it)."""
        if self.client is None and self.rank == 0:
            self.journal = LocalLedger.open(self.run_dir, resume_step=self.resume_step,
                                            position=self.resumed_position, checkpoint=checkpoint or "")

    def begin_run(self, world: int, node_sizes: tuple[int, ...]) -> Topology | None:
        """Rank 0 with a coordinator: hand it the carried rows, then start its run (it cuts
        the ledger back to the resumed checkpoint and answers with the topology for this
        world); rows it did not take are handed over as soon as it takes them. None when it
        does not answer, or without one (or off rank 0)."""
        if self.rank != 0 or self.client is None:
            return None
        left = self.carried
        try:
            left = hand_over(self.client, self.carried)
            topo = self.client.begin_run(world, resume_step=self.resume_step, state=self.resumed_position,
                                         node_sizes=node_sizes)
        except CoordinatorUnavailable:
            topo = None
        for t, row in pending_of(left).items():
            self._pending.setdefault(t, row)
        self.flush()
        return topo

    def trained_ids(self, epoch: int, through_step: int | None) -> np.ndarray:
        """Sorted ids ``epoch`` trained already: the ledger's (up to ``through_step``, the
        step resumed from; none when the epoch was not resumed) and the carried rows' (the
        coordinator may not have them yet)."""
        done = committed_ids(self.run_dir, epoch, through_step=through_step) if through_step is not None \
            else np.zeros(0, dtype=np.int64)
        return np.union1d(done, carried_ids(self.carried, epoch))

    # ---- per step ----------------------------------------------------------------------------

    def committed(self, step: int, epoch: int, planned: PlannedStep, this: StepMeta, expert: int = 0) -> None:
        """After the optimizer step that trained ``step`` (in ``epoch``, by ``expert``)."""
        self.recent[step] = (int(epoch), [int(i) for i in this.sample_ids])
        self.experts[step] = int(expert)
        if len(self.recent) > RECENT_STEPS:
            self.recent.pop(min(self.recent))
        while len(self.experts) > RECENT_STEPS:
            self.experts.pop(min(self.experts))
        if self.rank != 0:
            return
        if self.client is None:
            assert planned.rows is not None and self.journal is not None
            self.journal.append(step, epoch, *planned.rows, expert)
        elif planned.planned_by == "coordinator":
            self.client.commit_async(step, self._experts())
        else:
            assert planned.rows is not None
            self._pending[step] = (*planned.rows, epoch, int(expert))

    def _experts(self) -> dict[int, int] | None:
        """What a commit carries of ``experts``: None when every recent step was expert 0's
        (a run of one model sends nothing more than before)."""
        return dict(self.experts) if any(self.experts.values()) else None

    def resend(self, recents: list[Recent]) -> None:
        """Rank 0 with a coordinator, at a locally planned step (``recents``: every rank's
        ``recent``, gathered): the steps the lost coordinator may never have committed, to
        hand over with that step's rows (it ignores rows of steps it has)."""
        if self.rank == 0 and self.client is not None:
            for t, row in lost_rows(recents, self.experts).items():
                self._pending.setdefault(t, row)

    def flush(self) -> None:
        """Rank 0: hand the coordinator the rows it has not taken, in step order, until it
        does not answer (then again later)."""
        for t in sorted(self._pending):
            try:
                self.client.record_external(t, *self._pending[t])
            except CoordinatorUnavailable:
                return  # still away: try again after the next step
            del self._pending[t]

    # ---- checkpoints and the end -----------------------------------------------------------

    def settle(self, step: int) -> None:
        """Rank 0, before the checkpoint at ``step``: what it records (``state_dict``). With a
        coordinator, every pending row it takes now is handed over; if none is left, a commit
        of ``step`` covers every step the checkpoint does and the position is the
        coordinator's; else the checkpoint carries the rows and no position, and the resume
        hands them over, so a group lost right after the checkpoint loses no rows. Without
        one, the journal's position."""
        position, carried = None, []
        if self.rank == 0:
            if self.client is not None:
                self.flush()
                carried = rows_to_carry(self._pending)
                if carried:
                    logger.warning("checkpoint at step %d: the coordinator has not taken the rows of locally "
                                   "planned steps %s; the checkpoint carries them", step, [r["step"] for r in carried])
                else:
                    try:
                        self.client.commit(step, self._experts())
                        position = self.client.state_dict()  # a few numbers: the ledger's position
                    except CoordinatorUnavailable as e:
                        logger.warning("checkpoint at step %d: coordinator commit not confirmed (%s)", step, e)
            elif self.journal is not None:
                position = self.journal.position()
        self._to_save = (position, carried)

    def finish(self, last_step: int | None) -> None:
        """Rank 0 at the end of the run: hand over what is pending and commit the last step
        (``CoordinatorUnavailable`` if rows are left)."""
        if self.rank != 0 or self.client is None:
            return
        self.flush()
        if self._pending:
            raise CoordinatorUnavailable(f"ledger rows of steps {sorted(self._pending)} could not be handed over")
        if last_step is not None:
            self.client.commit(last_step, self._experts())

    def close(self) -> None:
        """Close the journal (idempotent)."""
        if self.journal is not None:
            self.journal.close()
            self.journal = None
