"""Rivals benchmark: the planners knapray can execute, run side by side on gloo processes.

``knapray simulate --rivals`` predicts every planner of ``knapray.planning.simulation.rivals`` under
the calibrated cost model. This runs the ones whose plans knapray's router and Ulysses
execute: knapray's ``auto``, ``per-step`` and ``overlap`` (a rank's own whole sequences
beside its share of a bag's), KnapFormer's greedy on fixed homogeneous bags, dynamic CP (one
degree per step) and the FlexSP-style planner on the steps whose groups are aligned blocks
(of any size dividing the heads: their groups are made at start). The Zellige-style planner's
groups of several sizes overlapping one another have no execution path; knapray's
``overlap`` is the part of its idea that does. Beside them, the unbalanced step (every rank
its own sequences).

``world_size`` gloo processes, one thread each, run forward + backward + gradient all-reduce
of a seeded MMDiT. Every step draws one batch per rank from ``mix`` at 1/``scale``
resolution; rank 0 plans it with every planner (``rivals_step``, under ``bench_cost``: a cost
model of this benchmark's model) and sends the plans to the others; every rank runs each
plan in rotating order. Per rank and plan it records the compute (thread CPU time of forward
+ backward minus the CPU time inside all-to-alls, as ``knapray bench step``) and the plan's
predicted compute (``CostModel.step_times``); the report is the measured compute max/mean
beside the predicted one. Every plan must compute the unbalanced step's loss and gradient
norm (relative difference at most ``LOSS_TOL``), else the command exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time

import numpy as np
import torch

from knapray.benchmarks.step import LOSS_TOL, step_config, write_records
from knapray.distributed.local import free_port, init_local_gloo, spawn_local
from knapray.planning.costs.cost import CostModel
from knapray.limits import MAX_SCALE

MIX = ("g1b4i256f1s0,g1b5i512f1s0,g1b5i1024f1s0,g1b1i2048f1s0,"
       "g1b10i256f4s0,g1b1i512f4s0,g1b2i256f85s1,g1b1i512f85s1")
"""The paper's image+video mix with one rank per data code (8 ranks, the same codes)."""
SCALE = 4
MAX_TEXT_TOKENS = 392
UNBALANCED = "unbalanced"
EXECUTABLE = ("knapray_auto", "knapray_per_step", "knapray_overlap", "knapformer", "dynamic_cp", "flexsp")
LABELS = {"unbalanced": "none (each rank its own)", "knapray_auto": "knapray auto",
          "knapray_per_step": "knapray per-step", "knapray_overlap": "knapray overlap",
          "knapformer": "KnapFormer greedy, fixed bags",
          "dynamic_cp": "dynamic CP", "flexsp": "FlexSP-style"}
FLUX_WIDTH = 3072
HISTORY_SEED = 50_000
"""Steps drawn from this seed on choose the static topologies (the measured ones count from 0)."""


def bench_cost(hidden: int, heads: int, depth: int, world: int) -> CostModel:
    """The benchmark model's cost: FLOP counts at its width and depth, fp32 activations, no
    checkpointing, one node of ``world`` ranks; bandwidths scaled by 3072 / ``hidden`` so a
    token's communication weighs against its compute as Flux's does on H100s (a narrow model
    would otherwise make every bag look too expensive to plan)."""
    base = CostModel()
    return CostModel(d_model=hidden, double_blocks=depth, single_blocks=depth, num_heads=heads,
                     recompute_passes=0.0, ulysses_a2a_per_layer=8, activation_bytes=4, gpus_per_node=world,
                     intra_node_bw=base.intra_node_bw * FLUX_WIDTH / hidden,
                     inter_node_bw=base.inter_node_bw * FLUX_WIDTH / hidden)


def _topologies(history: list, cost: CostModel):
    """knapray auto's static topology and KnapFormer's fixed bags, chosen from steps drawn
    before the run (as training chooses them)."""
    from knapray.planning.search.autotopo import search_topology
    from knapray.planning.simulation.rivals import knapformer_topology

    return search_topology(history, len(history[0]), cost, cost.gpus_per_node).topology, \
        knapformer_topology(history, cost)


def _plans(lens: list[list[int]], auto, fixed, cost: CostModel) -> dict:
    """Every executable planner's plan of the step: name -> (plan, layout). Bags other than
    the run's static ones run on the aligned blocks' groups."""
    from knapray.planning import identity_plan
    from knapray.planning.shapes.blocks import check_aligned
    from knapray.planning.simulation.rivals import rivals_step

    out = {UNBALANCED: (identity_plan(lens, cost), "g1")}
    for name, p in rivals_step(lens, cost, auto, fixed).items():
        if name not in EXECUTABLE:
            continue
        topo = p.plan.topology
        if topo.bags != auto.bags or topo.group_size != auto.group_size:
            try:
                check_aligned(topo, cost.gpus_per_node, any_size=True)
            except ValueError:
                continue  # FlexSP-style groups that are not aligned blocks: no groups for them
            if topo.num_groups != 1:
                continue
        out[name] = (p.plan, p.layout)
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, opts: dict) -> None:
    import torch.distributed as dist

    from knapray.distributed import BagGroups
    from knapray.distributed.block_groups import BlockGroups, StepGroups
    from knapray.distributed.comms import comm_timer
    from knapray.distributed.parallel_dims import ParallelDims
    from knapray.models import MMDiT, MMDiTConfig
    from knapray.models.flow import flow_loss
    from knapray.testing.batches import mix_batches
    from knapray.worker.balanced import balanced_forward
    from knapray.config.parallel import ParallelConfig
    from knapray.worker.parallelize import clip_grad_norm_, parallelize

    init_local_gloo(rank, world, port, timeout_s=600)
    try:
        cfg = MMDiTConfig(**opts["cfg"])
        cost = CostModel.from_dict(opts["cost"])
        torch.manual_seed(opts["seed"])
        model = MMDiT(cfg)
        model.init_weights(std=0.02)
        par = parallelize(model, ParallelConfig(), ParallelDims(world_size=world))

        def draw(step: int):
            return mix_batches(opts["mix"], cfg, scale=opts["scale"], seed=opts["seed"] * 100_003 + step,
                               world_size=world, max_text_tokens=opts["max_text_tokens"])

        history = [[b.seq_lens.tolist() for b in draw(HISTORY_SEED + k)] for k in range(2)]  # before the run
        box = [_topologies(history, cost) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        auto, fixed = box[0]
        groups = StepGroups(BagGroups.build(auto, cfg.num_heads), BlockGroups.build(world, cfg.num_heads, divisors=True))
        records = []
        for step in range(opts["steps"]):
            batches = draw(step)
            batch = batches[rank]
            lens = [b.seq_lens.tolist() for b in batches]
            global_tokens = sum(b.x_img.shape[0] for b in batches)
            del batches
            box = [_plans(lens, auto, fixed, cost) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            plans = box[0]
            names = list(plans)
            k = step % len(names)
            for name in names[k:] + names[:k]:  # rotating order: machine noise hits every planner
                plan, layout = plans[name]
                times = cost.step_times(plan)
                bag_group, route_group = (None, None) if name == UNBALANCED else groups.for_topology(plan.topology)
                model.zero_grad(set_to_none=True)
                dist.barrier()
                c0 = time.thread_time()
                with comm_timer() as comm:
                    out = balanced_forward(model, batch, plan, rank, bag_group=bag_group, route_group=route_group)
                    loss = flow_loss(out, batch.targets, global_tokens)
                    loss.backward()
                compute = time.thread_time() - c0 - comm.cpu_s
                par.reduce_gradients()
                del out
                grad_norm = float(clip_grad_norm_(model.parameters(), float("inf")))
                records.append({
                    "step": step, "planner": name, "rank": rank, "layout": layout, "compute_s": compute,
                    "predicted_s": float(times.compute[rank]), "predicted_step_s": times.step_time, "loss": float(loss.detach()),
                    "grad_norm": grad_norm, "tokens": int(plan.recv_counts[rank]),
                })
                del loss
        write_records(records, world, rank, out_dir)
    finally:
        dist.destroy_process_group()


def summarize(records: list[dict], world: int, warmup: int) -> list[dict]:
    """One row per planner: measured and predicted compute max/mean (means over the measured
    steps), the slowest rank's compute, the predicted step time (compute and communication)
    over knapray's best, and the loss / gradient-norm difference from the unbalanced step's
    (every step). A planner whose plan could not run on some steps (FlexSP-style groups that
    are not aligned blocks) is averaged over the steps it ran."""
    steps = sorted({r["step"] for r in records if r["step"] >= warmup})
    ref = {(r["step"], r["rank"]): r for r in records if r["planner"] == UNBALANCED}
    rows = []
    for name in [UNBALANCED, *EXECUTABLE]:
        mine = [r for r in records if r["planner"] == name]
        if not mine:
            continue
        ran = sorted({r["step"] for r in mine if r["step"] >= warmup})
        measured, predicted = np.zeros((len(ran), world)), np.zeros((len(ran), world))
        step_s = np.zeros(len(ran))
        for r in mine:
            if r["step"] >= warmup:
                measured[ran.index(r["step"]), r["rank"]] = r["compute_s"]
                predicted[ran.index(r["step"]), r["rank"]] = r["predicted_s"]
                step_s[ran.index(r["step"])] = r["predicted_step_s"]
        rel = max(max(abs(r[k] - ref[r["step"], r["rank"]][k]) / max(abs(ref[r["step"], r["rank"]][k]), 1e-30)
                      for k in ("loss", "grad_norm")) for r in mine)
        rows.append({
            "planner": name, "label": LABELS[name], "steps": len(ran), "of_steps": len(steps),
            "measured_max_over_mean": float(np.mean(measured.max(1) / measured.mean(1))) if ran else float("nan"),
            "predicted_max_over_mean": float(np.mean(predicted.max(1) / predicted.mean(1))) if ran else float("nan"),
            "compute_max_s": float(np.mean(measured.max(1))) if ran else float("nan"),
            "predicted_step_s": float(np.mean(step_s)) if ran else float("nan"),
            "layouts": sorted({r["layout"] for r in mine}),
            "math_rel": float(rel),
        })
    base = rows[0]["compute_max_s"]
    best = min(r["predicted_step_s"] for r in rows if r["planner"].startswith("knapray"))
    for row in rows:
        row["speedup_vs_unbalanced"] = base / row["compute_max_s"]
        row["predicted_step_ratio"] = row["predicted_step_s"] / best
    return rows


def run_rivals_bench(*, world_size: int = 8, steps: int = 4, warmup: int = 1, mix: str = MIX, scale: int = SCALE,
                     max_text_tokens: int = MAX_TEXT_TOKENS, hidden: int = 192, heads: int = 4, depth: int = 2,
                     seed: int = 0) -> dict:
    from knapray.testing.batches import mix_batches

    if warmup < 0 or steps <= warmup:
        raise ValueError(f"steps ({steps}) must be larger than warmup ({warmup}) >= 0")
    cfg = step_config(hidden, heads, depth, depth)
    mix_batches(mix, cfg, scale=scale, seed=seed, world_size=world_size, max_text_tokens=max_text_tokens)  # errors here
    cost = bench_cost(hidden, heads, depth, world_size)
    opts = {"cfg": dataclasses.asdict(cfg), "cost": cost.to_dict(), "mix": mix, "scale": scale,
            "max_text_tokens": max_text_tokens, "steps": steps, "seed": seed}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spawn_local(_worker, (world_size, free_port(), tmp, opts), world_size)
        with open(os.path.join(tmp, "records.json")) as f:
            records = json.load(f)
    rows = summarize(records, world_size, warmup)
    worst = max(r["math_rel"] for r in rows)
    return {"rows": rows, "math_rel_max": worst, "math_tol": LOSS_TOL, "math_ok": bool(worst <= LOSS_TOL),
            "meta": {"world_size": world_size, "steps": steps, "warmup": warmup, "mix": mix, "scale": scale,
                     "hidden": hidden, "heads": heads, "depth": depth, "seed": seed,
                     "seconds": time.perf_counter() - t0}}


def print_report(result: dict) -> None:
    m = result["meta"]
    print(f"{m['world_size']} gloo processes, one thread each; {m['steps'] - m['warmup']} measured steps after "
          f"{m['warmup']} warm-up; mix {m['mix']} at 1/{m['scale']}; MMDiT d={m['hidden']}, {m['heads']} heads, "
          f"{m['depth']}+{m['depth']} blocks; {m['seconds']:.0f} s")
    print(f"{'planner':<30} {'compute max/mean':>16} {'predicted':>9} {'max s':>7} {'x none':>6} "
          f"{'pred. step':>10} {'steps':>5} {'rel diff':>8}  bags")
    for r in result["rows"]:
        print(f"{r['label']:<30} {r['measured_max_over_mean']:>16.3f} {r['predicted_max_over_mean']:>9.3f} "
              f"{r['compute_max_s']:>7.4f} {r['speedup_vs_unbalanced']:>6.2f} {r['predicted_step_ratio']:>9.3f}x "
              f"{r['steps']:>2}/{r['of_steps']:<2} {r['math_rel']:>8.1e}  {', '.join(r['layouts'])}")
    print("compute max/mean: measured thread CPU time of forward+backward minus all-to-all CPU, slowest rank over "
          "the mean, mean over steps; predicted: the cost model's for the same plans; pred. step: the cost "
          "model's step time (compute and communication) over knapray's best; x none: the unbalanced "
          "step's slowest rank's compute over this planner's; rel diff: loss / gradient norm against the "
          "unbalanced step's")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_json, add_seed, add_world_size, int_at_least, step_count

    add_world_size(p, default=8, help="gloo processes (default 8)")
    p.add_argument("--steps", type=step_count, default=4, help="steps, the warm-up included (default 4)")
    p.add_argument("--warmup", type=int_at_least(0), default=1, help="leading steps left out (default 1)")
    p.add_argument("--mix", default=MIX, help="data codes (default: the paper's image+video codes, one rank each)")
    p.add_argument("--scale", type=int_at_least(1, MAX_SCALE), default=SCALE, help=f"divide resolutions (default {SCALE})")
    add_seed(p)
    add_json(p)


def cli(args: argparse.Namespace) -> int:
    import sys

    from knapray.commands.flags import check_local_processes

    check_local_processes(args.world_size, "knapray bench rivals")
    result = run_rivals_bench(world_size=args.world_size, steps=args.steps, warmup=args.warmup, mix=args.mix,
                              scale=args.scale, seed=args.seed)
    print_report(result)
    if args.json:
        print(json.dumps(result))
    if not result["math_ok"]:
        print(f"error: a planner's step computes different math: relative loss / grad norm difference "
              f"{result['math_rel_max']:.2e} from the unbalanced step's exceeds {result['math_tol']:g}",
              file=sys.stderr)
        return 1
    return 0
