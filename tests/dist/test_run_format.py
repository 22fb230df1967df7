"""A run directory of another format is refused in one line naming its format, never read
as this knapray's: the fixture tests/fixtures/run-9508edb is a run written at commit 9508edb
(its config.json has no ``format_version``: run format 1, with ``run.timeout_s``, which is
``distributed.timeout_s`` now). A run written today carries ``RUN_FORMAT`` and resumes
(tests/dist/test_runs.py)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from knapray.config.run import load_config
from knapray.driver.run_dir import RUN_FORMAT, RunError, read_run_config, saved_config, write_config

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "run-9508edb"
MODEL = ["model.hidden_size=8", "model.num_heads=1", "model.rope_axes_dim=[2,2,4]", "model.mlp_ratio=2",
         "model.depth_double=1", "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16"]
"""The fixture's model (tests/fixtures/run-9508edb/README.md)."""


def _copy_fixture(tmp_path: pathlib.Path) -> pathlib.Path:
    """The fixture's run directory as ``<tmp>/runs/r`` beside its corpus, ``<tmp>/corpus``."""
    shutil.copytree(FIXTURE / "run", tmp_path / "runs" / "r")
    shutil.copytree(FIXTURE / "corpus", tmp_path / "corpus")
    return tmp_path / "runs" / "r"


def _tree(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_fixture_is_refused_naming_its_format(tmp_path):
    run = _copy_fixture(tmp_path)
    for read in (saved_config, read_run_config):
        with pytest.raises(RunError) as e:
            read(str(run))
        message = str(e.value)
        assert "\n" not in message and str(run / "config.json") in message
        assert "no format_version: run format 1" in message and f"reads run format {RUN_FORMAT} only" in message


def test_resuming_the_fixture_is_one_line_and_exit_2_and_changes_nothing(tmp_path):
    run = _copy_fixture(tmp_path)
    before = _tree(run)
    (tmp_path / "empty.yaml").write_text("{}\n")
    sets = [*MODEL, f"data.corpus={tmp_path / 'corpus'}", "data.samples_per_step=2", "balance.topology=g1n1",
            f"run.storage={tmp_path / 'runs'}", "run.name=r", "parallel.precision=fp32", "run.max_steps=4",
            "checkpoint.every=2", "metrics.tensorboard=off"]
    cmd = [sys.executable, "-m", "knapray.commands.torchrun", "--config", str(tmp_path / "empty.yaml"),
           *[f"--set={s}" for s in sets]]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith("knapray torchrun: error: run file ") and "run format 1" in lines[0], lines[0]
    assert _tree(run) == before  # nothing written, truncated or taken over


@pytest.mark.parametrize("command", [["export", "--out", "exported"], ["sample", "--caption", "a fox"]])
def test_export_and_sample_refuse_the_fixture_in_one_line(command, tmp_path, capsys):
    from knapray.cli import main

    run = _copy_fixture(tmp_path)
    code = main([command[0], "--run", str(run), *command[1:]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "run format 1" in err[0], err


def test_a_run_written_today_carries_its_format_and_reads_back(tmp_path):
    cfg = load_config(None, [f"run.storage={tmp_path}", "run.name=r", "distributed.timeout_s=60"])
    write_config(cfg)
    doc = json.loads((tmp_path / "r" / "config.json").read_text())
    assert doc["format_version"] == RUN_FORMAT and doc["distributed"]["timeout_s"] == 60
    assert saved_config(str(tmp_path / "r")) == json.loads(json.dumps(cfg.to_dict()))
    assert read_run_config(str(tmp_path / "r")) == cfg
    # A format that is not a number is named by its kind, not by what the file holds (issue 43).
    for other, said in ((RUN_FORMAT + 1, f"run format {RUN_FORMAT + 1}"), ("2", "format_version is a str"),
                        (True, "format_version is a bool"), (None, "format_version is null")):
        (tmp_path / "r" / "config.json").write_text(json.dumps({**doc, "format_version": other}))
        with pytest.raises(RunError, match=rf"{said}(, not a run format number)?; this knapray reads run format "
                                           rf"{RUN_FORMAT} only"):
            saved_config(str(tmp_path / "r"))
