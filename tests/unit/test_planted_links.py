"""A run directory is written without following a planted symbolic link (knapray/nofollow.py).

Anyone who can write into a run directory could replace ``metrics.jsonl`` by a link to any
file (a resume's torn-line cut then emptied the target), ``quarantine-*.jsonl`` likewise
(opened with "w"), or ``ledger/`` by a link to a folder outside. knapray never makes a link
there: pre-flight refuses one in one line, and every write opens the file itself with
O_NOFOLLOW. Storage is checked by creating a file, not by ``os.access`` (root passes that
on /proc).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from knapray.nofollow import PlantedLink, open_nofollow, refuse_links, truncate_nofollow
from knapray.worker.metrics import MetricsFile
from knapray.driver.run_dir import RunError, check_writable

TARGET_TEXT = "a file outside the run directory\n" * 2


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    target = tmp_path / "outside.txt"
    target.write_text(TARGET_TEXT)
    return target


@pytest.mark.parametrize("planted", ["metrics.jsonl", "quarantine-rank0.jsonl", "summary.json",
                                     "checkpoints/step-000000004/trainer.json", "ledger"])
def test_pre_flight_refuses_a_link_anywhere_in_the_run_directory(tmp_path, outside, planted):
    run = tmp_path / "runs" / "r"
    (run / "checkpoints" / "step-000000004").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    link = run / planted
    if link.exists():
        link.unlink()
    link.symlink_to(outside if planted != "ledger" else outside.parent)
    with pytest.raises(RunError) as e:
        check_writable(str(run))
    msg = str(e.value)
    assert "\n" not in msg and str(link) in msg and "symbolic link" in msg, msg
    assert outside.read_text() == TARGET_TEXT


def test_every_write_refuses_a_link_planted_after_the_check(tmp_path, outside):
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(outside)
    for write in (lambda: MetricsFile(str(tmp_path)).append({"step": 1}),
                  lambda: truncate_nofollow(str(link), 0),
                  lambda: open_nofollow(str(link), "w").close()):
        with pytest.raises(PlantedLink, match="metrics.jsonl is a symbolic link"):
            write()
    assert outside.read_text() == TARGET_TEXT
    plain = tmp_path / "plain.jsonl"
    with open_nofollow(str(plain), "a") as f:
        f.write("x\n")
    truncate_nofollow(str(plain), 1)
    assert plain.read_text() == "x"


def test_the_run_directory_itself_may_be_a_link(tmp_path):
    real = tmp_path / "scratch" / "runs"
    real.mkdir(parents=True)
    (tmp_path / "runs").symlink_to(real)
    refuse_links(str(tmp_path / "runs"))  # only what lies below it is the run's
    check_writable(str(tmp_path / "runs" / "new"))


def test_storage_is_checked_by_writing_not_by_access(tmp_path):
    """root passes os.access on /proc; a file cannot be made there."""
    with pytest.raises(RunError, match="run.storage: /proc "):
        check_writable("/proc/knapray-test/r")
    check_writable(str(tmp_path / "fine" / "r"))
    assert not any(p.name.startswith(".knapray-write-probe") for p in tmp_path.iterdir())


def test_train_refuses_a_planted_metrics_link_before_anything_starts(tmp_path, outside):
    """The resume of the issue: metrics.jsonl a link to any file, ``knapray train`` (and
    --check) is one line, exit 2, and the target keeps its bytes (the torn-line cut emptied
    it before)."""
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    corpus = tmp_path / "corpus"
    build_synthetic(SyntheticConfig(mix="g2b2i128f1s0", steps=2, scale=4, channels=4, text_dim=16, pooled_dim=16),
                    corpus, progress=False)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").symlink_to(outside)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data:\n  corpus: {corpus}\nrun:\n  name: r\n  storage: {tmp_path / 'runs'}\n"
                   "scaling:\n  num_workers: 2\nbalance:\n  topology: g2n1\n")
    for extra in (["--check"], []):
        out = subprocess.run([sys.executable, "-m", "knapray.cli", "train", "--config", str(cfg), *extra],
                             capture_output=True, text=True, timeout=300, env=dict(os.environ))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
        assert "metrics.jsonl is a symbolic link" in lines[0]
        assert outside.read_text() == TARGET_TEXT
