"""jobs/submit_demo.sh waits for its private Ray head on a check that can succeed (the Ray
CLI's job list, which sends the auth token) and, when the head does not answer in time,
fails with the reason, submits nothing and stops the head it started.

Only the failure path runs here: the success path (``--head-only``) waits for a full head
start, 30-90 s on a loaded 2-core machine."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

pytestmark = pytest.mark.ray

REPO = pathlib.Path(__file__).resolve().parents[2]


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return pids


def test_head_that_does_not_answer_in_time_is_a_clear_failure_and_nothing_is_submitted():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["KNAPRAY_HEAD_TIMEOUT_S"] = "0"
    proc = subprocess.run(["bash", "jobs/submit_demo.sh", "--head-only"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "did not answer within 0s (KNAPRAY_HEAD_TIMEOUT_S); nothing submitted" in proc.stderr
    assert "submitting" not in proc.stdout and "takes jobs" not in proc.stdout
    temp_dir = re.search(r"the head's log: (\S+)/head\.log", proc.stderr).group(1)
    assert not _processes_mentioning(temp_dir), "the private head was left running"
