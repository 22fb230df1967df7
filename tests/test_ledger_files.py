"""The trainer's ledger without a coordinator: rank 0 writes the coordinator's journal
format; a resume cuts later steps and starts a new attempt; readers never touch the files."""

from __future__ import annotations

import os

from knapray.train.ledger_files import LocalLedger, committed_ids, ledger_dir, read_ledger, write_ledger_jsonl


def _fill(led: LocalLedger, steps, epoch=0):
    for step in steps:
        led.append(step, epoch, [step * 10 + i for i in range(3)], [0, 1, 0])


def test_resume_cuts_later_steps_and_skips_only_what_the_checkpoint_covers(tmp_path):
    run = str(tmp_path)
    led = LocalLedger.open(run, resume_step=None)
    _fill(led, range(3), epoch=0)
    _fill(led, range(3, 6), epoch=1)
    led.close()
    assert committed_ids(run, 1, through_step=4).tolist() == [30, 31, 32, 40, 41, 42]
    resumed = LocalLedger.open(run, resume_step=3)  # the checkpoint covers steps <= 3
    _fill(resumed, range(4, 6), epoch=1)
    resumed.close()
    cols = read_ledger(run).columns()
    assert sorted(set(cols["step"].tolist())) == list(range(6)) and cols["step"].size == 18  # each step once
    assert set(cols["attempt"][cols["step"] >= 4].tolist()) == {1}
    assert set(cols["attempt"][cols["step"] <= 3].tolist()) == {0}
    assert write_ledger_jsonl(run, str(tmp_path / "ledger.jsonl")) == 18


def test_a_reader_leaves_the_files_alone(tmp_path):
    run = str(tmp_path)
    led = LocalLedger.open(run, resume_step=None)
    _fill(led, range(2))
    before = {n: os.path.getsize(os.path.join(ledger_dir(run), n)) for n in os.listdir(ledger_dir(run))}
    for _ in range(3):
        assert read_ledger(run).rows == 6
    after = {n: os.path.getsize(os.path.join(ledger_dir(run), n)) for n in os.listdir(ledger_dir(run))}
    assert before == after
    _fill(led, [2])  # the writer goes on after readers looked
    assert read_ledger(run).rows == 9
    assert read_ledger(str(tmp_path / "nowhere")) is None and committed_ids(str(tmp_path / "nowhere"), 0, None).size == 0
