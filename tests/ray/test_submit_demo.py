"""jobs/submit_demo.sh waits for its private Ray head on a check that can succeed (the Ray
CLI's job list, which sends the auth token, and the head's dashboard agent registered on
the port the script gave it) and, when the head does not answer in time, fails with the
reason, submits nothing and stops the head it started. Beside another Ray, with Ray's
default dashboard-agent port taken, its head takes a job (``--head-only`` submits a no-op
one): a full head start, 30-90 s on a loaded 2-core machine."""

from __future__ import annotations

import os
import pathlib
import re
import socket
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


DEFAULT_AGENT_PORT = 52365
"""Ray's default port of a head's dashboard agent, which runs submitted jobs."""


def test_beside_another_ray_the_head_takes_a_job(ray_session):
    """This session's Ray runs on the machine and Ray's default agent port is taken (by that
    Ray's agent, or here): the script's head gets ports of its own and runs a job. Before,
    its agent failed on 52365, its readiness check passed anyway and the submission failed
    with "No available agent to submit job"."""
    held = socket.socket()
    try:
        held.bind(("0.0.0.0", DEFAULT_AGENT_PORT))
        held.listen()
    except OSError:
        pass  # taken already, as by another Ray's agent
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        proc = subprocess.run(["bash", "jobs/submit_demo.sh", "--head-only"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=400)
    finally:
        held.close()
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "[submit_demo] the head ran a job" in text and "succeeded" in text, text[-4000:]
    assert "takes jobs after" in proc.stdout and "(dashboard agent)" in proc.stdout, text[-4000:]
    temp_dir = re.search(r"its temp dir: (\S+)\)", proc.stdout).group(1)
    assert not _processes_mentioning(temp_dir), "the private head was left running"
    # Stopped by its SIGTERM, not killed 10 s later (Ray 2.60's head drained itself for up to
    # 30 s first, and every run of the script waited the 10 s out).
    assert "did not stop within 10 s of SIGTERM" not in proc.stderr, text[-4000:]
