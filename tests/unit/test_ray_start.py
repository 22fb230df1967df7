"""How knapray starts its embedded Ray (``knapray.local_ray.init_ray``), with a stand-in for
``ray``: nothing starts here. Binding to 127.0.0.1 is tests/ray/test_local_ray.py's."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("ray")

from knapray.local_ray import STARTUP_ENV, init_ray  # noqa: E402


class _Ray:
    """Records what the raylet would read from the environment when it starts."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []

    def init(self, **kwargs) -> None:
        self.seen.append(os.environ.get(STARTUP_ENV))


def test_an_embedded_ray_expects_its_actors_to_start_together(monkeypatch):
    """Ray expects min(cores, CPUs) Python processes to start at once (2 on a 2-core
    machine) and printed "(raylet) WARNING: 8 PYTHON worker processes ... 4x the maximum
    expected startup concurrency (2)" when a command's zero- and half-CPU actors (a serving
    gang, Serve's controller and proxy; training workers, the coordinator, a relay) started
    together. An embedded Ray expects 4 per logical CPU; a cluster's raylets are not ours."""
    monkeypatch.delenv(STARTUP_ENV, raising=False)
    ray = _Ray()
    init_ray(ray, num_cpus=4)
    init_ray(ray)  # Ray counts the machine's cores
    init_ray(ray, address="10.0.0.1:6379")
    monkeypatch.setenv(STARTUP_ENV, "3")  # the user's setting wins
    init_ray(ray, num_cpus=4)
    assert ray.seen == ["16", str(4 * (os.cpu_count() or 1)), None, "3"]
    assert os.environ[STARTUP_ENV] == "3"
    monkeypatch.delenv(STARTUP_ENV)
    init_ray(ray, num_cpus=4)
    assert STARTUP_ENV not in os.environ  # set for the start only: the raylet reads it then
