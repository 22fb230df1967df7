"""``knapray parity``: balanced vs unbalanced vs a single-process reference, forward and
backward, on gloo processes (``knapray.testing.parity``)."""

from __future__ import annotations

import argparse
import json

from .flags import add_ac, add_compile, add_fsdp, add_gpus_per_node, add_json, add_seed, add_world_size, float_in, \
    int_at_least, text_tokens
from knapray.limits import MAX_SCALE


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_world_size(p, default=4, help="gloo processes (default 4)")
    p.add_argument("--topology", default="g1n2+g2n1", help="bags of the balanced run (default g1n2+g2n1)")
    p.add_argument("--mix", default="g1b3i256f1s0,g1b1i512f1s0,g1b2i128f2s0,g1b1i128f1s0",
                   help="data codes; the mix's ranks must divide --world-size")
    p.add_argument("--scale", type=int_at_least(1, MAX_SCALE), default=4, help="divide resolutions and text lengths (CPU size)")
    p.add_argument("--max-text-tokens", type=text_tokens, default=392)
    p.add_argument("--heads", type=int_at_least(1), default=4, help="attention heads (every bag size must divide it)")
    add_seed(p)
    p.add_argument("--tol", type=float_in(gt=0), default=1e-5, help="relative tolerance (default 1e-5)")
    add_fsdp(p, default="none", help="the model of every case (default none)")
    add_gpus_per_node(p, help="ranks per 'node' for --fsdp hybrid (e.g. 2 on 4 ranks = 2 nodes)")
    add_ac(p, default="none", help="every case (default none)")
    add_compile(p, "torch.compile of each block in every case", backends=["inductor", "aot_eager"])
    p.add_argument("--empty-ranks", type=int_at_least(0), nargs="*", default=[], metavar="RANK",
                   help="ranks that hold no sequences")
    p.add_argument("--textless-ranks", type=int_at_least(0), nargs="*", default=[], metavar="RANK",
                   help="ranks whose sequences hold no text tokens")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from knapray.testing.parity import passed, run_parity
    from knapray.config.parallel import ParallelConfig
    from .flags import check_local_processes

    check_local_processes(args.world_size, "knapray parity")
    report = run_parity(
        args.world_size, [args.topology], args.mix, scale=args.scale, seed=args.seed,
        num_heads=args.heads, max_text_tokens=args.max_text_tokens,
        empty_ranks=tuple(args.empty_ranks), textless_ranks=tuple(args.textless_ranks),
        parallelism=ParallelConfig(fsdp=args.fsdp, activation_checkpointing=args.ac, ac_every=args.ac_every or 2,
                                   compile=args.compile, compile_backend=args.compile_backend),
        gpus_per_node=args.gpus_per_node,
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
              + f", activation checkpointing {m['activation_checkpointing']}, compile "
              + (f"{m['compile_backend']} (recompiles per rank {m['recompiles']})" if m["compile"] else "off"))
        print(f"{'case':<16} {'outputs':>10} {'loss':>10} {'grads(max)':>11} {'grad norm':>10}  worst parameter")
        for case, r in report.items():
            if case.startswith("_"):
                continue
            print(f"{case:<16} {r['out_rel']:>10.2e} {r['loss_rel']:>10.2e} {r['grad_rel_max']:>11.2e} "
                  f"{r['grad_norm_rel']:>10.2e}  {r['worst_param']}")
        print("PASS" if ok else "FAIL")
    return 0 if ok else 1
