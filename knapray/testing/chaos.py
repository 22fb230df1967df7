"""Fault injection from outside the training job, and the exactly-once check.

``Chaos`` watches rank 0's metrics.jsonl from the driver and, once the run reaches a
given step, SIGKILLs a training worker (its pid is in ``run_dir/pids``) or kills the
coordinator actor (Ray restarts it: ``max_restarts``). Nothing in the training code knows
about it: the faults are the real thing, not polite exceptions.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from knapray.run_files import RunDir


@dataclass
class ChaosLog:
    events: list[dict] = field(default_factory=list)


class Chaos(threading.Thread):
    def __init__(
        self,
        run_dir: str,
        *,
        kill_worker_at: int | None = None,
        worker_rank: int = 1,
        kill_coordinator_at: int | None = None,
        coordinator_name: str | None = None,
        coordinator_down_steps: int | None = None,
        recreate_coordinator=None,
        coordinator_gone: bool = False,
        poll_s: float = 0.2,
    ) -> None:
        """``coordinator_down_steps``: instead of letting Ray restart the killed actor at
        once, keep it dead while the run trains that many more steps (a node that is down
        for a while: ranks must plan locally meanwhile), then ``recreate_coordinator()``.
        ``coordinator_gone``: killed without a restart and never back."""
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.kill_worker_at, self.worker_rank = kill_worker_at, worker_rank
        self.kill_coordinator_at, self.coordinator_name = kill_coordinator_at, coordinator_name
        self.down_steps, self.recreate, self.gone = coordinator_down_steps, recreate_coordinator, coordinator_gone
        self.recreated = None
        self.poll_s = poll_s
        self.log = ChaosLog()
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def _last_step(self) -> int:
        path = RunDir(self.run_dir).metrics
        if not os.path.exists(path):
            return -1
        last = -1
        with open(path) as f:
            for line in f:
                try:
                    last = max(last, json.loads(line)["step"])
                except (ValueError, KeyError):
                    pass  # a line being written
        return last

    def run(self) -> None:
        while not self._halt.wait(self.poll_s):
            step = self._last_step()
            if self.kill_worker_at is not None and step >= self.kill_worker_at:
                pid_file = RunDir(self.run_dir).pid_file(self.worker_rank)
                try:
                    pid = int(open(pid_file).read())
                    os.kill(pid, signal.SIGKILL)
                    self.log.events.append({"event": "worker_sigkill", "rank": self.worker_rank,
                                            "pid": pid, "after_step": step, "t": time.time()})
                except (OSError, ValueError) as e:
                    self.log.events.append({"event": "worker_kill_failed", "error": str(e)})
                self.kill_worker_at = None
            if self.kill_coordinator_at is not None and step >= self.kill_coordinator_at:
                import ray

                try:
                    down = self.down_steps is not None
                    ray.kill(ray.get_actor(self.coordinator_name), no_restart=down or self.gone)
                    self.log.events.append({"event": "coordinator_killed", "after_step": step, "t": time.time()})
                    if down and not self.gone:
                        while self._last_step() < step + self.down_steps and not self._halt.wait(self.poll_s):
                            pass
                        # Keep the handle: a non-detached actor dies with its last reference.
                        self.recreated = self.recreate()
                        self.log.events.append({"event": "coordinator_recreated", "after_step": self._last_step(),
                                                "t": time.time()})
                except Exception as e:  # noqa: BLE001 - report whatever stopped the kill
                    self.log.events.append({"event": "coordinator_kill_failed", "error": str(e)})
                self.kill_coordinator_at = None
            if self.kill_worker_at is None and self.kill_coordinator_at is None:
                return


def check_once_per_epoch(ledger_path: str, expected_ids, epochs: int) -> dict:
    """``check_exactly_once`` for each of ``epochs`` epochs: every expected sample once in each."""
    rows = [json.loads(line) for line in open(ledger_path) if line.strip()]
    out = {"rows": len(rows), "epochs": {}}
    for epoch in range(epochs):
        counts = Counter(r["sample_id"] for r in rows if r["epoch"] == epoch)
        expected = set(int(i) for i in expected_ids)
        out["epochs"][epoch] = {"missing": sorted(expected - set(counts)),
                                "duplicated": sorted(i for i, c in counts.items() if c > 1),
                                "unexpected": sorted(set(counts) - expected)}
    out["ok"] = all(not any(e.values()) for e in out["epochs"].values())
    return out


def check_exactly_once(ledger_path: str, expected_ids) -> dict:
    """Compare the ledger with the samples that should have been trained once each."""
    rows = [json.loads(line) for line in open(ledger_path) if line.strip()]
    counts = Counter(r["sample_id"] for r in rows)
    expected = set(int(i) for i in expected_ids)
    missing = sorted(expected - set(counts))
    duplicated = sorted(i for i, c in counts.items() if c > 1)
    unexpected = sorted(set(counts) - expected)
    return {
        "rows": len(rows),
        "expected": len(expected),
        "missing": missing,
        "duplicated": duplicated,
        "unexpected": unexpected,
        "attempts": sorted({r["attempt"] for r in rows}),
        "ok": not missing and not duplicated and not unexpected,
    }
