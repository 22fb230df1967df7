"""ProgressDeadline: a wait that fails when the run under test is stuck, not when it is slow."""

from __future__ import annotations

from knapray.testing.waits import ProgressDeadline


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_slow_run_that_keeps_moving_never_expires_and_a_quiet_one_does():
    clock = Clock()
    wait = ProgressDeadline(floor_s=60, factor=2, clock=clock)
    for step in range(100):  # a step every 50 s: slower than the floor, but moving
        clock.t += 50
        assert wait.progressed(step) and not wait.expired()
    assert wait.allowance_s == 2 * 5000  # twice the time to the last progress
    clock.t += 9_999
    assert not wait.progressed(99) and not wait.expired()
    clock.t += 2
    assert wait.expired() and "nothing changed for 10001 s (allowed 10000 s" in wait.why("the run")
    fresh = ProgressDeadline(floor_s=60, clock=clock)
    clock.t += 61
    assert fresh.expired()  # nothing at all for longer than the floor
