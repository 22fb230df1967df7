"""Elastic restart with a re-planned topology (Ray Train's ScalingConfig(num_workers=(min,
max))) on an emulated two-node Ray cluster (``ray.cluster_utils.Cluster``), where the
bags follow where Ray really put the workers:

- shrink: 4 workers on nodes of 3 and 1 slots (uneven: the rule bags_of:2 alone would
  give g2n2, whose second bag spans both nodes; the real layout gives g2n1+g1n2, a bag of 2
  and one of 1 in the node of 3), then the 1-slot node is removed: 3 workers, g2n1+g1n1;
- grow: 2 workers on one node (g2n1); the coordinator actor is killed after step 1 (Ray
  restarts it on the head, where it is pinned; the ranks plan locally meanwhile), then a
  second 2-slot node joins: 4 workers, g2n2.

After each change the run goes on from its checkpoint with the coordinator's topology
for the new world on its nodes, bag groups rebuilt, data re-sharded, and the ledger
holds every corpus sample exactly once.

Each scenario runs ``python -m knapray.commands.elastic_check`` in a subprocess: it builds
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
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "knapray.commands.elastic_check", "--scenario", scenario, "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
    path = out / "result.json"
    assert path.exists(), f"{scenario}: no result.json (rc {proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(path.read_text())
    assert proc.returncode == 0, f"{scenario} failed: {result.get('checks')}\n{proc.stdout[-6000:]}"
    return result


def _check(result: dict, worlds: tuple[int, int], topologies: tuple[str, str], nodes: tuple[list, list]) -> None:
    segs = result["segments"]
    sizes = [s["world_size"] for s in segs]
    # The world size changed as intended (Ray may pass through an intermediate size when
    # it notices added nodes one at a time, never away from the target).
    assert (segs[0]["world_size"], segs[0]["topology"]) == (worlds[0], topologies[0]), segs
    assert (segs[-1]["world_size"], segs[-1]["topology"]) == (worlds[1], topologies[1]), segs
    assert sorted(segs[0]["node_sizes"]) == nodes[0] and sorted(segs[-1]["node_sizes"]) == nodes[1], segs
    assert sizes == sorted(sizes, reverse=worlds[1] < worlds[0]), segs
    # Every attempt: the rule's topology for its world on its real nodes, no bag across one.
    assert all(s["topology"] == s["expected_topology"] and s["bags_within_nodes"] for s in segs), segs
    # ... and the last attempt (the run's summary) ran on the new world with the new topology.
    assert (result["final_attempt"]["world_size"], result["final_attempt"]["topology"]) == (worlds[1], topologies[1])
    # Training went on after the change, from a checkpoint (not from step 0, no gap).
    last = segs[-1]
    assert last["steps"] > 0 and 0 < last["first_step"] <= segs[-2]["last_step"] + 1, segs
    final = result["final_attempt"]
    assert (final["first_step"], final["last_step"]) == (last["first_step"], last["last_step"])
    # The coordinator stayed on the head node.
    assert [p["coordinator_on"] for p in result["coordinator_placements"]] == ["head"] * len(
        result["coordinator_placements"]) and len(result["coordinator_placements"]) >= 2
    # The ledger, read here from the run directory: every corpus sample exactly once.
    run_dir = pathlib.Path(result["settings"]["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines() if line.strip()]
    corpus = run_dir.parents[1] / f"corpus-{result['settings']['corpus_steps']}"
    ids = [i for p in shard_paths(corpus) for i in pq.read_table(p, columns=["sample_id"])["sample_id"].to_pylist()]
    counts = Counter(r["sample_id"] for r in rows)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}
    assert {r["step"] for r in rows} == set(range(last["last_step"] + 1))


def test_elastic_shrink_uneven_nodes_4_to_3(tmp_path):
    """Nodes of 3 and 1 slots: bags stay within them and keep sequence parallelism where a
    node allows it (g2n1+g1n2, where the rule alone would give g2n2 across the two); the
    1-slot node is removed after step 2: the group fails, Ray restarts it on the 3 workers
    left (after a 10 s start timeout, not its default 60), g2n1+g1n1 (the node of 3 keeps
    its bag of 2; g1n3 before)."""
    result = _run_scenario("shrink", tmp_path)
    _check(result, (4, 3), ("g2n1+g1n2", "g2n1+g1n1"), ([1, 3], [3]))
    # The recovery, phase by phase, from each attempt's startup marks (the table the check prints).
    after = result["recovery"]["after_change"]
    assert after["world_size"] == 3 and after["total"] > 0
    assert sum(after[p] for p in ("ray", "build", "restore", "first step")) == pytest.approx(after["total"], abs=0.1)
    assert result["checks"]["the rule alone (g2n2) would cross a node of the start layout"]


def test_elastic_grow_2_to_4_with_the_coordinator_killed(tmp_path):
    """The coordinator actor is killed after step 1: Ray restarts it on the head, it reloads
    its state from the run directory, the ranks plan locally until it answers again. A
    second 2-slot node joins after step 2: Ray Train's elastic monitor resizes the running
    group 2 -> 4 from the latest checkpoint, g2n1 -> g2n2. ``--nudge`` has Ray's
    AutoscalingCoordinator re-read the cluster at once rather than at its next 20 s tick,
    so that the resize comes before this small epoch runs out."""
    result = _run_scenario("grow", tmp_path, "--nudge", "--change-after-step", "3")
    _check(result, (2, 4), ("g2n1", "g2n2"), ([2], [2, 2]))
    assert result["checks"]["coordinator killed, restarted by Ray, found on the head again"]
