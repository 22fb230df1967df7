"""Step benchmark: measured per-rank compute of balanced vs unbalanced training steps.

``world_size`` gloo processes on this machine, one thread each, run forward + backward +
gradient all-reduce of a seeded MMDiT for ``steps`` steps of a skewed data mix. Every
step draws fresh per-rank batches (seeded per step) and runs them twice, balanced (a
``plan_balance`` plan on ``topology``) and unbalanced (``identity_plan``: every rank
computes its own sequences), in alternating order so machine noise hits both modes.

Per rank and step it records:

- ``compute_s``: CPU time of the rank's own thread (``time.thread_time``) over forward +
  backward, minus the CPU time spent inside all-to-alls. Thread time does not grow while
  a process waits for a core, so it stays meaningful with 4 processes on 2 cores.
- ``comm_wall_s``: wall time inside the routing and Ulysses all-to-alls (``comm_timer``).
  It includes waiting for peers that have not reached the collective yet; on a machine
  whose cores the ranks share that waiting is most of it.
- ``comm_isolated_s``: the same exchanges (recorded shapes, splits, groups) replayed after
  the step, each right after a barrier of its group: the cost of moving the bytes alone.
- ``step_wall_s``: wall time of the whole step, gradient all-reduce included.

The footnote of the printed table explains the projected speedup.

Variants (``--fsdp``, ``--ac``, ``--compile``): the balanced step is also run, on the same
batches and plans, by models parallelized with each requested feature alone and with all of
them together (``knapray.worker.parallelize``). Each variant has its own model, built from the
same seed (``parallelize`` mutates in place), so every variant computes the same loss and
gradients as the eager baseline (``balanced``: fsdp none, no checkpointing, eager); the
largest relative difference of the global loss and of the gradient norm is reported per
variant and the run fails above ``LOSS_TOL``: a benchmark that compares different math is
wrong. Every step runs all modes and variants in rotating order so machine noise hits all.
After the timed steps, one untimed step per variant on the last step's batches measures, per
rank, what each feature is for: ``saved_mb``, the distinct bytes autograd saves for backward
during the forward (``memory_check.saved_activation_bytes``; parameters, gathered or not,
left out), and ``state_mb``, the bytes of this rank's parameters and gradients (local shards
under FSDP); the table shows the largest rank's and their ratio to the baseline's.

The default mix puts two long video-like sequences (2 x ~700 tokens at ``scale=4``) on
rank 0 and four small images (~20-100 tokens, mostly text) on each other rank: ~3x the
mean predicted work on rank 0. ``g2n2`` is the default topology because it is the one of
``g2n2`` / ``g1n2+g2n1`` that can balance it: each video alone is more work than a rank's
fair share, so it must be split over a bag of two, and with ``g1n2+g2n1`` both videos
land in the one bag of two (predicted imbalance ~1.45 vs ~1.001 for ``g2n2``).

``CPU_GAMMA``: attention on CPU (SDPA, fp32, head_dim 48, one thread) is relatively more
expensive than on a GPU's flash kernel. Fitting ``t(L) = c0 + c1 L + c2 L^2`` to the
forward+backward thread time of single sequences of 26..3338 tokens on this model gives
``gamma = 6 d c2 / c1`` ~0.85 at d=192 (~0.67 at d=128), against 0.4 for GPUs. Every
run also fits ``compute_s = c0 + c1 tokens + c2 sum(L^2/g)`` to its own (rank, step)
points (``fit`` in the result; rough, as the points fall in a few clusters), a hint for
``--gamma`` on another machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import tempfile
import time

import numpy as np
import torch

from knapray.distributed.local import free_port, init_local_gloo, spawn_local

from knapray.models import MMDiT, MMDiTConfig
from knapray.distributed.parallel_dims import ParallelDims
from knapray.config.parallel import ParallelConfig
from knapray.planning import Topology, WorkloadModel, identity_plan, plan_balance
from knapray.limits import MAX_SCALE

DEFAULT_MIX = "g1b2i512f34s1,g3b4i256f1s0"
DEFAULT_TOPOLOGY = "g2n2"
DEFAULT_SCALE = 4
DEFAULT_MAX_TEXT_TOKENS = 392
CPU_GAMMA = 0.85
MODES = ("balanced", "unbalanced")
BASELINE = "balanced"
LOSS_TOL = 1e-4
"""Largest relative difference (global loss, gradient norm) a variant may show against the
baseline in fp32: the same math in another order differs by ~1e-7."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepVariant:
    """One way to parallelize the model for the balanced step."""

    name: str
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    gpus_per_node: int | None = None
    """Ranks per 'node' of the hybrid FSDP mesh."""

    def describe(self) -> dict:
        """Plain values for the report (JSON)."""
        return {"name": self.name, **self.parallel.describe(), "gpus_per_node": self.gpus_per_node}

    def to_spawn(self) -> tuple:
        return self.name, {f.name: getattr(self.parallel, f.name) for f in dataclasses.fields(self.parallel)}, \
            self.gpus_per_node

    @classmethod
    def from_spawn(cls, t: tuple) -> "StepVariant":
        name, parallel, gpn = t
        return cls(name=name, parallel=ParallelConfig(**parallel), gpus_per_node=gpn)


def step_variants(
    *, fsdp: str = "none", ac: str = "none", ac_every: int = 2, compile: bool = False,
    compile_backend: str = "inductor", gpus_per_node: int | None = None, world_size: int = 1,
) -> list[StepVariant]:
    """The variants to measure beside the eager baseline: each requested feature alone, then
    all of them together when more than one was requested. Checked here (ValueError), before
    any process is spawned."""
    cfg = ParallelConfig(fsdp=fsdp, activation_checkpointing=ac, ac_every=ac_every, compile=compile,
                         compile_backend=compile_backend)
    if cfg.fsdp != "none":
        ParallelDims(world_size=world_size, gpus_per_node=gpus_per_node).mesh_shape(cfg.fsdp)
    if compile_backend not in ("inductor", "aot_eager"):
        raise ValueError(f"compile_backend must be one of ['inductor', 'aot_eager'], got {compile_backend!r}")
    ac_name = f"ac every_{ac_every}" if ac == "every_k" else f"ac {ac}"
    alone = []
    if fsdp != "none":
        alone.append(StepVariant(name=f"fsdp {fsdp}", parallel=ParallelConfig(fsdp=fsdp), gpus_per_node=gpus_per_node))
    if ac != "none":
        alone.append(StepVariant(name=ac_name, parallel=ParallelConfig(activation_checkpointing=ac, ac_every=ac_every)))
    if compile:
        alone.append(StepVariant(name=f"compile {compile_backend}",
                                 parallel=ParallelConfig(compile=True, compile_backend=compile_backend)))
    if len(alone) > 1:
        alone.append(StepVariant(name="+".join(v.name for v in alone), parallel=cfg, gpus_per_node=gpus_per_node))
    return alone


def step_config(hidden: int = 192, heads: int = 4, depth_double: int = 2, depth_single: int = 2) -> MMDiTConfig:
    """An MMDiT wide enough that GEMMs, not Python, dominate a step on one CPU thread."""
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} must be divisible by heads {heads}")
    head_dim = hidden // heads
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim {head_dim} (hidden/heads) must be even and >= 6")
    side = (head_dim * 3 // 8) // 2 * 2  # RoPE channels for h and w; t gets the rest
    rope = (head_dim - 2 * side, side, side)
    return MMDiTConfig(
        in_channels=4, patch_size=(1, 2, 2), hidden_size=hidden, num_heads=heads,
        depth_double=depth_double, depth_single=depth_single, text_dim=16, pooled_dim=16,
        rope_axes_dim=rope,
    )


def _attention_pairs(plan) -> np.ndarray:
    """(W,) per rank: sum over its chunks of L^2 / g (the attention share the workload
    model charges it, without the gamma * attn_coef * d factor)."""
    lens = plan.seq_lens[plan.chunk_seq].astype(np.float64)
    g = plan.bag_size_of_seq[plan.chunk_seq]
    return np.bincount(plan.chunk_rank, weights=lens * lens / g, minlength=plan.world_size)


@contextlib.contextmanager
def _recording_all_to_alls(log: list):
    """Record the shape, dtype, splits and group of every ``all_to_all_single`` called in
    the block (this benchmark process only), so the exchanges can be replayed alone."""
    import torch.distributed as dist

    original = dist.all_to_all_single

    def recording(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        log.append((tuple(output.shape), tuple(input.shape), output.dtype,
                    output_split_sizes, input_split_sizes, group))
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = recording
    try:
        yield log
    finally:
        dist.all_to_all_single = original


def _replay_all_to_alls(log: list) -> float:
    """Wall seconds of the recorded exchanges run again, same sizes and groups, each one
    started right after a barrier of its group: the transfers without the waiting for
    peers still computing. Every rank of a group recorded that group's calls in the same
    order, so the replay (in each rank's own order) cannot deadlock."""
    import torch.distributed as dist

    total = 0.0
    for out_shape, in_shape, dtype, out_splits, in_splits, group in log:
        out, inp = torch.empty(out_shape, dtype=dtype), torch.zeros(in_shape, dtype=dtype)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        total += time.perf_counter() - t0
    return total


def _worker(rank: int, world: int, port: int, out_dir: str, opts: dict) -> None:
    import torch.distributed as dist

    from knapray.distributed import BagGroups
    from knapray.distributed.comms import comm_timer
    from knapray.models.flow import flow_loss
    from knapray.worker.balanced import balanced_forward
    from knapray.worker.parallelize import clip_grad_norm_, parallelize
    from knapray.testing.batches import mix_batches

    init_local_gloo(rank, world, port, timeout_s=300)
    try:
        cfg = MMDiTConfig(**opts["cfg"])
        topo = Topology.parse(opts["topology"], world_size=world)
        groups = BagGroups.build(topo, cfg.num_heads)
        workload = WorkloadModel(d_model=cfg.hidden_size, gamma=opts["gamma"])
        # One model per variant, the same initial weights in each (parallelize mutates in
        # place). Every rank builds them in one order: FSDP meshes create process groups.
        variants = [StepVariant.from_spawn(v) for v in opts["variants"]]
        parallel = {}
        for v in [StepVariant(name=BASELINE), *variants]:
            torch.manual_seed(opts["seed"])
            model = MMDiT(cfg)
            model.init_weights(std=0.02)
            parallel[v.name] = parallelize(model, v.parallel, ParallelDims(world_size=world,
                                                                           gpus_per_node=v.gpus_per_node))
        modes = [*MODES, *(v.name for v in variants)]
        records = []
        memory: dict[str, dict] = {}
        for step in range(opts["steps"]):
            batches = mix_batches(
                opts["mix"], cfg, scale=opts["scale"], seed=opts["seed"] * 100_003 + step,
                world_size=world, max_text_tokens=opts["max_text_tokens"],
            )
            batch = batches[rank]
            lens = [b.seq_lens.tolist() for b in batches]
            global_tokens = sum(b.x_img.shape[0] for b in batches)
            del batches
            balanced = (plan_balance(lens, topo, workload), groups.bag_group, groups.balance_group)
            plans = {"unbalanced": (identity_plan(lens, workload), None, None)}
            # Rotating order: each mode runs first, second, ... equally often.
            k = step % len(modes)
            for mode in modes[k:] + modes[:k]:
                plan, bag_group, route_group = plans.get(mode, balanced)
                par = parallel.get(mode, parallel[BASELINE])
                model = par.model
                model.zero_grad(set_to_none=True)
                dist.barrier()
                exchanges: list = []
                w0, c0 = time.perf_counter(), time.thread_time()
                with comm_timer() as comm, _recording_all_to_alls(exchanges):
                    out = balanced_forward(model, batch, plan, rank, bag_group=bag_group, route_group=route_group)
                    loss = flow_loss(out, batch.targets, global_tokens)
                    loss.backward()
                c1, w1 = time.thread_time(), time.perf_counter()
                par.reduce_gradients()  # FSDP: already reduce-scattered in backward
                w2 = time.perf_counter()
                del out
                isolated = _replay_all_to_alls(exchanges)
                # Outside the timed step: the check that every variant computes the same
                # gradients (the norm is reduced over FSDP's mesh; max_norm=inf scales by 1).
                grad_norm = float(clip_grad_norm_(model.parameters(), float("inf")))
                records.append({
                    "step": step,
                    "mode": mode,
                    "rank": rank,
                    "compute_s": (c1 - c0) - comm.cpu_s,
                    "comm_wall_s": comm.wall_s,
                    "comm_cpu_s": comm.cpu_s,
                    "comm_calls": comm.calls,
                    "comm_isolated_s": isolated,
                    "comm_bytes": int(sum(
                        int(np.prod(e[1])) * torch.empty((), dtype=e[2]).element_size() for e in exchanges
                    )),
                    "fwd_bwd_wall_s": w1 - w0,
                    "step_wall_s": w2 - w0,
                    "loss": float(loss.detach()),
                    "grad_norm": grad_norm,
                    "recompiles": par.recompiles,
                    "compiles": par.compile_stats.compiles if par.compile_stats is not None else 0,
                    "tokens": int(plan.recv_counts[rank]),
                    "attn_pairs": float(_attention_pairs(plan)[rank]),
                    "planned_work": float(plan.rank_work[rank]),
                    "planned_imbalance": float(plan.imbalance),
                    "moved_token_fraction": float(plan.moved_token_fraction),
                    "plan_ms": float(plan.plan_time_ms),
                    "sequences": int(sum(len(x) for x in lens)),
                    "total_tokens": int(sum(sum(x) for x in lens)),
                })
                del loss
        # Untimed: what each variant keeps in memory on the last step's batch and plans.
        for mode in modes:
            plan, bag_group, route_group = plans.get(mode, balanced)
            memory[mode] = _measure_memory(
                parallel.get(mode, parallel[BASELINE]).model,
                lambda m, p=plan, b=bag_group, r=route_group: balanced_forward(
                    m, batch, p, rank, bag_group=b, route_group=r),
                batch.targets, global_tokens, flow_loss,
            )
        for r in records:
            r.update(memory[r["mode"]])
        write_records(records, world, rank, out_dir)
    finally:
        dist.destroy_process_group()


def write_records(records: list[dict], world: int, rank: int, out_dir: str) -> None:
    """Every rank's records gathered; rank 0 writes them to ``<out_dir>/records.json``."""
    import torch.distributed as dist

    gathered: list = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        with open(os.path.join(out_dir, "records.json"), "w") as f:
            json.dump([r for rank_records in gathered for r in rank_records], f)


def _measure_memory(model, forward, targets, global_tokens: int, loss_fn) -> dict:
    """One untimed forward + backward of ``forward(model)``: MB saved for backward by the
    forward (parameters left out) and MB of this rank's parameters + gradients after it."""
    from knapray.testing.memory_check import saved_activation_bytes, state_bytes

    model.zero_grad(set_to_none=True)
    out, saved = saved_activation_bytes(lambda: forward(model), exclude=model.parameters())
    loss_fn(out, targets, global_tokens).backward()
    del out
    state = state_bytes(model)
    model.zero_grad(set_to_none=True)
    return {"saved_mb": saved / 2**20, "state_mb": (state["params"] + state["grads"]) / 2**20}


def _math_check(records: list[dict], mode: str) -> dict:
    """Largest relative difference, over all steps (warm-up included), of ``mode``'s global
    loss (summed over ranks) and gradient norm (the same on every rank) from the baseline's."""

    def per_step(key: str, m: str, reduce) -> dict:
        out: dict = {}
        for r in records:
            if r["mode"] == m:
                out.setdefault(r["step"], []).append(r[key])
        return {s: reduce(v) for s, v in out.items()}

    def worst(key: str, reduce) -> float:
        ref, got = per_step(key, BASELINE, reduce), per_step(key, mode, reduce)
        return max(abs(got[s] - ref[s]) / max(abs(ref[s]), 1e-30) for s in ref)

    return {"loss_rel_max": worst("loss", sum), "grad_norm_rel_max": worst("grad_norm", max)}


def _mode_summary(records: list[dict], mode: str, world: int, warmup: int) -> dict:
    rows = [r for r in records if r["mode"] == mode and r["step"] >= warmup]
    steps = sorted({r["step"] for r in rows})
    if not steps:
        raise ValueError(f"no measured steps: steps must exceed warmup ({warmup})")

    def per_rank(key: str) -> np.ndarray:
        # (steps, ranks)
        m = np.zeros((len(steps), world))
        for r in rows:
            m[steps.index(r["step"]), r["rank"]] = r[key]
        return m

    compute, comm, wall = per_rank("compute_s"), per_rank("comm_wall_s"), per_rank("step_wall_s")
    isolated = per_rank("comm_isolated_s")
    planned = per_rank("planned_work")
    first = {r["step"]: r for r in rows if r["rank"] == 0}
    return {
        "steps": len(steps),
        "compute_max_over_mean": float(np.mean(compute.max(1) / compute.mean(1))),
        "compute_max_s": float(np.mean(compute.max(1))),
        "compute_mean_s": float(np.mean(compute)),
        "comm_wall_mean_s": float(np.mean(comm)),
        "comm_wall_max_s": float(np.mean(comm.max(1))),
        "comm_isolated_s": float(np.mean(isolated.max(1))),
        "comm_bytes_sent": float(np.mean(per_rank("comm_bytes").sum(1))),
        "step_wall_s": float(np.mean(wall.max(1))),
        "planned_imbalance": float(np.mean([first[s]["planned_imbalance"] for s in steps])),
        "planned_max_over_mean": float(np.mean(planned.max(1) / planned.mean(1))),
        "moved_token_fraction": float(np.mean([first[s]["moved_token_fraction"] for s in steps])),
        "plan_ms": float(np.mean([first[s]["plan_ms"] for s in steps])),
        "comm_calls": int(np.mean([r["comm_calls"] for r in rows])),
        "rank_compute_s": compute.mean(0).tolist(),
        "rank_tokens": per_rank("tokens").mean(0).tolist(),
        "per_step_compute_max_over_mean": (compute.max(1) / compute.mean(1)).tolist(),
    }


def _variant_row(v: StepVariant, summary: dict, base: dict, records: list[dict], warmup: int) -> dict:
    """One line of the variants table: its times, their ratios to the baseline's, recompiles
    and the math check."""
    mine = [r for r in records if r["mode"] == v.name]
    return {
        **v.describe(),
        "steps": summary["steps"],
        "step_wall_s": summary["step_wall_s"],
        "compute_max_s": summary["compute_max_s"],
        "compute_mean_s": summary["compute_mean_s"],
        "compute_max_over_mean": summary["compute_max_over_mean"],
        "wall_ratio": summary["step_wall_s"] / base["step_wall_s"],
        "compute_max_ratio": summary["compute_max_s"] / base["compute_max_s"],
        "rank_compute_s": summary["rank_compute_s"],
        # Counted per rank over the whole run; after the warm-up they should stay flat.
        "compiles": max(r["compiles"] for r in mine),
        "recompiles": max(r["recompiles"] for r in mine),
        "recompiles_after_warmup": max(r["recompiles"] for r in mine)
        - max([r["recompiles"] for r in mine if r["step"] < warmup], default=0),
        # Measured once per rank after the timed steps; the largest rank's.
        "saved_mb": max(r["saved_mb"] for r in mine),
        "state_mb": max(r["state_mb"] for r in mine),
        **_math_check(records, v.name),
    }


def _fit_cost(records: list[dict], warmup: int, d_model: int) -> dict:
    """Least squares ``compute_s = c0 + c1 * tokens + c2 * sum(L^2/g)`` over every measured
    (rank, step, mode) of the eager model (variants left out: checkpointing and compile
    change the cost per token); ``gamma = 6 d c2 / c1`` is the attention weight that would
    make the workload model proportional to this machine's measured cost."""
    rows = [r for r in records if r["step"] >= warmup and r["mode"] in MODES]
    a = np.array([[1.0, r["tokens"], r["attn_pairs"]] for r in rows])
    t = np.array([r["compute_s"] for r in rows])
    coef, *_ = np.linalg.lstsq(a, t, rcond=None)
    pred = a @ coef
    r2 = 1.0 - float(np.sum((t - pred) ** 2) / max(np.sum((t - t.mean()) ** 2), 1e-30))
    gamma = 6.0 * d_model * coef[2] / coef[1] if coef[1] > 0 else float("nan")
    return {
        "overhead_s": float(coef[0]),
        "s_per_token": float(coef[1]),
        "s_per_attn_pair": float(coef[2]),
        "gamma": float(gamma),
        "r2": r2,
    }


def run_step_bench(
    *,
    world_size: int = 4,
    steps: int = 6,
    warmup: int = 1,
    mix: str = DEFAULT_MIX,
    scale: int = DEFAULT_SCALE,
    topology: str = DEFAULT_TOPOLOGY,
    max_text_tokens: int = DEFAULT_MAX_TEXT_TOKENS,
    hidden: int = 192,
    heads: int = 4,
    depth_double: int = 2,
    depth_single: int = 2,
    gamma: float = CPU_GAMMA,
    seed: int = 0,
    fsdp: str = "none",
    ac: str = "none",
    ac_every: int = 2,
    compile: bool = False,
    compile_backend: str = "inductor",
    gpus_per_node: int | None = None,
) -> dict:
    """Spawn ``world_size`` gloo processes, run the steps, return the summary (see module doc).

    ``fsdp``, ``ac``, ``ac_every``, ``compile``, ``compile_backend``, ``gpus_per_node``: the
    variants measured beside the eager baseline (``step_variants``); none by default."""
    from knapray.distributed import check_heads
    from knapray.testing.batches import mix_batches

    if warmup < 0 or steps <= warmup:
        raise ValueError(f"steps ({steps}) must be larger than warmup ({warmup}) >= 0")
    # Clear errors here rather than tracebacks from every spawned rank.
    cfg = step_config(hidden, heads, depth_double, depth_single)
    topo = Topology.parse(topology, world_size=world_size)
    check_heads(cfg.num_heads, topo)
    mix_batches(mix, cfg, scale=scale, seed=seed, world_size=world_size, max_text_tokens=max_text_tokens)
    variants = step_variants(fsdp=fsdp, ac=ac, ac_every=ac_every, compile=compile, compile_backend=compile_backend,
                             gpus_per_node=gpus_per_node, world_size=world_size)
    opts = {
        "cfg": dataclasses.asdict(cfg), "mix": mix, "scale": scale, "topology": topology,
        "max_text_tokens": max_text_tokens, "gamma": gamma, "steps": steps, "seed": seed,
        "variants": [v.to_spawn() for v in variants],
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spawn_local(_worker, (world_size, free_port(), tmp, opts), world_size)
        with open(os.path.join(tmp, "records.json")) as f:
            records = json.load(f)
    seconds = time.perf_counter() - t0
    bal = _mode_summary(records, "balanced", world_size, warmup)
    unbal = _mode_summary(records, "unbalanced", world_size, warmup)
    speedup = unbal["compute_max_s"] / (bal["compute_max_s"] + bal["comm_isolated_s"])
    first = [r for r in records if r["rank"] == 0 and r["mode"] == "balanced"]
    unbal.update(_math_check(records, "unbalanced"))
    rows = [_variant_row(StepVariant(name=BASELINE), bal, bal, records, warmup)]
    rows += [_variant_row(v, _mode_summary(records, v.name, world_size, warmup), bal, records, warmup)
             for v in variants]
    for row in rows:
        row["saved_ratio"] = row["saved_mb"] / rows[0]["saved_mb"]
        row["state_ratio"] = row["state_mb"] / rows[0]["state_mb"]
    worst = max([unbal["loss_rel_max"], unbal["grad_norm_rel_max"]]
                + [max(r["loss_rel_max"], r["grad_norm_rel_max"]) for r in rows])
    return {
        "balanced_compute_max_over_mean": bal["compute_max_over_mean"],
        "unbalanced_compute_max_over_mean": unbal["compute_max_over_mean"],
        "projected_speedup": speedup,
        "compute_only_speedup": unbal["compute_max_s"] / bal["compute_max_s"],
        "balanced": bal,
        "unbalanced": unbal,
        "fit": _fit_cost(records, warmup, cfg.hidden_size),
        "variants": rows,
        "math_rel_max": worst,
        "math_tol": LOSS_TOL,
        "math_ok": bool(worst <= LOSS_TOL),
        "meta": {
            "world_size": world_size, "steps": steps, "warmup": warmup, "mix": mix, "scale": scale,
            "topology": str(topo), "max_text_tokens": max_text_tokens, "hidden": hidden,
            "heads": heads, "depth": [depth_double, depth_single], "gamma": gamma, "seed": seed,
            "sequences": first[0]["sequences"], "tokens_per_step": float(np.mean([r["total_tokens"] for r in first])),
            "seconds": seconds,
        },
    }


def print_report(result: dict) -> None:
    m = result["meta"]
    print(
        f"step benchmark: {m['world_size']} gloo ranks x 1 thread, MMDiT d={m['hidden']} heads={m['heads']} "
        f"depth {m['depth'][0]}+{m['depth'][1]}, fp32 CPU ({os.cpu_count()} cores)"
    )
    print(
        f"mix {m['mix']} at 1/{m['scale']} resolution: {m['sequences']} sequences, "
        f"~{m['tokens_per_step']:.0f} tokens/step; topology {m['topology']}, gamma {m['gamma']:g}; "
        f"{m['steps'] - m['warmup']} steps measured (+{m['warmup']} warm-up), {m['seconds']:.1f} s"
    )
    header = (
        f"{'mode':<11} {'compute':>8} {'compute':>8} {'compute':>8} {'comm wall':>9} {'comm':>8} "
        f"{'step wall':>9} {'planned':>8}"
    )
    sub = (
        f"{'':<11} {'max/mean':>8} {'mean s':>8} {'max s':>8} {'s':>9} {'alone s':>8} "
        f"{'s':>9} {'max/mean':>8}"
    )
    print(header)
    print(sub)
    print("-" * len(header))
    for mode in MODES:
        r = result[mode]
        print(
            f"{mode:<11} {r['compute_max_over_mean']:>8.3f} {r['compute_mean_s']:>8.4f} "
            f"{r['compute_max_s']:>8.4f} {r['comm_wall_mean_s']:>9.4f} {r['comm_isolated_s']:>8.4f} "
            f"{r['step_wall_s']:>9.4f} {r['planned_imbalance']:>8.3f}"
        )
    for mode in MODES:
        per_rank = " ".join(f"{x:.3f}" for x in result[mode]["rank_compute_s"])
        print(f"  {mode + ' compute per rank (s):':<37} {per_rank}")
    print(
        f"projected speedup = unbalanced max compute / (balanced max compute + balanced comm alone) = "
        f"{result['projected_speedup']:.2f}x  (compute only: {result['compute_only_speedup']:.2f}x)"
    )
    f = result["fit"]
    print(
        "\ncompute: thread CPU time of forward+backward minus CPU time inside all-to-alls, per rank "
        "(max/mean over ranks,\n  then the mean over steps). comm wall: wall time inside the routing "
        "and Ulysses all-to-alls during the step\n  (mean over ranks); with ranks sharing cores it is "
        "mostly waiting for peers. comm alone: the same exchanges\n  replayed after the step, each "
        "right after a barrier (slowest rank). step wall: forward+backward+grad all-reduce.\n"
        "projected speedup: on GPUs, where ranks do not share cores, a synchronous step lasts as long as "
        "its slowest\n  rank, so the step time is ~ the max per-rank compute (plus, balanced, the "
        "routing/Ulysses communication).\n  Here 4 ranks share the cores, so the measured step wall "
        "times follow total CPU work instead."
    )
    print(
        f"cost fit to the measured (rank, step) points: {f['overhead_s'] * 1e3:.1f} ms + "
        f"{f['s_per_token'] * 1e6:.1f} us/token + attention -> gamma ~{f['gamma']:.2f} "
        f"(rough; planned with {m['gamma']:g})"
    )

    if len(result.get("variants", ())) > 1:
        print_variants(result)
    print(
        f"same math: largest relative difference of loss / grad norm from the baseline "
        f"{result['math_rel_max']:.1e} (limit {result['math_tol']:g})"
    )


def print_variants(result: dict) -> None:
    """The variants table: the balanced step parallelized each way, side by side."""
    rows = result["variants"]
    width = max(24, *(len(_variant_label(r)) for r in rows))
    header = (
        f"{'variant (balanced step)':<{width}} {'step wall':>9} {'x base':>6} {'compute':>8} {'x base':>6} "
        f"{'compute':>8} {'saved':>8} {'x base':>6} {'params+':>8} {'x base':>6} {'recompiles':>10} "
        f"{'loss':>8} {'grad norm':>9}"
    )
    sub = (
        f"{'':<{width}} {'s':>9} {'':>6} {'max s':>8} {'':>6} {'max/mean':>8} {'MB':>8} {'':>6} "
        f"{'grads MB':>8} {'':>6} {'(warm-up)':>10} {'rel diff':>8} {'rel diff':>9}"
    )
    print()
    print(header)
    print(sub)
    print("-" * len(header))
    for r in rows:
        recompiles = (f"{r['recompiles_after_warmup']} ({r['recompiles'] - r['recompiles_after_warmup']})"
                      if r["compile"] else "-")
        print(
            f"{_variant_label(r):<{width}} {r['step_wall_s']:>9.4f} {'x' + format(r['wall_ratio'], '.2f'):>6} "
            f"{r['compute_max_s']:>8.4f} {'x' + format(r['compute_max_ratio'], '.2f'):>6} "
            f"{r['compute_max_over_mean']:>8.3f} {r['saved_mb']:>8.2f} {'x' + format(r['saved_ratio'], '.2f'):>6} "
            f"{r['state_mb']:>8.2f} {'x' + format(r['state_ratio'], '.2f'):>6} {recompiles:>10} "
            f"{r['loss_rel_max']:>8.1e} "
            f"{r['grad_norm_rel_max']:>9.1e}"
        )
    print(
        "x base: the variant's time over the eager baseline's (same batches, same plans, run in rotating "
        "order each step).\n"
        "  On this CPU the ratios say what each feature costs, not what it saves on GPUs: activation "
        "checkpointing\n  recomputes each checkpointed block's forward in backward (about one forward "
        "more, the price of its\n  memory savings); compile's gains are GPU ones (fused kernels, fewer "
        "launches, less memory traffic),\n  on one CPU thread it can be a wash or slower; FSDP on one "
        "machine adds parameter all-gathers and\n  gradient reduce-scatters over shared cores and saves "
        "only memory. saved MB: what autograd keeps for backward\n  (activations; weights left out), "
        "params+grads MB: this rank's parameters and gradients (its shards under FSDP),\n  both "
        "measured on one untimed step after the timed ones, largest rank. recompiles: after the "
        "warm-up\n  (during it). loss / grad norm rel diff: largest over all steps of "
        "|variant - baseline| / |baseline|\n  (global loss, gradient norm): the variants compute the same math."
    )


def _variant_label(row: dict) -> str:
    return "baseline (eager)" if row["name"] == BASELINE else row["name"]


def plot_rank_compute(path: str, result: dict) -> str:
    """Bars of mean per-rank compute time, unbalanced vs balanced."""
    from knapray.driver.plots import _plt

    plt = _plt()
    unbal = np.asarray(result["unbalanced"]["rank_compute_s"])
    bal = np.asarray(result["balanced"]["rank_compute_s"])
    ranks = np.arange(unbal.size)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.4
    ax.bar(ranks - width / 2, unbal, width, color="#b0b0b0",
           label=f"unbalanced (max/mean {result['unbalanced_compute_max_over_mean']:.2f})")
    ax.bar(ranks + width / 2, bal, width, color="#2a6fdb",
           label=f"balanced (max/mean {result['balanced_compute_max_over_mean']:.2f})")
    ax.set_xticks(ranks)
    ax.set_xlabel("rank")
    ax.set_ylabel("compute per step (s, thread CPU time)")
    m = result["meta"]
    ax.set_title(
        f"{m['mix']} on {m['topology']}: projected speedup {result['projected_speedup']:.2f}x", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import (add_ac, add_compile, add_fsdp, add_gpus_per_node, add_json, add_seed,
                                        add_world_size, float_in, int_at_least, step_count, text_tokens)

    add_world_size(p, default=4, help="gloo processes (default 4)")
    p.add_argument("--steps", type=step_count, default=6, help="steps, the warm-up included (default 6)")
    p.add_argument("--warmup", type=int_at_least(0), default=1,
                   help="leading steps left out of the averages (default 1)")
    p.add_argument("--mix", default=DEFAULT_MIX,
                   help="data codes; skewed by default: rank 0 holds two videos, the others small images")
    p.add_argument("--scale", type=int_at_least(1, MAX_SCALE), default=DEFAULT_SCALE,
                   help=f"divide resolutions and text lengths (default {DEFAULT_SCALE})")
    p.add_argument("--topology", default=DEFAULT_TOPOLOGY,
                   help=f"bags of the balanced run (default {DEFAULT_TOPOLOGY})")
    p.add_argument("--max-text-tokens", type=text_tokens, default=DEFAULT_MAX_TEXT_TOKENS)
    p.add_argument("--hidden", type=int_at_least(1), default=192, help="model width (default 192)")
    p.add_argument("--heads", type=int_at_least(1), default=4, help="attention heads (default 4)")
    p.add_argument("--depth", type=int_at_least(0), default=2,
                   help="double- and single-stream blocks, each (default 2)")
    p.add_argument("--gamma", type=float_in(ge=0), default=None,
                   help=f"attention cost weight of the workload model (default: fitted for CPU, {CPU_GAMMA})")
    add_seed(p)
    p.add_argument("--plot", metavar="PNG", help="write a PNG of per-rank compute time, balanced vs unbalanced")
    add_json(p)
    v = p.add_argument_group("variants of the balanced step, measured beside it")
    add_fsdp(v, default="none", help="also measure the balanced step sharded (default none)")
    add_gpus_per_node(v, help="ranks per 'node' for --fsdp hybrid (e.g. 2 on 4 ranks = 2 nodes)")
    add_ac(v, default="none", help="also measure the balanced step with it (default none)")
    add_compile(v, "also measure the balanced step with torch.compile of each block",
                backends=["inductor", "aot_eager"])


def cli(args: argparse.Namespace) -> int:
    import sys

    from knapray.commands.flags import check_local_processes

    check_local_processes(args.world_size, "knapray bench step")
    result = run_step_bench(
        world_size=args.world_size, steps=args.steps, warmup=args.warmup, mix=args.mix, scale=args.scale,
        topology=args.topology, max_text_tokens=args.max_text_tokens, hidden=args.hidden, heads=args.heads,
        depth_double=args.depth, depth_single=args.depth, gamma=CPU_GAMMA if args.gamma is None else args.gamma,
        seed=args.seed, fsdp=args.fsdp, ac=args.ac, ac_every=args.ac_every or 2, compile=args.compile,
        compile_backend=args.compile_backend, gpus_per_node=args.gpus_per_node,
    )
    if args.plot:
        result["plot"] = plot_rank_compute(args.plot, result)
    print_report(result)
    if args.plot:
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(result))
    if not result["math_ok"]:
        print(f"error: a variant computes different math: relative loss / grad norm difference "
              f"{result['math_rel_max']:.2e} from the baseline exceeds {result['math_tol']:g}", file=sys.stderr)
        return 1
    return 0
