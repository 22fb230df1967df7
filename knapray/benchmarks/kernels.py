"""``knapray bench kernels``: the kernel ceiling at a run's shape (what a block's matrix
products and attention reach alone; the measurement is knapray/testing/kernels.py, which
the GPU check uses too)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from knapray.testing.kernels import DEFAULT_HEADS, DEFAULT_HIDDEN, DEFAULT_LENGTHS, MAX_REPEAT, report, run


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_device, add_dtype, add_json, int_at_least, int_list

    from knapray.limits import MAX_SEQUENCE_TOKENS

    p.add_argument("--hidden", type=int_at_least(1), default=DEFAULT_HIDDEN, help=f"width (default {DEFAULT_HIDDEN})")
    p.add_argument("--heads", type=int_at_least(1), default=DEFAULT_HEADS, help=f"heads (default {DEFAULT_HEADS})")
    p.add_argument("--seq-lens", type=int_list(MAX_SEQUENCE_TOKENS), default=None,
                   help="packed sequence lengths, comma-separated (default: the GPU check's 4x4292)")
    add_dtype(p, "compute dtype (auto: bf16 on CUDA, fp32 on CPU)")
    add_device(p)
    p.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed repetitions first (default 3)")
    p.add_argument("--repeat", type=int_at_least(1), default=10, help="timed repetitions, median taken (default 10)")
    p.add_argument("--fp8", action="store_true",
                   help="instead: the block's matmuls in float8 (parallel.fp8, torchao) against bf16 at --hidden over "
                        "the --seq-lens' tokens (default d=5120 over 16,384 tokens: Wan 14B's width)")
    add_json(p)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cli(args: argparse.Namespace) -> int:
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
        "cpu" if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("knapray bench kernels: error: --device cuda but no CUDA device here", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else torch.bfloat16 if device == "cuda" else torch.float32
    from knapray.limits import MAX_MODEL_WIDTH

    for flag, value, most in (("--hidden", args.hidden, MAX_MODEL_WIDTH), ("--heads", args.heads, MAX_MODEL_WIDTH),
                              ("--warmup", args.warmup, MAX_REPEAT), ("--repeat", args.repeat, MAX_REPEAT)):
        if value > most:
            print(f"knapray bench kernels: error: {flag} {value}: at most {most}", file=sys.stderr)
            return 2
    if args.fp8:
        from knapray.testing.kernels import FP8_SHAPE, float8_matmuls, float8_report
        from knapray.worker.float8 import check_available

        if (missing := check_available()) is not None:
            print(f"knapray bench kernels: error: --fp8: {missing}", file=sys.stderr)
            return 2
        hidden = args.hidden if args.hidden != DEFAULT_HIDDEN else FP8_SHAPE["hidden"]
        tokens = sum(args.seq_lens) if args.seq_lens else FP8_SHAPE["tokens"]
        r = float8_matmuls(hidden=hidden, tokens=tokens, device=device, warmup=args.warmup, repeat=args.repeat)
        print(json.dumps(r) if args.json else float8_report(r))
        return 0
    try:
        r = run(hidden=args.hidden, heads=args.heads, lengths=tuple(args.seq_lens or DEFAULT_LENGTHS),
                dtype=dtype, device=device, warmup=args.warmup, repeat=args.repeat)
    except ValueError as e:
        print(f"knapray bench kernels: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r) if args.json else report(r))
    return 0
