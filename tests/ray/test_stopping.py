"""How a run stops (issue 43, items 1-3): one Ctrl-C stops it, SIGTERM is handled like SIGINT
(exit 143, no native stack dump), workers that wait past ``scaling.start_timeout_s`` stop the
run with Ray's reason, a ``ray job submit`` entrypoint's driver stops with its shell, and a
file-system error crosses from a Ray actor to the driver's one line with its file and
operation.

Every driver here is a process of its own attached (``--address``) to this session's Ray
(``ray_session``), whose CPUs but one a holder actor takes while the workers (one CPU each)
should wait: the one left is for what the driver runs before them (Ray Data reads the
corpus's metadata)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
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
        "balance.topology=g1n2", "scaling.num_workers=2", "scaling.cpus_per_worker=0.5", "run.name=r",
        "parallel.precision=fp32", "metrics.log_every=1000"]
STOPPED_WITHIN_S = 40.0
"""From the signal to the driver's exit: the controller's abort (at most launch.ABORT_WAIT_S,
10 s, then it is killed) and Ray's shutdown; before the fix the first Ctrl-C did nothing."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"), "g1b2i64f1s0", steps=8, shards=2)


@pytest.fixture
def address(ray_session) -> str:
    return ray_session.get_runtime_context().gcs_address


@pytest.fixture
def cpus_held(ray_session):
    """Every free CPU of the session's Ray but one held by an actor: two workers of one CPU
    each wait."""
    ray = ray_session

    @ray.remote
    class Holder:
        def ready(self) -> bool:
            return True

    free = int(ray.available_resources().get("CPU", 0)) - 1
    holder = Holder.options(num_cpus=free).remote() if free > 0 else None
    if holder is not None:
        ray.get(holder.ready.remote(), timeout=60)
    yield
    if holder is not None:
        ray.kill(holder)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONUNBUFFERED="1", RAY_AUTH_MODE="token")  # the session's Ray asks for its token
    return env


def _argv(corpus: str, storage, address: str, *sets: str) -> list[str]:
    argv = [sys.executable, "-m", "knapray.cli", "train", "--config", str(REPO / "jobs/configs/demo.yaml"),
            "--address", address]
    for s in [*SETS, f"data.corpus={corpus}", f"run.storage={storage}", *sets]:
        argv += ["--set", s]
    return argv


def _wait_for(log: pathlib.Path, text: str, proc: subprocess.Popen, what: str) -> None:
    wait = ProgressDeadline(floor_s=90.0)
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"the driver exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        wait.progressed(log.stat().st_size)
        assert not wait.expired(), wait.why(what) + f":\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _my_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("knapray train:")]


def _no_waiting_groups(ray) -> None:
    """Nothing of the stopped run waits for the CPUs the holder gives back."""
    from ray.util import placement_group_table

    waiting = [g for g in placement_group_table().values() if g["state"] in ("PENDING", "RESCHEDULING")]
    assert not waiting, waiting


WAYS = {"SIGINT": 130, "SIGTERM": 143, "start timeout": 1, "shell died": None}
"""How a driver whose workers wait is stopped, and its exit code (None: not this test's child)."""


def _children(pid: int) -> list[int]:
    try:
        text = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_waiting_workers_stop_on_one_signal_the_start_timeout_or_their_shell(corpus, address, cpus_held,
                                                                             ray_session, tmp_path):
    """Four drivers at once (their start-up is most of the time), each with two workers that
    wait for a CPU: one gets one SIGINT, one one SIGTERM, one ``scaling.start_timeout_s=3``,
    and one runs as ``ray job submit`` runs an entrypoint, in ``/bin/sh -c``, whose shell
    alone gets SIGTERM (a scheduler's). Before: one Ctrl-C did nothing until Ray Train's
    placement wait ended (here 600 s), SIGTERM left Ray's native stack dump and exit 134, no
    start timeout existed, and a job's driver trained on after its shell died (the job marked
    FAILED)."""
    drivers = {}
    for how in WAYS:
        # A controller waiting for its placement group (up to worker_start_timeout_s) answered
        # Ray Train's abort only when the wait ended: the first Ctrl-C did nothing for minutes.
        extra = ["scaling.cpus_per_worker=1"] + (["scaling.start_timeout_s=3"] if how == "start timeout"
                                                 else ["scaling.worker_start_timeout_s=600"])
        argv = _argv(corpus, tmp_path / how.replace(" ", "-"), address, *extra)
        env = _env()
        if how == "shell died":
            argv = ["/bin/sh", "-c", " ".join(f"'{a}'" for a in argv) + "; echo the shell went on"]
            env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": {}, "metadata": {}})
        log = tmp_path / f"{how.replace(' ', '-')}.log"
        with open(log, "w") as out:
            drivers[how] = (subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True), log)
    took = {}
    try:
        for how, (driver, log) in drivers.items():
            _wait_for(log, "[knapray] starting 2 workers", driver, f"{how}: the driver did not start its workers")
        (python,) = _children(drivers["shell died"][0].pid)  # the job's driver under its shell
        time.sleep(2.0)  # Ray Train's controllers are up and wait for their placement groups
        t0 = time.monotonic()
        for how in ("SIGINT", "SIGTERM", "shell died"):
            drivers[how][0].send_signal(signal.SIGINT if how == "SIGINT" else signal.SIGTERM)  # once
        for how, (driver, _) in drivers.items():
            driver.wait(timeout=STOPPED_WITHIN_S + 30)
            while how == "shell died" and _alive(python) and time.monotonic() - t0 < STOPPED_WITHIN_S + 30:
                time.sleep(0.2)
            took[how] = time.monotonic() - t0
    finally:
        for driver, _ in drivers.values():
            if driver.poll() is None:
                driver.kill()
                driver.wait()
        if _alive(python):
            os.kill(python, signal.SIGKILL)
    for how, (driver, log) in drivers.items():
        text = log.read_text(errors="replace")
        if WAYS[how] is not None:
            assert driver.returncode == WAYS[how], (how, text[-3000:])
        assert took[how] < STOPPED_WITHIN_S, (how, took, text[-3000:])
        assert "Traceback" not in text and "SIGTERM received" not in text and "Aborted" not in text, text[-3000:]
        mine = _my_lines(text)
        assert len(mine) == 1, (how, text[-3000:])
        if how == "start timeout":
            assert mine[0].startswith("knapray train: error: the workers waited "), mine
            assert "(scaling.start_timeout_s=3)" in mine[0] and "2 x {'CPU': 1}" in mine[0], mine
            assert "NO_RESOURCES" in mine[0] or "INFEASIBLE" in mine[0], mine  # Ray's own state of the group
        else:
            verb = "interrupted" if how == "SIGINT" else "stopped by SIGTERM"
            assert mine[0].startswith(f"knapray train: {verb}: run 'r' stopped before its first checkpoint"), mine
        assert not (tmp_path / how.replace(" ", "-") / "r" / "RUNNING.lock").exists()
    assert "the shell went on" not in drivers["shell died"][1].read_text()  # the shell itself died
    _no_waiting_groups(ray_session)


def test_a_file_error_in_a_ray_actor_reaches_the_driver_with_its_file_and_operation(ray_session):
    """The ledger journal is written by the coordinator actor: its full disk reaches rank 0 as
    the actor's error (``CoordinatorClient`` re-raises the cause) and the driver's one line
    (``first_failure``) names the journal and what was done to it."""
    import errno

    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError

    from knapray.commands.train import first_failure
    from knapray.file_errors import file_error

    ray = ray_session

    @ray.remote(num_cpus=0)
    class Journal:
        def append(self):
            raise file_error("appending to the ledger journal", "/runs/r/ledger/journal-000000000000.bin",
                             OSError(errno.ENOSPC, "No space left on device"))

    with pytest.raises(RayTaskError) as e:
        ray.get(Journal.remote().append.remote(), timeout=60)
    cause = e.value.cause  # what CoordinatorClient raises on the rank
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    line = first_failure(WorkerGroupError("...", {0: cause}))
    assert line == ("worker 0: FileError: appending to the ledger journal /runs/r/ledger/journal-000000000000.bin: "
                    "No space left on device"), line


def test_what_an_attached_cluster_has_is_asked_of_it(ray_session):
    """``--address``: the live nodes' resources; a cluster that reports no node types (this
    one, as a cluster started by hand) may still have an autoscaler: a worker no live node
    holds is not refused, and the run starts with a note instead."""
    from knapray.config.run import load_config
    from knapray.driver.placement import check_placement, cluster_capacity, fits_line

    capacity = cluster_capacity(ray_session, "the Ray cluster at here")
    assert capacity.autoscaler_unknown and len(capacity.nodes) == 1
    assert capacity.total()["CPU"] == ray_session.cluster_resources()["CPU"]
    gpus = load_config(None, ["scaling.use_gpu=true", "scaling.num_workers=2"])
    check_placement(gpus, capacity, [2])
    assert "its autoscaler must add them within scaling.start_timeout_s=900 s" in fits_line(gpus, capacity, [2])
