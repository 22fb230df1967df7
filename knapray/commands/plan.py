"""``knapray plan``: plan steps of a data mix (or of recorded lengths) on a topology and
report the balance, the plan time and the tokens moved."""

from __future__ import annotations

import argparse
import json
import sys

from .cost import add_cost_model, cost_model
from .flags import add_gpus_per_node, add_json, add_seed, add_world_size, float_in, int_at_least, step_count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mix", help="paper data codes, e.g. 'g16b4i256f1s0,g4b5i512f1s0,...'")
    p.add_argument("--lengths", metavar="FILE",
                   help="JSON file: list of steps, each a list of per-rank lists of lengths")
    p.add_argument("--topology", default="g8n4", help="bags, e.g. g8n4 or g1n16+g4n2+g8n1, or auto (default g8n4)")
    add_world_size(p, default=None, help="replicate the mix and topology to this many ranks (default: the mix's)")
    add_gpus_per_node(p, help="lay bags out so none crosses a node")
    p.add_argument("--steps", type=step_count, default=50, help="steps of the mix to plan (default 50)")
    add_seed(p)
    p.add_argument("--solver", default="knapray", choices=["knapray", "greedy"])
    p.add_argument("--d-model", type=int_at_least(1), default=3072,
                   help="model width d in the workload model (default 3072, Flux)")
    p.add_argument("--gamma", type=float_in(ge=0), default=0.4, help="relative cost of attention FLOPs (default 0.4)")
    p.add_argument("--plot", metavar="PNG", help="write a PNG of the per-step imbalance and per-rank work")
    p.add_argument("--export", metavar="FILE", help="write the plans as JSON")
    add_json(p)
    add_cost_model(p, what="--topology auto: ")
    p.add_argument("--auto-steps", type=int_at_least(1), default=2,
                   help="--topology auto: steps the search scores (default 2)")


def run(args: argparse.Namespace) -> int:
    from knapray.planning import Topology, WorkloadModel
    from knapray.planning.shapes.mix import check_planned, parse_mix
    from knapray.planning.simulation.runner import load_lengths, mix_ranks, mix_steps, plan_run

    if (args.mix is None) == (args.lengths is None):
        raise ValueError("give exactly one of --mix CODES or --lengths FILE")
    model = WorkloadModel(d_model=args.d_model, gamma=args.gamma)
    if args.mix is not None:
        world = args.world_size or mix_ranks(args.mix)
        check_planned(parse_mix(args.mix), args.steps, world)  # before the steps are drawn
        steps = list(mix_steps(args.mix, args.steps, args.seed, world_size=world))
    else:
        steps = load_lengths(args.lengths)
        world = len(steps[0])
    if args.topology == "auto":
        # Cost model plans on the topology with the lowest predicted step time.
        from knapray.planning.search.autotopo import search_topology

        model = cost_model(args)
        choice = search_topology(steps[: args.auto_steps], world, model, args.gpus_per_node)
        topo = choice.topology
    else:
        topo = Topology.parse(args.topology, world_size=world, gpus_per_node=args.gpus_per_node)
    progress = None
    if not args.json and len(steps) >= 20:
        from tqdm import tqdm

        progress = tqdm(total=len(steps), desc="planning", unit="step", file=sys.stderr, leave=False)
    summary = plan_run(steps, topo, model, args.solver, keep_plans=bool(args.export), progress=progress)
    if progress is not None:
        progress.close()
    result = summary.to_dict()
    if args.topology == "auto":
        result["auto"] = choice.summary()
    if args.export:
        with open(args.export, "w") as f:
            extra = {"cost_model": model.to_dict(), "auto": choice.summary()} if args.topology == "auto" else {}
            json.dump({"world_size": world, "steps": [p.to_json() for p in summary.plans], **extra}, f)
        result["export"] = args.export
    if args.plot:
        from knapray.driver.plots import plot_rank_work

        plot_rank_work(
            args.plot,
            summary.baseline_rank_work,
            summary.rank_work,
            summary.baseline_imbalance,
            summary.imbalance,
            summary.greedy_imbalance or None,
            title=f"{_short(args.mix or args.lengths)} on {topo}: {world} ranks, {len(steps)} steps",
        )
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result))
    else:
        _print_plan_table(result)
    return 0


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _print_plan_table(r: dict) -> None:
    print(f"topology {r['topology']}  ranks {r['world_size']}  steps {r['steps']}  solver {r['solver']}")
    print(f"{'':<22} {'mean':>9} {'worst':>9}")
    print(f"{'imbalance unbalanced':<22} {r['baseline_imbalance_mean']:>9.4f} {r['baseline_imbalance_max']:>9.4f}")
    if "greedy_imbalance_mean" in r:
        print(f"{'imbalance greedy':<22} {r['greedy_imbalance_mean']:>9.5f} {r['greedy_imbalance_max']:>9.5f}")
    print(f"{'imbalance ' + r['solver']:<22} {r['imbalance_mean']:>9.5f} {r['imbalance_max']:>9.5f}")
    print(f"{'tokens moved':<22} {r['moved_token_fraction_mean']:>9.1%}")
    print(f"{'plan time (ms)':<22} {r['plan_ms_p50']:>9.2f} {r['plan_ms_max']:>9.2f}   (p50, max)")
    if r["baseline_imbalance_mean"] > 0:
        print(
            f"projected step-time speedup vs unbalanced: "
            f"{r['baseline_imbalance_mean'] / r['imbalance_mean']:.2f}x (compute only)"
        )
    if "auto" in r:
        a = r["auto"]
        print(f"auto topology {a['topology']}: predicted step {r['predicted_step_s_mean']:.4f} s, efficiency "
              f"{r['efficiency']:.4f} (greedy on it {r.get('greedy_efficiency', float('nan')):.4f})")
    if "plot" in r:
        print(f"plot: {r['plot']}")
    if "export" in r:
        print(f"plans: {r['export']}")
