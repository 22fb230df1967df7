"""The trainer's ledger without a coordinator: rank 0 writes the coordinator's journal
format; a resume cuts later steps and starts a new attempt; readers never touch the files."""

from __future__ import annotations

import os

from knapray.worker.ledger_files import LocalLedger, committed_ids, ledger_dir, read_ledger, write_ledger_jsonl


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


def _journal_behind(tmp_path, lost: int) -> tuple[str, dict, list[int]]:
    """A ledger of 4 committed steps whose journal then loses its last ``lost`` records:
    (run dir, the position a checkpoint after step 3 recorded, journal sizes after each record)."""
    run = str(tmp_path)
    led = LocalLedger.open(run, resume_step=None)
    journal = next(os.path.join(ledger_dir(run), n) for n in os.listdir(ledger_dir(run)) if n.startswith("journal-"))
    sizes = [os.path.getsize(journal)]
    for step in range(4):
        _fill(led, [step])
        sizes.append(os.path.getsize(journal))
    position = led.position()
    led.close()
    os.truncate(journal, sizes[4 - lost])
    return run, position, sizes


def test_a_journal_behind_its_checkpoint_stops_the_resume_naming_both(tmp_path):
    import pytest

    from knapray.worker.ledger_files import LedgerBehind

    run, position, _ = _journal_behind(tmp_path, lost=2)
    with pytest.raises(LedgerBehind) as err:
        LocalLedger.open(run, resume_step=3, position=position, checkpoint="ck/step-000000003")
    msg = str(err.value)
    assert "\n" not in msg and ledger_dir(run) in msg and "ck/step-000000003" in msg and "tail was lost" in msg
    assert read_ledger(run).rows == 6  # the refused resume left the journal as it was


def test_a_whole_journal_resumes(tmp_path):
    run, position, _ = _journal_behind(tmp_path, lost=0)
    led = LocalLedger.open(run, resume_step=3, position=position, checkpoint="ck")
    led.close()
    assert read_ledger(run).rows == 12


def test_preflight_refuses_a_resume_whose_journal_lost_its_tail(tmp_path):
    """The launchers' pre-flight (``decide_start``) compares the checkpoint's ledger position
    with the journal, so the run stops before any worker starts, with or without a coordinator."""
    import pytest

    from knapray.config.run import load_config
    from knapray.driver.run_dir import RunError, decide_start, write_config
    import torch

    from knapray.worker.checkpoint import Checkpointer, JsonState, training_parts

    cfg = load_config(None, [f"run.storage={tmp_path}", "run.name=r"])
    run, position, _sizes = _journal_behind(tmp_path / "r", lost=2)
    write_config(cfg)
    model = torch.nn.Linear(2, 2)
    ck = Checkpointer(os.path.join(run, "checkpoints"), rank=0, group=None,
                      parts=training_parts(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                      state=JsonState({"epoch": 0, "world_size": 1, "topology": "g1n1", "ledger": position}),
                      ).save(3, barrier=lambda: None)
    with pytest.raises(RunError) as err:
        decide_start(cfg, [ck])
    assert "ledger journal" in str(err.value) and ck in str(err.value)


def test_steps_trained_without_ledger_rows_are_named_in_one_line(tmp_path):
    from knapray.coordinator.ledger import Ledger
    from knapray.coordinator.store import StateStore
    from knapray.worker.ledger_files import ledger_dir, unrecorded_steps
    from knapray.driver.report import ledger_line

    ledger = Ledger(StateStore(ledger_dir(str(tmp_path))))
    for step in (0, 1, 3):
        ledger.add(step, 0, [10 * step, 10 * step + 1], [0, 1])
    ledger.close()
    assert unrecorded_steps(str(tmp_path), [0, 1, 2, 3, 4]) == [2, 4]
    assert unrecorded_steps(str(tmp_path / "none"), [0]) == [0]
    line = ledger_line({"ledger_missing_steps": [2, 4]})
    assert "\n" not in line and line.startswith("the ledger has no rows of 2 trained step(s) (2, 4)")
    assert ledger_line({"ledger_missing_steps": []}) is None and ledger_line({}) is None


def test_an_environment_setting_lasts_for_its_call_only(monkeypatch):
    import os

    from knapray.driver.launch import scoped_env

    monkeypatch.delenv("KNAPRAY_TEST_SCOPED", raising=False)
    with scoped_env("KNAPRAY_TEST_SCOPED", "10"):
        assert os.environ["KNAPRAY_TEST_SCOPED"] == "10"
    assert "KNAPRAY_TEST_SCOPED" not in os.environ
    monkeypatch.setenv("KNAPRAY_TEST_SCOPED", "30")
    with scoped_env("KNAPRAY_TEST_SCOPED", "10"):
        pass
    with scoped_env("KNAPRAY_TEST_SCOPED", None):
        assert os.environ["KNAPRAY_TEST_SCOPED"] == "30"
    assert os.environ["KNAPRAY_TEST_SCOPED"] == "30"
