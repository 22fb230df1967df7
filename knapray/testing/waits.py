"""Waiting on a run under test by its progress, not by the wall clock.

A fixed bound ("a second checkpoint within 100 s") fails on a machine loaded by other work,
where the same run is merely slower. ``ProgressDeadline`` fails only when the run stops
making progress: it is told what the run has produced so far (a log's size, a step
record, a checkpoint), and the wait expires after a quiet spell longer than
``max(floor_s, factor x the time the run took to its last progress)``: a run that needed
40 s to reach its last event may be quiet for 80 s before it counts as stuck; one that
produced something a moment ago keeps its allowance.
"""

from __future__ import annotations

import time
from collections.abc import Hashable


class ProgressDeadline:
    """``progressed(signature)`` with whatever the run has produced so far; ``expired()``
    once nothing has changed for longer than the allowance; ``why()`` says so in one line."""

    def __init__(self, floor_s: float = 60.0, factor: float = 2.0, clock=time.monotonic) -> None:
        self.floor_s, self.factor, self.clock = floor_s, factor, clock
        self.start = self.last = clock()
        self.signature: Hashable = None

    def progressed(self, signature: Hashable) -> bool:
        """Record the run's state; True if it changed since the last call."""
        if signature == self.signature:
            return False
        self.signature, self.last = signature, self.clock()
        return True

    @property
    def allowance_s(self) -> float:
        return max(self.floor_s, self.factor * (self.last - self.start))

    def expired(self) -> bool:
        return self.clock() - self.last > self.allowance_s

    def why(self, what: str) -> str:
        return (f"{what}: nothing changed for {self.clock() - self.last:.0f} s (allowed {self.allowance_s:.0f} s, "
                f"{self.factor:g}x the {self.last - self.start:.0f} s the run took to its last progress, at least "
                f"{self.floor_s:.0f} s)")
