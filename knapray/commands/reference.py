"""``knapray reference``: a family's model against its reference implementation, loaded
from the same checkpoint (knapray/testing/reference.py)."""

from __future__ import annotations

import argparse
import json

NAME = "reference"
HELP = "a pretrained checkpoint in knapray vs its reference implementation (diffusers): outputs and gradients"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .flags import add_fsdp, add_json, add_seed, add_world_size, float_in, int_at_least

    p.add_argument("--pretrained", required=True, action="append", metavar="DIR",
                   help="diffusers model directory (config.json + safetensors); repeat to check several")
    p.add_argument("--family", default=None, help="force a family (default: from the checkpoint's config.json)")
    add_world_size(p, default=1, help="1: single process (default); N: balanced on N local gloo ranks")
    p.add_argument("--topology", default=None, help="bags of the balanced run, e.g. g1n2+g2n1 (with --world-size N)")
    add_fsdp(p, default="none", help="the balanced run shards the loaded model over all its ranks (none or full; "
             "default none)")
    p.add_argument("--sequences", type=int_at_least(1), default=4,
                   help="random sequences, each its own resolution and text length (default 4)")
    add_seed(p)
    p.add_argument("--tol", type=float_in(gt=0), default=1e-5, help="largest relative error that passes (default 1e-5)")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from knapray.testing.reference import passed, run_reference
    from .flags import check_local_processes

    check_local_processes(args.world_size, "knapray reference")
    if args.fsdp == "hybrid":
        raise ValueError("--fsdp hybrid: knapray reference shards over the whole world; use none or full")
    report = run_reference(args.pretrained, family=args.family, world_size=args.world_size, topology=args.topology,
                           seed=args.seed, sequences=args.sequences, fsdp=args.fsdp)
    meta = report["_meta"]
    where = "single process" if meta["world_size"] == 1 else \
        f"balanced on {meta['world_size']} gloo ranks, {meta['topology']}, fsdp {meta['fsdp']}"
    print(f"reference check ({where}, {meta['sequences']} sequences, seed {meta['seed']}, fp32), "
          f"largest relative error (tolerance {args.tol:g}):")
    for path, r in report.items():
        if path.startswith("_"):
            continue
        extra = "" if "weights_diff" not in r else (
            f"  loaded weights vs file {r['weights_diff']:.1e} (each rank read {max(r['bytes_read_per_rank']) / 1024:.0f}"
            f" of {r['checkpoint_bytes'] / 1024:.0f} KiB)")
        verdict = "ok" if max(r["out_rel"], r["grad_rel"], r.get("weights_diff", 0.0)) <= args.tol else "FAIL"
        print(f"  {path}: {r['family']} d={r['hidden']} heads={r['heads']} blocks={r['depth'][0]}+{r['depth'][1]} "
              f"rope={r['rope_axes']} guidance={r['guidance']}: outputs {r['out_rel']:.1e}, "
              f"gradients {r['grad_rel']:.1e} (worst {r['worst_grad']}){extra}  {verdict}")
    ok = passed(report, args.tol)
    if args.json:
        print(json.dumps({"passed": ok, "tol": args.tol, **report}))
    return 0 if ok else 1
