"""The memory model against a measured step on this machine's device.

    python -m knapray.commands.memory_check --hidden 3072 --heads 24 --depth-double 3 --depth-single 3 --tokens 16384

Prints, per category (activations, parameters, gradients, optimizer state and on CUDA the
forward + backward peak), what ``knapray.planning.costs.memory`` predicts beside what
``knapray.testing.memory_check`` measures on one packed batch.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.planning.costs.checkpointing import AC_MODES

    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--depth-double", type=int, default=2)
    p.add_argument("--depth-single", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="image tokens per sequence x sequences (rounded)")
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--ac", choices=list(AC_MODES), default="none")
    p.add_argument("--ac-every", type=int, default=2)
    p.add_argument("--device", default=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="memory model vs measurement on one packed batch")
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    import torch

    from knapray.testing.memory_check import measure_step, probe_step

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cfg, batch = probe_step(hidden=args.hidden, heads=args.heads, depth_double=args.depth_double,
                            depth_single=args.depth_single, tokens=args.tokens, sequences=args.sequences)
    _report(measure_step(cfg, batch, dtype=dtype, checkpointing=args.ac, ac_every=args.ac_every, device=device))
    return 0


def _report(r: dict[str, Any]) -> None:
    from knapray.planning.costs.memory import GIB

    print(f"tokens {r['tokens']}")
    print(f"{'':<16} {'predicted GiB':>14} {'measured GiB':>13} {'pred/meas':>10}")
    rows = [("activations", "activations"), ("params", "params"), ("grads", "grads"), ("optimizer", "optimizer")]
    if "cuda_fwd_bwd_peak" in r:
        rows.append(("fwd_bwd_peak", "cuda_fwd_bwd_peak"))
    for pred_key, meas_key in rows:
        p, m = r["predicted"][pred_key], r[meas_key]
        ratio = p / m if m else math.nan
        print(f"{pred_key:<16} {p / GIB:>14.3f} {m / GIB:>13.3f} {ratio:>10.3f}")


if __name__ == "__main__":
    from knapray.stopping import run_main

    run_main(main)
