"""``knapray bench sample``: one denoising loop of a FLUX.1-dev-shaped model run the ways
``knapray sample`` can run it, side by side, at a size a CPU runs (``knapray.testing.sample_bench``):

- fp32 eager (a CPU's default) against bf16 compiled (a GPU's: bf16 weights, fp32 residual
  stream, the blocks compiled and warmed up), per step, and their ratio;
- the first-block step cache (``--step-cache``, off by default in ``knapray sample``) at a
  threshold: its speedup over the same run uncached and its latents' error.

On a CPU the ratio catches regressions (bf16 matrix products are slow on most CPUs: a ratio
below 1 there says nothing about a GPU); ``make gpu-bench``'s sampling section gives the
GPU figures, beside diffusers.
"""

from __future__ import annotations

import argparse
import json
import sys

from knapray.testing.sample_bench import CPU_SHAPE


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_json, float_in, int_at_least, step_count

    p.add_argument("--hidden", type=int_at_least(1), default=CPU_SHAPE["hidden"],
                   help=f"width (default {CPU_SHAPE['hidden']})")
    p.add_argument("--heads", type=int_at_least(1), default=CPU_SHAPE["heads"],
                   help=f"heads (default {CPU_SHAPE['heads']})")
    for name in ("double", "single", "side", "text"):
        p.add_argument(f"--{name}", type=int_at_least(0 if name != "side" else 16, MAX_SIZES[name]),
                       default=CPU_SHAPE[name], help=f"default {CPU_SHAPE[name]}")
    p.add_argument("--steps", type=step_count, default=CPU_SHAPE["steps"],
                   help=f"Euler steps of the loop (default {CPU_SHAPE['steps']}, at most {MAX_SIZES['steps']})")
    p.add_argument("--repeat", type=int_at_least(1), default=3,
                   help=f"timed loops, median taken (default 3, at most {MAX_SIZES['repeat']})")
    p.add_argument("--step-cache", type=float_in(gt=0), default=0.3, metavar="THRESHOLD",
                   help="the first-block cache's threshold the cached loop is timed at (default 0.3)")
    add_json(p)


MAX_SIZES = {"double": 1024, "single": 1024, "side": 4096, "text": 4096, "steps": 1000, "repeat": 100}


def _error(message: str) -> int:
    print(f"knapray bench sample: error: {message}", file=sys.stderr)
    return 2


def _config(args: argparse.Namespace):
    """A FLUX.1-dev-shaped model of the flags' size."""
    from knapray.limits import MAX_MODEL_WIDTH
    from knapray.testing.sample_bench import flux_config

    for flag, value, most in (("--hidden", args.hidden, MAX_MODEL_WIDTH), ("--heads", args.heads, MAX_MODEL_WIDTH),
                              ("--steps", args.steps, MAX_SIZES["steps"]), ("--repeat", args.repeat,
                                                                             MAX_SIZES["repeat"])):
        if value > most:
            raise ValueError(f"{flag} {value}: at most {most}")
    if not 0 < args.step_cache <= 10:
        raise ValueError(f"--step-cache {args.step_cache:g}: a threshold in (0, 10]")
    if args.hidden % args.heads or (args.hidden // args.heads) % 8:
        raise ValueError(f"--hidden {args.hidden} over --heads {args.heads}: heads of a multiple of 8 channels")
    if args.side % 16:
        raise ValueError(f"--side {args.side}: a multiple of 16 pixels")
    return flux_config(args.hidden, args.heads, args.double, args.single)


def cli(args: argparse.Namespace) -> int:
    from knapray.testing.sample_bench import prepared, relative, request, time_knapray

    try:
        cfg = _config(args)
    except ValueError as e:
        return _error(str(e))
    thresholds = [args.step_cache]
    job = request(cfg, args.side, args.text, args.steps)
    print(f"knapray bench sample: FLUX.1-dev-shaped, d={args.hidden}, {args.heads} heads, "
          f"{args.double + args.single} blocks, one {args.side}x{args.side} request ({job.tokens} tokens), "
          f"{args.steps} steps, median of {args.repeat} loops, on the CPU", flush=True)
    eager = time_knapray("fp32 eager", prepared(cfg, "cpu", "fp32", compile=False), job, repeats=args.repeat)
    print(_row(eager), flush=True)
    compiled_model = prepared(cfg, "cpu", "bf16", compile=True)
    compiled = time_knapray("bf16 compiled", compiled_model, job, repeats=args.repeat)
    print(_row(compiled), flush=True)
    ratio = eager.per_step / compiled.per_step
    print(f"fp32 eager / bf16 compiled per step: {ratio:.2f}x")
    cached = []
    for t in thresholds:
        run = time_knapray(f"bf16 compiled, step cache {t:g}", compiled_model, job, repeats=args.repeat, step_cache=t)
        speedup, err = compiled.seconds / run.seconds, relative(run.latents, compiled.latents)
        print(f"{_row(run)}: {run.stats.get('cached_steps', 0)} of {args.steps} steps cached, {speedup:.2f}x the "
              f"uncached loop, latents {err:.2e} off the uncached ones", flush=True)
        cached.append({**run.row(), "threshold": t, "speedup": speedup, "error": err})
    if args.json:
        print(json.dumps({"family": cfg.family, "tokens": job.tokens, "steps": args.steps,
                          "rows": [eager.row(), compiled.row()], "ratio": ratio, "step_cache": cached}))
    return 0


def _row(t) -> str:
    return f"  {t.name:30s} {t.seconds:7.3f} s a loop, {1e3 * t.per_step:7.1f} ms a step (first loop {t.first_s:.1f} s)"
