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

    knapray dryrun --sample --config jobs/configs/wan_t2v_14b.yaml --world-size 8 --topology g8n1 \
        --size 832x480 --frames 21 --guidance 5 [--encoders keep|offload|free] [--rank 0] [--gpu-gib 80]

``--sample``: rank R of an N-rank sampling gang drawing a request per ``--size`` (``knapray
sample``'s ``--size``, ``--frames`` in latent frames, ``--guidance``, ``--topology``), placed as
the gang places it (``knapray.planning.inference.sampling_memory``: the transformer whole on every rank
as ``worker.denoise.prepare_model`` holds it, the text encoders on rank 0 per ``--encoders``,
the VAE on each bag lead): each phase the
rank runs (encode, denoise, decode) measured on fake tensors by torch's ``MemTracker`` beside
the memory model's prediction (``knapray.testing.sample_dryrun``). Exit status as above (1:
a phase more than 10% off, a host sync in the denoising step, q/k/v not in bf16); a gang
the model predicts a GPU cannot hold is refused like bad input, in one line naming what
would fit, exit 2, before anything is built.
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
    _add_sample_arguments(p)
    add_json(p)


SAMPLE_FLAGS = ("size", "frames", "guidance", "encoders", "topology")


def _add_sample_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import float_in, int_at_least
    from knapray.planning.inference.sampling_memory import ENCODER_POLICIES
    from knapray.testing.sample_dryrun import DEFAULT_ENCODERS, DEFAULT_SIZE

    p.add_argument("--sample", action="store_true",
                   help="a sampling gang's rank instead of a training step: its peak per phase (encode, denoise, "
                        "decode) measured beside the sampling memory model's")
    p.add_argument("--size", action="append", metavar="WIDTHxHEIGHT",
                   help=f"--sample: a request's size in pixels, one request per --size (default one of {DEFAULT_SIZE})")
    p.add_argument("--frames", type=int_at_least(1), default=None,
                   help="--sample: latent frames of every request, as knapray sample's (videos; default 1)")
    p.add_argument("--guidance", type=float_in(ge=0), default=None,
                   help="--sample: classifier-free guidance scale (not 1: two passes), or FLUX.1-dev's embedded input "
                        "(default: 1, off; FLUX.1-dev: 3.5)")
    p.add_argument("--encoders", choices=ENCODER_POLICIES, default=None,
                   help="--sample: rank 0's text encoders kept beside the transformer (serving), offloaded to the host "
                        f"between batches, or freed before it loads (default {DEFAULT_ENCODERS}: knapray sample's)")
    p.add_argument("--topology", default=None,
                   help="--sample: the gang's bags (default: knapray sample's halving bags; 4 ranks: g2n1+g1n2)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="knapray dryrun", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def _error(message: str) -> int:
    print(f"knapray dryrun: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from knapray.testing.dryrun import GIB, assess, check_setup, measure, step_inputs

    if args.sample:
        return run_sample(args)
    given = [f"--{f}" for f in SAMPLE_FLAGS if getattr(args, f) is not None]
    if given:
        return _error(f"{', '.join(given)}: --sample's (a sampling gang's dry run); a training step's batch comes "
                      "from --mix")
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
    from knapray.planning.costs.memory import ModelShape

    shape = ModelShape.of(m)
    print(f"model  {shape.num_params / 1e9:.2f} B parameters ({m.depth_double} double + {m.depth_single} single "
          f"blocks, d={m.hidden_size}, {m.num_heads} heads), {str(setup.dtype)[6:]}, fsdp {cfg.parallel.fsdp}, "
          f"activation checkpointing {cfg.parallel.activation_checkpointing}"
          + (f" (k={cfg.parallel.ac_every})" if cfg.parallel.activation_checkpointing == "every_k" else "")
          + ("; parallel.compile is left out (eager blocks)" if cfg.parallel.compile else ""))
    if cfg.flow.expert_boundary:
        print(f"       two experts of this shape (flow.expert_boundary={cfg.flow.expert_boundary}), both resident with "
              "their shards" + (", AdamW state and EMA" if cfg.optim.ema_decay else " and AdamW state")
              + "; the measured step trains the first")
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
          f"calls, {step.watch.matmuls} matmuls in the measured step"
          + (f"; {step.watch.float8_matmuls} float8 matmuls beside them, parallel.fp8" if step.watch.float8_matmuls
             else "") + "): " + ("OK" if not dtype_lines else "; ".join(dtype_lines)))
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


def run_sample(args: argparse.Namespace) -> int:
    """``--sample``: one rank of a sampling gang (the module docstring)."""
    from knapray.testing.sample_dryrun import DEFAULT_ENCODERS, DoesNotFit, assess, attention_dtype_violations, \
        check_sample_setup, fp32_matmuls, measure

    if args.mix is not None:
        return _error("--mix: the training dry run's; --sample draws a request per --size")
    try:
        setup = check_sample_setup(args.config, args.set, world_size=args.world_size, rank=args.rank,
                                   gpu_gib=args.gpu_gib, sizes=args.size, frames=args.frames or 1,
                                   guidance=args.guidance, encoders=args.encoders or DEFAULT_ENCODERS,
                                   topology=args.topology)
    except DoesNotFit as e:
        return _error(f"does not fit: {e}")
    except (ValueError, OSError) as e:
        what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else str(e)
        return _error(what)
    import torch

    from knapray.planning.inference.sampling_memory import GIB

    _print_sample_setup(args, setup, torch.__version__)
    measured = measure(setup)
    found = assess(setup, measured)
    role = setup.role
    print(f"\nmemory: rank {setup.rank}'s peak by phase, GiB: predicted (knapray.planning.inference.sampling_memory) | "
          f"measured (torch's MemTracker)")
    print(f"  {'phase':<8} {'transformer':>11} {'encoders':>8} {'vae':>6} {'latents':>7} {'working':>7} {'total':>7}"
          f"  | {'weights':>7} {'latents':>7} {'working':>7} {'total':>7} {'error':>7}")
    for r in found.rows:
        p, m = r.predicted, r.measured
        print(f"  {r.phase:<8} {p.transformer / GIB:>11.2f} {p.encoders / GIB:>8.2f} {p.vae / GIB:>6.2f} "
              f"{p.latents / GIB:>7.2f} {p.working / GIB:>7.2f} {p.total / GIB:>7.2f}  | "
              f"{m.category('weights') / GIB:>7.2f} {m.category('latents') / GIB:>7.2f} "
              f"{m.category('working') / GIB:>7.2f} {m.total / GIB:>7.2f} {r.error:>+7.1%}")
    mem = setup.memory
    fits = max(found.measured_peak, found.predicted_peak) <= found.usable
    print(f"  peak: {found.peak_phase}, {found.predicted_peak / GIB:.2f} GiB predicted, "
          f"{found.measured_peak / GIB:.2f} measured ({found.peak_error:+.1%}); fits {setup.gpu_gib:g} GiB: "
          f"{'yes' if fits else 'NO'} (usable {found.usable / GIB:.2f} GiB after {mem.reserve_bytes / GIB:g} GiB "
          f"reserve and {mem.fragmentation:.0%} fragmentation)")
    w = measured.watch
    print("\nchecks")
    bad = attention_dtype_violations(w)
    print(f"  dtype: q, k, v in bfloat16 at the denoising step's {w.attention_calls} attention calls: "
          + ("OK" if not bad else "; ".join(bad)) + f"; of its {w.matmuls} matrix products those in fp32 are at "
          + (", ".join(fp32_matmuls(w)) or "none") + " (the engine keeps the final layer in fp32)")
    print(f"  host syncs in the denoising step: {len(w.syncs)}" + "".join(f"\n    {s}" for s in w.syncs))
    print(f"  measured in {measured.seconds:.0f} s")
    print("DRY RUN " + ("PASSED" if found.passed else "FAILED: " + "; ".join(found.failures)))
    if args.json:
        print(json.dumps({
            "config": args.config, "sample": True, "world_size": setup.world, "rank": setup.rank,
            "topology": str(setup.topology), "encoders": setup.encoders, "sizes": [list(wh) for wh in setup.sizes],
            "frames": setup.frames, "guidance": setup.guidance, "passes": setup.jobs[0].passes,
            "bags": [s.bag for s in setup.steps],
            "role": {"encodes": role.encodes, "lead": role.lead, "bag_size": role.bag_size,
                     "routed_tokens": role.routed, "routed_text": role.routed_text, "home_tokens": role.home},
            "phases": [{"phase": r.phase, "predicted": r.predicted.to_gib(), "predicted_bytes": r.predicted.total,
                        "measured": r.measured.peak, "measured_bytes": r.measured.total, "error": r.error}
                       for r in found.rows],
            "predicted_peak_bytes": found.predicted_peak, "measured_peak_bytes": found.measured_peak,
            "peak_error": found.peak_error, "peak_phase": found.peak_phase, "usable_bytes": found.usable,
            "fits": fits, "syncs": w.syncs, "failures": found.failures, "passed": found.passed,
            "seconds": measured.seconds,
        }))
    return 0 if found.passed else 1


def _print_sample_setup(args: argparse.Namespace, setup, torch_version: str) -> None:
    from knapray.models.families import get_family
    from knapray.planning.inference.sampling_memory import GIB

    m, mem, role, job = setup.cfg.model, setup.memory, setup.role, setup.jobs[0]
    print(f"knapray dryrun: {args.config} sampling, as rank {setup.rank} of a gang of {setup.world}; torch "
          f"{torch_version}; no GPU, no Ray: fake CPU tensors over a fake process group")
    print(f"model    {get_family(m.family).title}, {mem.shape.num_params / 1e9:.2f} B parameters, whole on every rank "
          f"as the engine prepares it (bf16, the final layer and the residual stream fp32): "
          f"{mem.transformer_bytes() / GIB:.2f} GiB")
    encoders = ", ".join(f"{e.cls} {e.num_params / 1e9:.2f} B at {e.tokens} tokens" for e in mem.text_encoders)
    vae = "no VAE declared (no decode phase)" if mem.vae is None else \
        f"VAE {mem.vae.cls} {mem.vae.num_params / 1e6:.1f} M in {'bfloat16' if mem.vae.dtype == 'bf16' else 'float32'}" \
        " on every bag lead"
    print(f"encoders {encoders or 'none declared by the family'} in bfloat16 on rank 0, --encoders {setup.encoders}; "
          f"{vae}")
    sizes = ", ".join(f"{w}x{h}" for w, h in setup.sizes)
    frames = f", {setup.frames} latent frames ({mem.vae.frames(setup.frames)} frames)" if setup.frames > 1 and mem.vae \
        else ""
    guide = (f"embedded guidance {setup.guidance:g} (1 pass)" if setup.embedded else
             f"classifier-free guidance {setup.guidance:g} (2 passes)" if job.passes == 2 else "no guidance (1 pass)")
    tokens = "+".join(str(j.image_tokens) for j in setup.jobs)
    print(f"requests {sizes}{frames}: {tokens} image tokens + {job.text_tokens} text tokens a pass, {guide}")
    bags = ", ".join(f"bag {s.bag} ({_count(int(setup.topology.bag_sizes[s.bag]), 'rank')}: "
                     f"{_count(len(s.jobs), 'request')}" + (", CFG parallel in halves" if s.halves else "") + ")"
                     for s in setup.steps)
    what = []
    if role.encodes:
        what.append(f"encodes the batch's captions ({role.captions})")
    if role.lead:
        what.append("leads its bag (latents, batch, VAE)")
    if role.routed:
        what.append(f"{role.routed} routed tokens ({role.routed_text} text)"
                    + (f" of {role.home} at home" if role.lead else ""))
    else:
        what.append("its bag has no request: the transformer alone")
    print(f"plan     topology {setup.topology}: the requests on {bags}; rank {setup.rank}: " + ", ".join(what))


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


if __name__ == "__main__":
    from knapray.stopping import run_main

    run_main(main)
