"""The GPU check: short bf16 training runs through the torchrun launcher, judged.

    python3 -m knapray.commands.gpu_check            # one GPU: NCCL, world 1, topology g1n1
    python3 -m knapray.commands.gpu_check --cpu      # the first run's chain on gloo with a tiny model
    python3 -m knapray.commands.gpu_check --bench --json F   # make gpu-bench: gradients, sampling, runs profiled

The runs, how each is launched and judged: ``knapray.testing.gpu_check``. It needs neither
Ray nor an install (only torch, numpy, pyarrow and pyyaml): ``make gpu-check`` and
``make gpu-bench`` run it on the GPU machine. Exit status: 0 if every run passed, 1 if one
failed, 2 without a CUDA device (and without ``--cpu``) or on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path


STAGES = ("gradients", "sampling", "runs", "fp8")
"""The bench's stages, in the order they run."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.testing.gpu_check import GPU_CHECKS

    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU with a tiny model (tests the chain)")
    p.add_argument("--only", action="append", choices=[c.name for c in GPU_CHECKS] + ["fp8"],
                   help="run only these GPU checks (default: all); fp8: parallel.fp8's stage alone (its gradient "
                        "check and float8 against bf16), e.g. when make gpu-bench had no time left for it")
    p.add_argument("--profile", action="store_true",
                   help="profile 3 steps after the warm-up (metrics.profile_steps) and print where the device time went")
    p.add_argument("--nproc", type=int, default=1, help="ranks (default 1)")
    p.add_argument("--topology", default=None, help="bags (default g1n<nproc>)")
    p.add_argument("--out", default=None, help="work directory (default: a temporary one, removed)")
    p.add_argument("--bench", action="store_true",
                   help="make gpu-bench: the gradient check first (compiled bf16 against float64, "
                        "knapray.testing.grad_truth), then the runs, each profiled")
    p.add_argument("--no-sampling", action="store_true",
                   help="with --bench: leave out the sampling section (its forward truth, and knapray beside diffusers)")
    p.add_argument("--skip", action="append", default=[], choices=list(STAGES),
                   help="with --bench: leave out this stage (repeatable), e.g. to split the bench over two calls "
                        "of the GPU machine: the gradients, the sampling section, the training runs, the fp8 stage")
    p.add_argument("--json", default=None, metavar="FILE", help="write every number of the check to FILE")
    p.add_argument("--timeout", type=int, default=520,
                   help="seconds the check may take from its start, the bench's stages included (default 520: "
                        "with the gpu tests, make gpu-check fits 10 minutes); a run that would pass it is stopped "
                        "and fails, a stage with too little time left is not run")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m knapray.commands.gpu_check", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    import torch

    from knapray.testing.gpu_check import (CPU_CHECK, FP8_STAGE_S, GPU_CHECKS, attention_packages, checkout_commit,
                                           fp8_stage, gradient_stage, run_check, sampling_stage)

    if args.steps < 1 or args.nproc < 1:
        print(f"gpu_check: error: --steps and --nproc must be >= 1, got {args.steps}, {args.nproc}", file=sys.stderr)
        return 2
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device here (use --cpu to check the chain on CPU)", file=sys.stderr)
        return 2
    fp8_only = bool(args.only) and set(args.only) == {"fp8"}
    skip = set(args.skip) | ({"sampling"} if args.no_sampling else set())
    checks = [] if fp8_only or "runs" in skip else [CPU_CHECK] if args.cpu else [
        c for c in GPU_CHECKS if not args.only or c.name in args.only]
    topology = args.topology or f"g1n{args.nproc}"
    device = "cpu (gloo)" if args.cpu else f"{torch.cuda.get_device_name(0)} (NCCL)"
    print(f"== knapray GPU check: {device}, torch {torch.__version__}, {args.nproc} rank(s), {args.steps} steps "
          f"per run, runs: {', '.join(c.name for c in checks)}", flush=True)
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="knapray-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    failures = []
    deadline = time.monotonic() + args.timeout  # from the start: the bench's stages count
    report = {"device": device, "torch": torch.__version__, "steps": args.steps, "nproc": args.nproc,
              "commit": checkout_commit(), "attention_packages": attention_packages(), "gradients": [], "runs": []}
    print("attention: " + ", ".join(f"{k} {v}" for k, v in report["attention_packages"].items()), flush=True)
    if args.bench and not fp8_only:
        if "gradients" not in skip:
            failures += gradient_stage(report, cpu=args.cpu)
        if "sampling" not in skip:
            failures += sampling_stage(report, cpu=args.cpu, deadline=deadline)
    for check in checks:
        left = deadline - time.monotonic()
        if left < 10:
            print(f"== {check.name}: not run, the check's {args.timeout} s are used up", flush=True)
            failures.append(f"{check.name}: not run (out of time)")
            continue
        run_failures, numbers = run_check(check, work, steps=args.steps, nproc=args.nproc, topology=topology,
                                          cpu=args.cpu, timeout=left, profile=args.profile or args.bench)
        failures += run_failures
        report["runs"].append(numbers)
        shutil.rmtree(work / check.name / "checkpoints", ignore_errors=True)  # none by default; never kept
    if (args.bench and "fp8" not in skip) or fp8_only:  # after the runs: what is left of the time
        if deadline - time.monotonic() >= FP8_STAGE_S or args.cpu or fp8_only:
            failures += fp8_stage(report, cpu=args.cpu)
        else:
            print(f"== fp8: not run, less than {FP8_STAGE_S} s of the check's {args.timeout} s left (alone: "
                  "GPU_BENCH_FLAGS='--only fp8')", flush=True)
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    report["failures"] = failures
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"every number above: {args.json}")
    if failures:
        print("GPU CHECK FAILED: " + "; ".join(failures))
        return 1
    print("GPU CHECK PASSED")
    return 0


if __name__ == "__main__":
    from knapray.stopping import run_main

    run_main(main)
