"""One rank's part of balanced sampling: the batch's jobs planned over the topology's bags
(``planning.inference.sampling.plan_jobs``, the same plan on every rank), then this rank's bag runs
its jobs' denoising loops, with no other bag in step:

- the bag's first rank (the *lead*) holds its jobs' latents and takes every Euler step;
- each step, the active jobs' passes are one ``BalancePlan`` (``planning.inference.sampling.bag_plan``)
  run by ``balanced_forward`` over the bag: the lead embeds, one all-to-all sends the
  chunks to the bag's ranks, the blocks run with Ulysses over the bag (or, CFG parallel,
  over its halves: conditional passes on one, unconditional on the other), one all-to-all
  brings the velocities home;
- a job leaves the loop after its own steps; the plan of the remaining ones is rebuilt;
- a job with a clean first frame (``DenoiseJob.first_frame``: image to video, Wan 2.2 TI2V)
  starts with it in its latent rows; its passes give that frame time 0 and its rows step 0;
- a job with a conditioning image's channels and tokens (``DenoiseJob.condition``,
  ``image_context``: Wan 2.1 I2V) has its condition's features after its latent rows' on every
  pass (packed once per segment on the device, never stepped) and its image tokens on every pass;
- a run of two experts (``models.sampling.Experts``) runs each step on the expert of its
  jobs' times (both, where the bag's jobs are on both sides of the boundary: each pass's rows
  then take their own expert's velocity); every rank of the bag knows which from the jobs.

A bag of one rank (and one process with no group at all: ``denoise_local``) runs the same
loop over a plan that moves nothing. Every job's result is the single-process sampler's
(``models.sampling.sample_latents``) for the same noise, up to floating-point
reassociation, and in the compute dtype's rounding when that is bf16.

How it runs on a GPU (``prepare_model``): the weights in the compute dtype, held once
(bf16 on CUDA: no fp32 copy), the blocks compiled by the same ``parallelize`` as training,
attention chosen per batch as in training (``knapray.attention.choose_backend``), the
latents and the Euler update in fp32 (TF32 allowed for what stays fp32). The loop is
planned first and executed thinly: every stretch of steps whose active jobs do not change
(a *segment*) gets its plan, its ``StepLayout``, its packed batch on the device and its
timestep and step-size tables once; a step then only slices those tables, runs the model
and updates the latents, so nothing in it reads the device back or builds a tensor on the
host (``step_context`` lets a test watch that).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from knapray.models.sampling import DenoiseJob, experts_of, guided, latent_channels
from knapray.planning import CostModel, Topology
from knapray.planning.inference.sampling import COND, SINGLE, UNCOND, JobPlan, bag_plan, cfg_parallel_bag, choose_job_plan, \
    plan_jobs
from knapray.transfer import host_to_device


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
    host: dist.ProcessGroup | None = None
    """The bag's gloo group where the world's backend is not gloo (NCCL): small host-side
    agreements between steps (a serving bag's stopped jobs); None: ``whole`` serves."""

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
        whole = half = host = None
        gloo = not dist.is_initialized() or dist.get_backend() == "gloo"
        for b in range(topology.num_bags):
            ranks = list(topology.bag_ranks(b))
            g = len(ranks)
            if g > 1:
                made_now = group(ranks)  # created on every rank, kept by the bag's own
                if b == bag:
                    whole = made_now
                if not gloo:
                    key = ("gloo", *ranks)
                    if key not in made:
                        made[key] = dist.new_group(ranks, backend="gloo")
                    if b == bag:
                        host = made[key]
            if g % 2 == 0 and g > 2:
                for part in (ranks[: g // 2], ranks[g // 2:]):
                    made_now = group(part)
                    if rank in part:
                        half = made_now
        return cls(topology, rank, bag, whole, half, host)

    @classmethod
    def build_all(cls, specs: list[str], world_size: int, rank: int) -> dict[str, "SamplingGroups"]:
        """The groups of every topology a gang may choose per batch, each set of ranks once."""
        made: dict = {}
        return {spec: cls.build(Topology.parse(spec, world_size=world_size), rank, made) for spec in specs}

    @classmethod
    def alone(cls) -> "SamplingGroups":
        """One process, no process group: a world of one rank in one bag."""
        return cls(Topology((1,)), rank=0, bag=0, whole=None, half=None)


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


# ---- the model as sampling runs it -----------------------------------------------------------


def prepare_model(model: torch.nn.Module, device: torch.device | str, *, precision: str = "auto",
                  compile: bool | None = None, compile_backend: str = "inductor",
                  shard_group: dist.ProcessGroup | None = None):
    """``model`` (any family's, on any device or on the meta device, fp32 or not) made ready
    to sample on ``device``, in place: its weights in the compute dtype of ``precision``
    (``auto``: bf16 on CUDA, fp32 elsewhere; ``knapray.worker.parallelize.compute_dtype``),
    cast once so a rank holds them once; TF32 allowed on CUDA for what stays fp32 (the Euler
    update's inputs are fp32 already), torch's flash kernels routed to FA3/FA4 where
    installed; the blocks compiled as training compiles them (``compile``: default on CUDA).
    ``shard_group``: FSDP2 over these ranks (a bag's: they run every unit together), for a
    model that does not fit one device; a meta model is then given storage (``to_empty``)
    and its weights by the caller, shard by shard. Returns ``parallelize``'s handle
    (``recompiles`` counts recompilations, ``sharded`` whether FSDP was applied)."""
    from knapray.attention import activate_flash_impl
    from knapray.config.parallel import ParallelConfig
    from knapray.worker.parallelize import compute_dtype, parallelize

    device = torch.device(device)
    dtype = compute_dtype(precision, device)
    if device.type == "cuda" and torch.cuda.is_available():
        device = indexed(device)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        activate_flash_impl(device)
    meta = next(model.parameters()).is_meta
    model.to(dtype=dtype) if meta else model.to(device=device, dtype=dtype)
    model.eval()
    if dtype != torch.float32:
        _bf16_matmuls_fp32_stream(model, device.type, dtype)
    compile = device.type == "cuda" if compile is None else compile
    config = ParallelConfig(compile=compile, compile_backend=compile_backend,
                            fsdp="full" if shard_group is not None else "none")
    mesh = None
    if shard_group is not None:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(shard_group, device.type)
    # The weights are in their dtypes already (the final layer fp32, the rest ``dtype``): FSDP
    # gathers each unit in its own, casting nothing.
    return parallelize(model, config, compute_dtype=torch.float32, mesh=mesh)


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the current CUDA device (torch 2.11's
    ``torch.cuda.set_device`` refuses a device without an index)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _bf16_matmuls_fp32_stream(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Half-precision weights, computed as precisely as their matrix products allow: the
    residual stream in fp32 (the embedders' output widened once), the blocks under autocast
    (every matrix product in ``dtype`` on fp32 activations cast at its input, every sum and
    norm on the fp32 stream), the final layer in fp32 (the velocity leaves the model unrounded,
    into the fp32 Euler update). Measured on the families' blocks (``knapray.testing.sample_truth``):
    a step's velocity as far from float64 as rounding the matrix products' inputs alone puts
    it; all in bf16 it was 2.3x as far (Flux), 1.75x with only the final layer in fp32. The
    final layer is two small products (``hidden x patch`` and the modulation's); the stream
    doubles the bytes of the per-token elementwise work, which compiled blocks fuse."""
    import functools

    model.fsdp_units().final.float()
    embed, blocks = model.embed, model.blocks

    @functools.wraps(embed)
    def embed_fp32(*args, **kwargs):
        return embed(*args, **kwargs).float()

    @functools.wraps(blocks)
    def blocks_mixed(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return blocks(*args, **kwargs)

    model.embed, model.blocks = embed_fp32, blocks_mixed


def warm_up(model: torch.nn.Module, steps: int = 1) -> None:
    """Run the model (each of a run's ``Experts``) on a few made-up requests of different sizes
    (guided and not, with and without text) so that compiled blocks have their graphs before
    the first real batch: shapes are dynamic, so a later mix of sizes reuses them (a recompile
    is counted by ``prepare_model``'s handle)."""
    from knapray.models.sampling import denoise_job

    cfg = model.cfg
    pt, ph, pw = cfg.patch_size
    c, image_dim = latent_channels(cfg), int(getattr(cfg, "image_dim", 0) or 0)
    jobs = []
    for k, (side, text, guidance) in enumerate(((4, 3, 2.0), (6, 0, 1.0), (2, 5, 3.0))):
        noise = np.zeros((c, pt, side * ph, side * pw), np.float32)
        cond = (np.zeros((text, cfg.text_dim), np.float32), np.zeros(cfg.pooled_dim, np.float32))
        condition = np.zeros((cfg.in_channels - c, *noise.shape[1:]), np.float32) if cfg.in_channels > c else None
        image = np.zeros((cfg.image_tokens, image_dim), np.float32) if image_dim else None
        jobs.append(denoise_job(cfg, noise, cond, steps=steps + k % 2, guidance=guidance, shift=1.0,
                                unconditional=None, condition=condition, image_context=image))
    for one in experts_of(model).models:
        denoise_rank(one, jobs, SamplingGroups.alone())


# ---- the denoising loop ------------------------------------------------------------------------


StepContext = Callable[[], contextlib.AbstractContextManager]
"""A context entered around every denoising step's body (``denoise_rank(step_context=...)``)."""


def denoise_local(model: torch.nn.Module, jobs: list[DenoiseJob], **kwargs: Any) -> list[np.ndarray]:
    """Latents (C, T, H, W) of ``jobs`` drawn by this process alone (no process group), in order."""
    got = denoise_rank(model, jobs, SamplingGroups.alone(), cfg_parallel=False, **kwargs)
    return [got[k] for k in range(len(jobs))]


def denoise_rank(model: torch.nn.Module, jobs: list[DenoiseJob], groups: SamplingGroups | dict[str, SamplingGroups],
                 *, cfg_parallel: bool = True, planner=None, max_tokens_per_gpu: int | None = None,
                 on_step: Callable[[int], None] | None = None, step_context: StepContext | None = None,
                 step_cache: float | None = None, stats: dict | None = None) -> dict[int, np.ndarray]:
    """Run the batch ``jobs`` (the same list on every rank of the world) on ``groups``' topology,
    or (several) on the one ``batch_plan`` chooses, with ``model`` (any family's, or a run's
    ``models.sampling.Experts``). Returns the latents (C, T, H, W) of the jobs whose bag this
    rank leads, by job index.

    ``on_step(i)``: called after the bag's step ``i`` (a host int; nothing is read from the
    device for it). ``step_context``: entered around every step's body (a test's watch).
    ``step_cache``: the first-block cache's threshold (``knapray.models.step_cache``; None: off).
    ``stats``: filled with this rank's ``steps``, ``segments`` and, with the cache, its
    ``full_steps`` and ``cached_steps``."""
    if isinstance(groups, dict):
        first = next(iter(groups.values()))
        spec, plan = batch_plan(model.cfg, jobs, list(groups), first.topology.world_size, max_tokens_per_gpu)
        groups = groups[spec]
    else:
        plan = plan_jobs([j.tokens for j in jobs], [j.steps for j in jobs], [j.passes for j in jobs],
                         groups.topology, planner, max_tokens_per_gpu)
    return _run_bag(model, jobs, plan.jobs_of(groups.bag).tolist(), groups, cfg_parallel, planner, on_step,
                    step_context, step_cache, stats)


def denoise_bag(model: torch.nn.Module, jobs: list[DenoiseJob], groups: SamplingGroups, *, cfg_parallel: bool = True,
                on_step: Callable[[int], None] | None = None, step_cache: float | None = None,
                stats: dict | None = None, stop: Callable[[], set[int]] | None = None) -> dict[int, np.ndarray]:
    """Run every job of ``jobs`` on this rank's bag of ``groups`` (a serving gang's block: the
    scheduler chose the bag, every rank of it calls this with the same jobs, no other rank
    does). Returns the latents of the jobs, by index, on the bag's lead (else ``{}``).

    ``stop()``: the jobs (indices) to drop, asked on the lead after every step and agreed on
    by the bag (one small host-side broadcast a step, on the bag's gloo group): a dropped job
    leaves the loop at once, gives no latent, and its bag goes on with the others (or ends).
    ``stats["stopped"]`` lists them."""
    return _run_bag(model, jobs, list(range(len(jobs))), groups, cfg_parallel, None, on_step, None, step_cache,
                    stats, stop)


def _run_bag(model, jobs, mine, groups, cfg_parallel, planner, on_step, step_context, step_cache, stats, stop=None):
    if not mine:
        return {}
    loop = _BagLoop(model, jobs, mine, groups, cfg_parallel, planner, step_cache, stop)
    with torch.no_grad():
        out = loop.run(on_step, step_context)
    if stats is not None:
        stats.update(steps=max(jobs[k].steps for k in mine), segments=len({jobs[k].steps for k in mine}),
                     left_at=dict(loop.left_at), stopped=sorted(loop.stopped))
        if loop.caches:
            stats.update(full_steps=sum(c.full for c in loop.caches), cached_steps=sum(c.cached for c in loop.caches))
    return out


@dataclass(frozen=True, eq=False)
class _Segment:
    """Steps ``[start, stop)`` of a bag whose active jobs do not change: everything its steps
    need, built once on the host and placed on the device."""

    start: int
    stop: int
    active: list[int]
    """Job indices, in the order of their rows in the lead's latents."""
    plan: Any
    """The bag's ``BalancePlan`` for the segment's passes."""
    layout: Any
    """``StepLayout`` of this rank for ``plan``."""
    batch: Any
    """The packed passes on the device (the lead's; the others' is empty)."""
    times: torch.Tensor
    """(S_pass, stop - start) fp32: every pass's timestep at each step (the lead's; empty elsewhere)."""
    first_times: torch.Tensor | None
    """(S_pass, stop - start) fp32: every pass's first-frame time (0 for a job with a clean first
    frame, else its timestep; the lead's, empty elsewhere), or None: a model with one time per sequence."""
    step_size: torch.Tensor
    """(Ni, stop - start) fp32: each latent row's Euler step at every step of the segment."""
    condition: torch.Tensor | None
    """(Ni_pass, in_patch_dim - out_patch_dim) fp32: every pass row's conditioning features, which
    follow its latent's in the model's input (the lead's; None: the model takes the latent alone)."""
    caches: tuple | None
    """The segment's first-block cache of each expert (a residual is its own model's), or None: off."""
    calls: tuple[tuple[int, ...], ...]
    """The experts each step of the segment runs (indices into ``Experts.models``, ascending)."""
    high_rows: dict[int, torch.Tensor]
    """(Ni_pass, 1) bool per step (offset in the segment) that runs both experts: the rows of
    the passes on the high-noise side (the lead's; empty elsewhere)."""
    pass_rows: torch.Tensor | None
    """(Ni_pass,) rows of the latents each pass's image tokens are (None: every pass is a
    job's only or conditional pass, in row order)."""
    guided_rows: torch.Tensor | None
    """(Ng,) latent rows of the guided jobs, whose velocity is combined from two passes."""
    guided_scale: torch.Tensor | None
    """(Ng, 1) fp32 guidance scale of each of those rows."""


class _BagLoop:
    """A bag's denoising loops (see the module docstring): planned segment by segment, run
    step by step."""

    def __init__(self, model, jobs: list[DenoiseJob], mine: list[int], groups: SamplingGroups, cfg_parallel: bool,
                 planner, step_cache: float | None = None, stop: Callable[[], set[int]] | None = None) -> None:
        from knapray.models import pack_samples

        topo, bag = groups.topology, groups.bag
        self.experts = experts_of(model)
        self.jobs, self.mine, self.groups, self.planner = jobs, mine, groups, planner
        self.g = int(topo.bag_sizes[bag])
        self.lead = groups.rank == int(topo.bag_starts[bag])
        self.cfg = self.experts.cfg
        self.renorm = any(jobs[k].cfg_renorm for k in mine)
        """The guided rows rescaled to the conditional prediction's norm (one family: all or none)."""
        self.device = next(self.experts.models[0].parameters()).device
        self.use_halves = cfg_parallel_bag(self.g, any(jobs[k].passes == 2 for k in mine), cfg_parallel)
        self.attn_group = groups.half if self.use_halves else groups.whole
        self.per_token = bool(getattr(self.cfg, "expand_timesteps", False))
        """The model takes a first-frame time per sequence (Wan 2.2 TI2V): a conditioned job's is 0."""
        empty = pack_samples([], self.cfg)
        if getattr(self.cfg, "guidance_embeds", False):
            empty = replace(empty, guidance=torch.zeros(0))
        if self.per_token:
            empty = replace(empty, first_frame_timesteps=torch.zeros(0))
        if getattr(self.cfg, "image_dim", 0):  # a rank with no rows still takes (0, L, image_dim)
            empty = replace(empty, image_context=torch.zeros(0, self.cfg.image_tokens, self.cfg.image_dim))
        self.empty = empty
        self.step_cache = step_cache
        self.stop = stop
        self.stopped: set[int] = set()
        """Jobs dropped by ``stop``."""
        self.left_at: dict[int, float] = {}
        """When (host's monotonic clock) each of the lead's jobs left the loop."""
        self.caches: list = []
        """Every segment's ``StepCache`` (with ``step_cache``): its full and cached steps."""

    def run(self, on_step, step_context) -> dict[int, np.ndarray]:
        jobs, mine = self.jobs, self.mine
        # The lead's latents: every active job's image tokens, job after job, fp32.
        x = torch.cat([_tokens(jobs[k], self.cfg) for k in mine]).to(self.device) if self.lead else None
        rows = {k: n for k, n in zip(mine, (jobs[k].image_tokens for k in mine))}
        done: dict[int, torch.Tensor] = {}
        active = list(mine)
        start = 0
        context = step_context or contextlib.nullcontext
        while active:
            end = min(jobs[k].steps for k in active)
            seg = self._segment(start, end, active, rows)
            i, dropped = start, set()
            while i < end and not dropped:
                with context():
                    x = self._step(seg, i, x)
                if on_step is not None:
                    on_step(i)
                i += 1
                if self.stop is not None:  # between steps: what the bag drops now
                    dropped = self._agreed_stop() & set(active)
            self.stopped |= dropped
            if self.lead:  # jobs that end or stop here leave; the others' rows stay, in order
                keep, offset, kept = [], 0, []
                for k in active:
                    n = rows[k]
                    if k in dropped:
                        pass
                    elif jobs[k].steps == i:
                        done[k] = x.narrow(0, offset, n)
                        self.left_at[k] = time.monotonic()  # queued there; a GPU may still run it
                    else:
                        keep.append(np.arange(offset, offset + n))
                        kept.append(k)
                    offset += n
                if kept:
                    x = x.index_select(0, host_to_device(np.concatenate(keep), self.device, torch.int64))
            active = [k for k in active if jobs[k].steps > i and k not in dropped]
            start = i
        return self._unpack(done) if self.lead else {}

    def _agreed_stop(self) -> set[int]:
        """The lead's ``stop()``, the same on every rank of the bag (host tensors on its gloo group)."""
        if self.g == 1:
            return set(self.stop())
        flags = torch.zeros(len(self.jobs), dtype=torch.uint8)
        if self.lead:
            wanted = [k for k in self.stop() if 0 <= k < len(self.jobs)]
            flags[wanted] = 1
        group = self.groups.host if self.groups.host is not None else self.groups.whole
        dist.broadcast(flags, src=int(self.groups.topology.bag_starts[self.groups.bag]), group=group)
        return set(np.flatnonzero(flags.numpy()).tolist())

    def _segment(self, start: int, stop: int, active: list[int], rows: dict[int, int]) -> _Segment:
        from knapray.models.families import cross_text_pad
        from knapray.worker.balanced import prepare_step

        jobs, cfg = self.jobs, self.cfg
        passes = [(k, COND if jobs[k].passes == 2 else SINGLE) for k in active]
        guided = [k for k in active if jobs[k].passes == 2]
        passes += [(k, UNCOND) for k in guided]
        text = np.array([_text(jobs[k], kind).shape[0] for k, kind in passes], dtype=np.int64)
        lens = [int(t) + jobs[k].image_tokens for t, (k, _) in zip(text, passes)]
        topo = self.groups.topology
        plan = bag_plan(topo, self.groups.bag, lens, [kind for _, kind in passes], self.use_halves, self.planner)
        host = _pack(jobs, passes, cfg) if self.lead else self.empty
        layout = prepare_step(host, plan, self.groups.rank, text, self.device, bag_group=self.attn_group,
                              route_group=self.groups.whole, cross_pad=cross_text_pad(cfg))
        empty = torch.zeros(0, device=self.device)
        caches = None
        if self.step_cache is not None:
            from knapray.models.step_cache import StepCache

            caches = tuple(StepCache(self.step_cache, _bag_sum(self.groups.whole)) for _ in self.experts.models)
            self.caches.extend(caches)
        # Tables, on the host once: every pass's timesteps and expert (every rank: each runs the
        # experts its bag runs), every latent row's step sizes (the lead).
        times = np.array([jobs[k].times[start:stop] for k, _ in passes], dtype=np.float64).reshape(len(passes), -1)
        which = self.experts.expert_at(times)  # (passes, stop - start)
        calls = tuple(tuple(np.unique(which[:, j]).tolist()) for j in range(stop - start))
        if not self.lead:
            return _Segment(start, stop, active, plan, layout, host.to(self.device), empty,
                            empty if self.per_token else None, empty, None, caches, calls, {}, None, None, None)
        rows_pass = host.image_seq_index.numpy()  # (Ni_pass,) pass of each image row
        high_rows = {j: host_to_device((which[:, j] == 0)[rows_pass, None], self.device, torch.bool)
                     for j, used in enumerate(calls) if len(used) > 1}
        counts = [rows[k] for k in active]
        own = np.repeat(np.arange(len(active)), counts)  # (Ni,) job of each latent row
        sizes = np.array([[jobs[k].times[i] - jobs[k].times[i + 1] for i in range(start, stop)] for k in active])
        first = np.cumsum(counts) - counts
        step_size = sizes[own]  # (Ni, stop - start)
        first_times = None
        if self.per_token:
            # A clean first frame is a job's first rows (raster order, a temporal patch of 1): no step, time 0.
            for j, k in enumerate(active):
                if jobs[k].first_frame is not None:
                    step_size[first[j]: first[j] + _frame_tokens(jobs[k], cfg)] = 0.0
            kept = np.array([jobs[k].first_frame is None for k, _ in passes], dtype=np.float64)
            first_times = host_to_device(times * kept[:, None], self.device, torch.float32)
        pass_rows = guided_rows = scale = None
        if guided:
            g_rows = np.concatenate([np.arange(first[active.index(k)], first[active.index(k)] + rows[k])
                                     for k in guided])
            pass_rows = host_to_device(np.concatenate([np.arange(own.size), g_rows]), self.device, torch.int64)
            guided_rows = host_to_device(g_rows, self.device, torch.int64)
            scale = host_to_device(np.repeat([jobs[k].cfg_scale for k in guided], [rows[k] for k in guided])[:, None],
                                   self.device, torch.float32)
        batch = host.to(self.device)
        width = cfg.out_patch_dim
        condition = batch.x_img[:, width:].contiguous() if batch.x_img.shape[1] > width else None
        return _Segment(start, stop, active, plan, layout, batch,
                        host_to_device(times, self.device, torch.float32), first_times,
                        host_to_device(step_size, self.device, torch.float32), condition, caches, calls, high_rows,
                        pass_rows, guided_rows, scale)

    def _step(self, seg: _Segment, i: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """One Euler step of the segment's jobs: device work only."""
        from knapray.worker.balanced import balanced_forward

        batch, j = seg.batch, i - seg.start
        if self.lead:
            x_in = x if seg.pass_rows is None else x.index_select(0, seg.pass_rows)
            if seg.condition is not None:
                x_in = torch.cat((x_in, seg.condition), dim=1)
            batch = replace(batch, x_img=x_in, timesteps=seg.times[:, j],
                            **({} if seg.first_times is None else {"first_frame_timesteps": seg.first_times[:, j]}))
        vs = [balanced_forward(self.experts.models[e], batch, seg.plan, self.groups.rank, bag_group=self.attn_group,
                               route_group=self.groups.whole, layout=seg.layout,
                               cache=None if seg.caches is None else seg.caches[e]) for e in seg.calls[j]]
        if not self.lead:
            return x
        v = vs[0] if len(vs) == 1 else torch.where(seg.high_rows[j], vs[0], vs[1])  # each pass its expert's
        v = v.float()
        n = x.shape[0]
        if seg.guided_rows is not None:  # v = v_u + s (v_c - v_u) on the guided rows
            v_c, v_u = v[:n], v[n:]
            mixed = guided(v_c.index_select(0, seg.guided_rows), v_u, seg.guided_scale, self.renorm)
            v = v_c.index_copy(0, seg.guided_rows, mixed)
        return torch.addcmul(x, seg.step_size[:, i - seg.start: i - seg.start + 1], v, value=-1.0)

    def _unpack(self, done: dict[int, torch.Tensor]) -> dict[int, np.ndarray]:
        from knapray.models.packing import unpatchify

        cfg = self.cfg
        out = {}
        for k in [k for k in self.mine if k in done]:  # stopped jobs give none
            grid = tuple(s // p for s, p in zip(self.jobs[k].noise.shape[1:], cfg.patch_size))
            out[k] = unpatchify(done[k].cpu(), grid, cfg.patch_size, latent_channels(cfg)).numpy()
        return out


def _bag_sum(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The step cache's ``agree``: a sum over the bag (None: a bag of one)."""
    if group is None:
        return None

    def total(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    return total


def _text(job: DenoiseJob, kind: int) -> np.ndarray:
    return job.text if kind != UNCOND else job.unconditional[0]


def _item(job: DenoiseJob, kind: int, latent: torch.Tensor, per_token: bool) -> dict:
    text, pooled = (job.text, job.pooled) if kind != UNCOND else job.unconditional
    # Copies: a job that came through Ray holds read-only arrays (a tensor may not share them).
    item = {"latent": latent, "text": torch.tensor(np.asarray(text), dtype=torch.float32),
            "pooled": torch.tensor(np.asarray(pooled), dtype=torch.float32), "timestep": 1.0}
    if job.guidance_input is not None:
        item["guidance"] = job.guidance_input
    if job.image_context is not None:  # both passes of a guided job: the pipeline's image_embeds on each
        item["image_context"] = torch.tensor(np.asarray(job.image_context), dtype=torch.float32)
    if per_token:  # the step's times are the segment's tables
        item["first_frame_timestep"] = 1.0
    return item


def _tokens(job: DenoiseJob, cfg) -> torch.Tensor:
    """The job's starting latent as image tokens (N, patch_dim) on the host, as packing lays them
    out: its noise, the first frame replaced by its clean one where it has one."""
    from knapray.models.packing import patchify

    latent = torch.tensor(np.asarray(job.noise, dtype=np.float32))
    if job.first_frame is not None:
        latent[:, :1] = torch.tensor(np.asarray(job.first_frame, dtype=np.float32))
    return patchify(latent, cfg.patch_size)[0]


def _frame_tokens(job: DenoiseJob, cfg) -> int:
    """Image tokens of one latent frame of the job (a temporal patch of 1)."""
    _, ph, pw = cfg.patch_size
    return (job.noise.shape[2] // ph) * (job.noise.shape[3] // pw)


def _pack(jobs: list[DenoiseJob], passes: list[tuple[int, int]], cfg):
    """The passes packed on the host (their latents are the loop's: zeros here; a condition's
    channels follow them, as they are)."""
    from knapray.models import pack_samples

    per_token = bool(getattr(cfg, "expand_timesteps", False))
    return pack_samples([_item(jobs[k], kind, _input(jobs[k]), per_token) for k, kind in passes], cfg)


def _input(job: DenoiseJob) -> torch.Tensor:
    """(C_in, T, H, W): zeros for the latent, then the job's condition where it has one."""
    zeros = torch.zeros(job.noise.shape)
    if job.condition is None:
        return zeros
    return torch.cat((zeros, torch.tensor(np.asarray(job.condition, dtype=np.float32))))
