"""``knapray dryrun``: one rank's training step of a run config at full scale, without a GPU.

    knapray dryrun --config jobs/configs/flux_cluster.yaml [--world-size 64] [--rank 0] [--gpu-gib 80]

Rank R of an N-rank run in one process, no GPU, no Ray, on fake tensors over torch's fake
process group (``knapray.testing.dryrun`` says how). It reports

(a) the rank's peak memory by category, measured by torch's tracker (``FSDPMemTracker``
    under FSDP, else ``MemTracker``), beside ``knapray memory``'s prediction;
(b) the collectives one step issues (kind, group size, count, bytes) beside what the plan
    and the parallelism imply;
(c) a device and dtype check (q, k, v and every matrix multiply in the compute dtype; every
    collective's tensors on the training device), host synchronizations inside the step's
    timed region (forward + backward), and ops without a fake implementation.

Exit status: 0 if every check passed, 1 on a device or dtype violation, a host sync in
the timed region, an op without a fake implementation, collectives other than the
expected ones, or measured and predicted peaks more than 10% apart; 2 on bad input (one
line, before anything runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_config, add_json, add_world_size, float_in, int_at_least
    from knapray.testing.dryrun import DEFAULT_MIX

    add_config(p, required=True)
    add_world_size(p, default=None, help="ranks of the run (default: scaling.num_workers)")
    p.add_argument("--rank", type=int_at_least(0), default=0, help="the rank to run (default 0)")
    p.add_argument("--gpu-gib", type=float_in(gt=0), default=80.0, help="GPU memory in GiB, for the fit (default 80)")
    p.add_argument("--mix", default=None,
                   help="data codes (gGbBiRfFsS, or low-res / mixed-res / image+video) the batch is drawn from "
                        f"(default: {DEFAULT_MIX}, the paper's; the corpus itself is never read)")
    add_json(p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="knapray dryrun", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def _error(message: str) -> int:
    print(f"knapray dryrun: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from knapray.testing.dryrun import GIB, assess, check_setup, measure, step_inputs

    try:
        setup = check_setup(args.config, args.set, world_size=args.world_size, rank=args.rank, gpu_gib=args.gpu_gib,
                            mix=args.mix)
    except (ValueError, OSError) as e:
        what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else str(e)
        return _error(what)
    import torch

    cfg, world, rank = setup.cfg, setup.world, setup.rank
    budget = cfg.data.max_tokens_per_gpu
    inputs = step_inputs(setup)
    samples, plan = inputs.samples, inputs.plan
    m = cfg.model
    corpus = Path(cfg.data.corpus)
    print(f"knapray dryrun: {args.config} as rank {rank} of {world} ({setup.gpus_per_node} per node); torch "
          f"{torch.__version__}; no GPU, no Ray: fake tensors over a fake process group")
    from knapray.planning.memory import ModelShape

    shape = ModelShape.of(m)
    print(f"model  {shape.num_params / 1e9:.2f} B parameters ({m.depth_double} double + {m.depth_single} single "
          f"blocks, d={m.hidden_size}, {m.num_heads} heads), {str(setup.dtype)[6:]}, fsdp {cfg.parallel.fsdp}, "
          f"activation checkpointing {cfg.parallel.activation_checkpointing}"
          + (f" (k={cfg.parallel.ac_every})" if cfg.parallel.activation_checkpointing == "every_k" else "")
          + ("; parallel.compile is left out (eager blocks)" if cfg.parallel.compile else ""))
    print(f"data   the corpus ({corpus}{'' if corpus.exists() else ', absent here'}) is not read: lengths from "
          f"--mix {setup.mix}{' (the paper mix)' if args.mix is None else ''}, "
          f"{sum(len(s) for s in samples)} samples over {world} ranks"
          + (f", as many as keep the mean within data.max_tokens_per_gpu={budget}" if budget else ""))
    routed_here = int(plan.rank_tokens[rank])
    part = inputs.planned
    if len(part) == world:
        over, imbalance = "ranks", plan.imbalance
    else:  # the rank's balance group alone was planned
        work = plan.rank_work[part.start:part.stop]
        over, imbalance = f"its balance group, ranks {part.start}-{part.stop - 1}", \
            float(work.max() / work.mean()) if work.mean() > 0 else 1.0
    print(f"plan   topology {plan.topology} (balance.topology {cfg.balance.topology}); rank {rank}: "
          f"{len(samples[rank])} home sequences, {routed_here} routed tokens (max over {over} "
          f"{int(plan.rank_tokens[part.start:part.stop].max())}); imbalance {imbalance:.4f}"
          + ("" if len(part) == world else " (only this group planned: the others plan alike, apart, and change "
             "nothing this rank computes)"))

    step, device = measure(setup, inputs)
    print(f"step   a training step on fake CPU tensors in {step.seconds:.0f} s (after one on no tokens: FSDP's "
          f"lazy init, AdamW's state)")
    print(f"device a training step on fake tensors of a device that is not the host's (meta), unsharded, fp32, "
          f"{min(1, m.depth_double)}+{min(1, m.depth_single)} blocks, in {device.seconds:.0f} s")

    found = assess(setup, inputs, step, device)
    mem, pred, measured, err = found.memory, found.predicted, found.measured_peak, found.peak_error
    print(f"\nmemory: rank {rank}'s peak, {step.routed_tokens} routed tokens ({step.routed_text} text) of "
          f"{step.routed_sequences} sequences")
    print(f"  {'measured (torch tracker)':<28} {'GiB':>8}    {'predicted (knapray memory)':<28} {'GiB':>8}")
    meas_rows = [(k, v) for k, v in step.peak.items() if k != "Total" and v]
    pred_rows = [(k.replace("_", " "), v * GIB) for k, v in pred.to_gib().items() if k != "total" and v]
    for i in range(max(len(meas_rows), len(pred_rows))):
        left = f"  {meas_rows[i][0]:<28} {meas_rows[i][1] / GIB:>8.2f}" if i < len(meas_rows) else " " * 39
        right = f"    {pred_rows[i][0]:<28} {pred_rows[i][1] / GIB:>8.2f}" if i < len(pred_rows) else ""
        print(left + right)
    print(f"  {'total (peak)':<28} {measured / GIB:>8.2f}    {'total (' + pred.peak_phase + ')':<28} "
          f"{pred.total / GIB:>8.2f}   predicted {err:+.1%}")
    print(f"  fits {setup.gpu_gib:g} GiB: {'yes' if max(measured, pred.total) <= found.usable else 'NO'} (usable "
          f"{found.usable / GIB:.2f} GiB after {mem.reserve_bytes / GIB:g} GiB reserve and "
          f"{mem.fragmentation:.0%} fragmentation)")

    print(f"\ncollectives: one training step of rank {rank} (measured | the plan and parallelism imply)")
    print(f"  {'kind':<24} {'group':>5} {'count':>6} {'MiB':>10} | {'count':>6}")
    for r in found.collectives:
        group = r.group if r.group is not None else "?"
        print(f"  {r.kind:<24} {group:>5} {r.count:>6} {r.nbytes / 2**20:>10.1f} | {r.expected:>6}"
              + ("   <- differs" if r.differs else ""))

    w = device.watch
    print("\nchecks")
    print("  device: every tensor of the step and every collective's on the training device (meta stands in for "
          "cuda): " + ("OK" if not w.device_violations else "; ".join(w.device_violations)))
    dtype_lines = found.dtype_violations
    print(f"  dtype: q, k, v and every matmul in {str(setup.dtype)[6:]} ({step.watch.attention_calls} attention "
          f"calls, {step.watch.matmuls} matmuls in the measured step): " + ("OK" if not dtype_lines else "; ".join(dtype_lines)))
    print(f"  host syncs in the timed region (forward + backward): {len(found.syncs)}"
          + "".join(f"\n    {s}" for s in found.syncs))
    failures = found.failures
    print("DRY RUN " + ("PASSED" if found.passed else "FAILED: " + "; ".join(failures)))
    if args.json:
        print(json.dumps({
            "config": args.config, "world_size": world, "rank": rank, "topology": str(plan.topology),
            "routed_tokens": step.routed_tokens, "measured_peak_bytes": measured, "predicted_peak_bytes": pred.total,
            "peak_error": err, "measured": step.peak, "predicted": pred.to_gib(),
            "collectives": [{"kind": k, "group": s, "count": c, "bytes": b} for k, s, c, b in step.collectives],
            "expected": [{"kind": k, "group": s, "count": c} for (k, s), c in sorted(found.expected.items())],
            "syncs": found.syncs, "failures": failures, "passed": found.passed,
            "seconds": {"step": step.seconds, "device": device.seconds},
        }))
    return 0 if found.passed else 1


if __name__ == "__main__":
    sys.exit(main())
