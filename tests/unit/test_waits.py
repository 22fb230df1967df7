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


def test_startup_marks_and_the_recovery_breakdown(tmp_path):
    """Rank 0's startup.jsonl line per attempt, split into Ray's part and the trainer's."""
    import json
    import os
    import time

    from knapray.testing.elastic_check import recovery_breakdown, recovery_table
    from knapray.worker.startup import StartupClock, process_started_at, read_startups

    started = process_started_at()
    assert started is not None and started <= time.time()
    clock = StartupClock()
    for name in ("model_ready", "restored", "first_step"):
        clock.mark(name)
    clock.write(str(tmp_path), step=0, world_size=4, node_sizes=[4], topology="g2n2")
    clock.write(str(tmp_path), step=1)  # once per attempt
    (line,) = read_startups(str(tmp_path))
    assert line["step"] == 0 and line["process_started"] <= line["trainer_started"] <= line["first_step"]
    cold = {"process_started": 105.0, "trainer_started": 110.0, "model_ready": 120.0, "restored": 120.0,
            "first_step": 140.0, "world_size": 4, "topology": "g2n2"}
    again = {"process_started": 230.0, "trainer_started": 235.0, "model_ready": 241.0, "restored": 243.0,
             "first_step": 252.0, "world_size": 3, "topology": "g2n1+g1n1"}
    with open(os.path.join(tmp_path, "startup.jsonl"), "w") as f:
        f.write(json.dumps(cold) + "\n" + json.dumps(again) + "\n{torn")
    rec = recovery_breakdown(read_startups(str(tmp_path)), fit_wall=100.0, changed_wall=200.0)
    assert rec["cold_start"] == {"ray": 10.0, "build": 10.0, "restore": 0.0, "first step": 20.0, "total": 40.0,
                                 "world_size": 4, "topology": "g2n2"}
    assert rec["after_change"]["ray"] == 35.0 and rec["after_change"]["total"] == 52.0
    table = recovery_table({"recovery": rec, "ledger": {"exactly_once": True, "rows": 44, "corpus_samples": 44}})
    assert "ray               10.0 s        35.0 s" in table and "total             40.0 s        52.0 s" in table
    assert table.endswith("ledger: exactly once (44 rows for 44 samples)")


def test_the_world_size_path_of_an_elastic_run():
    """Each change's target in turn, through sizes between two targets only (Ray noticing
    nodes one at a time), never away from the next target nor past it."""
    from knapray.testing.elastic_check import sizes_took_the_path

    assert sizes_took_the_path([3, 3, 4, 3], [3, 4, 3])
    assert sizes_took_the_path([2, 3, 4], [2, 4])  # an added node noticed one slot at a time
    assert not sizes_took_the_path([3, 2, 4, 3], [3, 4, 3])  # away from the target
    assert not sizes_took_the_path([2, 4, 3], [2, 4])  # past the last one
    assert not sizes_took_the_path([3, 4], [3, 4, 3])  # a change never landed
    assert not sizes_took_the_path([4, 3], [3, 4, 3]) and not sizes_took_the_path([], [3])
