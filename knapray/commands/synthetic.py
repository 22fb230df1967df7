"""``knapray synthetic`` (also ``python -m knapray.commands.synthetic``): build a synthetic
corpus from a mix of the paper's data codes (knapray/corpus/synthetic.py)."""

from __future__ import annotations

import argparse
import sys

from knapray.commands.flags import Parser, int_at_least, step_count, text_tokens
from knapray.corpus.schema import TEXT_DTYPES
from knapray.limits import MAX_EMBED_DIM, MAX_SCALE, MAX_SEED, MAX_SHARDS
from knapray.planning.shapes.mix import MAX_TEXT_TOKENS, PAPER_MIXES

DESCRIPTION = ("Build a synthetic knapray corpus (parquet shards + schema.json) from a "
               "mix of the paper's data codes gGbBiRfFsS.")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="build_synthetic", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--demo", action="store_true",
                   help="the demo corpus of `make run` (image+video mix, scale 8, 2 steps, text/pooled width 32); "
                        "--text-dtype, --seed, --shards, --noise and --no-payload apply to it, the mix's flags are "
                        "refused with it")
    p.add_argument("--mix",
                   help=f"data codes like 'g8b4i256f1s0,g2b1i1024f1s0' or a paper mix: {', '.join(PAPER_MIXES)}")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--steps", type=step_count, default=1, help="steps of the mix to hold (default 1)")
    p.add_argument("--scale", type=int_at_least(1, MAX_SCALE), default=1,
                   help="divide resolution and max text tokens by this (1 = paper sizes; 8 for a CPU demo)")
    p.add_argument("--channels", type=int_at_least(1, MAX_EMBED_DIM), default=4, help="latent channels C (4 demo, 16 Flux; default 4)")
    p.add_argument("--text-dim", type=int_at_least(1, MAX_EMBED_DIM), default=64, help="text token embedding width (default 64)")
    p.add_argument("--pooled-dim", type=int_at_least(1, MAX_EMBED_DIM), default=32, help="pooled text embedding width (default 32)")
    p.add_argument("--max-text-tokens", type=text_tokens, default=MAX_TEXT_TOKENS,
                   help=f"text tokens per sample before scaling (default {MAX_TEXT_TOKENS})")
    p.add_argument("--shards", type=int_at_least(1, MAX_SHARDS), default=4, help="number of parquet files (default 4)")
    p.add_argument("--seed", type=int_at_least(0, MAX_SEED), default=0, help="seed; same seed, same corpus (default 0)")
    p.add_argument("--noise", type=float, default=0.05, help="white noise std on the latent field")
    p.add_argument("--text-dtype", choices=TEXT_DTYPES, default="fp32",
                   help="store text embeddings as fp32 or bf16 (half the bytes; read back exactly; default fp32)")
    p.add_argument("--no-payload", action="store_true",
                   help="write lengths only (null latent/text/pooled): cheap full-size corpora for planning")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Build the corpus and print its path; a bad value is ValueError (one line, exit 2)."""
    from knapray.corpus.synthetic import DEMO, SyntheticConfig, build_synthetic

    if not args.demo and not args.mix:
        raise ValueError("give --mix (or --demo)")
    if args.demo:
        cfg = _demo(args, DEMO)
    else:
        cfg = SyntheticConfig(
            mix=args.mix, steps=args.steps, scale=args.scale, channels=args.channels,
            text_dim=args.text_dim, pooled_dim=args.pooled_dim,
            max_text_tokens=args.max_text_tokens, shards=args.shards, seed=args.seed,
            payload=not args.no_payload, noise=args.noise, text_dtype=args.text_dtype,
        )
    try:
        path = build_synthetic(cfg, args.out, progress=not args.quiet)
    except FileExistsError as e:
        raise ValueError(str(e)) from None
    print(path)
    return 0


DEMO_FIXES = ("mix", "steps", "scale", "channels", "text_dim", "pooled_dim", "max_text_tokens")
"""What ``--demo`` is (make run's corpus, which jobs/configs/demo.yaml's model fits): a flag
that changes one of them is refused with it; the others apply to the demo too."""


def _demo(args: argparse.Namespace, demo):
    """``demo`` (``DEMO``) with the flags given beside ``--demo`` that leave it make run's
    corpus (--text-dtype, --seed, --shards, --noise, --no-payload); ValueError naming a flag
    that would change what it is."""
    from dataclasses import replace

    defaults = build_parser().parse_args(["--out", "x"])
    changed = [name for name in DEMO_FIXES if getattr(args, name) != getattr(defaults, name)]
    if changed:
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        raise ValueError(f"--demo builds make run's corpus ({demo.mix}, scale {demo.scale}, {demo.steps} steps, "
                         f"widths {demo.channels}/{demo.text_dim}/{demo.pooled_dim}): {flags} would change it; leave "
                         "it out, or give --mix instead of --demo")
    return replace(demo, shards=args.shards, seed=args.seed, noise=args.noise, payload=not args.no_payload,
                   text_dtype=args.text_dtype)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    from knapray.stopping import run_main

    run_main(main)
