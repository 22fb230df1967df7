"""Per-rank compute and communication seconds of a training step.

What the coordinator's per-rank speed factors are learned from, so it must measure the
device's work, not the host's:

- on CUDA, a pair of CUDA events around the step on the current stream gives the GPU
  time of the step; every all-to-all inside it is bracketed by events too
  (``comm_timer``), and compute is the step's GPU time minus the exchanges'. Kernels run
  asynchronously, so host clocks (``time.thread_time``) would measure kernel launches.
- on CPU, the calling thread's CPU time (``time.thread_time``) minus the CPU time spent
  inside all-to-alls: it does not grow while a process waits for a core, so it stays
  meaningful with more ranks than cores; communication is wall time in the exchanges.

Neither path synchronizes the device while the step runs; ``StepTimer.result`` waits for
the step's last event once, after the caller has queued everything it wants to overlap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from knapray.distributed.comms import CommTime, comm_timer


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    """Model compute of the step on this rank, communication excluded."""
    comm_s: float
    """Time inside the routing and Ulysses all-to-alls (waiting for peers included)."""
    clock: str
    """``cuda_events`` or ``thread_time``: what measured it."""


class StepTimer:
    """``with StepTimer(device) as timer: forward; backward`` then ``timer.result()``."""

    def __init__(self, device: torch.device | str) -> None:
        self.on_cuda = torch.device(device).type == "cuda"
        self._comm_ctx = comm_timer()
        self._comm: CommTime | None = None
        self._result: StepTime | None = None

    def __enter__(self) -> "StepTimer":
        if self.on_cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.thread_time()
        self._comm = self._comm_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._comm_ctx.__exit__(*exc)
        if self.on_cuda:
            self._end.record()
        else:
            self._cpu_s = time.thread_time() - self._t0

    def result(self) -> StepTime:
        """The step's times; on CUDA this waits for the step's kernels (once)."""
        if self._result is None:
            comm = self._comm
            assert comm is not None, "StepTimer.result() before the timed block ran"
            if self.on_cuda:
                self._end.synchronize()
                total = self._start.elapsed_time(self._end) / 1e3
                comm_s = comm.device_s()
                self._result = StepTime(max(total - comm_s, 0.0), comm_s, "cuda_events")
            else:
                self._result = StepTime(max(self._cpu_s - comm.cpu_s, 0.0), comm.wall_s, "thread_time")
        return self._result
