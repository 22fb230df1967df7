"""Planner benchmark: imbalance and plan time, greedy (KnapFormer) vs knapray, on the
paper's three mixes at 32 ranks and on two mixes replicated to 1024 ranks."""

from __future__ import annotations

import argparse
import json

import numpy as np

from knapray.planning import PAPER_MIXES, Topology, WorkloadModel
from knapray.planning.runner import mix_steps, plan_run

CASES_32 = [(name, spec, 32) for name in PAPER_MIXES for spec in ("g1n32", "g2n16", "g4n8", "g8n4")]
CASES_1024 = [
    ("image+video", "g8n128", 1024),
    ("low-res", "g8n128", 1024),
    ("image+video", "g8n4", 1024),
    ("low-res", "g8n4", 1024),
]


def run(steps: int = 20, steps_1024: int = 5, seed: int = 0, d_model: int = 3072, gamma: float = 0.4) -> list[dict]:
    model = WorkloadModel(d_model=d_model, gamma=gamma)
    rows = []
    header = (
        f"{'mix':<12} {'topology':<12} {'ranks':>5} {'seqs':>6} | {'unbal':>7} {'greedy':>8} "
        f"{'knapray':>8} {'worse':>5} | {'greedy ms':>9} {'knapray ms':>10} {'time ratio':>10} | {'moved':>5}"
    )
    print(header)
    print("-" * len(header))
    for name, spec, world in CASES_32 + CASES_1024:
        n = steps if world <= 32 else steps_1024
        lens_steps = list(mix_steps(PAPER_MIXES[name], n, seed, world_size=world))
        topo = Topology.parse(spec, world_size=world)
        ours = plan_run(lens_steps, topo, model, "knapray", compare_greedy=False)
        greedy = plan_run(lens_steps, topo, model, "greedy", compare_greedy=False)
        o, g = ours.to_dict(), greedy.to_dict()
        # Equal peaks can differ in the last bits (summation order): 1e-12 relative.
        worse = int(np.sum(np.asarray(ours.imbalance) > np.asarray(greedy.imbalance) * (1 + 1e-12)))
        row = {
            "mix": name,
            "topology": str(topo),
            "world_size": world,
            "sequences": int(sum(len(r) for r in lens_steps[0])),
            "baseline_imbalance_mean": o["baseline_imbalance_mean"],
            "greedy_imbalance_mean": g["imbalance_mean"],
            "imbalance_mean": o["imbalance_mean"],
            "imbalance_max": o["imbalance_max"],
            "steps_worse_than_greedy": worse,
            "greedy_plan_ms_p50": g["plan_ms_p50"],
            "plan_ms_p50": o["plan_ms_p50"],
            "time_ratio_vs_greedy": o["plan_ms_p50"] / max(g["plan_ms_p50"], 1e-9),
            "moved_token_fraction_mean": o["moved_token_fraction_mean"],
        }
        rows.append(row)
        print(
            f"{name:<12} {row['topology']:<12} {world:>5} {row['sequences']:>6} | "
            f"{row['baseline_imbalance_mean']:>7.4f} {row['greedy_imbalance_mean']:>8.5f} "
            f"{row['imbalance_mean']:>8.5f} {worse:>5} | {row['greedy_plan_ms_p50']:>9.2f} "
            f"{row['plan_ms_p50']:>10.2f} {row['time_ratio_vs_greedy']:>9.1f}x | "
            f"{row['moved_token_fraction_mean']:>5.2f}",
            flush=True,
        )
    print(
        "\nimbalance = max/mean per-rank work (mean over steps); 'worse' = steps where knapray's "
        "imbalance exceeds greedy's;\ntime ratio = knapray plan time / greedy plan time (p50); "
        "moved = fraction of tokens computed away from their home rank."
    )
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_json, add_seed, int_at_least

    p.add_argument("--steps", type=int_at_least(1), default=20, help="steps per case at 32 ranks (default 20)")
    p.add_argument("--steps-1024", type=int_at_least(1), default=5, help="steps per case at 1024 ranks (default 5)")
    add_seed(p)
    add_json(p)


def cli(args: argparse.Namespace) -> int:
    rows = run(steps=args.steps, steps_1024=args.steps_1024, seed=args.seed)
    if args.json:
        print(json.dumps(rows))
    return 0
