"""tests/ray_worker_fork.py, the fork server the test session's Ray workers start from: a
worker is a fork of a warm server that runs with the small process's argv, streams,
directory and environment, never shares Ray's random ids with another fork, answers for
the small process's signals, and a request it cannot honour exactly is refused (the small
process then execs the worker as Ray would). The session's Ray running on it:
tests/ray/test_data.py's ``test_the_sessions_workers_are_forks_that_draw_their_own_ids``."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

TESTS = pathlib.Path(__file__).resolve().parents[1]
SERVER = TESTS / "ray_worker_fork.py"
WORKER = """
import json, os, signal, sys, time
from ray._raylet import UniqueID
out = sys.argv[1]
defaults = (signal.getsignal(signal.SIGINT) is signal.default_int_handler
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL == signal.getsignal(signal.SIGHUP))
def stop(signum, frame):
    open(out + ".signal", "w").write(str(signum))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "cwd": os.getcwd(),
                  "X": os.environ.get("X_FOR_THE_WORKER"), "job": os.environ.get("RAY_JOB_ID"),
                  "warm": "ray.train" in sys.modules, "defaults": defaults, "id": UniqueID.from_random().hex()}), flush=True)
open(out + ".ready", "w").close()
time.sleep(float(sys.argv[2]))
open(out + ".done", "w").close()
"""
ASK = "import sys; sys.path.insert(0, %r); import ray_worker_fork as f; f.ask(%r, sys.argv[1:]) or print('refused')"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    where = tmp_path_factory.mktemp("fork")
    path = str(where / "server")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "KNAPRAY_TEST_RAY"))}
    proc = subprocess.Popen([sys.executable, str(SERVER), path], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    (where / "worker.py").write_text(WORKER)
    yield path, env, where / "worker.py"
    proc.kill()
    proc.wait()


def _small(server, out: pathlib.Path, sleep="0", extra=None, cwd=None, wait=True):
    """The small process (as tests/ray_worker_start.py runs it) asking for the worker
    script; its standard output (the worker's) goes to ``out``.stdout, a file, so that
    waiting for the small process does not wait for the worker through a pipe."""
    path, env, worker = server
    env = {**env, "RAY_JOB_ID": "01000000", "X_FOR_THE_WORKER": "x", **(extra or {})}
    cmd = [sys.executable, "-c", ASK % (str(TESTS), path), str(worker), str(out), sleep]
    with open(f"{out}.stdout", "w") as stdout:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=stdout, stdin=subprocess.DEVNULL)
    if wait:
        proc.wait(timeout=120)
    return proc


def _said(out: pathlib.Path):
    text = pathlib.Path(f"{out}.stdout").read_text().strip()
    return text if text == "refused" else json.loads(text)


def test_a_worker_is_a_fork_of_a_warm_server_with_the_small_processs_argv_streams_and_directory(server, tmp_path):
    for i in range(2):
        assert _small(server, tmp_path / f"w{i}", sleep="0.3", cwd=tmp_path).returncode == 0
    got = [_said(tmp_path / f"w{i}") for i in range(2)]
    for i, g in enumerate(got):
        assert g["argv"] == [str(tmp_path / f"w{i}"), "0.3"] and g["cwd"] == str(tmp_path)
        assert g["X"] == "x" and g["job"] == "01000000"
        assert g["warm"]  # Ray Train was imported by the server, not by the worker
        assert g["defaults"]  # Python's own Ctrl-C and SIGTERM, not the servers' (which ignore them)
        assert (tmp_path / f"w{i}.done").exists()  # the small process ended after its worker
    assert got[0]["ppid"] == got[1]["ppid"] != got[0]["pid"]  # both forks of one level-1 server
    assert got[0]["id"] != got[1]["id"]  # each fork draws its own ids from Ray's generator


def test_another_job_gets_its_own_level_1_server(server, tmp_path):
    _small(server, tmp_path / "a")
    _small(server, tmp_path / "b", extra={"RAY_JOB_ID": "02000000"})
    first, other = _said(tmp_path / "a"), _said(tmp_path / "b")
    assert other["job"] == "02000000" and other["ppid"] != first["ppid"]


def test_an_environment_that_differs_beyond_rays_own_is_refused(server, tmp_path):
    _small(server, tmp_path / "w", extra={"OMP_NUM_THREADS": "7"})
    assert _said(tmp_path / "w") == "refused" and not (tmp_path / "w.ready").exists()
    assert "refused: {'OMP_NUM_THREADS': ('7'," in pathlib.Path(server[0] + ".log").read_text()  # and says why


def test_a_signal_to_the_small_process_reaches_its_worker(server, tmp_path):
    proc = _small(server, tmp_path / "w", sleep="60", wait=False)
    deadline = time.monotonic() + 60
    while not (tmp_path / "w.ready").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert (tmp_path / "w.signal").read_text() == str(int(signal.SIGTERM))
    assert not (tmp_path / "w.done").exists()


def test_without_a_server_the_small_process_says_so(tmp_path):
    sys.path.insert(0, str(TESTS))
    try:
        import ray_worker_fork
    finally:
        sys.path.remove(str(TESTS))
    assert ray_worker_fork.ask(str(tmp_path / "nobody"), ["w.py"]) is False
