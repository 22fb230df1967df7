"""Elastic restart with a re-planned topology (Ray Train's ScalingConfig(num_workers=(min,
max))) on an emulated two-node Ray cluster (``ray.cluster_utils.Cluster``), where the
bags follow where Ray really put the workers: one run grows onto uneven nodes (3 -> 4
workers on nodes of 3 and 1 slots) with its coordinator killed on the way, then shrinks
back (the 1-slot node removed: 4 -> 3). The scenarios ``grow`` (2 -> 4, g2n2) and
``shrink`` (4 -> 3 from the uneven start) of the same command are the two halves alone.

After each change the run goes on from its checkpoint with the coordinator's topology
for the new world on its nodes, bag groups rebuilt, data re-sharded, and the ledger
holds every corpus sample exactly once.

The scenario runs ``python -m knapray.commands.elastic_check`` in a subprocess: it builds
its own Ray cluster (in a private Ray temp dir), which must not collide with the Ray
instance this test session shares (``ray_session``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections import Counter

import pyarrow.parquet as pq
import pytest

from knapray.corpus import shard_paths

# The scenario waits on its run's progress (knapray.testing.waits): stuck after a quiet spell,
# never for being slow; the bounds here only guard against a hang outside it.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(1800)]

REPO = pathlib.Path(__file__).resolve().parents[2]


def _run_scenario(scenario: str, out: pathlib.Path, *extra: str) -> dict:
    # A cluster of several nodes: Ray Train's preemption watcher as Ray has it (the suite
    # turns it off for its single-machine Rays).
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER")}
    cmd = [sys.executable, "-m", "knapray.commands.elastic_check", "--scenario", scenario, "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
    path = out / "result.json"
    assert path.exists(), f"{scenario}: no result.json (rc {proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(path.read_text())
    assert proc.returncode == 0, f"{scenario} failed: {result.get('checks')}\n{proc.stdout[-6000:]}"
    return result


def _check_ledger(result: dict, last_step: int) -> None:
    """The ledger, read here from the run directory: every corpus sample exactly once."""
    run_dir = pathlib.Path(result["settings"]["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.strip()]
    corpus = run_dir.parents[1] / f"corpus-{result['settings']['corpus_steps']}"
    ids = [i for p in shard_paths(corpus) for i in pq.read_table(p, columns=["sample_id"])["sample_id"].to_pylist()]
    counts = Counter(r["sample_id"] for r in rows)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}
    assert {r["step"] for r in rows} == set(range(last_step + 1))


def test_elastic_grow_then_shrink_on_uneven_nodes_with_the_coordinator_killed(tmp_path):
    """One run on one cluster, both directions (one cluster's start and one run's, not two):

    - starts on a node of 3 slots: g2n1+g1n1;
    - the coordinator actor is killed after step 1: Ray restarts it on the head, it reloads
      its state from the run directory, the ranks plan locally until it answers again;
    - grow: a node of 1 slot joins; Ray Train's elastic monitor resizes the running group
      3 -> 4 from the latest checkpoint, on uneven nodes (3 and 1): g2n1+g1n2, where the
      rule bags_of:2 alone would give g2n2, whose second bag spans both nodes. ``--nudge``
      has Ray's AutoscalingCoordinator re-read the cluster at once rather than at its next
      20 s tick, so that the resize comes before this small epoch runs out;
    - shrink: 2 steps after it trains at 4, the 1-slot node is removed: the group fails, Ray
      restarts it on the 3 workers left (after a 10 s start timeout, not its default 60):
      g2n1+g1n1.
    """
    result = _run_scenario("grow-shrink", tmp_path, "--nudge")
    segs = result["segments"]
    path = [(s["world_size"], sorted(s["node_sizes"]), s["topology"]) for s in segs]
    # Each attempt, in turn: the size, the real nodes and the topology the rule gives them.
    # (Ray may restart at the same size once more; it never passes through another here.)
    collapsed = [p for i, p in enumerate(path) if i == 0 or p != path[i - 1]]
    assert collapsed == [(3, [3], "g2n1+g1n1"), (4, [1, 3], "g2n1+g1n2"), (3, [3], "g2n1+g1n1")], segs
    assert all(s["topology"] == s["expected_topology"] and s["bags_within_nodes"] for s in segs), segs
    # Training went on after each change from a checkpoint (not from step 0, no gap).
    assert all(0 < b["first_step"] <= a["last_step"] + 1 for a, b in zip(segs, segs[1:])), segs
    assert [c["change"] for c in result["changes"]] == [1, -1]
    assert segs[-1]["steps"] > 0 and segs[-1]["first_step"] > result["changes"][0]["after_step"]  # a checkpoint at 4
    final = result["final_attempt"]
    assert (final["world_size"], final["topology"]) == (3, "g2n1+g1n1")
    assert (final["first_step"], final["last_step"]) == (segs[-1]["first_step"], segs[-1]["last_step"])
    # The coordinator: killed, restarted, on the head at the kill and after each change.
    assert [p["coordinator_on"] for p in result["coordinator_placements"]] == ["head"] * 3
    assert result["checks"]["coordinator killed, restarted by Ray, found on the head again"]
    assert result["checks"]["the rule alone (g2n2) would cross a node of the layout [1, 3]"]
    # The recovery after each change, phase by phase, from each attempt's startup marks.
    grown, shrunk = result["recovery"]["after_changes"]
    assert (grown["world_size"], shrunk["world_size"]) == (4, 3)
    for after in (grown, shrunk):
        assert after["total"] > 0
        assert sum(after[p] for p in ("ray", "build", "restore", "first step")) == pytest.approx(after["total"], abs=0.1)
    _check_ledger(result, segs[-1]["last_step"])
