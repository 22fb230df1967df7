"""`knapray parity`: balanced and unbalanced execution against a single-process reference.

Spawns ``world_size`` local gloo processes; each builds the same seeded model and the same
per-rank batches, parallelizes it (``knapray.worker.parallelize``: FSDP full / hybrid,
activation checkpointing, compile; none by default), runs one forward+backward per topology
(balanced) and once with the identity plan (unbalanced), and sums gradients across ranks
(FSDP: during backward). The parent computes the single-process reference on all batches
at once and reports, per case, the largest relative difference of the outputs, of the loss,
of every parameter gradient (``max|a-b| / max|b|`` per tensor; a sharded gradient is
gathered whole first) and of the global gradient norm (sharded: reduced over the mesh).

``empty_ranks`` hold no sequences; ``textless_ranks`` hold sequences without text tokens.
A topology ``SPEC/overlap`` runs the plan on ``SPEC`` with every other sequence moved whole
onto a rank of a bag of several (``overlapped``): groups that overlap, the rank's own
sequences beside its share of the bag's.
The coverage fields say what the routed chunks exercised: ranks computing nothing, ranks
whose chunks hold no text (text weights unused there), ranks without image tokens.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from knapray.distributed.local import free_port, init_local_gloo, spawn_local
from knapray.models import MMDiT, MMDiTConfig, pack_samples
from knapray.models.flow import add_noise, flow_loss
from knapray.planning import BalancePlan, Topology, WorkloadModel, identity_plan, plan_balance
from knapray.planning.shapes.mix import MAX_TEXT_TOKENS
from knapray.testing.batches import concat_batches, mix_batches

if TYPE_CHECKING:
    from knapray.config.parallel import ParallelConfig

UNBALANCED = "unbalanced"
DEFAULT_TOL = 1e-5


def parity_config(num_heads: int = 4) -> MMDiTConfig:
    """A small MMDiT that still has every part: double and single blocks, text, RoPE."""
    return MMDiTConfig(
        in_channels=4, patch_size=(1, 2, 2), hidden_size=16 * num_heads, num_heads=num_heads,
        depth_double=1, depth_single=1, text_dim=16, pooled_dim=16, rope_axes_dim=(4, 6, 6),
    )


OVERLAP = "/overlap"


def overlapped(plan: BalancePlan) -> BalancePlan:
    """``plan`` with overlapping groups, for a parity check: every other sequence (by global
    id) runs whole on a rank of a bag of several ranks in its balance group, the ranks taken
    in turn from the one after its home (so most of them route), beside that rank's share
    of its bag (``knapray.planning.search.overlap.whole_on``). A topology with no bag of several
    gets no move."""
    from knapray.planning.search.overlap import whole_on

    topo = plan.topology
    moves = {}
    for s in range(0, plan.num_sequences, 2):
        home = int(plan.home_rank[s])
        group = topo.group_ranks(home // topo.group_size)
        shared = [r for r in group if int(topo.bag_sizes[topo.bag_of_rank[r]]) > 1]
        if shared:
            moves[s] = shared[(home + 1 + s // 2) % len(shared)]
    return whole_on(plan, moves)


def plan_of(spec: str, lens: list[list[int]], world: int, model) -> BalancePlan:
    """The plan a parity case runs: ``identity`` for ``unbalanced``, the solver's on the
    topology ``spec``, and ``overlapped`` for ``SPEC/overlap``."""
    if spec == UNBALANCED:
        return identity_plan(lens, model)
    plan = plan_balance(lens, Topology.parse(spec.removesuffix(OVERLAP), world_size=world), model)
    return overlapped(plan) if spec.endswith(OVERLAP) else plan


def _build_model(cfg: MMDiTConfig, seed: int) -> MMDiT:
    torch.manual_seed(seed)
    model = MMDiT(cfg)
    model.init_weights(std=0.1)  # non-degenerate: every parameter gets a gradient
    return model


def _batches(cfg: MMDiTConfig, mix: str, scale: int, seed: int, world: int,
             max_text_tokens: int, empty_ranks: tuple[int, ...], textless_ranks: tuple[int, ...] = ()):
    batches = mix_batches(mix, cfg, scale=scale, seed=seed, world_size=world, max_text_tokens=max_text_tokens)
    if textless_ranks:
        # The same draws with a text limit of 0: the same images, no text tokens.
        textless = mix_batches(mix, cfg, scale=scale, seed=seed, world_size=world, max_text_tokens=0)
        batches = [textless[r] if r in textless_ranks else b for r, b in enumerate(batches)]
    empty = add_noise(pack_samples([], cfg), torch.zeros(0, cfg.patch_dim))
    return [empty if r in empty_ranks else b for r, b in enumerate(batches)]


def _worker(rank: int, world: int, port: int, out_dir: str, specs: list[str], mix: str,
            scale: int, seed: int, cfg_dict: dict, max_text_tokens: int,
            empty_ranks: tuple[int, ...], textless_ranks: tuple[int, ...], par: dict,
            gpus_per_node: int | None) -> None:
    import torch.distributed as dist

    from knapray.distributed import BagGroups
    from knapray.worker.balanced import balanced_forward, prepare_step
    from knapray.distributed.parallel_dims import ParallelDims
    from knapray.config.parallel import ParallelConfig
    from knapray.worker.parallelize import parallelize

    init_local_gloo(rank, world, port, timeout_s=120)
    try:
        cfg = MMDiTConfig(**cfg_dict)
        model = _build_model(cfg, seed)
        # Before the specs' BagGroups: both create process groups, in one order on every rank.
        parallel = parallelize(model, ParallelConfig(**par),
                               ParallelDims(world_size=world, device_type="cpu", gpus_per_node=gpus_per_node))
        batches = _batches(cfg, mix, scale, seed, world, max_text_tokens, empty_ranks, textless_ranks)
        batch = batches[rank]
        lens = [b.seq_lens.tolist() for b in batches]
        text_tokens = np.concatenate([b.text_tokens_per_sequence() for b in batches])
        global_tokens = sum(b.x_img.shape[0] for b in batches)
        workload = WorkloadModel(d_model=cfg.hidden_size)
        results = {}
        for spec in specs:
            plan = plan_of(spec, lens, world, workload)
            if spec == UNBALANCED:
                bag_group, route_group = None, None
            else:
                groups = BagGroups.build(plan.topology, cfg.num_heads)
                bag_group, route_group = groups.bag_group, groups.balance_group
            model.zero_grad(set_to_none=True)
            # The trainer's path: index maps and routing prepared on the host from the plan and
            # every sequence's text count (every rank drew every batch, so it knows them).
            layout = prepare_step(batch, plan, rank, text_tokens, batch.x_img.device, bag_group=bag_group,
                                  route_group=route_group)
            out = balanced_forward(model, batch, plan, rank, bag_group=bag_group, route_group=route_group,
                                   layout=layout)
            loss = flow_loss(out, batch.targets, global_tokens)
            loss.backward()
            parallel.reduce_gradients()
            # max_norm=inf: the norm is measured, the gradients are scaled by exactly 1.
            grad_norm = parallel.clip_grad_norm_(float("inf"))
            # full_tensor is a collective: every rank gathers every sharded gradient.
            grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()}
            results[spec] = {
                "out": out.detach(),
                "loss": loss.detach(),
                "grad_norm": float(grad_norm),
                "imbalance": plan.imbalance,
                "baseline_imbalance": plan.baseline_imbalance,
                "grads": grads if rank == 0 else None,
            }
        results["_recompiles"] = parallel.recompiles
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _coverage(spec: str, lens: list[list[int]], world: int, n_text, cfg: MMDiTConfig) -> dict:
    """What the case exercised: the cases a parity check must cover, counted from the plan
    (every rank derived the same plan from the same lengths)."""
    plan = plan_of(spec, lens, world, WorkloadModel(d_model=cfg.hidden_size))
    g = plan.bag_size_of_seq
    recv = plan.recv_counts
    # Text tokens lead each sequence: a chunk holds those of [start, start + len).
    chunk_text = np.clip(n_text[plan.chunk_seq] - plan.chunk_start, 0, plan.chunk_len)
    rank_text = np.bincount(plan.chunk_rank, weights=chunk_text, minlength=world)
    rank_img = np.bincount(plan.chunk_rank, weights=plan.chunk_len - chunk_text, minlength=world)
    return {
        "ranks_without_sequences": int(sum(1 for r in lens if not r)),
        "ranks_computing_nothing": int((recv == 0).sum()),
        "ranks_without_text": int((rank_text == 0).sum()),
        "ranks_without_image_tokens": int((rank_img == 0).sum()),
        "sequences_shorter_than_bag": int((plan.seq_lens < g).sum()),
        "chunks_without_text": int((plan.chunk_start >= n_text[plan.chunk_seq]).sum()),
        "moved_token_fraction": plan.moved_token_fraction,
        # Overlapping groups: sequences whole on a rank of a bag of several, and the ranks
        # that ran both their own and a share of their bag's.
        "whole_on_shared_ranks": int((plan.bag >= plan.topology.num_bags).sum()),
        "ranks_running_both": int(sum(
            1 for r in range(world)
            if plan.solo_sequences(r).size and plan.bag_sequences(int(plan.topology.bag_of_rank[r])).size)),
    }


def passed(report: dict, tol: float = DEFAULT_TOL) -> bool:
    return all(
        max(r["out_rel"], r["loss_rel"], r["grad_rel_max"], r["grad_norm_rel"]) <= tol
        for k, r in report.items() if not k.startswith("_")
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def run_parity(
    world_size: int,
    topologies: list[str],
    mix: str,
    *,
    scale: int = 8,
    seed: int = 0,
    num_heads: int = 4,
    include_unbalanced: bool = True,
    max_text_tokens: int = MAX_TEXT_TOKENS,
    empty_ranks: tuple[int, ...] = (),
    textless_ranks: tuple[int, ...] = (),
    parallelism: ParallelConfig | None = None,
    gpus_per_node: int | None = None,
) -> dict:
    """Run the check; returns {case: {out_rel, loss_rel, grad_rel_max, worst_param, ...}}.
    ``parallelism``: how the ranks parallelize their model (default: not at all);
    ``gpus_per_node``: ranks per node, for a hybrid FSDP mesh."""
    from knapray.distributed import check_heads
    from knapray.config.parallel import ParallelConfig

    cfg = parity_config(num_heads)
    for spec in topologies:
        topo = Topology.parse(spec.removesuffix(OVERLAP), world_size=world_size)  # clear errors before spawning
        check_heads(cfg.num_heads, topo)
    for name, ranks in (("empty_ranks", empty_ranks), ("textless_ranks", textless_ranks)):
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < world_size)]
        if bad:
            raise ValueError(f"{name} {bad} are not ranks of a world of {world_size}")
    from knapray.distributed.parallel_dims import ParallelDims

    pcfg = parallelism or ParallelConfig()
    par = {f.name: getattr(pcfg, f.name) for f in dataclasses.fields(pcfg)}
    if pcfg.fsdp != "none":
        ParallelDims(world_size=world_size, gpus_per_node=gpus_per_node).mesh_shape(pcfg.fsdp)
    batches = _batches(cfg, mix, scale, seed, world_size, max_text_tokens, tuple(empty_ranks), tuple(textless_ranks))
    specs = list(topologies) + ([UNBALANCED] if include_unbalanced else [])

    # The reference: one process, all sequences, plain local attention.
    model = _build_model(cfg, seed)
    full = concat_batches(batches)
    ref_out = model(full)
    ref_loss = flow_loss(ref_out, full.targets, full.x_img.shape[0])
    ref_loss.backward()
    ref_grads = {n: p.grad.detach() for n, p in model.named_parameters()}
    ref_norm = torch.nn.utils.get_total_norm(list(ref_grads.values())).item()

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        spawn_local(_worker, (world_size, free_port(), tmp, specs, mix, scale, seed, dataclasses.asdict(cfg),
                              max_text_tokens, tuple(empty_ranks), tuple(textless_ranks), par, gpus_per_node),
                    world_size)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world_size)]
    lens = [b.seq_lens.tolist() for b in batches]
    n_text = torch.stack([(full.is_text & (full.seq_index == i)).sum() for i in range(full.num_sequences)]) \
        if full.num_sequences else torch.zeros(0, dtype=torch.int64)
    report = {}
    for spec in specs:
        out = torch.cat([per_rank[r][spec]["out"] for r in range(world_size)])
        loss = sum(per_rank[r][spec]["loss"] for r in range(world_size))
        grads = per_rank[0][spec]["grads"]
        rels = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads}
        worst = max(rels, key=rels.get)
        report[spec] = {
            "out_rel": _rel(out, ref_out.detach()),
            "loss_rel": abs(float(loss) - ref_loss.item()) / abs(ref_loss.item()),
            "grad_rel_max": rels[worst],
            "worst_param": worst,
            "grad_norm_rel": max(abs(per_rank[r][spec]["grad_norm"] - ref_norm) for r in range(world_size)) / ref_norm,
            "num_params": len(rels),
            "imbalance": per_rank[0][spec]["imbalance"],
            "baseline_imbalance": per_rank[0][spec]["baseline_imbalance"],
            **_coverage(spec, lens, world_size, n_text.numpy(), cfg),
        }
    report["_meta"] = {
        "world_size": world_size,
        "mix": mix,
        "scale": scale,
        "seed": seed,
        **pcfg.describe(),
        "gpus_per_node": gpus_per_node,
        "recompiles": [per_rank[r]["_recompiles"] for r in range(world_size)],
        "sequences": int(full.num_sequences),
        "tokens": int(full.seq_lens.sum()),
        "seconds": time.perf_counter() - t0,
    }
    return report
