"""The session's Ray on the fork server (tests/ray_worker_fork.py): its workers are forks of a
warm server (with ``KNAPRAY_TEST_FORK=1``: docs/testing.md), and each draws its own random
ids from Ray, as Ray assumes of separate processes. The server alone:
tests/unit/test_ray_worker_fork.py."""

from __future__ import annotations

import os
import pathlib

import pytest

pytestmark = pytest.mark.ray


def _who():
    import sys

    from ray._raylet import UniqueID

    return os.getpid(), os.getppid(), "ray.train" in sys.modules, UniqueID.from_random().hex()


class _Who:
    def who(self):
        return _who()


@pytest.mark.skipif(os.environ.get("KNAPRAY_TEST_FORK") != "1", reason="the fork server is on with KNAPRAY_TEST_FORK=1")
def test_the_sessions_workers_are_forks_that_draw_their_own_ids(ray_session):
    ray = ray_session
    got = ray.get([ray.remote(num_cpus=1)(_who).remote() for _ in range(2)])
    actors = [ray.remote(num_cpus=0)(_Who).remote() for _ in range(2)]  # two processes for sure
    got += ray.get([a.who.remote() for a in actors])
    for a in actors:
        ray.kill(a)
    assert os.environ.get("KNAPRAY_TEST_RAY_FORK_SERVER"), "conftest started no fork server"
    log = pathlib.Path(os.environ["KNAPRAY_TEST_RAY_FORK_SERVER"] + ".log")
    said = log.read_text() if log.exists() else "(the server logged nothing)"
    assert all(warm for _pid, _ppid, warm, _id in got), (got, said)  # Ray Train imported before the fork
    by_pid = {pid: drawn for pid, _ppid, _warm, drawn in got}
    assert len(set(by_pid.values())) == len(by_pid) >= 2, got
