"""The run's ledger as the trainer uses it: ``<run dir>/ledger/``, the coordinator's state
directory (``knapray.coordinator.ledger``: an append-only, fsync'd journal with compacted
snapshots, never pickle).

With a coordinator actor, the actor writes it. Without one (the torchrun launcher, or
``balance.coordinator: false``), rank 0 writes it through ``LocalLedger``: one journal
record per step committed after its optimizer step, a truncate record and a new attempt
when a run resumes from an earlier checkpoint. Every rank reads it read-only, to skip the
samples a resumed epoch already trained.
"""

from __future__ import annotations

import os

import numpy as np

from knapray.coordinator.ledger import Ledger
from knapray.coordinator.store import StateStore

from knapray.run_files import RunDir


def ledger_dir(run_dir: str) -> str:
    return RunDir(run_dir).ledger_dir


class LocalLedger:
    """The ledger's writer when there is no coordinator (rank 0)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    @classmethod
    def open(cls, run_dir: str, resume_step: int | None, position: dict | None = None,
             checkpoint: str = "") -> "LocalLedger":
        """A fresh run starts a new, empty ledger; a resumed one (``resume_step``: the last
        step its checkpoint covers, ``position``: the ledger position the checkpoint
        recorded) first checks the journal holds everything the checkpoint covers, then
        cuts everything after it and starts a new attempt."""
        ledger = Ledger(StateStore(ledger_dir(run_dir)))
        if resume_step is None:
            ledger.reset()
        else:
            check_covers(ledger, position, checkpoint, ledger_dir(run_dir))
            ledger.truncate(resume_step, ledger.attempt + 1)
        return cls(ledger)

    def append(self, step: int, epoch: int, sample_ids, home_ranks, expert: int = 0) -> None:
        self.ledger.add(step, epoch, sample_ids, home_ranks, expert)

    def position(self) -> dict:
        return self.ledger.position()

    def close(self) -> None:
        self.ledger.close()


class LedgerBehind(ValueError):
    """The run's ledger journal lacks steps its checkpoint covers; one line naming both."""


def check_covers(ledger: Ledger | None, position: dict | None, checkpoint: str, directory: str) -> None:
    """Raise ``LedgerBehind`` unless ``ledger`` holds everything the checkpoint at
    ``position`` covers: a resume from a journal that lost its tail would train the lost
    steps' samples again (or not at all) without a word. Every launcher checks it before
    workers start, and the ledger's writer again when it opens the journal."""
    if position is None:
        return  # the checkpoint was taken while its commit could not be confirmed: nothing to compare
    why = "the run has no ledger directory" if ledger is None else ledger.covers(position)
    if why is not None:
        raise LedgerBehind(
            f"ledger journal {directory} is behind checkpoint {checkpoint}: {why}; resuming would repeat or "
            "skip the samples of the lost steps, so the run stops (restore the journal, or start a new run "
            "under another run.name)")


def read_ledger(run_dir: str) -> Ledger | None:
    """The run's ledger, read-only; None if it has none."""
    directory = ledger_dir(run_dir)
    if not os.path.isdir(directory):
        return None
    return Ledger(StateStore(directory), writable=False)


def committed_ids(run_dir: str, epoch: int, through_step: int | None) -> np.ndarray:
    """Sorted ids the ledger has for ``epoch`` (up to ``through_step``): what a resumed
    epoch skips."""
    ledger = read_ledger(run_dir)
    if ledger is None:
        return np.zeros(0, np.int64)
    cols = ledger.columns()
    keep = cols["epoch"] == epoch
    if through_step is not None:
        keep &= cols["step"] <= through_step
    return np.unique(cols["sample_id"][keep])


def write_ledger_jsonl(run_dir: str, path: str) -> int:
    """``ledger.jsonl``: one JSON object per trained sample (step, sample_id, home_rank,
    attempt, epoch, expert); returns the number of rows (0 without a ledger, and no file)."""
    ledger = read_ledger(run_dir)
    return ledger.write_jsonl(path) if ledger is not None and ledger.rows else 0


def take_over(run_dir: str, checkpoint: str | None) -> list[int]:
    """The driver, at the end of a run whose coordinator is gone for good: the ledger rows
    ``checkpoint`` (the run's newest) carried because the coordinator could not take them
    (``StepPlanner.settle``), appended to the journal by this process (no other writes it
    any more); steps the journal holds already are left as they are. Returns the steps
    added."""
    from knapray.worker.checkpoint import read_trainer_state

    if checkpoint is None:
        return []
    rows = read_trainer_state(checkpoint).get("ledger_rows") or []
    if not rows:
        return []
    ledger = Ledger(StateStore(ledger_dir(run_dir)))
    try:
        return [int(r["step"]) for r in rows if ledger.add(int(r["step"]), int(r["epoch"]), r["sample_ids"],
                                                            r["home_ranks"], int(r.get("expert", 0)))]
    finally:
        ledger.close()


def unrecorded_steps(run_dir: str, trained_steps) -> list[int]:
    """Steps the run trained (``metrics.jsonl``'s) of which the ledger holds no row: their
    samples would be trained again by a resume, or never counted."""
    ledger = read_ledger(run_dir)
    recorded = np.unique(ledger.columns()["step"]) if ledger is not None else np.zeros(0, np.int64)
    if ledger is not None:
        ledger.close()
    trained = np.unique(np.asarray(list(trained_steps), dtype=np.int64))
    return [int(s) for s in np.setdiff1d(trained, recorded)]
