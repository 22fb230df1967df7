"""Ledger benchmark: what committing one step costs when the ledger already holds 10k, 1M
or 10M rows.

For each size, a ``BalanceCoordinator`` on a fresh state directory whose ledger holds
that many rows (written as one snapshot, the fast way to build it), then ``steps`` steps
of ``world_size`` ranks with ``samples_per_rank`` samples each: every rank submits (the
last submit plans and rewrites ``run.json``), then rank 0's ``commit_step`` (one journal
record, appended and fsync'd). Reported per size: the median commit time; the median time
the planning submit spends besides the solver (staging the rows, statistics, rewriting
``run.json``); the median bytes the coordinator wrote per step (journal + ``run.json``);
and, for scale, the time of one full snapshot (written every ``snapshot_every`` records)
and of a restore (an actor restart). Step numbers and sample ids of the measured steps are the same at every size,
so any difference in bytes would come from the ledger's size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time

import numpy as np

from knapray.coordinator import BalanceCoordinator

DEFAULT_SIZES = (10_000, 1_000_000, 10_000_000)
_FIRST_STEP = 10**8  # measured steps come after any prebuilt ledger's steps
_FIRST_ID = 10**12


def run(
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    steps: int = 30,
    world_size: int = 8,
    samples_per_rank: int = 32,
    directory: str | None = None,
) -> dict:
    """Measure every size; prints a table and returns ``{"sizes": [...], ...}``."""
    bad = [s for s in sizes if s < 0]
    if bad or steps < 1 or world_size < 1 or samples_per_rank < 1:
        raise ValueError(f"sizes must be >= 0 (got {list(sizes)}), steps, world_size and samples_per_rank >= 1 "
                         f"(got {steps}, {world_size}, {samples_per_rank})")
    print(f"ledger commit cost: {steps} steps of {world_size} ranks x {samples_per_rank} samples "
          f"({world_size * samples_per_rank} rows per step), state directory under {directory or tempfile.gettempdir()}")
    header = (f"{'rows':>12} | {'commit ms p50':>13} {'p90':>7} | {'plan+state ms':>13} | {'bytes/step':>10} | "
              f"{'snapshot ms':>11} {'restore ms':>10}")
    print(header)
    print("-" * len(header))
    out = []
    for rows in sizes:
        with tempfile.TemporaryDirectory(prefix="knapray-ledger-bench-", dir=directory) as tmp:
            r = _measure(int(rows), steps, world_size, samples_per_rank, tmp)
        out.append(r)
        print(f"{r['rows']:>12,} | {r['commit_ms']:>13.2f} {r['commit_ms_p90']:>7.2f} | {r['plan_overhead_ms']:>13.2f} | "
              f"{r['bytes_per_step']:>10,} | "
              f"{r['snapshot_ms']:>11.1f} {r['restore_ms']:>10.1f}", flush=True)
    return {"sizes": out, "steps": steps, "world_size": world_size, "rows_per_step": world_size * samples_per_rank}


def _measure(rows: int, steps: int, world: int, per_rank: int, state_dir: str) -> dict:
    config = dict(world_size=world, topology=f"g1n{world}", d_model=256, state_dir=state_dir)
    coord = BalanceCoordinator(**config)
    per_step = world * per_rank
    k = -(-rows // per_step)
    counts = np.full(k, per_step, np.int64)
    if k:
        counts[-1] = rows - per_step * (k - 1)
    table = np.stack([np.arange(k), np.zeros(k, np.int64), np.zeros(k, np.int64), counts], axis=1)
    ids = np.arange(rows, dtype=np.int64)
    coord.ledger.replace(table, ids, (ids // per_rank) % world, k - 1, 0)
    del ids

    rng = np.random.default_rng(0)
    commit_ms, plan_overhead_ms, written = [], [], []
    for i in range(steps):
        t = _FIRST_STEP + i
        before = coord.bytes_written
        for r in range(world):
            first = _FIRST_ID + (i * world + r) * per_rank
            t0 = time.perf_counter()
            coord.submit(t, r, rng.integers(64, 4096, per_rank).tolist(), list(range(first, first + per_rank)))
        submit_ms = 1e3 * (time.perf_counter() - t0)  # the last submit plans, stages, writes run.json
        plan, _ = asyncio.run(coord.get_plan(t, 0))
        plan_overhead_ms.append(submit_ms - plan.plan_time_ms)
        t0 = time.perf_counter()
        coord.commit_step(t)
        commit_ms.append(1e3 * (time.perf_counter() - t0))
        written.append(coord.bytes_written - before)
    assert coord.ledger.rows == rows + steps * per_step

    t0 = time.perf_counter()
    coord.ledger.snapshot()
    snapshot_ms = 1e3 * (time.perf_counter() - t0)
    coord.close()
    quiet = logging.getLogger("knapray.coordinator")
    level, quiet.level = quiet.level, logging.ERROR  # no "restored from" line inside the table
    try:
        t0 = time.perf_counter()
        restored = BalanceCoordinator(**config)
        restore_ms = 1e3 * (time.perf_counter() - t0)
    finally:
        quiet.setLevel(level)
    assert restored.ledger.rows == rows + steps * per_step and restored.committed_step == _FIRST_STEP + steps - 1
    restored.close()
    return {
        "rows": rows,
        "commit_ms": float(np.median(commit_ms)),
        "commit_ms_p90": float(np.percentile(commit_ms, 90)),
        "plan_overhead_ms": float(np.median(plan_overhead_ms)),
        "bytes_per_step": int(np.median(written)),
        "snapshot_ms": snapshot_ms,
        "restore_ms": restore_ms,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_json, int_list, step_count

    from knapray.limits import MAX_BENCH_LEDGER_ROWS

    p.add_argument("--sizes", type=int_list(MAX_BENCH_LEDGER_ROWS), default=None,
                   help="ledger sizes in rows, comma-separated (default 10000,1000000,10000000)")
    p.add_argument("--steps", type=step_count, default=30, help="committed steps measured per size (default 30)")
    p.add_argument("--dir", default=None, help="where the state directories go (default: the temp directory)")
    add_json(p)


def cli(args: argparse.Namespace) -> int:
    result = run(sizes=tuple(args.sizes) if args.sizes else DEFAULT_SIZES, steps=args.steps, directory=args.dir)
    if args.json:
        print(json.dumps(result))
    return 0
