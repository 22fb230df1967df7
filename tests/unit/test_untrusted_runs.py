"""A run directory is untrusted input (issue 43, item 10): a run directory that is itself a
symbolic link, or a linked file in it, is refused in one line before anything is read or
written; no error message quotes what a file holds; every number read from a run file is
range-checked (trainer.json, RUNNING.lock); a checkpoint whose files disagree (its trainer
state against its directory's step and its ledger's committed step) is refused in one line;
a storage folder inside Ray's upload folder is refused."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from dist_utils import build_tiny_corpus
from knapray.cli import main
from knapray.config.run import load_config
from knapray.driver.run_dir import (RUN_FORMAT, RunError, RunLock, check_resumable, check_writable, read_run_config,
                                    resolve_paths, write_config)
from knapray.worker.checkpoint import Checkpointer, CheckpointError, JsonState, RUN_STATE, read_trainer_state, \
    training_parts
from knapray.worker.ledger_files import LocalLedger

REPO = Path(__file__).resolve().parents[2]
SECRET = "SECRET-7d1f0c"
"""What a file outside the run directory holds; no message may show it."""
SETS = ["model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[2,2,4]", "model.depth_double=1",
        "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16", "data.samples_per_step=1",
        "balance.topology=g1n2", "scaling.num_workers=2", "run.name=r", "parallel.precision=fp32"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"), "g2b2i64f1s0", steps=2)


def _argv(corpus: str, storage, *extra: str) -> list[str]:
    out = ["train", "--config", str(REPO / "jobs/configs/demo.yaml")]
    for s in [*SETS, f"data.corpus={corpus}", f"run.storage={storage}", *extra]:
        out += ["--set", s]
    return out


def _main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _one_line(code: int, err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err[-3000:])
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert SECRET not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def run_dir(corpus, tmp_path_factory):
    """config.json, a ledger journal of steps 0..2 and a checkpoint at step 2 whose
    trainer.json records the journal's position (committed step 2)."""
    storage = tmp_path_factory.mktemp("runs")
    cfg = resolve_paths(load_config(str(REPO / "jobs/configs/demo.yaml"),
                                    [*SETS, f"data.corpus={corpus}", f"run.storage={storage}"]))
    write_config(cfg)
    ledger = LocalLedger.open(cfg.run_dir, None)
    for step in range(3):
        ledger.append(step, 0, [2 * step, 2 * step + 1], [0, 1])
    position = ledger.position()
    ledger.close()
    model = torch.nn.Linear(2, 2)
    Checkpointer(os.path.join(cfg.run_dir, "checkpoints"), rank=0, group=None,
                 parts=training_parts(model, torch.optim.AdamW(model.parameters())),
                 state=JsonState({"epoch": 0, "world_size": 2, "topology": "g1n2", "ledger": position})).save(
        2, barrier=lambda: None)
    return cfg.run_dir


@pytest.fixture
def run_copy(run_dir, tmp_path):
    """A copy of ``run_dir`` under this test's storage, and the argv that resumes it (--check)."""
    copy = tmp_path / "runs" / "r"
    shutil.copytree(run_dir, copy)
    saved = json.loads((copy / "config.json").read_text())
    saved["run"]["storage"] = str(tmp_path / "runs")
    (copy / "config.json").write_text(json.dumps(saved))
    return copy, _argv(saved["data"]["corpus"], tmp_path / "runs") + ["--check"]


# ---- links -----------------------------------------------------------------------------------


def test_a_run_directory_that_is_a_link_is_refused_before_anything_is_read(run_dir, corpus, tmp_path, capsys):
    """runs/r -> a full run directory elsewhere: neither --check nor a run uses it, and
    nothing there changes."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run_dir, elsewhere)
    (elsewhere / "metrics.jsonl").write_text('{"step": 0, "epoch": 0}\n')
    before = {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(RunError, match="symbolic link"):
        check_writable(str(tmp_path / "runs" / "r"))
    for extra in (["--check"], []):
        code, err = _main(_argv(corpus, tmp_path / "runs", *[]) + extra, capsys)
        _one_line(code, err, str(tmp_path / "runs" / "r"), "symbolic link")
    assert {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()} == before


def test_sample_and_export_refuse_a_linked_config_json_without_quoting_it(run_copy, tmp_path, capsys):
    run, _ = run_copy
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"format_version": RUN_FORMAT, "model": SECRET}))
    (run / "config.json").unlink()
    (run / "config.json").symlink_to(outside)
    with pytest.raises(RunError) as e:
        read_run_config(str(run))
    assert "symbolic link" in str(e.value) and SECRET not in str(e.value), e.value
    for argv in (["export", "--run", str(run), "--out", str(tmp_path / "out")],
                 ["sample", "--run", str(run), "--like", "0", "--out", str(tmp_path / "grid.png")]):
        code, err = _main(argv, capsys)
        _one_line(code, err, "config.json", "symbolic link")
    assert not (tmp_path / "out").exists() and not (tmp_path / "grid.png").exists()


@pytest.mark.parametrize("doc", [
    {"format_version": RUN_FORMAT, "model": SECRET},
    {"format_version": SECRET},
    {"format_version": RUN_FORMAT, "model": {"hidden_size": SECRET}},
    {"format_version": RUN_FORMAT, "run": {"name": SECRET + "/.."}},
], ids=["section", "format_version", "a value", "run.name"])
def test_no_message_about_a_config_json_quotes_what_it_holds(doc, run_copy, capsys):
    run, argv = run_copy
    (run / "config.json").write_text(json.dumps(doc))
    with pytest.raises(RunError) as e:
        read_run_config(str(run))
    assert SECRET not in str(e.value) and "config.json" in str(e.value), e.value
    code, err = _main(argv, capsys)
    _one_line(code, err, "config.json")


# ---- numbers read from run files ----------------------------------------------------------------


@pytest.mark.parametrize("change, needle", [
    ({"step": 10**30}, "step"), ({"step": -1}, "step"), ({"step": SECRET}, "step"),
    ({"epoch": 10**30}, "epoch"), ({"world_size": 10**30}, "world_size"), ({"topology": SECRET}, "topology"),
    ({"ledger": {"ledger_id": 10**30, "records": 3, "committed_step": 2, "attempt": 0}}, "ledger"),
    ({"ledger": {"ledger_id": 1 << 61, "records": 10**30, "committed_step": 2, "attempt": 0}}, "ledger"),
    ({"ledger_rows": [{"step": 10**30, "epoch": 0, "sample_ids": [1], "home_ranks": [0]}]}, "ledger_rows"),
    ({"ledger_rows": [{"step": 2, "epoch": 0, "sample_ids": [10**30], "home_ranks": [0]}]}, "ledger_rows"),
], ids=["step huge", "step negative", "step text", "epoch huge", "world huge", "topology text", "ledger id huge",
        "records huge", "carried step huge", "carried id huge"])
def test_every_number_of_trainer_json_is_range_checked(change, needle, run_copy, capsys):
    run, argv = run_copy
    path = run / "checkpoints" / "step-000000002" / "trainer.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(CheckpointError) as e:
        read_trainer_state(str(path.parent), RUN_STATE)
    assert needle in str(e.value) and SECRET not in str(e.value) and "\n" not in str(e.value), e.value
    code, err = _main(argv, capsys)
    _one_line(code, err, str(path), needle)


def test_a_trainer_state_that_disagrees_with_its_checkpoint_and_ledger_is_refused(run_copy, capsys):
    """trainer.json of step-000000002 saying step 1 (its ledger committed step 2): a resume
    would train step 2's samples again. And a checkpoint whose ledger position says another
    committed step than its own."""
    run, argv = run_copy
    ckpt = run / "checkpoints" / "step-000000002"
    trainer = json.loads((ckpt / "trainer.json").read_text())
    (ckpt / "trainer.json").write_text(json.dumps({**trainer, "step": 1}))
    with pytest.raises(RunError, match="trainer.json"):
        check_resumable(str(run), str(ckpt))
    code, err = _main(argv, capsys)
    _one_line(code, err, "trainer.json", "step 1", "step-000000002")
    ledger = {**trainer["ledger"], "committed_step": 1}
    (ckpt / "trainer.json").write_text(json.dumps({**trainer, "ledger": ledger}))
    code, err = _main(argv, capsys)
    _one_line(code, err, "trainer.json", "committed step 1")
    (ckpt / "trainer.json").write_text(json.dumps(trainer))
    code, err = _main(argv, capsys)
    assert code == 0, err


@pytest.mark.parametrize("pid", [0, -1, 10**20, 1 << 40, "1", True, None])
def test_a_lock_whose_pid_no_process_can_have_is_taken_over(pid, tmp_path):
    """pid 0 signals the caller's own process group (always "alive"), 10**20 overflowed."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "RUNNING.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": SECRET}))
    lock = RunLock(str(run))
    lock.check_free()
    with lock:
        assert json.loads((run / "RUNNING.lock").read_text())["pid"] == os.getpid()


def test_a_live_lock_names_no_field_of_the_file_but_pid_and_host(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "RUNNING.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                  "started": SECRET * 100}))
    with pytest.raises(RunError, match=f"pid {os.getpid()}") as e:
        RunLock(str(run)).check_free()
    assert SECRET not in str(e.value)


# ---- where runs are stored ----------------------------------------------------------------------


@pytest.mark.parametrize("storage_env", ["", "relative/runs", None])
def test_a_run_directory_inside_the_ray_upload_folder_is_refused(storage_env, tmp_path, monkeypatch):
    """Under ray job submit a relative run.storage goes to $KNAPRAY_STORAGE; an empty or
    relative one (or an absolute run.storage inside the upload folder) would put the run into
    the folder Ray deletes when the job ends."""
    upload = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    upload.mkdir(parents=True)
    monkeypatch.chdir(upload)
    if storage_env is None:
        monkeypatch.delenv("KNAPRAY_STORAGE", raising=False)
        storage = str(upload / "runs")
    else:
        monkeypatch.setenv("KNAPRAY_STORAGE", storage_env)
        storage = "runs"
    with pytest.raises(RunError, match="upload") as e:
        resolve_paths(load_config(None, [f"run.storage={storage}", "data.corpus=/data/c"]))
    assert "\n" not in str(e.value)
    monkeypatch.setenv("KNAPRAY_STORAGE", str(tmp_path / "shared"))
    cfg = resolve_paths(load_config(None, ["run.storage=runs", "data.corpus=/data/c"]))
    assert cfg.run.storage == str(tmp_path / "shared" / "runs")


@pytest.mark.parametrize("field", ["format_version", "family", "text_dtype", "dims", "shards", "payload"])
def test_no_message_about_a_corpus_schema_quotes_what_it_holds(field, corpus, tmp_path):
    """A corpus is untrusted input too: its schema.json's fields are named by kind."""
    from knapray.corpus.schema import SchemaFileError, load_schema_json

    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    doc = json.loads((copy / "schema.json").read_text())
    (copy / "schema.json").write_text(json.dumps({**doc, field: SECRET}))
    with pytest.raises(SchemaFileError) as e:
        load_schema_json(str(copy))
    assert field in str(e.value) and SECRET not in str(e.value), e.value
