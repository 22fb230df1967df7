"""Workers stop when their driver dies: ``knapray train --address`` attached to a running Ray
head is SIGKILLed mid-run, and nothing more is written into its run directory.

The head is started here (``ray start --head --block`` in a new session, a private temp dir,
a free port), not the Ray this test session shares (``ray_session``), and every process of
that session is killed at the end: ``ray stop`` would stop any Ray on the machine. Measured
by hand (docs/faults.md): the same holds for a ``ray job submit`` entrypoint killed with
SIGKILL and for ``ray job stop``.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from dist_utils import build_tiny_corpus
from knapray.testing.waits import ProgressDeadline

pytestmark = pytest.mark.ray

REPO = pathlib.Path(__file__).resolve().parents[2]
SETS = ["model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[2,2,4]", "model.depth_double=1",
        "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16", "data.samples_per_step=1",
        "balance.topology=g1n2", "scaling.num_workers=2", "run.name=r", "parallel.precision=fp32",
        "data.epochs=1000", "run.max_steps=100000", "checkpoint.every=2", "metrics.log_every=1000"]
WATCH_S = 8.0
"""How long the run directory is watched after the kill. Measured: nothing changed from the
kill on (0 s), while a live run of this size writes a line every ~0.2 s and a checkpoint
every other step, so a run that went on would show within a second or two."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    """Processes of session ``sid`` (the head, its raylet and GCS, every Ray worker they start)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:  # field 6: the session id
                pids.append(int(entry))
    return pids


RUN_ACTORS = ("ray::RayTrainWorker", "ray::TrainController", "ray::_CoordinatorActor")


def _name(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _snapshot(run_dir: pathlib.Path) -> tuple:
    metrics = run_dir / "metrics.jsonl"
    checkpoints = run_dir / "checkpoints"
    return (metrics.stat().st_size if metrics.exists() else None,
            metrics.stat().st_mtime_ns if metrics.exists() else None,
            sorted(os.listdir(checkpoints)) if checkpoints.exists() else [])


HEAD_STARTS = 3
"""Tries at starting the private head. On a loaded machine ``ray start`` itself can give up
("Failed to get node info: Deadline Exceeded", Ray's own wall-clock bound); a new head on
a new port is started then, and the test fails only if every try did."""


def _up(head: subprocess.Popen, log: pathlib.Path, port: int) -> bool:
    """Whether the head came up: its log says it started and its GCS port takes connections
    (a driver attached before that fails to connect). False if the head exited first. Waited
    for by progress (the head's log growing), not by the clock."""
    wait = ProgressDeadline(floor_s=60.0)
    while True:
        if head.poll() is not None:
            return False
        text = log.read_text(errors="replace")
        if "Ray runtime started" in text:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return True
        wait.progressed(len(text))
        assert not wait.expired(), wait.why("the Ray head did not start") + f":\n{text[-3000:]}"
        time.sleep(0.2)


def _kill_session(head: subprocess.Popen) -> None:
    for pid in _session_pids(head.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    head.wait(timeout=30)


@pytest.fixture
def ray_head(tmp_path):
    """A private Ray head: its GCS address; afterwards every process of its session is killed."""
    import shutil

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "token"  # Ray 2.60's head asks for its token; the driver sends it only in this mode
    ray_tmp = pathlib.Path("/tmp") / f"kr-dd-{os.getpid()}"  # short: Ray's socket paths have a length limit
    for attempt in range(1, HEAD_STARTS + 1):
        port, log = _free_port(), tmp_path / f"head-{attempt}.log"
        head = subprocess.Popen(
            [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block", "--port", str(port),
             "--node-ip-address", "127.0.0.1", "--num-cpus", "4", "--include-dashboard=false",
             "--disable-usage-stats", "--temp-dir", str(ray_tmp)],
            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if _up(head, log, port):
                break
        except BaseException:
            _kill_session(head)
            raise
        _kill_session(head)
        shutil.rmtree(ray_tmp, ignore_errors=True)
        assert attempt < HEAD_STARTS, f"the Ray head exited {HEAD_STARTS} times:\n{log.read_text()[-3000:]}"
    try:
        yield f"127.0.0.1:{port}", env, head.pid
    finally:
        _kill_session(head)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_workers_stop_writing_when_an_attached_driver_is_killed(ray_head, tmp_path):
    address, env, head_sid = ray_head
    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b2i64f1s0", steps=8, shards=2)
    run_dir = tmp_path / "runs" / "r"
    argv = [sys.executable, "-m", "knapray.cli", "train", "--config", str(REPO / "jobs/configs/demo.yaml"),
            "--address", address]
    for s in [*SETS, f"data.corpus={corpus}", f"run.storage={tmp_path / 'runs'}"]:
        argv += ["--set", s]
    log = tmp_path / "driver.log"
    driver = subprocess.Popen(argv, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        # Mid-run: a few steps and two checkpoints written, so the workers are past start-up.
        # Waited for by progress (the driver's log, the run directory), not by the clock: a
        # loaded machine is slower, not stuck.
        wait = ProgressDeadline(floor_s=90.0)
        while len(_snapshot(run_dir)[2]) < 2 or _snapshot(run_dir)[0] is None:
            assert driver.poll() is None, f"the driver exited ({driver.returncode}):\n{log.read_text()[-3000:]}"
            wait.progressed((log.stat().st_size, _snapshot(run_dir)))
            assert not wait.expired(), wait.why("no second checkpoint") + f":\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        running = [name for name in map(_name, _session_pids(head_sid)) if name.startswith(RUN_ACTORS)]
        assert sum(n.startswith("ray::RayTrainWorker") for n in running) == 2, running  # the check below sees them
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    time.sleep(1.0)  # a line or a checkpoint already under way when the driver died may land
    before = _snapshot(run_dir)
    time.sleep(WATCH_S)
    after = _snapshot(run_dir)
    assert after == before, f"the run directory changed after the driver was killed: {before} -> {after}"
    # ... and the run's actors are gone, not only quiet (the coordinator is not detached).
    left = [name for name in map(_name, _session_pids(head_sid)) if name.startswith(RUN_ACTORS)]
    assert not left, f"still running after the driver was killed: {left}"
