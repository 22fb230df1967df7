"""``knapray simulate``: predicted step time per rank of unbalanced, greedy and knapray
plans under the cost model (``knapray.planning.simulation.sim``), and the paper tables."""

from __future__ import annotations

import argparse
import json
import sys

from .cost import add_cost_model, cost_model
from .flags import add_gpus_per_node, add_json, add_seed, add_world_size, step_count

MODELS = ("flux", "wan14b", "qwen_image", "flux2")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=MODELS, default="flux",
                   help="the model's cost-model fields (knapray.planning.costs.cost.MODEL_PRESETS; --cost overrides "
                   "them): flux (default: Flux.1, joint attention), wan14b (Wan 2.1 14B, cross-attention to 512 "
                   "text tokens; a sequence is its visual tokens, e.g. --mix wan), qwen_image (Qwen-Image, 60 "
                   "double-stream blocks, joint attention) or flux2 (FLUX.2 [dev], d 6144, 8 + 48 blocks, 48 heads, "
                   "SwiGLU MLPs)")
    p.add_argument("--mix", help="named mix (low-res, mixed-res, image+video; wan), data codes, or a non-stationary "
                   "schedule alternate:MIX[*K]/MIX[*K]/... (K steps of each in turn, e.g. "
                   "alternate:low-res/image+video)")
    p.add_argument("--lengths", metavar="FILE",
                   help="JSON file: list of steps, each a list of per-rank lists of lengths")
    p.add_argument("--topology", default="auto", help="bags, e.g. g8n4, 'auto' (default: chosen once from other "
                   "steps), or 'per-step' (aligned power-of-two blocks of each node chosen every step, vs static auto)")
    add_world_size(p, default=None, help="ranks (a multiple of the mix's ranks; default the mix's)")
    add_gpus_per_node(p, help="GPUs per node (default: the cost model's, 8)")
    add_cost_model(p, what="")
    p.add_argument("--rank-speed", action="append", metavar="RANK=SPEED", help="a rank's speed factor, e.g. 5=0.5")
    p.add_argument("--steps", type=step_count, default=3, help="steps to simulate (default 3)")
    add_seed(p)
    p.add_argument("--paper-table", action="store_true", help="auto vs best greedy on the paper mixes at 32 and 1024 "
                   "GPUs; with --topology per-step: per-step vs static auto on them, alternate:low-res/image+video and "
                   "alternate:low-res*2/image+video*2 (and --mix, if given)")
    p.add_argument("--rivals", action="store_true",
                   help="knapray (auto, per-step, overlap) against the newest balancers' planners (KnapFormer's "
                   "greedy on fixed bags, dynamic CP, FlexSP-style, Zellige-style overlapping groups: "
                   "knapray.planning.simulation.rivals) on the paper's image and image+video mixes, the Wan mix and two "
                   "held-out mixes at --worlds")
    p.add_argument("--random", type=int, metavar="N", default=None,
                   help="--rivals on N mixes drawn at random instead (images and clips of random sizes, both cost "
                   "presets, 8 to 256 GPUs; one step each; --seed picks them): a row each, and the worst case")
    p.add_argument("--worlds", default="8,32,128,512", help="--rivals: GPU counts, comma-separated (default 8,32,128,512)")
    p.add_argument("--markdown", metavar="FILE", help="--paper-table, --rivals: also write the table to this file")
    p.add_argument("--plot", metavar="PNG", help="write a PNG of predicted per-rank time")
    add_json(p)


def _rank_speeds(items: list[str] | None, world: int) -> list[float] | None:
    """``--rank-speed 5=0.5``: rank 5 runs at half speed."""
    if not items:
        return None
    speeds = [1.0] * world
    for item in items:
        rank, sep, value = item.partition("=")
        if not sep or not rank.strip().isdigit() or not 0 <= int(rank) < world:
            raise ValueError(f"--rank-speed expects RANK=SPEED with 0 <= RANK < {world}, got {item!r}")
        speeds[int(rank)] = float(value)
    return speeds


def run(args: argparse.Namespace) -> int:
    from knapray.planning.simulation import sim
    from knapray.planning.costs.cost import MODEL_PRESETS

    preset = [f"{k}={json.dumps(v)}" for k, v in MODEL_PRESETS[args.model].items()]
    args.cost = preset + list(args.cost)  # --cost after the preset: it overrides it
    cost = cost_model(args)
    if args.random is not None and not args.rivals:
        raise ValueError(f"--random {args.random}: mixes drawn at random are for --rivals (knapray simulate --rivals "
                         f"--random {args.random})")
    if args.rivals:
        return _rivals(args)
    if args.paper_table and args.topology == sim.PER_STEP:
        mixes = (*sim.PAPER_MIXES, *sim.NONSTATIONARY_MIXES) + ((args.mix,) if args.mix else ())
        print("mix                             GPUs  static s  per-step s  ratio   worst  behind", file=sys.stderr)
        rows = sim.per_step_table(
            mixes=mixes, cost=cost, steps=args.steps, seed=args.seed,
            progress=lambda r: print(
                f"{sim._short(r['mix'], 31):<31} {r['world_size']:>4}  {r['static_step_s']:>8.4f}  "
                f"{r['per_step_s']:>10.4f}  {r['ratio']:.4f}  {r['worst_step_ratio']:.4f}  {r['steps_behind']}",
                file=sys.stderr, flush=True),
        )
        command = "knapray simulate --paper-table --topology per-step" + (
            f" --steps {args.steps}" if args.steps != 3 else "") + (f" --mix {args.mix}" if args.mix else "")
        text = sim.per_step_markdown(rows, command, args.steps)
        return _table_out(args, text, rows)
    if args.paper_table:
        print("mix          GPUs  auto topology                  eff.    best greedy   eff.    ratio", file=sys.stderr)
        rows = sim.paper_table(
            cost=cost, steps=args.steps, seed=args.seed,
            progress=lambda r: print(
                f"{r['mix']:<12} {r['world_size']:>4}  {sim._short(r['auto_topology'], 28):<28} "
                f"{r['auto_efficiency']:.4f}  {r['greedy_topology']:<12} {r['greedy_efficiency']:.4f}  "
                f"{r['ratio']:.4f}", file=sys.stderr, flush=True),
        )
        command = "knapray simulate --paper-table" + (f" --steps {args.steps}" if args.steps != 3 else "")
        text = sim.table_markdown(rows, command, cost, args.steps)
        return _table_out(args, text, rows)
    if (args.mix is None) == (args.lengths is None):
        raise ValueError("give exactly one of --mix CODES|NAME, --lengths FILE or --paper-table")
    if args.mix is not None:
        from knapray.planning.shapes.mix import check_planned, parse_mix

        world = args.world_size or sim.schedule_ranks(args.mix)
        for _, codes, _ in sim.parse_schedule(args.mix):  # before any step is drawn
            check_planned(parse_mix(codes), args.steps, world)
        speeds = _rank_speeds(args.rank_speed, world)
        if speeds is not None:
            cost = cost.with_rank_speed(speeds)
        result = sim.simulate_mix(args.mix, args.topology, world, cost, steps=args.steps, seed=args.seed)
    else:
        from knapray.planning.simulation.runner import load_lengths

        steps = load_lengths(args.lengths)
        speeds = _rank_speeds(args.rank_speed, len(steps[0]))
        if speeds is not None:
            cost = cost.with_rank_speed(speeds)
        result = sim.simulate(steps, args.topology, cost)
        result["mix"] = args.lengths
    if args.plot:
        result["plot"] = sim.plot_rank_times(args.plot, result)
    sim.print_report(result)
    if args.json:
        print(json.dumps(result))
    return 0


RIVAL_MIXES = (("mixed-res", "flux"), ("image+video", "flux"), ("wan", "wan14b"),
               ("alternate:low-res/image+video", "flux"), ("long-video", "flux"))
"""The paper's image (mixed-res) and image+video mixes, the Wan mix under the Wan 14B model,
and two held out: image-only steps alternating with video-heavy ones, and a mix of long
clips (``knapray.planning.shapes.mix``'s ``long-video``)."""


MAX_RANDOM_MIXES = 10_000


def _random_rivals(args: argparse.Namespace) -> int:
    from knapray.planning.simulation.rivals import rivals_markdown, random_rivals_table

    if not 1 <= args.random <= MAX_RANDOM_MIXES:
        raise ValueError(f"--random {args.random}: a number of mixes from 1 to {MAX_RANDOM_MIXES}")
    print("  # mix                                        model   GPUs  knapray s  behind  rivals' step over knapray's best",
          file=sys.stderr)
    count = iter(range(1, args.random + 1))
    rows = random_rivals_table(args.random, args.seed, progress=lambda r: print(
        f"{next(count):>3} {r['mix'][:42]:<42} {r['model']:<7} {r['world_size']:>4} {r['knapray_best_s']:>10.4f} "
        f"{r['behind']:>6.2%}  " + "  ".join(f"{n} {v:.3f}" for n, v in r["ratios"].items() if not n.startswith("knapray")),
        file=sys.stderr, flush=True))
    worst = max(rows, key=lambda r: r["behind"])
    ahead = sum(1 for r in rows if r["behind"] == 0.0)
    command = f"knapray simulate --rivals --random {args.random} --seed {args.seed}"
    text = rivals_markdown(rows, command) + (
        f"\nknapray's best (auto, per-step or overlap) at or ahead of every rival on {ahead} of {len(rows)} mixes; "
        f"the worst: {worst['behind']:.3%} behind the best rival on {worst['mix']} ({worst['model']}, "
        f"{worst['world_size']} GPUs, step seed {worst['step_seed']}).\n")
    return _table_out(args, text, rows)


def _table_out(args: argparse.Namespace, text: str, rows: list[dict]) -> int:
    """A table command's output: the markdown (also to --markdown FILE), then --json's rows."""
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print(text)
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


def _rivals(args: argparse.Namespace) -> int:
    from knapray.limits import MAX_WORLD_SIZE
    from knapray.planning.simulation.rivals import rivals_markdown, rivals_table

    if args.random is not None:
        return _random_rivals(args)
    try:
        worlds = tuple(int(w) for w in args.worlds.split(","))
    except ValueError:
        raise ValueError(f"--worlds {args.worlds!r}: expected GPU counts such as 8,32,128,512") from None
    if any(not 1 <= w <= MAX_WORLD_SIZE for w in worlds):
        raise ValueError(f"--worlds {args.worlds!r}: each from 1 to {MAX_WORLD_SIZE}")
    print("mix                             GPUs  best knapray s  rivals' step time over knapray's best", file=sys.stderr)
    rows = rivals_table(
        RIVAL_MIXES, worlds=worlds, steps=args.steps, seed=args.seed,
        progress=lambda r: print(
            f"{r['mix'][:31]:<31} {r['world_size']:>4}  {r['knapray_best_s']:>14.4f}  " + "  ".join(
                f"{n} {v:.3f}" for n, v in r["ratios"].items() if not n.startswith("knapray")),
            file=sys.stderr, flush=True),
    )
    command = f"knapray simulate --rivals --worlds {args.worlds} --steps {args.steps}"
    text = rivals_markdown(rows, command)
    return _table_out(args, text, rows)
