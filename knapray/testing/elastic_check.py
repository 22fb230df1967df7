"""Elastic restart with a re-planned topology, end to end on a private two-node Ray cluster
(the library of ``python -m knapray.commands.elastic_check``).

Builds its own Ray cluster (``ray.cluster_utils.Cluster``: a head with a few CPUs for Ray
Data and the driver-side actors, the balance coordinator pinned there, plus worker nodes
that carry ``knapray_slot`` resources, the custom resource every training worker asks for
one of, so a node with k slots runs k training workers), a tiny corpus, and runs
``run_training`` elastically (``scaling.min_workers < scaling.num_workers``, topology rule
``bags_of:2``) in a background thread. The main thread watches rank 0's
``metrics.jsonl`` and, after a few steps,

- ``shrink``: starts on nodes of 3 and 1 slots (uneven: the rule's g2n2 would put a bag
  across the two nodes; the real layout gives g2n1+g1n2), then removes the 1-slot node
  (4 -> 3 workers, g2n1+g1n2 -> g2n1+g1n1);
- ``grow``: starts on one node of 2 slots (g2n1), kills the coordinator actor after step 1
  (Ray restarts it on the head; it reloads its state from the run directory while the
  ranks plan locally), then adds a second node of 2 slots (2 -> 4 workers, g2n2);
- ``grow-shrink``: both in one run (what the suite runs: one cluster, one start): starts on
  one node of 3 slots (g2n1+g1n1), kills the coordinator after step 1, adds a node of 1
  slot (3 -> 4 workers on uneven nodes, g2n1+g1n2 where the rule alone would give g2n2
  across them), then, a few steps after the run trains at 4, removes it again (4 -> 3,
  g2n1+g1n1).

Ray Train restarts the group at the new size from the latest checkpoint; every rank
reports its node id, rank 0 asks the coordinator for the topology of that world on those
nodes, bag groups are rebuilt and the data re-sharded. ``run_scenario`` returns (and the
command prints and writes to ``OUT/result.json``) the (world size, nodes, topology)
segments the run went through (from the per-step records), the steps trained after the
change, the timings, where the coordinator ran, the ledger's exactly-once check, and
whether every check passed.

How fast Ray notices (Ray 2.60, from its source):

- Ray Train's elastic policy counts workers from the resources the
  ``AutoscalingCoordinator`` actor reserves for the run, and that actor refreshes its view
  of the cluster's nodes on a 20 s tick (``_AutoscalingCoordinatorActor.TICK_INTERVAL_S``).
- grow: a running group is reconsidered every ``elastic_resize_monitor_interval_s``
  (``scaling.elastic_monitor_interval_s``); once the tick has seen the new nodes it resizes.
- shrink: the worker on the removed node dies, the group fails (one of
  ``run.max_failures``), and the restart sizes the group from the same reservation,
  still counting the dead node until the next tick; the placement group for 4 cannot be
  placed, and Ray retries only after ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (60 s by
  Ray's default: the ~70 s in RAY_NOTES). The launcher sets it to 10 s for elastic runs
  (``scaling.worker_start_timeout_s``); the command's ``--start-timeout`` sets that key (60: Ray's
  default, to measure the difference). It bounds only the wait for the placement group, not the
  workers' start-up.
- Nodes noticed one at a time give one restart per size seen (e.g. 2 -> 3 -> 4).
- ``nudge`` (``--nudge``) asks the AutoscalingCoordinator to re-read the cluster right after the
  change (its ``get_reserved_resources(recompute=True)``), which removes the wait for the
  tick; off by default, so the check measures what a real cluster does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass

from knapray.testing.waits import ProgressDeadline
from knapray.worker.startup import read_startups
from knapray.run_files import RunDir

SLOT = "knapray_slot"
MODEL = [
    "model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[2,2,4]",
    "model.depth_double=1", "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16",
]
RULE = "bags_of:2"
SCENARIOS = {
    # name: (slots per worker node at start, min_workers, max_workers, the changes in turn:
    #        slots of a node added (+) or of one removed (-); kill the coordinator after this step)
    "shrink": ((3, 1), 2, 4, (-1,), None),
    "grow": ((2,), 2, 4, (+2,), 1),
    "grow-shrink": ((3,), 2, 4, (+1, -1), 1),
}
CORPUS_STEPS = {"shrink": 4, "grow": 12, "grow-shrink": 8}


def _private_ray_env() -> str:
    """Ray's temp dir holds ``ray_current_cluster``, which a plain ``ray.init()`` on this
    machine connects to: give this cluster a private one so that other Ray sessions on
    the machine neither join it nor lose their own address file when it shuts down."""
    tmp = tempfile.mkdtemp(prefix="kre", dir="/tmp")  # short: Ray's socket paths live here
    os.environ["RAY_TMPDIR"] = tmp
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.pop("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", None)  # the run's config sets it
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    return tmp


def build_corpus(out: str, steps: int) -> list[int]:
    """The tiny corpus of tests/ray/test_train_ray.py: 11 samples per mix step, mixed sizes."""
    import pyarrow.parquet as pq

    from knapray.corpus import shard_paths
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    if not os.path.exists(os.path.join(out, "schema.json")):
        build_synthetic(
            SyntheticConfig(mix="g1b3i128f1s0,g1b2i64f1s0,g1b5i64f1s0,g1b1i256f1s0", steps=steps, scale=4,
                            channels=4, text_dim=16, pooled_dim=16, shards=3, seed=1),
            out, progress=False,
        )
    return [i for p in shard_paths(out) for i in pq.read_table(p, columns=["sample_id"])["sample_id"].to_pylist()]


def segments(records: list[dict]) -> list[dict]:
    """Rank 0's per-step records (``metrics.jsonl``, appended by every attempt) cut into
    attempts: a new one starts where the step does not follow the previous one (a restart
    from a checkpoint) or the (world size, nodes, topology) changes."""
    out: list[dict] = []
    for r in records:
        key = (r.get("world_size", len(r["rank_work"])), r.get("node_sizes"), r.get("topology", "?"))
        if out and (out[-1]["world_size"], out[-1]["node_sizes"], out[-1]["topology"]) == key \
                and r["step"] == out[-1]["last_step"] + 1:
            out[-1]["last_step"] = r["step"]
            out[-1]["steps"] += 1
            out[-1]["planned_locally"] += r["planned_by"] == "local"
        else:
            out.append({"attempt": len(out), "world_size": key[0], "node_sizes": key[1], "topology": key[2],
                        "first_step": r["step"], "last_step": r["step"], "steps": 1,
                        "planned_locally": int(r["planned_by"] == "local")})
    return out


def expected_topology(world_size: int, node_sizes: list[int] | None) -> str:
    """What the rule gives a world on those nodes (the coordinator's answer)."""
    from knapray.planning.search.rules import resolve_rule

    return str(resolve_rule(RULE, world_size, node_sizes=node_sizes).topology)


def bags_within_nodes(segment: dict) -> bool:
    """No bag of the segment's topology crosses one of its nodes."""
    from knapray.planning import Topology

    spec, _, _ = segment["topology"].partition(" x")
    try:
        Topology.parse(spec, world_size=segment["world_size"]).check_nodes(segment["node_sizes"])
    except (ValueError, TypeError):
        return False
    return True


def sizes_took_the_path(sizes: list[int], waypoints: list[int]) -> bool:
    """The world sizes of the attempts, in turn, went from ``waypoints[0]`` to each next one,
    passing only through sizes between two consecutive waypoints (Ray may notice added nodes
    one at a time), never away from the next one nor past it."""
    path = [w for i, w in enumerate(sizes) if i == 0 or w != sizes[i - 1]]
    if not path or path[0] != waypoints[0]:
        return False
    reached = 0
    for w in path[1:]:
        if reached + 1 >= len(waypoints):
            return False
        a, b = waypoints[reached], waypoints[reached + 1]
        if w == b:
            reached += 1
        elif not min(a, b) < w < max(a, b):
            return False
    return reached == len(waypoints) - 1


def ledger_check(path: str, all_ids: list[int]) -> dict:
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    counts = Counter(r["sample_id"] for r in rows)
    expected = set(all_ids)
    return {
        "rows": len(rows),
        "corpus_samples": len(all_ids),
        "missing": sorted(expected - set(counts)),
        "duplicates": sorted(i for i, c in counts.items() if c > 1),
        "unknown": sorted(set(counts) - expected),
        "steps": sorted({r["step"] for r in rows}),
        "exactly_once": bool(rows) and set(counts) == expected and set(counts.values()) == {1},
    }


def _read_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]  # the last may be partial


@dataclass(frozen=True)
class Settings:
    """One scenario's run (the command's flags of the same names)."""

    scenario: str
    """A key of ``SCENARIOS``."""
    out: str
    """Directory for the corpus, the run and (the command's) result.json."""
    corpus_steps: int | None = None
    """Mix steps in the corpus, 11 samples each (None: ``CORPUS_STEPS`` of the scenario)."""
    samples_per_step: int = 1
    change_after_step: int = 2
    """Remove/add nodes once this step has been logged; a later change, once the run has
    trained this many steps at the size the change before it gave."""
    start_timeout: float = 0.0
    """``scaling.worker_start_timeout_s`` (0: the launcher's 10 s for elastic runs)."""
    monitor: float = 2.0
    """``scaling.elastic_monitor_interval_s``."""
    head_cpus: int = 2
    nudge: bool = False
    """Have the AutoscalingCoordinator re-read the cluster right after the change."""
    worker_logs: bool = False
    """Stream worker/actor logs to this process."""
    keep_logs: bool = False
    """Copy the Ray session's logs to ``out``/ray-logs."""
    timeout: float = 240.0
    """Give up once nothing has changed for this many seconds (``ProgressDeadline``'s floor)."""


def run_scenario(settings: Settings) -> dict:
    """Run one scenario on its own Ray cluster; the result (``ok``: every check passed)."""
    t_begin = time.perf_counter()
    tmp = _private_ray_env()
    import ray
    from ray.cluster_utils import Cluster

    from knapray.planning.search.rules import resolve_rule
    from knapray.driver.preflight import load_run_config
    from knapray.driver.launch import run_training
    from knapray.worker.step_planner import coordinator_name

    start_slots, min_w, max_w, changes, kill_coordinator_after = SCENARIOS[settings.scenario]
    out = os.path.abspath(settings.out)
    os.makedirs(out, exist_ok=True)
    corpus_steps = settings.corpus_steps or CORPUS_STEPS[settings.scenario]
    all_ids = build_corpus(os.path.join(out, f"corpus-{corpus_steps}"), corpus_steps)
    storage = os.path.join(out, "runs")
    shutil.rmtree(storage, ignore_errors=True)  # a fresh run, not a resume of an old one
    events: list[dict] = []

    def event(what: str, **kw) -> None:
        e = {"t": round(time.perf_counter() - t_begin, 2), "event": what, **kw}
        events.append(e)
        print(f"[elastic_check {e['t']:7.2f}s] {what} {kw if kw else ''}", flush=True)

    def node_args(slots: int) -> dict:
        return {"num_cpus": slots, "resources": {SLOT: slots}, "object_store_memory": 100 * 1024**2}

    result: dict = {"scenario": settings.scenario}
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": settings.head_cpus, "include_dashboard": False, "object_store_memory": 200 * 1024**2,
        })
        workers = [cluster.add_node(wait=False, **node_args(k)) for k in start_slots]
        slots = {n.node_id: k for n, k in zip(workers, start_slots)}
        cluster.wait_for_nodes(timeout=90)
        ray.init(address=cluster.address, namespace="knapray-elastic", log_to_driver=settings.worker_logs,
                 configure_logging=False)
        event("cluster up", worker_node_slots=list(start_slots), head_cpus=settings.head_cpus)

        cfg = load_run_config(None, MODEL + [
            f"data.corpus={os.path.join(out, f'corpus-{corpus_steps}')}", f"data.samples_per_step={settings.samples_per_step}",
            f"balance.topology={RULE}", f"run.name=elastic-{settings.scenario}", f"run.storage={storage}",
            f"scaling.num_workers={max_w}", f"scaling.min_workers={min_w}", "scaling.cpus_per_worker=0.5",
            f"scaling.resources_per_worker={{{SLOT}: 1}}", f"scaling.elastic_monitor_interval_s={settings.monitor}",
            f"scaling.worker_start_timeout_s={settings.start_timeout}",
            "checkpoint.every=1", "run.max_failures=3", "distributed.timeout_s=60",
            "balance.coordinator_timeout_s=10",
        ])
        name = coordinator_name(cfg)
        metrics = RunDir(cfg.run_dir).metrics
        box: dict = {}

        def train() -> None:
            try:
                box["summary"] = run_training(cfg)
            except BaseException as e:  # reported below, with the records so far
                box["error"] = f"{type(e).__name__}: {e}"

        trainer = threading.Thread(target=train, name="run_training", daemon=True)
        t_fit = time.perf_counter()
        trainer.start()

        start_w = sum(start_slots)
        targets = [start_w + sum(changes[:k + 1]) for k in range(len(changes))]
        changed: list[dict] = []  # per change made: after_step, at (perf), wall, landed_at_s, landed_step
        fit_wall = time.time()
        placements: list[dict] = []
        first_key = None  # (world size, nodes) of the first attempt
        # Stuck, not slow: the wait expires after a quiet spell (no new step, no event) longer
        # than --timeout or twice the time the run took to its last progress.
        wait = ProgressDeadline(floor_s=settings.timeout, clock=time.perf_counter)
        while trainer.is_alive() and not wait.expired():
            trainer.join(timeout=0.2)
            # A restart rewrites metrics.jsonl back to its checkpoint: read it whole each time.
            records = _read_records(metrics)
            wait.progressed((len(events), tuple((r["step"], r["world_size"]) for r in records)))
            if records and first_key is None:
                first_key = (records[0]["world_size"], records[0].get("node_sizes"))
                event("first step", step=records[0]["step"], world_size=first_key[0], node_sizes=first_key[1],
                      topology=records[0].get("topology"))
            last = records[-1] if records else None
            if changed and "landed_step" not in changed[-1] and last is not None \
                    and last["world_size"] == targets[len(changed) - 1]:
                changed[-1]["landed_step"] = last["step"]
                changed[-1]["landed_at_s"] = round(time.perf_counter() - t_begin, 2)
                event("training at new size", step=last["step"], world_size=last["world_size"],
                      node_sizes=last.get("node_sizes"), topology=last.get("topology"))
                placements.append(_placement(cluster, workers, name))  # while the run is live
            step = max((r["step"] for r in records), default=-1)
            if kill_coordinator_after is not None and step >= kill_coordinator_after and not placements:
                placements.append(_placement(cluster, workers, name))
                ray.kill(ray.get_actor(name), no_restart=False)  # Ray restarts it (max_restarts=-1)
                event("killed the coordinator actor", after_step=step, was_on=placements[-1]["coordinator_on"])
            # The next change: the first after step change_after_step (once the coordinator
            # was killed, where it is), a later one once the run trained that many steps at
            # the size the one before gave (a checkpoint at that size exists).
            ready = len(changed) < len(changes) and (
                step >= settings.change_after_step and (kill_coordinator_after is None or placements)
                if not changed else
                "landed_step" in changed[-1] and last is not None and last["world_size"] == targets[len(changed) - 1]
                and last["step"] >= changed[-1]["landed_step"] + settings.change_after_step)
            if ready:
                change = changes[len(changed)]
                if kill_coordinator_after is None and not changed:
                    placements.append(_placement(cluster, workers, name))
                wall = time.time()  # when the node is asked to go or to come (its join takes a while)
                if change < 0:
                    victim = next(n for n in reversed(workers) if slots[n.node_id] == -change)
                    workers.remove(victim)
                    cluster.remove_node(victim)
                    event(f"removed a worker node of {-change} slots", after_step=step,
                          worker_node_slots=[slots[n.node_id] for n in workers])
                else:
                    node = cluster.add_node(wait=False, **node_args(change))
                    slots[node.node_id] = change
                    workers.append(node)
                    cluster.wait_for_nodes(timeout=90)
                    event(f"added a worker node of {change} slots", after_step=step,
                          worker_node_slots=[slots[n.node_id] for n in workers])
                changed.append({"change": change, "after_step": step, "at": time.perf_counter(), "wall": wall})
                if settings.nudge:
                    try:
                        _refresh_autoscaling_view(len(workers) + 1)
                        event("nudged the AutoscalingCoordinator to re-read the cluster")
                    except Exception as e:  # then Ray's own 20 s tick does it
                        event("nudge failed", error=f"{type(e).__name__}: {e}")
        if trainer.is_alive():
            event("TIMEOUT: the run did not finish", why=wait.why("the run"))
            box.setdefault("error", wait.why("the run"))
        else:
            event("run_training returned" if "summary" in box else "run_training raised", error=box.get("error"))
        fit_s = time.perf_counter() - t_fit

        records = _read_records(metrics)
        segs = segments(records)
        for seg in segs:
            seg["expected_topology"] = expected_topology(seg["world_size"], seg["node_sizes"])
            seg["bags_within_nodes"] = bags_within_nodes(seg)
        summary = box.get("summary") or {}
        final = summary.get("records", [])
        end_w = targets[-1]
        worlds = [s["world_size"] for s in segs]
        after = [s for s in segs if s["world_size"] == end_w]
        # The segments after the last change (a run that ends where it started, grow-shrink,
        # has segments of that size before the changes too).
        last_change_step = changed[-1]["after_step"] if len(changed) == len(changes) else None
        after = [s for s in after if last_change_step is not None and s["last_step"] > last_change_step
                 and s is not segs[0]]
        ledger = ledger_check(RunDir(cfg.run_dir).ledger, all_ids)
        first = segs[0] if segs else {}
        checks = {
            "run finished": "summary" in box,
            f"started at world {start_w} on nodes of {sorted(start_slots, reverse=True)} slots":
                bool(segs) and first["world_size"] == start_w
                and sorted(first["node_sizes"] or [], reverse=True) == sorted(start_slots, reverse=True),
            f"made every change ({len(changes)})": len(changed) == len(changes)
                and all("landed_step" in c for c in changed),
            f"ended at world {end_w}": bool(segs) and segs[-1]["world_size"] == end_w,
            f"world size went {' -> '.join(map(str, [start_w, *targets]))}, only towards each target in turn":
                sizes_took_the_path(worlds, [start_w, *targets]),
            "every attempt used the rule's topology for its world and nodes":
                bool(segs) and all(s["topology"] == s["expected_topology"] for s in segs),
            "no bag crossed a node": bool(segs) and all(s["bags_within_nodes"] for s in segs),
            "final attempt ran at the new size": summary.get("world_size") == end_w
                and summary.get("topology") == (segs[-1]["topology"] if segs else None),
            "every restart resumed from a checkpoint, with no gap": len(segs) > 1
                and all(0 < b["first_step"] <= a["last_step"] + 1 for a, b in zip(segs, segs[1:])),
            "steps trained after the last change": sum(s["steps"] for s in after) > 0,
            "ledger exactly once": ledger["exactly_once"],
            "coordinator on the head node": len(placements) >= 2 and all(p["coordinator_on"] == "head"
                                                                         for p in placements),
        }
        # Where the real layout mattered: the rule alone (no nodes) would cross a node of an uneven one.
        for nodes in sorted({tuple(sorted(s["node_sizes"] or [])) for s in segs if len(set(s["node_sizes"] or [])) > 1}):
            naive = str(resolve_rule(RULE, sum(nodes)).topology)
            checks[f"the rule alone ({naive}) would cross a node of the layout {list(nodes)}"] = not bags_within_nodes(
                {"topology": naive, "world_size": sum(nodes), "node_sizes": list(nodes)})
        if kill_coordinator_after is not None:
            checks["coordinator killed, restarted by Ray, found on the head again"] = len(placements) >= 2 and any(
                e["event"] == "killed the coordinator actor" for e in events)
        recovery = recovery_breakdown(read_startups(cfg.run_dir), fit_wall, [c["wall"] for c in changed])
        change_rows = [{"change": c["change"], "after_step": c["after_step"], "at_s": round(c["at"] - t_begin, 2),
                        "new_size_training_at_s": c.get("landed_at_s"),
                        "seconds_to_new_size": round(c["landed_at_s"] - (c["at"] - t_begin), 2)
                        if "landed_at_s" in c else None} for c in changed]
        result.update({
            "recovery": recovery,
            "ok": all(checks.values()),
            "checks": checks,
            "segments": segs,
            "world_sizes": worlds,
            "topologies": [s["topology"] for s in segs],
            "node_sizes": [s["node_sizes"] for s in segs],
            "coordinator_placements": placements,
            "changes": change_rows,
            "steps_after_change": sum(s["steps"] for s in after),
            "final_attempt": {"world_size": summary.get("world_size"), "topology": summary.get("topology"),
                              "node_sizes": summary.get("node_sizes"),
                              "first_step": final[0]["step"] if final else None,
                              "last_step": final[-1]["step"] if final else None, "steps": len(final)},
            "ledger": ledger,
            "error": box.get("error"),
            "events": events,
            "timings_s": {"fit": round(fit_s, 2), "total": round(time.perf_counter() - t_begin, 2)},
            "settings": {"start_timeout_s": settings.start_timeout, "monitor_interval_s": settings.monitor,
                         "nudge": settings.nudge, "samples_per_step": settings.samples_per_step,
                         "corpus_steps": corpus_steps, "corpus_samples": len(all_ids), "run_dir": cfg.run_dir,
                         "coordinator": name, "rule": RULE},
        })
        return result
    finally:
        try:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
        finally:
            if settings.keep_logs:
                shutil.rmtree(os.path.join(out, "ray-logs"), ignore_errors=True)
                shutil.copytree(os.path.join(tmp, "ray", "session_latest", "logs"), os.path.join(out, "ray-logs"),
                                dirs_exist_ok=True, ignore_dangling_symlinks=True)
            shutil.rmtree(tmp, ignore_errors=True)


PHASES = (
    # From the trainer's start, not the worker process's: Ray keeps idle worker processes
    # started ahead, so a new attempt's process may predate the change.
    ("ray", "the change to the trainer's start (Ray: notice, decide, place and start the workers; imports, "
            "the process group)", None, "trainer_started"),
    ("build", "the trainer's start to the model built (node layout, topology, model, optimizer)",
     "trainer_started", "model_ready"),
    ("restore", "the checkpoint loaded", "model_ready", "restored"),
    ("first step", "the first step (data iterator, plan, compile, the step)", "restored", "first_step"),
)


def recovery_breakdown(startups: list[dict], fit_wall: float, changed_wall: float | list[float] | None) -> dict:
    """Seconds of each phase of the cold start (the first attempt, from the fit's start) and
    of the first attempt after each change (from the change): ``PHASES``, and the total.
    ``after_change`` is the last change's; ``after_changes`` has one per change."""

    def phases(attempt: dict | None, origin: float | None) -> dict | None:
        if attempt is None or origin is None:
            return None
        out = {}
        for name, _, start, end in PHASES:
            a = origin if start is None else attempt.get(start)
            b = attempt.get(end)
            out[name] = round(b - a, 2) if a is not None and b is not None else None
        out["total"] = round(attempt["first_step"] - origin, 2) if attempt.get("first_step") else None
        out["world_size"], out["topology"] = attempt.get("world_size"), attempt.get("topology")
        return out

    walls = [] if changed_wall is None else [changed_wall] if isinstance(changed_wall, (int, float)) else list(changed_wall)
    after = [phases(next((a for a in startups if (a.get("trainer_started") or 0) > w), None), w) for w in walls]
    return {"cold_start": phases(startups[0] if startups else None, fit_wall),
            "after_change": after[-1] if after else None, "after_changes": after}


def recovery_table(result: dict) -> str:
    """The recovery of ``result`` (``recovery_breakdown``) and its ledger check, as a table."""
    rec = result.get("recovery") or {}
    changes = [c for c in rec.get("after_changes") or [rec.get("after_change")]]
    cols = [rec.get("cold_start"), *changes]
    heads = ["cold start"] + (["after change"] if len(changes) == 1 else
                              [f"after change {k + 1}" for k in range(len(changes))])
    lines = [f"{'phase':<12} {heads[0]:>11} " + " ".join(f"{h:>13}" for h in heads[1:]) + "  what"]

    def row(label: str, key: str, what: str) -> str:
        vals = [f"{c[key]:.1f} s" if c and c.get(key) is not None else "-" for c in cols]
        return f"{label:<12} {vals[0]:>11} " + " ".join(f"{v:>13}" for v in vals[1:]) + f"  {what}"

    for name, what, _, _ in PHASES:
        lines.append(row(name, name, what))
    lines.append(row("total", "total", "to the first step"))
    ledger = result.get("ledger") or {}
    lines.append(f"ledger: {'exactly once' if ledger.get('exactly_once') else 'NOT exactly once'} "
                 f"({ledger.get('rows')} rows for {ledger.get('corpus_samples')} samples)")
    return "\n".join(lines)


def _placement(cluster, workers, coordinator: str) -> dict:
    """Which node the balance coordinator actor lives on (head or a worker node)."""
    import ray

    error = None
    for _ in range(5):  # a restarted actor's first call may fail ("may or may not have executed")
        try:
            actor = ray.get_actor(coordinator)
            node = ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()),
                           timeout=20)
            break
        except Exception as e:  # noqa: BLE001 - reported in the result
            error = e
            time.sleep(1)
    else:
        return {"coordinator_node_id": None, "coordinator_on": f"unknown ({error})"}
    where = "head" if node == cluster.head_node.node_id else (
        f"worker node {[n.node_id for n in workers].index(node)}" if node in [n.node_id for n in workers] else "?")
    return {"coordinator_node_id": node, "coordinator_on": where}


def _refresh_autoscaling_view(alive: int) -> None:
    """Make Ray's AutoscalingCoordinator re-read the cluster's nodes now instead of at its
    next 20 s tick (``recompute=True`` runs that tick), once the GCS shows ``alive`` nodes."""
    import ray

    deadline = time.perf_counter() + 30
    while sum(n["Alive"] for n in ray.nodes()) != alive and time.perf_counter() < deadline:
        time.sleep(0.1)
    actor = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    ray.get(actor.get_reserved_resources.remote("knapray-elastic-check", recompute=True), timeout=10)
