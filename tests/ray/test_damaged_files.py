"""Damaged or missing files of a run directory or a corpus, and a failing environment: each
is one line naming the file (or path), exit code 2 for bad input and a clear non-zero code
for the environment, before any worker starts where it can be; no traceback. Ray is never
started here except by the one SIGINT test (marked ``ray``)."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch

from dist_utils import build_tiny_corpus
from knapray.cli import main
from knapray.worker.checkpoint import Checkpointer, JsonState, StorageFull, training_parts
from knapray.config.run import load_config
from knapray.worker.ledger_files import LocalLedger
from knapray.driver.run_dir import resolve_paths, write_config

REPO = pathlib.Path(__file__).resolve().parents[2]
SETS = ["model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[2,2,4]", "model.depth_double=1",
        "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16", "data.samples_per_step=1",
        "balance.topology=g1n2", "scaling.num_workers=2", "run.name=r", "parallel.precision=fp32"]


@pytest.fixture(autouse=True)
def no_ray(request, monkeypatch):
    """A check that started Ray would fail here instead of starting it."""
    if request.node.get_closest_marker("ray") is None:
        ray = pytest.importorskip("ray")
        monkeypatch.setattr(ray, "init", lambda *a, **k: (_ for _ in ()).throw(AssertionError("Ray started")))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"), "g1b2i64f1s0", steps=2, shards=2)


def _argv(corpus: str, storage, *extra: str) -> list[str]:
    out = ["train", "--config", str(REPO / "jobs/configs/demo.yaml")]
    for s in [*SETS, f"data.corpus={corpus}", f"run.storage={storage}", *extra]:
        out += ["--set", s]
    return out


def _train(argv: list[str], capsys) -> tuple[int, list[str]]:
    """``knapray train`` in this process: (exit code, stderr lines)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def _one_line(code: int, err: list[str], want_code: int, *needles: str) -> None:
    assert code == want_code, (code, err)
    assert len(err) == 1 and err[0].startswith("knapray train: error:"), err
    assert "Traceback" not in err[0]
    for needle in needles:
        assert needle in err[0], (needle, err[0])


# ---- a corpus's schema.json ---------------------------------------------------------------


def _edit_schema(path: pathlib.Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


SCHEMA_DAMAGE = {
    "not JSON": (lambda p: p.write_text("{not json"), "is not JSON"),
    "binary": (lambda p: p.write_bytes(b"\xff\xfe\x00"), "is not JSON"),
    "a list": (lambda p: p.write_text("[]"), "holds a list"),
    "channels a string": (lambda p: _edit_schema(p, lambda d: d["dims"].__setitem__("channels", "abc")),
                          "dims.channels is a str, not an int"),  # named by kind, never by content (issue 43)
    "shards an int": (lambda p: _edit_schema(p, lambda d: d.__setitem__("shards", 5)), "shards is an int"),
    "counts missing": (lambda p: _edit_schema(p, lambda d: d.pop("counts")), "counts.samples"),
}


@pytest.mark.parametrize("damage", SCHEMA_DAMAGE)
def test_a_damaged_schema_json_is_one_line_naming_it(damage, corpus, tmp_path, capsys):
    copy = tmp_path / "corpus"
    copy.mkdir()
    for f in pathlib.Path(corpus).iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    edit, needle = SCHEMA_DAMAGE[damage]
    edit(copy / "schema.json")
    code, err = _train(_argv(str(copy), tmp_path / "runs") + ["--check"], capsys)
    _one_line(code, err, 2, str(copy / "schema.json"), needle)


# ---- a run directory: config.json, trainer.json, the ledger journal ------------------------


@pytest.fixture(scope="module")
def run_dir(corpus, tmp_path_factory):
    """A run directory with config.json, a ledger journal of 3 steps and a real checkpoint
    (DCP metadata, trainer.json with the ledger position) covering them."""
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
    opt = torch.optim.AdamW(model.parameters())
    Checkpointer(os.path.join(cfg.run_dir, "checkpoints"), rank=0, group=None, parts=training_parts(model, opt),
                 state=JsonState({"epoch": 0, "world_size": 2, "topology": "g1n2", "ledger": position}),
                 ).save(2, barrier=lambda: None)
    return cfg.run_dir


@pytest.fixture
def damaged_run(run_dir, tmp_path):
    """A copy of ``run_dir`` under a storage folder of this test, and the argv that resumes it."""
    import shutil

    copy = tmp_path / "runs" / "r"
    shutil.copytree(run_dir, copy)
    saved = json.loads((copy / "config.json").read_text())
    saved["run"]["storage"] = str(tmp_path / "runs")
    (copy / "config.json").write_text(json.dumps(saved))
    return copy, _argv(saved["data"]["corpus"], tmp_path / "runs") + ["--check"]


def test_the_undamaged_run_directory_would_resume(damaged_run, capsys):
    _, argv = damaged_run
    code, err = _train(argv, capsys)
    assert code == 0, err


CONFIG_DAMAGE = {
    "not JSON": ("{nope", "is not JSON"),
    "binary": (b"\xff\xfe\x00", "is not JSON"),
    "a list": ("[]", "holds a list"),
    "a section a number": ('{"format_version": 2, "model": 5}', "section 'model' is an int, not an object"),
    "a section a list": ('{"format_version": 2, "data": [1]}', "section 'data'"),
    "another format": ('{"format_version": 3}', "run format 3; this knapray reads run format 2 only"),
    "no format": ('{"model": {}}', "no format_version: run format 1"),
}


@pytest.mark.parametrize("damage", CONFIG_DAMAGE)
def test_a_damaged_config_json_is_one_line_naming_it(damage, damaged_run, capsys):
    run, argv = damaged_run
    text, needle = CONFIG_DAMAGE[damage]
    (run / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    code, err = _train(argv, capsys)
    _one_line(code, err, 2, str(run / "config.json"), needle)


TRAINER_DAMAGE = {  # named by kind, never by what the file holds (issue 43)
    "step a string": ({"step": "abc"}, "step is a str, not an int in [0, 1000000000]"),
    "epoch a string": ({"epoch": "x"}, "epoch is a str"),
    "topology a number": ({"topology": 3}, "topology is an int, not a topology spec"),
    "ledger a string": ({"ledger": "abc"}, "ledger is not a ledger position"),
}


@pytest.mark.parametrize("damage", TRAINER_DAMAGE)
def test_a_mistyped_trainer_json_is_one_line_naming_it(damage, damaged_run, capsys):
    run, argv = damaged_run
    path = run / "checkpoints" / "step-000000002" / "trainer.json"
    change, needle = TRAINER_DAMAGE[damage]
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    code, err = _train(argv, capsys)
    _one_line(code, err, 2, str(path), needle)
    path.write_text("[1, 2]")
    code, err = _train(argv, capsys)
    _one_line(code, err, 2, str(path), "holds a list")


def _flip_payload(journal: pathlib.Path, record: int) -> None:
    """Flip a byte inside ``record``'s payload (a record after it remains)."""
    data = bytearray(journal.read_bytes())
    off = 8  # the magic
    for _ in range(record):
        off += 12 + struct.unpack_from("<I", data, off)[0]
    data[off + 12 + 3] ^= 0xFF
    journal.write_bytes(bytes(data))


def test_a_journal_record_with_a_bad_checksum_is_one_line_naming_file_and_record(damaged_run, capsys):
    run, argv = damaged_run
    journal = next((run / "ledger").glob("journal-*.bin"))
    _flip_payload(journal, 1)
    code, err = _train(argv, capsys)
    _one_line(code, err, 2, str(journal), "payload checksum mismatch in record 1")


# ---- the environment: storage that cannot be written, a full disk --------------------------


def test_unwritable_storage_is_refused_before_ray_starts(corpus, tmp_path, capsys, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    code, err = _train(_argv(corpus, not_a_folder / "runs"), capsys)  # a real run, not --check: Ray would start
    _one_line(code, err, 2, str(not_a_folder), "is not a folder")
    # A folder that takes no new file (root writes into any mode-555 folder, so the probe
    # file pre-flight creates is refused here as the file system would refuse it).
    from knapray.driver import run_dir

    real = os.open

    def refusing(path, flags, *args, **kwargs):
        if os.path.dirname(str(path)) == str(tmp_path) and ".knapray-write-probe" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(run_dir.os, "open", refusing)
    code, err = _train(_argv(corpus, tmp_path / "runs"), capsys)
    _one_line(code, err, 2, f"run.storage: {tmp_path} takes no new file (Permission denied)", "cannot be written")
    assert not (tmp_path / "runs").exists()


def _save_tiny(root: str) -> str:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    return Checkpointer(root, rank=0, group=None, parts=training_parts(model, opt),
                        state=JsonState({"epoch": 0, "world_size": 1, "topology": "g1n1", "ledger": None}),
                        ).save(5, barrier=lambda: None)


@pytest.mark.parametrize("failure", ["zip writer", "ENOSPC"])
def test_a_full_disk_during_a_checkpoint_says_no_space_left_on_the_path(failure, tmp_path, monkeypatch):
    from knapray.worker import checkpoint

    def full(*args, **kwargs):  # what DCP raises when the disk fills, measured on a 700 KiB tmpfs
        if failure == "ENOSPC":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.dcp, "save", full)
    usage = type(checkpoint.shutil.disk_usage(str(tmp_path)))
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(1 << 20, (1 << 20) - 4096, 4096))
    root = str(tmp_path / "checkpoints")
    with pytest.raises(StorageFull) as e:
        _save_tiny(root)
    assert f"no space left on {root} (4096 bytes free)" in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(root) == []  # the partial directory is gone: the disk is not left full


def test_a_failed_save_with_space_left_is_not_called_a_full_disk(tmp_path, monkeypatch):
    from knapray.worker import checkpoint

    monkeypatch.setattr(checkpoint.dcp, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        _save_tiny(str(tmp_path / "checkpoints"))


# ---- Ray: workers failing past run.max_failures, SIGINT --------------------------------------


@pytest.fixture
def fake_ray(monkeypatch):
    """``knapray train`` past pre-flight with Ray's start-up stubbed: ``run_training`` raises
    what the test gives."""
    ray = pytest.importorskip("ray")
    from knapray.driver import launch

    monkeypatch.setattr(ray, "init", lambda *a, **k: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4})

    def failing(error):
        def run_training(cfg, **kwargs):
            raise error
        monkeypatch.setattr(launch, "run_training", run_training)

    return failing


def test_workers_failing_past_max_failures_are_one_line(corpus, tmp_path, capsys, fake_ray):
    from ray.exceptions import ActorDiedError
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    died = ActorDiedError()
    boom = UserExceptionWithTraceback(RuntimeError("boom\nmore"), "Traceback (most recent call last):\n ...")
    fake_ray(WorkerGroupError("a long message\n" * 40, {3: died, 1: boom}))
    code, err = _train(_argv(corpus, tmp_path), capsys)
    _one_line(code, err, 1, "training failed: worker 1: RuntimeError: boom (and 1 more worker(s)) "
              "(run.max_failures=1); the workers' logs: ", "stopped before its first checkpoint")
    storage_full = StorageFull(errno.ENOSPC, "no space left on /x/r/checkpoints (0 bytes free): ...")
    fake_ray(WorkerGroupError("...", {0: UserExceptionWithTraceback(storage_full, "Traceback ...")}))
    code, err = _train(_argv(corpus, tmp_path), capsys)
    _one_line(code, err, 1, "worker 0: StorageFull: [Errno 28] no space left on /x/r/checkpoints")


def test_an_interrupted_run_says_where_it_stopped_and_exits_130(damaged_run, capsys, fake_ray):
    from knapray.driver.launch import Interrupted

    run, argv = damaged_run
    fake_ray(Interrupted(str(run)))
    code, err = _train(argv[:-1], capsys)  # without --check
    assert code == 130 and len(err) == 1 and "Traceback" not in err[0], err
    assert err[0] == (f"knapray train: interrupted: run 'r' stopped; its last checkpoint is step 2 "
                      f"({run / 'checkpoints' / 'step-000000002'}); run the same command again to resume from it")


# ---- a run directory's metrics.jsonl -------------------------------------------------------


def _metrics_lines(steps: int = 3) -> list[str]:
    return [json.dumps({"step": s, "epoch": 0, "loss": 1.0 / (s + 1)}) + "\n" for s in range(steps)]


METRICS_DAMAGE = {
    "garbage": ("#!garbage\n", "not JSON"),
    "binary": (b"\xff\xfe\x00\n", "not UTF-8"),
    "a list": ("[1, 2]\n", "a JSON list, not an object"),
    "step a string": ('{"step": "2", "epoch": 0}\n', "step is '2'"),
    "no epoch": ('{"step": 2}\n', "no epoch"),
}


@pytest.mark.parametrize("at", ["middle", "last, with its newline"])
@pytest.mark.parametrize("damage", METRICS_DAMAGE)
def test_a_damaged_metrics_line_is_one_line_naming_file_and_line(damage, at, damaged_run, capsys):
    run, argv = damaged_run
    line, needle = METRICS_DAMAGE[damage]
    lines = [x.encode() for x in _metrics_lines()]
    lines.insert(1 if at == "middle" else 3, line if isinstance(line, bytes) else line.encode())
    (run / "metrics.jsonl").write_bytes(b"".join(lines))
    code, err = _train(argv, capsys)
    where = 2 if at == "middle" else 4
    _one_line(code, err, 2, f"run file {run / 'metrics.jsonl'}: line {where} is not a step record ({needle})")


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(damaged_run, capsys):
    from knapray.driver import preflight
    from knapray.worker.metrics import read_metrics, truncate_metrics

    run, argv = damaged_run
    path = run / "metrics.jsonl"
    whole = "".join(_metrics_lines())
    path.write_text(whole + '{"step": 3, "epo')  # a crash mid-append
    assert main(argv) == 0  # --check: says what the run would do, changes nothing
    out = capsys.readouterr()
    assert (f"  run directory: run file {path}: would drop a torn last line 4 (16 bytes, not JSON), as a crash "
            "while writing it leaves it") in out.out.splitlines()
    assert out.err == ""
    assert path.read_text().endswith('"epo')
    assert [r["step"] for r in read_metrics(str(run))] == [0, 1, 2]  # every reader leaves it out

    pre = preflight.check_file(argv[2], argv[4:-1:2])  # the run itself: its pre-flight cuts the torn line
    start, lock = preflight.prepare(pre)
    lock.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"[knapray] warning: run file {path}: dropped a torn last line 4 (16 bytes, not JSON), "
                   "as a crash while writing it leaves it"], err
    assert start.resume_from is not None and path.read_text() == whole

    # A worker group restarted mid-run (rank 0 killed mid-append) rewrites back to its checkpoint.
    path.write_bytes(whole.encode() + b'{"step": 3, "epoch": 0, "lo\xe2')
    truncate_metrics(str(run), 2)
    assert path.read_text() == "".join(_metrics_lines(2))
