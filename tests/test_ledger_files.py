"""The ledger journal: one fsync'd line per committed step, truncate records on resume,
compacted snapshots, torn tails dropped, corruption named, nothing unpickled, and a
commit whose cost does not grow with the ledger."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from knapray.train import ledger_files
from knapray.train.ledger_files import LedgerError, LocalLedger, committed_ids, ledger_rows, read_ledger


def _fill(led: LocalLedger, steps, epoch=0, per_step=3):
    for step in steps:
        led.append(step, epoch, [step * 10 + i for i in range(per_step)], [i % 2 for i in range(per_step)])


def test_round_trip_epochs_and_committed_ids(tmp_path):
    led = LocalLedger.open(str(tmp_path), resume_step=None)
    _fill(led, range(3), epoch=0)
    _fill(led, range(3, 5), epoch=1)
    rows, attempt, _ = read_ledger(str(tmp_path))
    assert len(rows) == 15 and attempt == 0
    assert committed_ids(str(tmp_path), 0, None).tolist() == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    assert committed_ids(str(tmp_path), 1, through_step=3).tolist() == [30, 31, 32]
    assert ledger_rows(str(tmp_path))[3] == {"step": 1, "epoch": 0, "attempt": 0, "sample_id": 10, "home_rank": 0}


def test_resume_truncates_later_steps_and_starts_a_new_attempt(tmp_path):
    led = LocalLedger.open(str(tmp_path), resume_step=None)
    _fill(led, range(6))
    led.close()
    resumed = LocalLedger.open(str(tmp_path), resume_step=3)  # the checkpoint covers steps <= 3
    _fill(resumed, range(4, 6))
    rows, attempt, _ = read_ledger(str(tmp_path))
    assert attempt == 1 and sorted(set(rows.step.tolist())) == list(range(6))
    assert set(rows.attempt[rows.step >= 4].tolist()) == {1} and set(rows.attempt[rows.step <= 3].tolist()) == {0}
    assert len(rows) == 18  # each step once
    fresh = LocalLedger.open(str(tmp_path), resume_step=None)  # a fresh run forgets the old ledger
    assert len(fresh.rows) == 0 and len(read_ledger(str(tmp_path))[0]) == 0


def test_torn_last_line_is_dropped_and_a_corrupt_middle_line_is_named(tmp_path):
    led = LocalLedger.open(str(tmp_path), resume_step=None)
    _fill(led, range(4))
    led.close()
    journal = os.path.join(tmp_path, "ledger", "journal-000000.log")
    data = open(journal, "rb").read()
    with open(journal, "wb") as f:
        f.write(data[:-7])  # a crash in the middle of appending step 3
    rows, _, _ = read_ledger(str(tmp_path))
    assert sorted(set(rows.step.tolist())) == [0, 1, 2]
    lines = data.split(b"\n")
    lines[1] = lines[1].replace(b'"step":1', b'"step":7')  # bit rot in the middle
    with open(journal, "wb") as f:
        f.write(b"\n".join(lines))
    with pytest.raises(LedgerError, match=r"journal-000000.log: line 2 is corrupt"):
        read_ledger(str(tmp_path))


def test_snapshots_compact_and_replay(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_files, "SNAPSHOT_EVERY", 5)
    led = LocalLedger.open(str(tmp_path), resume_step=None)
    _fill(led, range(12))
    names = sorted(os.listdir(os.path.join(tmp_path, "ledger")))
    assert names == ["journal-000002.log", "snapshot-000002.npz"]  # older segments folded in
    rows, _, nxt = read_ledger(str(tmp_path))
    assert nxt == 3 and len(rows) == 36 and sorted(set(rows.step.tolist())) == list(range(12))
    assert led.position() == {"attempt": 0, "rows": 36, "last_step": 11, "segment": 2}


def test_a_planted_pickle_is_not_loaded(tmp_path):
    led = LocalLedger.open(str(tmp_path), resume_step=None)
    _fill(led, range(2))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    planted = os.path.join(tmp_path, "ledger", "snapshot-000009.npz")
    with open(planted, "wb") as f:
        np.savez(f, step=np.array([Evil()], dtype=object))
    with pytest.raises(LedgerError, match="snapshot-000009.npz: not a ledger snapshot"):
        read_ledger(str(tmp_path))
    assert not marker.exists()
    with open(planted, "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(LedgerError):
        read_ledger(str(tmp_path))
    assert not marker.exists()


def test_commit_cost_does_not_grow_with_the_ledger(tmp_path):
    small = LocalLedger.open(str(tmp_path / "a"), resume_step=None)
    big = LocalLedger(str(tmp_path / "b"), ledger_files.Rows(*(np.arange(2_000_000) for _ in range(5))), 0, 0)
    ids, homes = list(range(64)), [0] * 64
    assert small.append(2_000_001, 0, ids, homes) == big.append(2_000_001, 0, ids, homes)
