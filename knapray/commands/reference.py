"""``knapray reference``: a family's model against its reference implementation, loaded
from the same checkpoint (knapray/testing/reference.py)."""

from __future__ import annotations

import argparse
import json

NAME = "reference"
HELP = "a pretrained checkpoint in knapray vs its reference implementation (diffusers): outputs and gradients"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.cli import _float_in, _int_at_least

    p.add_argument("--pretrained", required=True, action="append", metavar="DIR",
                   help="diffusers model directory (config.json + safetensors); repeat to check several")
    p.add_argument("--family", default=None, help="force a family (default: from the checkpoint's config.json)")
    p.add_argument("--world-size", type=_int_at_least(1), default=1,
                   help="1: single process (default); N: balanced on N local gloo ranks")
    p.add_argument("--topology", default=None, help="bags of the balanced run, e.g. g1n2+g2n1 (with --world-size N)")
    p.add_argument("--fsdp", default="none", choices=["none", "full"],
                   help="balanced run: FSDP2-shard the loaded model over the ranks (default none)")
    p.add_argument("--sequences", type=_int_at_least(1), default=4,
                   help="random sequences, each its own resolution and text length (default 4)")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--tol", type=_float_in(gt=0), default=1e-5, help="largest relative error that passes (default 1e-5)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    from knapray.testing.reference import passed, run_reference

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
