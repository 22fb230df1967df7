"""One rank's part of balanced sampling: the batch's jobs planned over the topology's bags
(``planning.sampling.plan_jobs``, the same plan on every rank), then this rank's bag runs
its jobs' denoising loops, with no other bag in step:

- the bag's first rank (the *lead*) holds its jobs' latents and takes every Euler step;
- each step, the active jobs' passes are one ``BalancePlan`` (``planning.sampling.bag_plan``)
  run by ``balanced_forward`` over the bag: the lead embeds, one all-to-all sends the
  chunks to the bag's ranks, the blocks run with Ulysses over the bag (or, CFG parallel,
  over its halves: conditional passes on one, unconditional on the other), one all-to-all
  brings the velocities home;
- a job leaves the loop after its own steps; the plan of the remaining ones is rebuilt.

A bag of one rank runs the model as ``sample_latents`` does. Every job's result is the
single-process sampler's for the same noise, up to floating-point reassociation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from knapray.models.sampling import DenoiseJob
from knapray.planning import Topology
from knapray.planning import CostModel
from knapray.planning.sampling import COND, SINGLE, UNCOND, JobPlan, bag_plan, cfg_parallel_bag, choose_job_plan, \
    plan_jobs


@dataclass(frozen=True, eq=False)
class SamplingGroups:
    """This rank's process groups for sampling on a topology: its bag's, and its half's
    (CFG parallel). Build with ``SamplingGroups.build`` (collective)."""

    topology: Topology
    rank: int
    bag: int
    whole: dist.ProcessGroup | None
    """The bag's group (None for a bag of one)."""
    half: dist.ProcessGroup | None
    """The group of the rank's half of an even bag (None: halves of one rank, or odd)."""

    @classmethod
    def build(cls, topology: Topology, rank: int, made: dict | None = None) -> "SamplingGroups":
        """Every rank of the world calls it with the same topology: groups are created in
        one order everywhere, also those a rank is not in (``dist.new_group``). ``made``:
        groups created already, by their ranks (several topologies share them)."""
        made = {} if made is None else made

        def group(ranks: list[int]) -> dist.ProcessGroup:
            if tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks)
            return made[tuple(ranks)]

        bag = int(topology.bag_of_rank[rank])
        whole = half = None
        for b in range(topology.num_bags):
            ranks = list(topology.bag_ranks(b))
            g = len(ranks)
            if g > 1:
                made_now = group(ranks)  # created on every rank, kept by the bag's own
                whole = made_now if b == bag else whole
            if g % 2 == 0 and g > 2:
                for part in (ranks[: g // 2], ranks[g // 2:]):
                    made_now = group(part)
                    half = made_now if rank in part else half
        return cls(topology, rank, bag, whole, half)

    @classmethod
    def build_all(cls, specs: list[str], world_size: int, rank: int) -> dict[str, "SamplingGroups"]:
        """The groups of every topology a gang may choose per batch, each set of ranks once."""
        made: dict = {}
        return {spec: cls.build(Topology.parse(spec, world_size=world_size), rank, made) for spec in specs}


def sampling_cost(cfg) -> CostModel:
    """The cost model that chooses a batch's topology: the model's shape (width, blocks,
    heads, attention kind) forward only (no backward, no recomputation), 4 Ulysses
    all-to-alls per layer (6 with cross-attention), the default bandwidths."""
    cross = getattr(cfg, "attention_kind", "joint") == "cross"
    return CostModel(d_model=int(cfg.hidden_size), double_blocks=int(getattr(cfg, "depth_double", 0)),
                     single_blocks=int(getattr(cfg, "depth_single", 0)), num_heads=int(cfg.num_heads),
                     backward_factor=0.0, recompute_passes=0.0, ulysses_a2a_per_layer=6 if cross else 4,
                     attention_kind="cross" if cross else "joint",
                     text_tokens=int(getattr(cfg, "text_pad_to", 0) or 0) if cross else 512)


def batch_plan(cfg, jobs: list[DenoiseJob], specs: list[str], world_size: int,
               max_tokens_per_gpu: int | None = None) -> tuple[str, JobPlan]:
    """(topology, plan) of a batch: the one topology of ``specs``, or the one of least
    predicted makespan under ``sampling_cost(cfg)`` (every rank derives the same)."""
    tokens, steps, passes = [j.tokens for j in jobs], [j.steps for j in jobs], [j.passes for j in jobs]
    topos = [Topology.parse(s, world_size=world_size) for s in specs]
    if len(specs) == 1:
        return specs[0], plan_jobs(tokens, steps, passes, topos[0], None, max_tokens_per_gpu)
    i, plan = choose_job_plan(tokens, steps, passes, topos, sampling_cost(cfg), max_tokens_per_gpu)
    return specs[i], plan


def denoise_rank(model: torch.nn.Module, jobs: list[DenoiseJob], groups: SamplingGroups | dict[str, SamplingGroups],
                 *, cfg_parallel: bool = True, planner=None, max_tokens_per_gpu: int | None = None
                 ) -> dict[int, np.ndarray]:
    """Run the batch ``jobs`` (the same list on every rank of the world) on ``groups``' topology,
    or (several) on the one ``batch_plan`` chooses. Returns the latents (C, T, H, W) of the
    jobs whose bag this rank leads, by job index."""
    if isinstance(groups, dict):
        first = next(iter(groups.values()))
        spec, plan = batch_plan(model.cfg, jobs, list(groups), first.topology.world_size, max_tokens_per_gpu)
        groups = groups[spec]
    else:
        plan = plan_jobs([j.tokens for j in jobs], [j.steps for j in jobs], [j.passes for j in jobs],
                         groups.topology, planner, max_tokens_per_gpu)
    mine = plan.jobs_of(groups.bag).tolist()
    if not mine:
        return {}
    with torch.no_grad():
        return _run_bag(model, jobs, mine, groups, cfg_parallel, planner)


def _run_bag(model, jobs: list[DenoiseJob], mine: list[int], groups: SamplingGroups, cfg_parallel: bool,
             planner) -> dict[int, np.ndarray]:
    from knapray.models import pack_samples
    from knapray.models.packing import unpatchify
    from knapray.worker.balanced import balanced_forward

    topo, rank, bag = groups.topology, groups.rank, groups.bag
    g = int(topo.bag_sizes[bag])
    lead = rank == int(topo.bag_starts[bag])
    cfg = model.cfg
    device = next(model.parameters()).device
    use_halves = cfg_parallel_bag(g, any(jobs[k].passes == 2 for k in mine), cfg_parallel)
    attn_group = (groups.half if use_halves else groups.whole)
    x = {k: _tokens(jobs[k], cfg, device) for k in mine} if lead else {}
    empty = pack_samples([], cfg)
    if getattr(cfg, "guidance_embeds", False):
        empty = replace(empty, guidance=torch.zeros(0))
    empty = empty.to(device)
    steps = max(jobs[k].steps for k in mine)
    base = None
    for i in range(steps):
        active = [k for k in mine if jobs[k].steps > i]
        passes = [(k, COND if jobs[k].passes == 2 else SINGLE) for k in active]
        passes += [(k, UNCOND) for k in active if jobs[k].passes == 2]
        if base is None or base[0] != active:  # the set changed: pack and plan again
            lens = [jobs[k].tokens if kind != UNCOND else jobs[k].image_tokens + jobs[k].unconditional[0].shape[0]
                    for k, kind in passes]
            plan = bag_plan(topo, bag, lens, [kind for _, kind in passes], use_halves, planner) if g > 1 else None
            batch = _pack(jobs, passes, cfg).to(device) if lead else empty
            base = (active, plan, batch)
        _, plan, batch = base
        if lead:
            t = torch.tensor([jobs[k].times[i] for k, _ in passes], dtype=torch.float64, device=device)
            batch = replace(batch, x_img=torch.cat([x[k] for k, _ in passes]), timesteps=t.float())
        if g == 1:
            v = model(batch)
        else:
            v = balanced_forward(model, batch, plan, rank, bag_group=attn_group, route_group=groups.whole)
        if not lead:
            continue
        parts = dict(zip([(k, kind) for k, kind in passes], torch.split(v, [x[k].shape[0] for k, _ in passes])))
        for k in active:
            job = jobs[k]
            vk = parts[(k, COND)] if job.passes == 2 else parts[(k, SINGLE)]
            if job.passes == 2:
                vu = parts[(k, UNCOND)]
                vk = vu + job.cfg_scale * (vk - vu)
            dt = torch.tensor(job.times[i] - job.times[i + 1], dtype=torch.float64).to(x[k].dtype)
            x[k] = x[k] - dt * vk
    out = {}
    for k in mine if lead else ():
        grid = tuple(s // p for s, p in zip(jobs[k].noise.shape[1:], cfg.patch_size))
        out[k] = unpatchify(x[k].cpu(), grid, cfg.patch_size, cfg.in_channels).numpy()
    return out


def _item(job: DenoiseJob, kind: int, latent: torch.Tensor) -> dict:
    text, pooled = (job.text, job.pooled) if kind != UNCOND else job.unconditional
    item = {"latent": latent, "text": torch.as_tensor(text, dtype=torch.float32),
            "pooled": torch.as_tensor(pooled, dtype=torch.float32), "timestep": 1.0}
    if job.guidance_input is not None:
        item["guidance"] = job.guidance_input
    return item


def _tokens(job: DenoiseJob, cfg, device) -> torch.Tensor:
    """The job's noise as image tokens (N, patch_dim), as packing lays them out."""
    from knapray.models import pack_samples

    return pack_samples([_item(job, SINGLE, torch.tensor(job.noise))], cfg).x_img.to(device)


def _pack(jobs: list[DenoiseJob], passes: list[tuple[int, int]], cfg):
    from knapray.models import pack_samples

    return pack_samples([_item(jobs[k], kind, torch.tensor(jobs[k].noise)) for k, kind in passes], cfg)
