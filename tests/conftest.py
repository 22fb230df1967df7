"""Shared fixtures. Ray starts once per test session (cold start costs seconds)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent
TIERS = ("unit", "dist", "ray", "gpu")
"""The suite's directories (tests/README.md): pure and single-process, multi-process gloo,
Ray, a CUDA device."""
# The helpers (dist_utils, flux_utils, tiny_encoders, ...) live here; train functions
# defined in test modules are pickled by module name, so Ray workers and spawned ranks
# need every tier's directory on their path too.
_PATHS = [str(TESTS_DIR), *(str(TESTS_DIR / t) for t in TIERS)]
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (*_PATHS, os.environ.get("PYTHONPATH", "")) if p
)
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# The session's Ray is a single-machine Ray, as the one knapray starts itself, where Ray
# Train's preemption watcher is off (knapray.driver.launch.preemption_watcher): the same here
# (an actor and ~1.5 CPU-s less per fit). The multi-node elastic scenario keeps Ray's default.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# Under pytest-xdist each worker process gets its share of the cores for torch's intra-op
# threads (torch reads it at its first parallel op; the processes tests start inherit it):
# two copies of a compiled-gradient test, two threads each on two cores, took 20% longer
# than with one thread each.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
for _p in reversed(_PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def _start_ray():
    import ray

    if not ray.is_initialized():
        _fast_worker_start()
        ray.init(num_cpus=6, include_dashboard=False, namespace="knapray-test", log_to_driver=False,
                 configure_logging=False)
    return ray


def _fast_worker_start():
    """Every Python worker a Ray started by this process runs ``tests/ray_worker_start.py``
    first, in place of Ray's ``setup_worker.py``, which imports Ray only to set the worker's
    environment and exec it (0.5 CPU-s a worker, hundreds of workers in the suite). Ray reads
    the file name when a node starts (``ray._private.node``); Ray's own program stays the
    fallback for anything but a plain Python worker. With ``KNAPRAY_TEST_FORK=1`` that program
    has a plain worker forked from a server that imported torch, Ray, Ray Train and Ray Data
    once (``_start_fork_server``)."""
    from ray._private import ray_constants

    ours = str(TESTS_DIR / "ray_worker_start.py")
    if ray_constants.SETUP_WORKER_FILENAME != ours:
        os.environ["KNAPRAY_TEST_RAY_SETUP_WORKER"] = os.path.join(
            os.path.dirname(ray_constants.__file__), "workers", ray_constants.SETUP_WORKER_FILENAME)
        ray_constants.SETUP_WORKER_FILENAME = ours
    _start_fork_server()


_FORK_SERVER: list = []


def _stop_fork_servers() -> None:
    """At this process's exit: its fork servers stopped and their directories gone."""
    import shutil

    for server in _FORK_SERVER:
        if server.poll() is None:
            server.kill()
            server.wait()
        shutil.rmtree(os.path.dirname(server.args[-1]), ignore_errors=True)


def _start_fork_server() -> None:
    """The fork server of this test process's Ray workers (``tests/ray_worker_fork.py``),
    started before the first Ray this process starts, with this process's environment (and
    again before a later one if it ended); it ends with this process. Only with
    ``KNAPRAY_TEST_FORK=1``: in ``make test`` only the first Ray of a test process had its
    workers forked (docs/testing.md), so it is off there (every worker a fresh interpreter,
    as Ray starts them) until that is understood."""
    if (_FORK_SERVER and _FORK_SERVER[-1].poll() is None) or os.environ.get("KNAPRAY_TEST_FORK") != "1":
        return
    import subprocess
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="knapray-fork-"), "server")
    os.environ["KNAPRAY_TEST_RAY_FORK_SERVER"] = path
    server = subprocess.Popen([sys.executable, str(TESTS_DIR / "ray_worker_fork.py"), path],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    _FORK_SERVER.append(server)
    if len(_FORK_SERVER) == 1:
        import atexit

        atexit.register(_stop_fork_servers)
    if server.stdout.readline().strip() != "ready":
        os.environ.pop("KNAPRAY_TEST_RAY_FORK_SERVER")


@pytest.fixture(scope="session")
def ray_session():
    """The local Ray of this test process (namespace 'knapray-test'), up while its files run:
    started by the first test that asks, shut down when the next test's file does not ask
    (``pytest_runtest_teardown``), started again by the next that does (``pytest_runtest_setup``)."""
    ray = _start_ray()
    yield ray
    ray.shutdown()


def _uses_ray(item) -> bool:
    return item is not None and "ray_session" in getattr(item, "fixturenames", ())


def pytest_runtest_setup(item):
    """A Ray test after the session's Ray was shut down between files: start it again."""
    if _uses_ray(item) and _RAY_DOWN[0]:
        _start_ray()
        _RAY_DOWN[0] = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a file, a local Ray left up (the session's, its module fixtures
    torn down, or one a command started in this process) is shut down unless the next test
    uses it: an idle local Ray costs ~8% of a core (its raylet, GCS, agents and idle workers
    polling), which the files after a worker's Ray files (most of the suite's tail) paid for
    nothing."""
    yield
    ray = sys.modules.get("ray")
    if (nextitem is None or nextitem.module is not item.module) and not _uses_ray(nextitem) \
            and getattr(ray, "is_initialized", lambda: False)():
        ray.shutdown()
        _RAY_DOWN[0] = True


_RAY_DOWN = [False]
"""Whether ``pytest_runtest_teardown`` shut the session's Ray down (a later Ray test starts it)."""


def _ray_installed() -> bool:
    """Whether the real Ray is importable. tests/ is on sys.path, so without Ray the tier
    directory tests/ray/ is found as a namespace package named ``ray`` (origin None)."""
    spec = importlib.util.find_spec("ray")
    return spec is not None and spec.origin is not None


SLOW_FILES = {
    "test_readme_commands.py": 170, "test_faults.py": 149, "test_elastic.py": 134, "test_sampling_engine.py": 133,
    "test_grad_truth.py": 126, "test_gang.py": 109, "test_serve_http.py": 94, "test_parallelize.py": 90,
    "test_torchrun.py": 82, "test_dryrun.py": 79, "test_float8.py": 73, "test_runs.py": 69,
    "test_balanced_sampling.py": 52, "test_overlap.py": 51, "test_serve_image.py": 46, "test_driver_death.py": 44,
    "test_submit_demo.py": 40, "test_train_ray.py": 39, "test_sample_dryrun.py": 35, "test_stopping.py": 33,
    "test_ingest_ray.py": 28, "test_experts.py": 28, "test_wan_ingest.py": 26, "test_float8_fsdp.py": 25,
    "test_wan_dist.py": 24, "test_lora_unit.py": 23, "test_lora.py": 23, "test_data.py": 20, "test_coordinator.py": 19,
    "test_profiling.py": 18, "test_coordinator_scale.py": 15,
}
"""Seconds a file's tests take here with torch's compile cache empty, as on a fresh machine or CI
runner (``--durations=0``, the mean of two fresh-machine runs, 2026-11-30; with the cache warm
the compiled files take 0.3-0.65 of this). ``make test`` runs the suite on several
workers, a file per worker at a time (``--dist loadfile``): these go first, so the short files
fill in around them instead of one long file running alone at the end."""


def pytest_collection_modifyitems(config, items):
    """Where Ray is not installed (the GPU machine), its tests skip instead of failing. The
    files that share the session's Ray first, then the others, the slowest first within
    each (``SLOW_FILES``), every file's tests in their own order: a worker then runs its
    Ray files one after another on one Ray, where the slowest-first order alone had it
    start and stop a Ray for nearly every one of them (each start with its idle workers
    and the singleton actors Ray Data and Ray Train create in it: ~8 CPU-s)."""
    shares = {item.path for item in items if _uses_ray(item)}
    rank = {}
    for i, item in enumerate(items):
        rank.setdefault(item.path, (item.path not in shares, -SLOW_FILES.get(item.path.name, 0), i))
    items.sort(key=lambda item: rank[item.path])
    if _ray_installed():
        return
    skip = pytest.mark.skip(reason="needs Ray (not installed here)")
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(skip)
