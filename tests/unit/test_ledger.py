"""The ledger's journal and snapshots (knapray/coordinator/ledger.py, store.py), the
coordinator's restore from its files, and ``knapray bench ledger``."""

from __future__ import annotations

import ast
import json
import logging
import os
import pathlib
import pickle
import shutil

import numpy as np
import pytest

from knapray.cli import main
from knapray.coordinator import BalanceCoordinator, Ledger, LedgerFileError, StateStore
from knapray.coordinator.store import COMMIT, MAGIC, Record

MODEL = dict(d_model=256, gamma=0.4)


def ids_of(step: int, n: int = 3) -> np.ndarray:
    return np.arange(100 * step, 100 * step + n, dtype=np.int64)


def commit(ledger: Ledger, step: int, epoch: int = 0, n: int = 3) -> None:
    ledger.stage(step, epoch, ids_of(step, n), np.arange(n) % 2)
    ledger.commit_through(step)


def open_ledger(path, **kw) -> Ledger:
    return Ledger(StateStore(str(path)), **kw)


def same(a: Ledger, b: Ledger) -> bool:
    ca, cb = a.columns(), b.columns()
    return (all(np.array_equal(ca[k], cb[k]) for k in ca) and a.position() == b.position()
            and a.cuts == b.cuts)


def segment_paths(path) -> list[str]:
    return [p for _, p in StateStore(str(path)).segments()]


# ---- journal ------------------------------------------------------------------------------------


def test_journal_round_trip_with_epochs_attempts_and_a_late_step(tmp_path):
    led = open_ledger(tmp_path)
    for t in range(3):
        commit(led, t, epoch=0)
    led.stage(4, 1, ids_of(4), [0, 1, 0])
    led.stage(5, 1, ids_of(5), [1, 1, 0])
    assert led.commit_through(5) == [4, 5]  # cumulative
    assert led.commit_through(5) == [] and led.records == 5  # idempotent: nothing written
    assert led.add(3, 0, ids_of(3), [0, 0, 1])  # planned elsewhere, recorded late
    assert not led.add(3, 0, ids_of(3), [0, 0, 1])  # a resend
    assert led.has_step(3) and not led.has_step(6)
    cols = led.columns()
    assert cols["step"].tolist() == [t for t in range(6) for _ in range(3)]  # by step
    assert cols["sample_id"].tolist() == np.concatenate([ids_of(t) for t in range(6)]).tolist()
    assert cols["epoch"].tolist() == [0] * 12 + [1] * 6
    assert led.epoch_sample_ids(1).tolist() == np.concatenate([ids_of(4), ids_of(5)]).tolist()
    assert led.committed_step == 5 and led.rows == 18
    led.close()
    again = open_ledger(tmp_path)
    assert same(led, again)


def test_commit_without_rows_moves_the_committed_step_durably(tmp_path):
    led = open_ledger(tmp_path)
    commit(led, 0)
    led.commit_through(3)  # steps 1..3 were planned locally: nothing staged here
    assert led.committed_step == 3 and led.rows == 3
    led.close()
    again = open_ledger(tmp_path)
    assert again.committed_step == 3
    assert again.add(2, 0, ids_of(2), [0, 1, 0])  # their rows may still arrive
    assert again.committed_step == 3


def test_truncate_is_a_record_and_new_rows_carry_the_new_attempt(tmp_path):
    led = open_ledger(tmp_path)
    for t in range(5):
        commit(led, t)
    pos = led.position()
    led.truncate(2, attempt=1)
    assert led.committed_step == 2 and led.attempt == 1 and led.rows == 9
    commit(led, 3, n=2)
    led.close()
    again = open_ledger(tmp_path)
    assert same(led, again)
    cols = again.columns()
    assert cols["step"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3]
    assert cols["attempt"].tolist() == [0] * 9 + [1, 1]
    assert again.cuts == [[5, 2]]
    # A checkpoint taken at step 4 is no longer covered: the ledger went back below it.
    assert "cut back to step 2" in again.covers(pos)
    assert again.covers(again.position()) is None


def test_torn_last_record_is_dropped_with_a_warning(tmp_path, caplog):
    led = open_ledger(tmp_path)
    for t in range(3):
        commit(led, t)
    led.close()
    path = segment_paths(tmp_path)[-1]
    full = pathlib.Path(path).read_bytes()
    record = (len(full) - len(MAGIC)) // 3
    for cut in (5, 12 + 7, record - 1):  # inside the frame, inside the payload, one byte short
        d = tmp_path / f"cut{cut}"
        shutil.copytree(tmp_path, d, ignore=shutil.ignore_patterns("cut*"))
        seg = segment_paths(d)[-1]
        pathlib.Path(seg).write_bytes(full[: len(full) - record + cut])
        with caplog.at_level(logging.WARNING, logger="knapray.coordinator"):
            caplog.clear()
            torn = open_ledger(d)
        assert torn.rows == 6 and not torn.has_step(2) and torn.records == 2
        assert any("torn last record" in m and seg in m for m in caplog.messages), caplog.messages
        commit(torn, 2, n=1)  # appends go after the last good record
        torn.close()
        again = open_ledger(d)
        assert again.rows == 7 and again.columns()["sample_id"].tolist()[-1] == 200
    # Zeros where the last record should be (a file extended, its data never written).
    pathlib.Path(path).write_bytes(full + bytes(40))
    assert open_ledger(tmp_path).rows == 9


def test_corrupt_middle_record_is_an_error_naming_file_and_offset(tmp_path):
    led = open_ledger(tmp_path)
    for t in range(3):
        commit(led, t)
    led.close()
    path = segment_paths(tmp_path)[-1]
    full = bytearray(pathlib.Path(path).read_bytes())
    record = (len(full) - len(MAGIC)) // 3
    second = len(MAGIC) + record
    payload = full.copy()
    payload[second + 12 + 20] ^= 0xFF  # a payload byte of record 1
    pathlib.Path(path).write_bytes(payload)
    with pytest.raises(LedgerFileError, match=rf"{path} is corrupt at byte offset {second}: payload checksum"):
        open_ledger(tmp_path)
    # A damaged length field must not pass for a torn tail (it would drop committed steps).
    length = full.copy()
    length[second + 3] ^= 0x40
    pathlib.Path(path).write_bytes(length)
    with pytest.raises(LedgerFileError, match=rf"offset {second}: frame checksum mismatch in record 1"):
        open_ledger(tmp_path)
    pathlib.Path(path).write_bytes(b"NOTAJRNL" + full[8:])
    with pytest.raises(LedgerFileError, match="not a knapray ledger journal"):
        open_ledger(tmp_path)


# ---- snapshots ----------------------------------------------------------------------------------


def test_snapshots_compact_the_journal_and_restore_replays_after_them(tmp_path, caplog):
    led = open_ledger(tmp_path, snapshot_every=3)
    for t in range(10):
        commit(led, t, epoch=t // 4)
    led.truncate(7, attempt=1)
    commit(led, 8)
    store = StateStore(str(tmp_path))
    snaps = [n for n, _ in store.snapshots()]
    assert snaps == [9, 12]  # the newest two; older snapshots and their journal are gone
    assert [n for n, _ in store.segments()] == [9, 12]
    led.close()
    again = open_ledger(tmp_path, snapshot_every=3)
    assert same(led, again) and again.rows == 27
    # A damaged newest snapshot: the older one plus more journal give the same ledger.
    newest = store.snapshots()[-1][1]
    data = bytearray(pathlib.Path(newest).read_bytes())
    data[len(data) // 2] ^= 0xFF
    pathlib.Path(newest).write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="knapray.coordinator"):
        fallback = open_ledger(tmp_path, snapshot_every=3)
    assert same(led, fallback)
    assert any("skipping a snapshot" in m and newest in m for m in caplog.messages)


def test_each_steps_expert_survives_the_journal_snapshots_and_a_cut(tmp_path):
    """A run of two experts: the expert of every step through commits (the steps of a
    cumulative commit each get theirs), ``add``, a snapshot, a restore and a truncate; a
    one-model run's records are written as before (no expert byte)."""
    led = open_ledger(tmp_path, snapshot_every=4)
    for t in range(3):
        led.stage(t, 0, ids_of(t), [0, 1, 0])
    led.commit_through(2, {0: 1, 1: 0, 2: 1})
    led.add(3, 0, ids_of(3), [0, 0, 1], expert=1)
    for t in range(4, 7):
        commit(led, t)  # expert 0 (no mapping)
    led.truncate(5, attempt=1)
    led.add(6, 0, ids_of(6), [0, 0, 0], expert=1)  # trained again, by the other expert
    want = {0: 1, 1: 0, 2: 1, 3: 1, 4: 0, 5: 0, 6: 1}
    cols = led.columns()
    assert dict(zip(cols["step"].tolist(), cols["expert"].tolist())) == want
    assert StateStore(str(tmp_path)).snapshots()  # a snapshot was taken on the way
    led.close()
    again = open_ledger(tmp_path, snapshot_every=4)
    assert same(led, again)
    with pytest.raises(ValueError, match="expert 256"):
        Record(COMMIT, 9, 0, 0, 9, ids_of(9), np.zeros(3, np.int32), 256).encode()
    plain = Record(COMMIT, 9, 0, 0, 9, ids_of(9), np.zeros(3, np.int32)).encode()
    tagged = Record(COMMIT, 9, 0, 0, 9, ids_of(9), np.zeros(3, np.int32), 1).encode()
    assert len(tagged) == len(plain) + 1 and Record.decode(tagged[12:]).expert == 1
    assert Record.decode(plain[12:]).expert == 0


def test_a_snapshot_of_format_1_reads_as_expert_0(tmp_path):
    """Snapshots written before the expert column (a (k, 4) step table) still restore."""
    led = open_ledger(tmp_path)
    for t in range(3):
        commit(led, t)
    led.snapshot()
    led.close()
    store = StateStore(str(tmp_path))
    n, path = store.snapshots()[-1]
    arrays = dict(np.load(path, allow_pickle=False))
    arrays["meta"][0] = 1
    arrays["steps"] = arrays["steps"][:, :4]
    os.remove(path)
    store.write_snapshot(n, arrays)
    again = open_ledger(tmp_path)
    assert again.rows == 9 and again.columns()["expert"].tolist() == [0] * 9
    assert np.array_equal(again.columns()["sample_id"], led.columns()["sample_id"])


def test_reset_starts_a_new_ledger_and_removes_the_old_files(tmp_path):
    led = open_ledger(tmp_path, snapshot_every=2)
    for t in range(5):
        commit(led, t)
    old = led.position()
    led.reset()
    assert led.rows == 0 and led.committed_step == -1 and led.attempt == 0
    assert "another ledger" in led.covers(old)
    store = StateStore(str(tmp_path))
    assert len(store.snapshots()) == 1 and len(store.segments()) == 1
    commit(led, 0)
    led.close()
    assert same(led, open_ledger(tmp_path))


# ---- no pickle ----------------------------------------------------------------------------------


class Planted:
    """Unpickling this creates a file: proof that something unpickled it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_no_module_of_the_coordinator_can_unpickle():
    root = pathlib.Path(__file__).resolve().parents[2] / "knapray" / "coordinator"
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any("pickle" in n for n in names), f"{path.name} imports pickle"
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load":
                kw = {k.arg: k.value for k in node.keywords}
                assert isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is False, (
                    f"{path.name}:{node.lineno} loads without allow_pickle=False"
                )


def test_planted_pickles_are_never_loaded(tmp_path, caplog):
    marker = tmp_path / "was-unpickled"
    state_dir = tmp_path / "coordinator"
    coord = BalanceCoordinator(world_size=2, topology="g1n2", state_dir=str(state_dir), **MODEL)
    coord.begin_run(2)
    coord.close()
    # A pickle named like a snapshot is skipped (np.load refuses it); the real one is used.
    planted_snapshot = state_dir / "snapshot-999999999999.npz"
    planted_snapshot.write_bytes(pickle.dumps(Planted(str(marker))))
    with caplog.at_level(logging.WARNING, logger="knapray.coordinator"):
        BalanceCoordinator(topology="g1n2", state_dir=str(state_dir), **MODEL).close()
    assert any("skipping a snapshot" in m and "pickled" in m for m in caplog.messages), caplog.messages
    planted_snapshot.unlink()
    # A pickle named like the run state is a clear error, not code that runs.
    (state_dir / "run.json").write_bytes(pickle.dumps(Planted(str(marker))))
    with pytest.raises(LedgerFileError, match=r"coordinator file .*run\.json is not JSON"):
        BalanceCoordinator(topology="g1n2", state_dir=str(state_dir), **MODEL)
    assert not marker.exists()


# ---- the coordinator on its files ---------------------------------------------------------------


def submit_step(coord: BalanceCoordinator, step: int, epoch: int | None = None) -> None:
    for r in range(coord.world_size):
        coord.submit(step, r, [64 * (1 + (step + r) % 5)] * 2, [1000 * step + 10 * r, 1000 * step + 10 * r + 1],
                     epoch=epoch)


def test_restart_restores_in_flight_steps_so_the_next_commit_covers_them(tmp_path):
    d = str(tmp_path / "c")
    coord = BalanceCoordinator(topology="g1n2", state_dir=d, **MODEL)
    coord.begin_run(2)
    for t in range(3):
        submit_step(coord, t)
    coord.commit_step(0)
    coord.close()  # the actor dies before commit_step(2) reaches it
    restarted = BalanceCoordinator(topology="g1n2", state_dir=d, **MODEL)
    assert restarted.world_size == 2 and restarted.committed_step == 0
    assert sorted(restarted.ledger.staged()) == [1, 2]
    submit_step(restarted, 3)  # the ranks go on
    restarted.commit_step(3)
    ids = [row[1] for row in restarted.ledger_rows()]
    assert sorted(ids) == sorted(1000 * t + 10 * r + k for t in range(4) for r in range(2) for k in range(2))


def test_a_crash_between_the_records_of_one_commit_loses_no_step(tmp_path):
    d = tmp_path / "c"
    coord = BalanceCoordinator(topology="g1n2", state_dir=str(d), **MODEL)
    coord.begin_run(2)
    for t in range(2):
        submit_step(coord, t)
    seg = segment_paths(d)[-1]
    size = os.path.getsize(seg)
    coord.commit_step(1)  # one record per step: 0, then 1
    coord.close()
    with open(seg, "r+b") as f:  # the actor died after writing step 0's record
        f.truncate(size + (os.path.getsize(seg) - size) // 2)
    restarted = BalanceCoordinator(topology="g1n2", state_dir=str(d), **MODEL)
    assert restarted.committed_step == 0 and sorted(restarted.ledger.staged()) == [1]
    restarted.commit_step(1)  # the loop's next (cumulative) commit
    assert sorted(r[1] for r in restarted.ledger_rows()) == [0, 1, 10, 11, 1000, 1001, 1010, 1011]


def test_epoch_state_survives_a_restart(tmp_path):
    d = str(tmp_path / "c")
    coord = BalanceCoordinator(topology="g1n2", state_dir=d, **MODEL)
    coord.begin_run(2)
    submit_step(coord, 0, epoch=0)
    coord.commit_step(0)
    for r in range(2):
        coord.submit(1, r, [], [], exhausted=True, epoch=0)
    assert coord.epoch == 1
    submit_step(coord, 2, epoch=1)
    coord.commit_step(2)
    stats = coord.stats()
    coord.close()
    restarted = BalanceCoordinator(topology="g1n2", state_dir=d, **MODEL)
    assert restarted.epoch == 1 and restarted.state_dict()["epoch_ends"] == {0: 1}
    assert restarted.epoch_sample_ids(1).tolist() == [2000, 2001, 2010, 2011]
    assert restarted.ledger_columns()["epoch"].tolist() == [0] * 4 + [1] * 4
    restarted.submit(3, 0, [], [], exhausted=True, epoch=0)  # a stale prefetch is still recognized
    assert restarted.stats()["stale_submissions"] == 1
    # Statistics are restored as of their last save (the run start here).
    assert restarted.stats()["steps_planned"] == 0 and stats["steps_planned"] == 2


def test_run_state_written_before_a_cut_is_not_trusted_after_it(tmp_path):
    d = tmp_path / "c"
    coord = BalanceCoordinator(topology="g1n2", state_dir=str(d), **MODEL)
    coord.begin_run(2)
    for t in range(3):
        submit_step(coord, t)
    coord.commit_step(0)
    before = (d / "run.json").read_bytes()  # steps 1, 2 in flight
    coord.truncate(0)
    coord.close()
    (d / "run.json").write_bytes(before)  # a crash between the truncate record and run.json
    restarted = BalanceCoordinator(topology="g1n2", state_dir=str(d), **MODEL)
    assert restarted.ledger.staged() == {} and restarted.attempt == 1 and restarted.committed_step == 0


def test_resume_from_a_checkpoint_the_ledger_does_not_hold_is_logged(tmp_path, caplog):
    coord = BalanceCoordinator(topology="g1n2", state_dir=str(tmp_path / "c"), **MODEL)
    coord.begin_run(2)
    for t in range(3):
        submit_step(coord, t)
        coord.commit_step(t)
    ckpt = coord.state_dict()
    assert set(ckpt) == {"version", "ledger_id", "records", "committed_step", "attempt", "epoch", "epoch_ends"}
    lost = BalanceCoordinator(topology="g1n2", **MODEL)  # its files are gone
    with caplog.at_level(logging.ERROR, logger="knapray.coordinator"):
        lost.begin_run(2, resume_step=2, state=ckpt)
    assert any("misses rows the checkpoint at step 2 covers" in m for m in caplog.messages)
    assert lost.committed_step == 2 and lost.attempt == 1 and lost.ledger_rows() == []


def test_a_checkpoint_of_another_state_version_is_refused():
    coord = BalanceCoordinator(topology="g1n2", **MODEL)
    old = {"version": 1, "epoch": 1, "attempt": 2, "committed_step": 4, "epoch_ends": {0: 2}, "ledger": {}}
    with pytest.raises(ValueError, match="coordinator state version 1 is not supported \\(expected 2\\)"):
        coord.begin_run(2, resume_step=4, state=old)


def test_write_ledger_jsonl(tmp_path):
    coord = BalanceCoordinator(topology="g1n2", **MODEL)
    coord.begin_run(2)
    for t in range(2):
        submit_step(coord, t)
    coord.commit_step(1, {1: 1})  # step 1 trained by a second expert (a run of two experts)
    path = tmp_path / "ledger.jsonl"
    assert coord.write_ledger_jsonl(str(path)) == 8
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [tuple(r.values()) for r in rows] == [row + (0, row[0]) for row in coord.ledger_rows()]
    assert list(rows[0]) == ["step", "sample_id", "home_rank", "attempt", "epoch", "expert"]


# ---- the benchmark ------------------------------------------------------------------------------


def test_bench_ledger_cost_per_step_does_not_grow_with_the_ledger(capsys):
    assert main(["bench", "ledger", "--sizes", "1000,300000", "--steps", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    small, big = out["sizes"]
    assert (small["rows"], big["rows"]) == (1000, 300000)
    assert small["bytes_per_step"] == big["bytes_per_step"] > 256 * 12  # one record of 256 rows, + run.json
    # 300x the rows; a cost that grew with them would be far over this (medians of fsync'd appends).
    assert big["commit_ms"] < 5 * max(small["commit_ms"], 1.0), out
    with pytest.raises(SystemExit):
        main(["bench", "ledger", "--sizes", "10,x"])
