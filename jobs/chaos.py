"""Chaos run: the demo training while a worker is SIGKILLed and the coordinator actor is
killed at random steps; then the exactly-once check of the ledger over the whole epoch.

    python jobs/chaos.py [--config jobs/configs/demo.yaml] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from knapray.driver.preflight import load_run_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="jobs/configs/demo.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seed", type=int, default=0, help="picks the steps at which things die")
    args = p.parse_args(argv)
    cfg = load_run_config(args.config, [
        "run.name=chaos", "run.max_steps=0", "run.max_failures=2", "checkpoint.every=4",
        "balance.coordinator_timeout_s=5", *args.set,
    ])

    import pyarrow.parquet as pq
    import ray

    from knapray.corpus import shard_paths
    from knapray.corpus.synthetic import DEMO, build_synthetic
    from knapray.testing.chaos import Chaos, check_exactly_once
    from knapray.driver.launch import run_training
    from knapray.driver.run_dir import resolve_paths
    from knapray.worker.step_planner import coordinator_name

    cfg = resolve_paths(cfg)
    if not os.path.exists(os.path.join(cfg.data.corpus, "schema.json")):
        print(f"[chaos] building the demo corpus in {cfg.data.corpus}", flush=True)
        build_synthetic(DEMO, cfg.data.corpus, progress=False)
    ids = [i for s in shard_paths(cfg.data.corpus) for i in pq.read_table(s, columns=["sample_id"])["sample_id"].to_pylist()]
    steps = len(ids) // (cfg.scaling.num_workers * cfg.data.samples_per_step)
    rng = random.Random(args.seed)
    kill_worker_at = rng.randrange(2, max(3, steps // 2))
    kill_coordinator_at = rng.randrange(steps // 2, max(steps // 2 + 1, steps - 3))
    worker_rank = rng.randrange(cfg.scaling.num_workers)
    print(f"[chaos] {len(ids)} samples, ~{steps} steps; SIGKILL rank {worker_rank} after step {kill_worker_at}, "
          f"kill the coordinator after step {kill_coordinator_at}", flush=True)

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    from knapray.local_ray import init_ray

    init_ray(ray, num_cpus=max(4, int(cfg.scaling.num_workers * cfg.scaling.cpus_per_worker) + 2),
             include_dashboard=False, log_to_driver=False)
    import shutil

    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a fresh run each time
    os.makedirs(cfg.run_dir, exist_ok=True)
    chaos = Chaos(cfg.run_dir, kill_worker_at=kill_worker_at, worker_rank=worker_rank,
                  kill_coordinator_at=kill_coordinator_at, coordinator_name=coordinator_name(cfg))
    chaos.start()
    try:
        summary = run_training(cfg)
    finally:
        chaos.stop()
    for e in chaos.log.events:
        print(f"[chaos] {e}")
    quarantined = set()
    qpath = os.path.join(cfg.run_dir, "quarantine.jsonl")
    if os.path.exists(qpath):
        quarantined = {r["sample_id"] for r in map(json.loads, filter(str.strip, open(qpath))) if "sample_id" in r}
    check = check_exactly_once(os.path.join(cfg.run_dir, "ledger.jsonl"), set(ids) - quarantined)
    planned = [r["planned_by"] for r in summary.get("records", [])]
    print(f"[chaos] steps after the last restart: {len(planned)} ({planned.count('local')} planned locally "
          f"while the coordinator was away)")
    print(f"[chaos] exactly-once: {check['rows']} ledger rows for {check['expected']} samples; "
          f"missing {len(check['missing'])}, duplicated {len(check['duplicated'])}, "
          f"unexpected {len(check['unexpected'])}; attempts {check['attempts']} -> "
          f"{'OK' if check['ok'] else 'FAILED'}")
    return 0 if check["ok"] else 1


if __name__ == "__main__":
    from knapray.stopping import run_main

    run_main(main)
