"""A pytest plugin that writes, for every test, the CPU seconds it took and its wall seconds:
where the suite's time goes.

    PYTHONPATH=tests CPU_PER_TEST=/tmp/cpu.txt OMP_NUM_THREADS=1 python -m pytest -p cpu_per_test tests

Each line: the machine's CPU-s, this process's, this process's and every process under it
(``TreeCPU``), wall s, the test's id. The machine's counts every process a test starts (gloo
ranks, Ray's workers and actors, commands, compilers) but also whatever else runs, so it is
the test's own only when tests run one at a time on a quiet machine; the tree's holds under
several pytest-xdist workers (``make test``: ``PYTEST_ADDOPTS="-p cpu_per_test"``), each
writing its own tests' lines. docs/testing.md sums them by file. Linux (/proc)."""

from __future__ import annotations

import os
import resource
import threading
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


class TreeCPU:
    """CPU seconds of this process and every process under it while a test runs, each process's
    time taken while it lives: a thread looks every ``every`` seconds and keeps each one's last
    value (a process's last ``every`` seconds are missed). Read at the end, the processes'
    ``children_*`` times would miss Ray's: the raylet, which starts every Ray worker, reaps its
    ended workers without adding their time to its own (a two-epoch Ray Train test: 7 of its
    55 CPU-s that way, 50 this way)."""

    def __init__(self, every: float = 0.25) -> None:
        import psutil  # Ray's dependency: there wherever the suite runs in full

        self.me, self.every = psutil.Process(), every
        self.base: dict = {}
        self.last: dict = {}
        self._look(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-per-test", daemon=True)
        self._thread.start()

    def _look(self, into: dict) -> None:
        import psutil

        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    into[(p.pid, p.create_time())] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._look(self.last)

    def seconds(self) -> float:
        self._stop.set()
        self._thread.join()
        self._look(self.last)
        return sum(cpu - self.base.get(key, 0.0) for key, cpu in self.last.items())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    tree = TreeCPU()
    machine, own, wall = _machine_busy_s(), _own_s(), time.monotonic()
    yield
    line = (f"{_machine_busy_s() - machine:8.2f} {_own_s() - own:8.2f} {tree.seconds():8.2f} "
            f"{time.monotonic() - wall:8.2f} {item.nodeid}\n")
    with open(os.environ.get("CPU_PER_TEST", "cpu_per_test.txt"), "a") as out:
        out.write(line)
