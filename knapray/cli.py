"""The `knapray` command."""

from __future__ import annotations

import argparse
import json
import math
import sys


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line (``knapray plan: error: ...``) and exit code 2, as every
    other user error of the command."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_parallel_args(group, also: str, backends: list[str] | None = None) -> None:
    """--fsdp/--gpus-per-node/--ac/--ac-every/--compile/--compile-backend, as ``parallelize``
    takes them (knapray parity and knapray bench step share them)."""
    group.add_argument("--fsdp", default="none", choices=["none", "full", "hybrid"],
                       help=f"{also}FSDP2 sharding over the world (full) or within nodes (hybrid)")
    group.add_argument("--gpus-per-node", type=_int_at_least(1), default=None,
                       help="ranks per 'node' for --fsdp hybrid (e.g. 2 on 4 ranks = 2 nodes)")
    group.add_argument("--ac", default="none", choices=["none", "full", "every_k"],
                       help=f"{also}activation checkpointing of blocks (every_k: every --ac-every-th)")
    group.add_argument("--ac-every", type=_int_at_least(1), default=2, help="k for --ac every_k (default 2)")
    group.add_argument("--compile", action="store_true", help=f"{also}torch.compile of each block")
    group.add_argument("--compile-backend", default="inductor", choices=backends,
                       help="torch.compile backend (default inductor; aot_eager compiles fast)")


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value
    return parse


def _float_in(*, ge: float | None = None, gt: float | None = None):
    bound = f">= {ge:g}" if ge is not None else f"> {gt:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or (ge is not None and value < ge) or (gt is not None and value <= gt):
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
        return value
    return parse


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=_int_at_least(1), default=3072, help="model width d in the workload model (default 3072, Flux)")
    p.add_argument("--gamma", type=_float_in(ge=0), default=0.4, help="relative cost of attention FLOPs (default 0.4)")


def cmd_plan(args: argparse.Namespace) -> int:
    from knapray.planning import Topology, WorkloadModel
    from knapray.planning.runner import load_lengths, mix_ranks, mix_steps, plan_run

    if (args.mix is None) == (args.lengths is None):
        raise ValueError("give exactly one of --mix CODES or --lengths FILE")
    model = WorkloadModel(d_model=args.d_model, gamma=args.gamma)
    if args.mix is not None:
        world = args.world_size or mix_ranks(args.mix)
        steps = list(mix_steps(args.mix, args.steps, args.seed, world_size=world))
    else:
        steps = load_lengths(args.lengths)
        world = len(steps[0])
    if args.topology == "auto":
        # Cost model plans on the topology with the lowest predicted step time.
        from knapray.planning.autotopo import search_topology

        model = _cost_model(args)
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
        from knapray.plots import plot_rank_work

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


def _int_list(text: str) -> list[int]:
    """``"10000,1000000"`` -> ``[10000, 1000000]``, for argparse."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, e.g. 10000,1000000; got {text!r}")
    return values


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


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "planner":
        from knapray.benchmarks.planner import run

        rows = run(steps=20 if args.steps is None else args.steps, steps_1024=args.steps_1024, seed=args.seed)
        if args.json:
            print(json.dumps(rows))
        return 0
    if args.what == "step":
        from knapray.benchmarks.step import CPU_GAMMA, plot_rank_compute, print_report, run_step_bench

        result = run_step_bench(
            world_size=args.world_size, steps=6 if args.steps is None else args.steps,
            warmup=args.warmup, mix=args.mix, scale=args.scale, topology=args.topology,
            max_text_tokens=args.max_text_tokens, hidden=args.hidden, heads=args.heads,
            depth_double=args.depth, depth_single=args.depth,
            gamma=CPU_GAMMA if args.gamma is None else args.gamma, seed=args.seed,
            fsdp=args.fsdp, ac=args.ac, ac_every=args.ac_every, compile=args.compile,
            compile_backend=args.compile_backend, gpus_per_node=args.gpus_per_node,
        )
        if args.plot:
            result["plot"] = plot_rank_compute(args.plot, result)
        print_report(result)
        if args.plot:
            print(f"plot: {args.plot}")
        if args.json:
            print(json.dumps(result))
        if not result["math_ok"]:
            print(f"error: a variant computes different math: relative loss / grad norm difference "
                  f"{result['math_rel_max']:.2e} from the baseline exceeds {result['math_tol']:g}", file=sys.stderr)
            return 1
        return 0
    if args.what == "ledger":
        from knapray.benchmarks.ledger import DEFAULT_SIZES
        from knapray.benchmarks.ledger import run as run_ledger

        result = run_ledger(
            sizes=tuple(args.sizes) if args.sizes else DEFAULT_SIZES,
            steps=30 if args.steps is None else args.steps, directory=args.dir,
        )
        if args.json:
            print(json.dumps(result))
        return 0
    raise ValueError(f"unknown benchmark {args.what!r}")


def cmd_parity(args: argparse.Namespace) -> int:
    from knapray.parity import Parallelism, passed, run_parity

    report = run_parity(
        args.world_size, [args.topology], args.mix, scale=args.scale, seed=args.seed,
        num_heads=args.heads, max_text_tokens=args.max_text_tokens,
        empty_ranks=tuple(args.empty_ranks), textless_ranks=tuple(args.textless_ranks),
        parallelism=Parallelism(fsdp=args.fsdp, ac=args.ac, ac_every=args.ac_every, compile=args.compile,
                                compile_backend=args.compile_backend, gpus_per_node=args.gpus_per_node),
    )
    ok = passed(report, args.tol)
    report["_meta"].update({"tolerance": args.tol, "passed": ok})
    if args.json:
        print(json.dumps(report))
    else:
        m = report["_meta"]
        print(f"parity: {m['world_size']} gloo ranks, {m['sequences']} sequences / {m['tokens']} tokens, "
              f"fp32, tolerance {args.tol:g} (max|a-b|/max|b| per tensor)")
        print(f"model: fsdp {m['fsdp']}" + (f" ({m['gpus_per_node']} ranks per node)" if m["fsdp"] == "hybrid" else "")
              + f", activation checkpointing {m['ac']}, compile "
              + (f"{m['compile_backend']} (recompiles per rank {m['recompiles']})" if m["compile"] else "off"))
        print(f"{'case':<16} {'outputs':>10} {'loss':>10} {'grads(max)':>11} {'grad norm':>10}  worst parameter")
        for case, r in report.items():
            if case.startswith("_"):
                continue
            print(f"{case:<16} {r['out_rel']:>10.2e} {r['loss_rel']:>10.2e} {r['grad_rel_max']:>11.2e} "
                  f"{r['grad_norm_rel']:>10.2e}  {r['worst_param']}")
        print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _cost_model(args: argparse.Namespace):
    """CostModel from ``--profile`` and ``--set key=value`` overrides (defaults: 8xH100, Flux)."""
    from knapray.planning.cost import CostModel

    overrides = {}
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value
    if getattr(args, "gpus_per_node", None):
        overrides.setdefault("gpus_per_node", args.gpus_per_node)
    if getattr(args, "profile", None):
        return CostModel.from_profile(args.profile, **overrides)
    return CostModel.from_dict(overrides)


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


def cmd_simulate(args: argparse.Namespace) -> int:
    from knapray import sim

    cost = _cost_model(args)
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
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text)
        print(text)
        if args.json:
            print(json.dumps({"rows": rows}))
        return 0
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
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text)
        print(text)
        if args.json:
            print(json.dumps({"rows": rows}))
        return 0
    if (args.mix is None) == (args.lengths is None):
        raise ValueError("give exactly one of --mix CODES|NAME, --lengths FILE or --paper-table")
    if args.mix is not None:
        world = args.world or sim.schedule_ranks(args.mix)
        speeds = _rank_speeds(args.rank_speed, world)
        if speeds is not None:
            cost = cost.with_rank_speed(speeds)
        result = sim.simulate_mix(args.mix, args.topology, world, cost, steps=args.steps, seed=args.seed)
    else:
        from knapray.planning.runner import load_lengths

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


def cmd_calibrate(args: argparse.Namespace) -> int:
    from knapray.calibrate import calibrate, print_report, print_validation, validate

    def progress(done: int, total: int) -> None:
        if not args.json:
            print(f"  timed round {done}/{total}", file=sys.stderr, flush=True)

    if args.validate:
        report = validate(
            args.validate, scale=args.validate_scale, target_s=args.validate_target_s, per_mix=args.per_mix,
            repeats=args.repeats, device=args.device, progress=progress,
        )
        print_validation(report, args.max_error)
        if args.json:
            print(json.dumps(report))
        return 0 if report["mean_abs_error"] <= args.max_error else 1
    budgets = [int(x) for x in args.budgets.split(",")] if args.budgets else None
    profile = calibrate(
        hidden=args.hidden, heads=args.heads, depth_double=args.depth_double, depth_single=args.depth_single,
        budgets=budgets, short=args.short, longest=args.longest, repeats=args.repeats, device=args.device, dtype=args.dtype,
        compile=args.compile, ac=args.ac, per_sequence={"auto": None, "on": True, "off": False}[args.per_sequence],
        out=args.out, progress=progress,
    )
    print_report(profile)
    if args.json:
        print(json.dumps(profile))
    return 0 if profile["fit"]["cv_mape"] <= args.max_error else 1


def cmd_train(args: argparse.Namespace) -> int:
    from knapray.train.job import run

    return run(args)


def cmd_ingest(args: argparse.Namespace) -> int:
    from knapray.corpus.ingest import run

    try:
        return run(args)
    except (TypeError, ImportError) as e:  # a factory that does not fit, a missing extra
        raise ValueError(str(e)) from None


def cmd_sample(args: argparse.Namespace) -> int:
    from knapray.sample import print_report, run

    print_report(run(args), args.json)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("knapray")
    except PackageNotFoundError:
        return "unknown (not installed)"


def cmd_memory(args: argparse.Namespace) -> int:
    from knapray.planning.memory import GIB, memory_model_for_run
    from knapray.train.config import load_config

    cfg = load_config(args.config)  # a ConfigError (ValueError) names the file or the key
    mem = memory_model_for_run(
        cfg, world_size=args.world_size, gpus_per_node=args.gpus_per_node, sharding=args.fsdp,
        checkpointing=args.ac, ac_every=args.ac_every,
    )
    gpu_bytes = int(args.gpu_gib * GIB)
    fit = mem.max_tokens_per_gpu(gpu_bytes)
    tokens = args.tokens_per_gpu
    if tokens is None:
        tokens = cfg.data.max_tokens_per_gpu or fit
    br = mem.breakdown(tokens)
    gib = br.to_gib()
    result = {
        "config": args.config, "params": mem.shape.num_params, "world_size": mem.world_size,
        "gpus_per_node": mem.gpus_per_node, "fsdp": mem.sharding, "shard_size": mem.shard_size,
        "ac": mem.checkpointing, "ac_every": mem.ac_every, "precision": mem.precision,
        "tokens_per_gpu": tokens, "breakdown": {k: v for k, v in gib.items() if k != "total"},
        "total_gib": gib["total"], "peak_phase": br.peak_phase, "gpu_gib": args.gpu_gib,
        "usable_gib": mem.usable_bytes(gpu_bytes) / GIB, "fits": mem.fits(tokens, gpu_bytes),
        "max_tokens_per_gpu": fit,
    }
    ac = mem.checkpointing + (f" (k={mem.ac_every})" if mem.checkpointing == "every_k" else "")
    print(f"{cfg.run.name}: {mem.shape.num_params / 1e9:.2f} B parameters, {mem.precision}, "
          f"{mem.world_size} GPUs ({mem.gpus_per_node} per node), fsdp {mem.sharding} "
          f"(state sharded over {mem.shard_size}), activation checkpointing {ac}")
    print(f"per GPU at {tokens} tokens per GPU:")
    for key, value in result["breakdown"].items():
        note = "  (optimizer step, after activations are freed)" if key == "step_buffers" else ""
        print(f"  {key.replace('_', ' '):<18} {value:>9.2f} GiB{note}")
    print(f"  {'total':<18} {gib['total']:>9.2f} GiB  peak in the {br.peak_phase}; usable of "
          f"{args.gpu_gib:g} GiB: {result['usable_gib']:.2f} GiB ({mem.reserve_bytes / GIB:g} GiB reserve, "
          f"{mem.fragmentation:.0%} fragmentation) -> {'fits' if result['fits'] else 'DOES NOT FIT'}")
    if fit:
        print(f"largest token budget that fits {args.gpu_gib:g} GiB: {fit} tokens per GPU")
    else:
        print(f"the model state alone does not fit {args.gpu_gib:g} GiB: shard it (--fsdp full|hybrid)")
    if args.json:
        print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from knapray.corpus.ingest import DESCRIPTION as INGEST_DESCRIPTION
    from knapray.corpus.ingest import add_arguments as ingest_arguments
    from knapray.sample import add_arguments as sample_arguments
    from knapray.train.job import add_arguments as train_arguments

    parser = _Parser(prog="knapray", description="Workload-balanced DiT training on Ray")
    parser.add_argument("--version", action="version", version=f"knapray {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train on Ray (embedded local Ray, or --address for a cluster)")
    train_arguments(t)
    t.set_defaults(func=cmd_train)

    i = sub.add_parser("ingest", help="encode a folder of images/videos into a corpus", description=INGEST_DESCRIPTION)
    ingest_arguments(i)
    i.set_defaults(func=cmd_ingest)

    s = sub.add_parser("sample", help="sample images from a trained run's checkpoint (PNG grid)")
    sample_arguments(s)
    s.set_defaults(func=cmd_sample)

    p = sub.add_parser("plan", help="plan steps of a data mix and report balance")
    p.add_argument("--mix", help="paper data codes, e.g. 'g16b4i256f1s0,g4b5i512f1s0,...'")
    p.add_argument("--lengths", help="JSON file: list of steps, each a list of per-rank lists of lengths")
    p.add_argument("--topology", default="g8n4", help="bags, e.g. g8n4 or g1n16+g4n2+g8n1 (default g8n4)")
    p.add_argument("--world-size", type=_int_at_least(1), default=None, help="replicate the mix and topology to this many ranks")
    p.add_argument("--gpus-per-node", type=_int_at_least(1), default=None, help="lay bags out so none crosses a node")
    p.add_argument("--steps", type=_int_at_least(1), default=50)
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--solver", default="knapray", choices=["knapray", "greedy"])
    _add_model_args(p)
    p.add_argument("--plot", help="write a PNG of per-rank work before/after")
    p.add_argument("--export", help="write the plans as JSON")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--profile", help="--topology auto: cost model profile JSON (knapray calibrate)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="--topology auto: override a CostModel field")
    p.add_argument("--auto-steps", type=_int_at_least(1), default=2, help="--topology auto: steps the search scores (default 2)")
    p.set_defaults(func=cmd_plan)

    q = sub.add_parser("parity", help="balanced vs unbalanced vs single-process reference (gloo)")
    q.add_argument("--world-size", type=_int_at_least(1), default=4)
    q.add_argument("--topology", default="g1n2+g2n1")
    q.add_argument("--mix", default="g1b3i256f1s0,g1b1i512f1s0,g1b2i128f2s0,g1b1i128f1s0",
                   help="data codes; the mix's ranks must divide --world-size")
    q.add_argument("--scale", type=_int_at_least(1), default=4, help="divide resolutions and text lengths (CPU size)")
    q.add_argument("--max-text-tokens", type=_int_at_least(0), default=392)
    q.add_argument("--heads", type=_int_at_least(1), default=4, help="attention heads (every bag size must divide it)")
    q.add_argument("--seed", type=_int_at_least(0), default=0)
    q.add_argument("--tol", type=_float_in(gt=0), default=1e-5)
    _add_parallel_args(q, "")
    q.add_argument("--empty-ranks", type=_int_at_least(0), nargs="*", default=[], metavar="RANK",
                   help="ranks that hold no sequences")
    q.add_argument("--textless-ranks", type=_int_at_least(0), nargs="*", default=[], metavar="RANK",
                   help="ranks whose sequences hold no text tokens")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_parity)

    b = sub.add_parser("bench", help="benchmarks (ratios measured side by side)")
    b.add_argument("what", choices=["planner", "step", "ledger"])
    b.add_argument("--steps", type=_int_at_least(1), default=None,
                   help="steps (default: planner 20, step 6 incl. warm-up, ledger 30)")
    b.add_argument("--steps-1024", type=_int_at_least(1), default=5)
    b.add_argument("--seed", type=_int_at_least(0), default=0)
    b.add_argument("--json", action="store_true")
    st = b.add_argument_group("step benchmark (gloo processes on this machine)")
    st.add_argument("--world-size", type=_int_at_least(1), default=4, help="gloo processes (default 4)")
    st.add_argument("--warmup", type=_int_at_least(0), default=1, help="leading steps left out of the averages (default 1)")
    st.add_argument("--mix", default="g1b2i512f34s1,g3b4i256f1s0",
                    help="data codes; skewed by default: rank 0 holds two videos, the others small images")
    st.add_argument("--scale", type=_int_at_least(1), default=4, help="divide resolutions and text lengths (default 4)")
    st.add_argument("--topology", default="g2n2", help="bags of the balanced run (default g2n2)")
    st.add_argument("--max-text-tokens", type=_int_at_least(0), default=392)
    st.add_argument("--hidden", type=_int_at_least(1), default=192, help="model width (default 192)")
    st.add_argument("--heads", type=_int_at_least(1), default=4, help="attention heads (default 4)")
    st.add_argument("--depth", type=_int_at_least(0), default=2, help="double- and single-stream blocks, each (default 2)")
    st.add_argument("--gamma", type=_float_in(ge=0), default=None,
                    help="attention cost weight of the workload model (default: fitted for CPU, 0.85)")
    st.add_argument("--plot", help="write a PNG of per-rank compute time, balanced vs unbalanced")
    _add_parallel_args(st, "also measure the balanced step with ", backends=["inductor", "aot_eager"])
    lb = b.add_argument_group("ledger benchmark (commit cost by ledger size, on this machine's disk)")
    lb.add_argument("--sizes", type=_int_list, default=None,
                    help="ledger sizes in rows, comma-separated (default 10000,1000000,10000000)")
    lb.add_argument("--dir", default=None, help="where the state directories go (default: the temp directory)")
    b.set_defaults(func=cmd_bench)

    m = sub.add_parser("simulate", help="predicted step time per rank: unbalanced, greedy, knapray (cost model)")
    m.add_argument("--mix", help="paper mix name (low-res, mixed-res, image+video), data codes, or a non-stationary "
                   "schedule alternate:MIX[*K]/MIX[*K]/... (K steps of each in turn, e.g. alternate:low-res/image+video)")
    m.add_argument("--lengths", help="JSON file: list of steps, each a list of per-rank lists of lengths")
    m.add_argument("--topology", default="auto", help="bags, e.g. g8n4, 'auto' (default: chosen once from other "
                   "steps), or 'per-step' (aligned power-of-two blocks of each node chosen every step, vs static auto)")
    m.add_argument("--world-size", dest="world", type=_int_at_least(1), default=None,
                   help="ranks (a multiple of the mix's ranks; default the mix's)")
    m.add_argument("--gpus-per-node", type=_int_at_least(1), default=None, help="GPUs per node (default: the cost model's, 8)")
    m.add_argument("--profile", help="cost model profile JSON (knapray calibrate), default: 8xH100 constants")
    m.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a CostModel field, e.g. inter_node_bw=25e9")
    m.add_argument("--rank-speed", action="append", metavar="RANK=SPEED", help="a rank's speed factor, e.g. 5=0.5")
    m.add_argument("--steps", type=_int_at_least(1), default=3, help="steps to simulate (default 3)")
    m.add_argument("--seed", type=_int_at_least(0), default=0)
    m.add_argument("--paper-table", action="store_true", help="auto vs best greedy on the paper mixes at 32 and 1024 "
                   "GPUs; with --topology per-step: per-step vs static auto on them, alternate:low-res/image+video and "
                   "alternate:low-res*2/image+video*2 (and --mix, if given)")
    m.add_argument("--markdown", help="--paper-table: also write the table to this file")
    m.add_argument("--plot", help="write a PNG of predicted per-rank time")
    m.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    m.set_defaults(func=cmd_simulate)

    c = sub.add_parser("calibrate", help="time packed batches on this device, fit the cost model, write a profile; "
                       "or --validate a profile on held-out batches")
    c.add_argument("--hidden", type=_int_at_least(1), default=128, help="model width (default 128: CPU size; Flux 3072)")
    c.add_argument("--heads", type=_int_at_least(1), default=4, help="attention heads (default 4; Flux 24)")
    c.add_argument("--depth-double", type=_int_at_least(0), default=1, help="double-stream blocks timed (default 1)")
    c.add_argument("--depth-single", type=_int_at_least(0), default=1, help="single-stream blocks timed (default 1)")
    c.add_argument("--budgets", help="comma-separated token budgets of the packed batches "
                   "(default: 1024,2048,3072 on CPU, 8192,16384,32768 on GPU)")
    c.add_argument("--short", type=_int_at_least(1), default=None, help="length of the short sequences (default 64 CPU, 256 GPU)")
    c.add_argument("--longest", type=_int_at_least(1), default=None,
                   help="longest calibrated sequence: the run's longest (default: 2048 on CPU, the largest budget on GPU)")
    c.add_argument("--repeats", type=_int_at_least(1), default=7, help="timed runs per batch; the fastest counts (default 7)")
    c.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    c.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bfloat16 on GPU, float32 on CPU)")
    c.add_argument("--compile", action="store_true", help="torch.compile every block (dynamic shapes), as the run does")
    c.add_argument("--ac", action="store_true", help="activation checkpointing of every block, as the run does")
    c.add_argument("--per-sequence", choices=["auto", "on", "off"], default="auto",
                   help="per-sequence cost term: auto keeps it if leave-one-out cross-validation says so (default)")
    c.add_argument("--out", default="profile.json", help="profile JSON to write (default profile.json)")
    c.add_argument("--validate", metavar="PROFILE", help="time held-out packed batches from the paper mixes in the "
                   "profile's mode; print predicted vs measured; exit 1 if the mean abs. error exceeds --max-error")
    c.add_argument("--validate-scale", type=_int_at_least(1), default=None,
                   help="--validate: divide the mixes' resolutions by this (default 4 on CPU, 1 on GPU)")
    c.add_argument("--validate-target-s", type=_float_in(gt=0), default=None,
                   help="--validate: seconds a held-out batch should take by the profile's prediction "
                   "(default 0.15 on CPU, 0.3 on GPU)")
    c.add_argument("--per-mix", type=_int_at_least(1), default=4, help="--validate: held-out batches per paper mix (default 4)")
    c.add_argument("--max-error", type=_float_in(gt=0), default=0.05,
                   help="exit 1 if the mean abs. error (calibration: leave-one-out; validation: held-out) exceeds "
                   "this (default 0.05)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_calibrate)

    y = sub.add_parser("memory", help="per-GPU memory of a run config and the largest token budget that fits")
    y.add_argument("--config", required=True, help="run config YAML (knapray.train.config)")
    y.add_argument("--world-size", type=_int_at_least(1), default=None, help="GPUs (default: run.num_workers)")
    y.add_argument("--gpus-per-node", type=_int_at_least(1), default=None, help="default: balance.gpus_per_node, else 8")
    y.add_argument("--fsdp", default=None, help="none|full|hybrid (default: run.fsdp, else none)")
    y.add_argument("--ac", default=None,
                   help="activation checkpointing none|full|every_k (default: run.activation_checkpointing, else none)")
    y.add_argument("--ac-every", type=_int_at_least(1), default=None, help="k of --ac every_k (default 2)")
    y.add_argument("--tokens-per-gpu", type=_int_at_least(0), default=None,
                   help="routed tokens per GPU (default: data.max_tokens_per_gpu, else the largest that fits)")
    y.add_argument("--gpu-gib", type=_float_in(gt=0), default=80.0, help="GPU memory in GiB (default 80)")
    y.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    y.set_defaults(func=cmd_memory)

    from knapray.commands import export, reference, register  # one module per command (knapray/commands)
    for command in (reference, export): register(sub, command)  # noqa: E701
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input or an unreadable file: one line, exit 2
        what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else str(e)
        print(f"knapray {args.command}: error: {what}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
