"""Planner benchmark: imbalance and plan time, greedy (KnapFormer) vs knapray, on the
paper's three mixes at 32 ranks and on two mixes replicated to 1024 ranks; with
``ranks``, also one balance group of bags of 8 at each of those world sizes, where the
workload-model planner, greedy and the cost-model planner (``planner: cost``) plan the
same steps side by side."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Sequence

import numpy as np

from knapray.planning import PAPER_MIXES, CostModel, Topology, WorkloadModel, plan_balance
from knapray.planning.shapes.mix import mix_world_size, parse_mix
from knapray.planning.search.overlap import overlap_plan
from knapray.planning.simulation.runner import mix_steps, plan_run

CASES_32 = [(name, spec, 32) for name in PAPER_MIXES for spec in ("g1n32", "g2n16", "g4n8", "g8n4")]
CASES_1024 = [
    ("image+video", "g8n128", 1024),
    ("low-res", "g8n128", 1024),
    ("image+video", "g8n4", 1024),
    ("low-res", "g8n4", 1024),
]
SCALING_MIXES = ("image+video", "mixed-res", "low-res")
SCALING_BAG = 8


def run(
    steps: int = 20,
    steps_1024: int = 5,
    seed: int = 0,
    d_model: int = 3072,
    gamma: float = 0.4,
    ranks: Sequence[int] | None = None,
) -> list[dict]:
    model = WorkloadModel(d_model=d_model, gamma=gamma)
    if ranks:
        _check_ranks(ranks)  # before the first section runs, not after it
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
    if ranks:
        rows += run_scaling(ranks, steps_1024, seed, model)
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_json, add_seed, int_list, step_count
    from knapray.limits import MAX_WORLD_SIZE

    p.add_argument("--steps", type=step_count, default=20, help="steps per case at 32 ranks (default 20)")
    p.add_argument("--steps-1024", type=step_count, default=5, help="steps per case at 1024 ranks (default 5)")
    p.add_argument("--ranks", type=int_list(MAX_WORLD_SIZE), default=None,
                   help="also these world sizes, one balance group of bags of 8 each (e.g. 1024,4096,16384)")
    add_seed(p)
    add_json(p)


def cli(args: argparse.Namespace) -> int:
    rows = run(steps=args.steps, steps_1024=args.steps_1024, seed=args.seed, ranks=args.ranks)
    if args.json:
        print(json.dumps(rows))
    return 0


def run_scaling(
    ranks: Sequence[int], steps: int, seed: int, model: WorkloadModel, reference: Callable | None = None
) -> list[dict]:
    """One balance group of bags of 8 per world size: each step is planned by greedy, by
    knapray and by knapray with the default ``CostModel``, one after the other (so all
    three see the same machine load), and each time is taken both on the wall clock and
    as this process's CPU time (a shared machine inflates the first, not the second).
    ``overlap ms``: what ``balance.overlap`` adds to the cost-model plan (the best
    overlapping plan on the same bags, ``knapray.planning.search.overlap``, given that plan).

    ``reference``: another ``plan_balance`` (e.g. an older solver's) that plans every step
    too, right before this one; a second table compares the two (times, and whether every
    plan puts every sequence in the same bag)."""
    _check_ranks(ranks)
    cost = CostModel()
    solvers = {"greedy": (model, "greedy"), "knapray": (model, "knapray"), "cost": (cost, "knapray")}
    # One untimed round first: the first plans of a process pay one-time costs (imports,
    # allocator growth) that would land on whichever solver runs first.
    warm = next(iter(mix_steps(PAPER_MIXES[SCALING_MIXES[0]], 1, seed + 1, world_size=32)))
    for m, solver in solvers.values():
        plan_balance(warm, Topology.parse("g8n4"), m, solver=solver)
    header = (
        f"{'mix':<12} {'ranks':>6} {'seqs':>7} | {'greedy':>8} {'knapray':>8} {'worse':>5} | "
        f"{'greedy ms':>9} {'knapray ms':>10} {'ratio':>6} | {'cost ms':>8} {'x wl':>5} | "
        f"{'cpu ratio':>9} {'cost x wl':>9} | {'overlap ms':>10}"
    )
    print(f"\none balance group, bags of {SCALING_BAG}: {steps} step(s) per row, p50 (same steps, side by side)")
    print(header)
    print("-" * len(header))
    rows = []
    for world in ranks:
        topo = Topology.parse(f"g{SCALING_BAG}n{world // SCALING_BAG}", world_size=world)
        for name in SCALING_MIXES:
            wall: dict[str, list[float]] = {s: [] for s in solvers}
            cpu: dict[str, list[float]] = {s: [] for s in solvers}
            imb: dict[str, list[float]] = {s: [] for s in solvers}
            ref_wall: dict[str, list[float]] = {s: [] for s in solvers}
            ref_cpu: dict[str, list[float]] = {s: [] for s in solvers}
            same = True
            seqs = 0
            overlap_ms: list[float] = []
            for lens in mix_steps(PAPER_MIXES[name], steps, seed, world_size=world):
                seqs = sum(len(r) for r in lens)
                for key, (m, solver) in solvers.items():
                    if reference is not None:
                        ref_plan, ref_ms, ref_cpu_ms = _timed(reference, lens, topo, m, solver)
                        ref_wall[key].append(ref_ms)
                        ref_cpu[key].append(ref_cpu_ms)
                    plan, ms, cpu_ms = _timed(plan_balance, lens, topo, m, solver)
                    if key == "cost":
                        t0 = time.perf_counter()
                        overlap_plan(lens, m, [topo], plain=plan)
                        overlap_ms.append((time.perf_counter() - t0) * 1e3)
                    wall[key].append(ms)
                    cpu[key].append(cpu_ms)
                    imb[key].append(plan.imbalance)
                    if reference is not None:
                        same = same and bool(np.array_equal(plan.bag, ref_plan.bag))
            p50 = {k: statistics.median(v) for k, v in wall.items()}
            c50 = {k: statistics.median(v) for k, v in cpu.items()}
            worse = int(np.sum(np.asarray(imb["knapray"]) > np.asarray(imb["greedy"]) * (1 + 1e-12)))
            row = {
                "case": "scaling",
                "mix": name,
                "topology": str(topo),
                "world_size": world,
                "sequences": seqs,
                "steps": steps,
                "greedy_imbalance_mean": float(np.mean(imb["greedy"])),
                "imbalance_mean": float(np.mean(imb["knapray"])),
                "cost_imbalance_mean": float(np.mean(imb["cost"])),
                "steps_worse_than_greedy": worse,
                "greedy_plan_ms_p50": p50["greedy"],
                "plan_ms_p50": p50["knapray"],
                "cost_plan_ms_p50": p50["cost"],
                "time_ratio_vs_greedy": p50["knapray"] / max(p50["greedy"], 1e-9),
                "cost_ratio_vs_workload": p50["cost"] / max(p50["knapray"], 1e-9),
                "greedy_cpu_ms_p50": c50["greedy"],
                "cpu_ms_p50": c50["knapray"],
                "cost_cpu_ms_p50": c50["cost"],
                "cpu_ratio_vs_greedy": c50["knapray"] / max(c50["greedy"], 1e-9),
                "cost_cpu_ratio_vs_workload": c50["cost"] / max(c50["knapray"], 1e-9),
                "overlap_added_ms_p50": statistics.median(overlap_ms),
            }
            if reference is not None:
                for key in solvers:
                    row[f"reference_{key}_ms_p50"] = statistics.median(ref_wall[key])
                    row[f"reference_{key}_cpu_ms_p50"] = statistics.median(ref_cpu[key])
                row["same_plans_as_reference"] = same
            rows.append(row)
            print(
                f"{name:<12} {world:>6} {seqs:>7} | {row['greedy_imbalance_mean']:>8.5f} "
                f"{row['imbalance_mean']:>8.5f} {worse:>5} | {p50['greedy']:>9.1f} {p50['knapray']:>10.1f} "
                f"{row['time_ratio_vs_greedy']:>5.1f}x | {p50['cost']:>8.1f} {row['cost_ratio_vs_workload']:>4.1f}x | "
                f"{row['cpu_ratio_vs_greedy']:>8.1f}x {row['cost_cpu_ratio_vs_workload']:>8.1f}x | "
                f"{row['overlap_added_ms_p50']:>10.1f}",
                flush=True,
            )
    print(
        "\nratio = knapray / greedy plan time; cost = knapray with the default CostModel (planner: cost), "
        "x wl = its time / knapray's with the\nworkload model; times are wall-clock ms (p50); the cpu "
        "columns are the same ratios of process CPU time."
    )
    if reference is not None:
        _print_against_reference(rows)
    return rows


def _check_ranks(ranks: Sequence[int]) -> None:
    for world in ranks:
        for name in SCALING_MIXES:
            mix_ranks = mix_world_size(parse_mix(PAPER_MIXES[name]))
            if world < SCALING_BAG or world % SCALING_BAG or world % mix_ranks:
                raise ValueError(
                    f"--ranks {world}: each world size must be a multiple of {SCALING_BAG} (bags of "
                    f"{SCALING_BAG}) and of the mixes' {mix_ranks} ranks, e.g. 1024,4096,16384"
                )


def _timed(plan_fn: Callable, lens, topo: Topology, model, solver: str):
    c0, t0 = time.process_time(), time.perf_counter()
    plan = plan_fn(lens, topo, model, solver=solver)
    return plan, (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def _print_against_reference(rows: list[dict]) -> None:
    header = (
        f"{'mix':<12} {'ranks':>6} | {'greedy ms: ref':>14} {'now':>7} | {'knapray ms: ref':>15} {'now':>7} | "
        f"{'cost ms: ref':>12} {'now':>7} | {'cpu speedup g/k/cost':>20} | same plans"
    )
    print("\nagainst the reference solver (each step planned by both, one right after the other), p50:")
    print(header)
    print("-" * len(header))
    for r in rows:
        speedup = "/".join(
            f"{r[f'reference_{k}_cpu_ms_p50'] / max(r[c], 1e-9):.1f}"
            for k, c in (("greedy", "greedy_cpu_ms_p50"), ("knapray", "cpu_ms_p50"), ("cost", "cost_cpu_ms_p50"))
        )
        print(
            f"{r['mix']:<12} {r['world_size']:>6} | {r['reference_greedy_ms_p50']:>14.1f} {r['greedy_plan_ms_p50']:>7.1f} | "
            f"{r['reference_knapray_ms_p50']:>15.1f} {r['plan_ms_p50']:>7.1f} | {r['reference_cost_ms_p50']:>12.1f} "
            f"{r['cost_plan_ms_p50']:>7.1f} | {speedup:>20} | {'yes' if r['same_plans_as_reference'] else 'NO'}",
            flush=True,
        )
    print("cpu speedup = reference CPU time / this solver's (greedy / knapray / cost model); same plans = every "
          "sequence in the same bag in every step and solver.")
