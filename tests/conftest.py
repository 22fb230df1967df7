"""Shared fixtures. Ray starts once per test session (cold start costs seconds)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent
# Train functions defined in test modules are pickled by module name: workers need this.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p
)
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole session (namespace 'knapray-test')."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=6,
            include_dashboard=False,
            namespace="knapray-test",
            log_to_driver=False,
            configure_logging=False,
        )
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """Where Ray is not installed (the GPU machine), its tests skip instead of failing."""
    if importlib.util.find_spec("ray") is not None:
        return
    skip = pytest.mark.skip(reason="needs Ray (not installed here)")
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(skip)
