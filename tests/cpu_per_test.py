"""A pytest plugin that writes, for every test, the machine's CPU seconds and the wall seconds
it took, and the CPU seconds of the test's own process: where the suite's time goes when its
tests run one at a time on a quiet machine (the machine's CPU counts every process a test
starts: gloo ranks, Ray's workers and actors, commands, compilers).

    PYTHONPATH=tests CPU_PER_TEST=/tmp/cpu.txt OMP_NUM_THREADS=1 python -m pytest -p cpu_per_test tests

Each line: machine CPU-s, this process's CPU-s, wall s, the test's id. docs/testing.md sums
them by file. Busy time is read from /proc/stat (Linux)."""

from __future__ import annotations

import os
import resource
import time

import pytest

_HZ = os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _HZ


def _own_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    machine, own, wall = _machine_busy_s(), _own_s(), time.monotonic()
    yield
    with open(os.environ.get("CPU_PER_TEST", "cpu_per_test.txt"), "a") as out:
        out.write(f"{_machine_busy_s() - machine:8.2f} {_own_s() - own:8.2f} {time.monotonic() - wall:8.2f} "
                  f"{item.nodeid}\n")
