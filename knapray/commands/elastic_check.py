"""Elastic restart with a re-planned topology, end to end on a private two-node Ray cluster.

    python -m knapray.commands.elastic_check --scenario shrink --out /tmp/elastic-shrink
    python -m knapray.commands.elastic_check --scenario grow --out /tmp/elastic-grow
    python -m knapray.commands.elastic_check --scenario grow-shrink --nudge --out /tmp/elastic-both

The scenarios, and how fast Ray notices a node coming or going: ``knapray.testing.elastic_check``.
Prints the result's summary and the recovery phase by phase, and writes the whole result
to ``OUT/result.json``. Exit status 0 iff all checks pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.testing.elastic_check import SCENARIOS

    p.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    p.add_argument("--out", required=True, help="directory for the corpus, the run and result.json")
    p.add_argument("--corpus-steps", type=int, default=None,
                   help="mix steps in the corpus, 11 samples each (default: shrink 4, grow 12, grow-shrink 8: "
                        "the run must still have steps left when Ray notices the last change)")
    p.add_argument("--samples-per-step", type=int, default=1)
    p.add_argument("--change-after-step", type=int, default=2,
                   help="remove/add nodes once this step has been logged (a later change: once the run has "
                        "trained this many steps at the size the change before it gave)")
    p.add_argument("--start-timeout", type=float, default=0.0,
                   help="scaling.worker_start_timeout_s (0: the launcher's 10 s for elastic runs; 60: Ray's default)")
    p.add_argument("--monitor", type=float, default=2.0, help="scaling.elastic_monitor_interval_s")
    p.add_argument("--head-cpus", type=int, default=2)
    p.add_argument("--nudge", action="store_true",
                   help="have the AutoscalingCoordinator re-read the cluster right after the change")
    p.add_argument("--worker-logs", action="store_true", help="stream worker/actor logs to this process")
    p.add_argument("--keep-logs", action="store_true", help="copy the Ray session's logs to OUT/ray-logs")
    p.add_argument("--timeout", type=float, default=240.0,
                   help="give up on the run once nothing has changed (no step, no event) for this many seconds, "
                        "or twice the time the run took to its last progress if longer (a loaded 2-core machine "
                        "took 160 s to the first step)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from knapray.testing.elastic_check import Settings, recovery_table, run_scenario

    # every flag is the field of its name
    result = run_scenario(Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)}))
    path = os.path.join(os.path.abspath(args.out), "result.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    brief = {k: result.get(k) for k in ("scenario", "ok", "checks", "segments", "changes", "steps_after_change",
                                         "final_attempt", "coordinator_placements", "timings_s", "error")}
    brief["ledger"] = {k: v for k, v in result.get("ledger", {}).items() if k != "steps"}
    print(json.dumps(brief, indent=1))
    print(recovery_table(result))
    print(f"[elastic_check] wrote {path}")
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    from knapray.stopping import run_main

    run_main(main)
