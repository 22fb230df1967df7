"""One rank's training step of a run config at full scale, without a GPU (the library of
``knapray dryrun``, ``knapray.commands.dryrun``).

Rank R of an N-rank run in one process, no GPU, no Ray: the model is built on the meta
device, the run's parallelism is applied (FSDP full / hybrid, activation checkpointing,
compile is left out, bag and block groups) over torch's fake process group (every
collective returns at once, as any rank of any world), and one training step runs on fake
tensors (``FakeTensorMode``: shapes, dtypes and devices, no data): routing, Ulysses,
forward, backward, gradient reduction, clipping, AdamW and the EMA, on a packed batch
drawn from a data mix at the run's ``data.max_tokens_per_gpu``, in the run's precision.
``assess`` judges it: the rank's peak memory by category (torch's tracker) against
``knapray memory``'s prediction, the collectives one step issues against what the plan and
the parallelism imply, and the device, dtype and host-sync checks.

Two passes, because the CPU build of torch cannot run everything on a fake CUDA device:
its autograd engine and its DeviceMesh need a real CUDA runtime. The *step* (forward,
backward, optimizer; memory and collectives are measured there) runs on fake **CPU**
tensors; a *device pass* runs the forward of the same plan, unsharded, with one block of
each kind, on fake **CUDA** tensors, where placement and dtype errors of the GPU path show.
Attention is the fused kernel's stand-in: torch's ``varlen_attn`` forward op (its own fake
implementation) and a backward with flash-attn's gradient shapes; it saves what a fused
kernel saves (q, k, v, output, logsumexp). ``F.rms_norm`` (Wan's q and k norms) is CUDA's
fused kernel's stand-in too (``fakes.kernel_rms_norm``): it saves the input and a per-row
rstd, where the CPU's composite keeps fp32 copies of the input's size. A first step on no
tokens (every unit still runs, on zero rows) does FSDP's lazy initialization and creates
AdamW's state; the second, on the batch, is measured: a run's steady state. A run of two experts (``flow.expert_boundary``)
builds both as the trainer does, each sharded on one mesh with its own AdamW state and EMA,
gives each its first step, and measures a step of the first with the second resident beside
it (its parameter shards and AdamW state counted, as every EMA's shadow is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any

import numpy as np
import torch

from knapray.limits import MAX_DRYRUN_PER_STEP_WORLD, MAX_DRYRUN_WORLD
from knapray.testing.fakes import Sample, fake_batch, fake_world, host_batch, kernel_attention, kernel_rms_norm, \
    leave_world, on_device, to_empty

GIB = 2**30
MAX_PEAK_ERROR = 0.10
DEFAULT_MIX = "image+video"


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything checked before the step runs."""

    cfg: Any
    world: int
    rank: int
    gpu_gib: float
    mix: str
    topology: Any
    per_step_node: int | None
    gpus_per_node: int
    dtype: torch.dtype


def check_setup(config: str, overrides: list[str], *, world_size: int | None = None, rank: int = 0,
                gpu_gib: float = 80.0, mix: str | None = None) -> Setup:
    """The run config ``config`` with ``overrides`` (``SECTION.KEY=VALUE``), run as ``rank`` of
    ``world_size`` (default: ``scaling.num_workers``) on GPUs of ``gpu_gib`` GiB with a batch
    drawn from ``mix`` (default ``DEFAULT_MIX``), checked (ValueError naming the value, in the
    command's flags) before anything runs."""
    from knapray.coordinator import BalanceCoordinator
    from knapray.planning.shapes.mix import parse_mix
    from knapray.planning.search.rules import per_step_node
    from knapray.distributed.parallel_dims import ParallelDims
    from knapray.driver.preflight import load_run_config
    from knapray.worker.step_planner import coordinator_config

    cfg = load_run_config(config, overrides)
    world = cfg.scaling.num_workers if world_size is None else world_size
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"--world-size must be an integer >= 1, got {world!r}")
    if world > MAX_DRYRUN_WORLD:
        raise ValueError(f"--world-size {world}: a dry run draws every rank's samples and makes its groups in one "
                         f"process; at most {MAX_DRYRUN_WORLD}")
    if not 0 <= rank < world:
        raise ValueError(f"--rank must be in [0, {world}) for a world of {world}, got {rank}")
    if not (gpu_gib > 0 and math.isfinite(gpu_gib)):
        raise ValueError(f"--gpu-gib must be a finite number > 0, got {gpu_gib!r}")
    mix = mix or DEFAULT_MIX
    parse_mix(mix)
    gpn = cfg.balance.gpus_per_node or min(8, world)
    if cfg.parallel.fsdp != "none":
        ParallelDims(world_size=world, gpus_per_node=gpn).mesh_shape(cfg.parallel.fsdp)
    step_node = per_step_node(cfg.balance.topology, world, cfg.balance.gpus_per_node or None)
    if step_node is not None and world > MAX_DRYRUN_PER_STEP_WORLD:
        raise ValueError(f"--world-size {world}: a dry run of a per-step topology plans every node's block layouts "
                         f"in one process; at most {MAX_DRYRUN_PER_STEP_WORLD} ranks with balance.topology per-step")
    topology = BalanceCoordinator(coordinator_config(cfg, world_size=world)).topology_for(world)
    from knapray.distributed import TopologyDims

    TopologyDims(topology, world, cfg.model.num_heads)
    precision = cfg.parallel.precision
    dtype = torch.float32 if precision == "fp32" or (precision == "auto" and not cfg.scaling.use_gpu) else torch.bfloat16
    return Setup(cfg=cfg, world=world, rank=rank, gpu_gib=gpu_gib, mix=mix, topology=topology,
                 per_step_node=step_node, gpus_per_node=gpn, dtype=dtype)


# ---- the batch ------------------------------------------------------------------------------


def draw_step(mix: str, world: int, budget: int, seed: int) -> list[list[Sample]]:
    """Every rank's samples: rank r draws code ``r % len(codes)`` of the mix (each code
    repeated for its G ranks), B samples per round, with 0..392 text tokens; as many
    rounds as keep the world's tokens within ``budget`` per rank (one round without one)."""
    from knapray.planning.shapes.mix import MAX_TEXT_TOKENS, SPATIAL_TOKEN_STRIDE, parse_mix

    codes = [c for c in parse_mix(mix) for _ in range(c.ranks)]
    per_rank = [codes[r % len(codes)] for r in range(world)]
    mean_round = sum(c.batch * (c.visual_tokens + MAX_TEXT_TOKENS / 2) for c in per_rank)
    rounds = max(1, int(budget * world // mean_round)) if budget else 1
    rng = np.random.default_rng(seed)
    out = []
    for code in per_rank:
        side = code.resolution // SPATIAL_TOKEN_STRIDE
        n = code.batch * rounds
        out.append([Sample(int(t), (code.latent_frames, side, side)) for t in rng.integers(0, MAX_TEXT_TOKENS + 1, n)])
    return out


# ---- autocast ------------------------------------------------------------------------------


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype, enabled: bool):
    """The trainer's autocast; on a fake CUDA device set directly (``torch.autocast("cuda")``
    switches itself off where CUDA is not available)."""
    if not enabled:
        yield
        return
    if device.type == "cuda" and not torch.cuda.is_available():
        prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        try:
            yield
        finally:
            torch.set_autocast_enabled("cuda", prev[0])
            torch.set_autocast_dtype("cuda", prev[1])
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


# ---- the run --------------------------------------------------------------------------------


def _groups(setup: Setup):
    from knapray.distributed import BagGroups
    from knapray.distributed.block_groups import BlockGroups, StepGroups

    heads = setup.cfg.model.num_heads
    base = BagGroups.build(setup.topology, heads)
    blocks = BlockGroups.build(setup.per_step_node, heads, setup.cfg.balance.overlap) \
        if setup.per_step_node is not None else None
    return StepGroups(base, blocks)


@dataclasses.dataclass
class StepResult:
    peak: dict[str, int]
    collectives: list
    watch: Any
    seconds: float
    routed_tokens: int
    routed_text: int
    routed_sequences: int
    error: str | None = None


def run_step(setup: Setup, plan, text_tokens: np.ndarray, batch_host, *, device: torch.device,
             device_pass: bool = False) -> StepResult:
    """One rank's training step under fake tensors on ``device``, twice (memory and
    collectives of the second). ``device_pass``: the placement check instead: unsharded,
    fp32, one block of each kind, once, on a device that is not the host's."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode, UnsupportedOperatorException

    from knapray.coordinator import plan_from_gathered
    from knapray.models.families import build_model, cross_text_pad
    from knapray.models.flow import flow_loss
    from knapray.worker.balanced import balanced_forward, prepare_step, routed_text_mask
    from knapray.worker.ema import build_ema
    from knapray.worker.optim import build_optimizer
    from knapray.distributed.parallel_dims import ParallelDims
    from knapray.config.parallel import sharding_of
    from knapray.worker.parallelize import parallelize

    from .step_watch import HostSync, StepWatch

    cfg = setup.cfg
    model_cfg = cfg.model
    if device_pass:
        model_cfg = dataclasses.replace(model_cfg, depth_double=min(1, model_cfg.depth_double),
                                        depth_single=min(1, model_cfg.depth_single))
    fsdp = "none" if device_pass else sharding_of(cfg.parallel.fsdp, setup.world)
    sharded = fsdp != "none"
    dtype = torch.float32 if device_pass else setup.dtype
    fake_world(setup.rank, setup.world)
    groups = _groups(setup)  # before FSDP's mesh: every rank creates groups in one order
    from knapray.models.families import fp8_base_layers
    from knapray.models.lora import hold_base_in

    applied = dataclasses.replace(cfg.parallel, fsdp=fsdp, activation_checkpointing="none") if device_pass \
        else cfg.parallel.for_world(setup.world)
    # Two experts (flow.expert_boundary) stay resident as the trainer keeps them: the second
    # on the first's mesh (Trainer._build_expert); the step trains the first.
    models, parallels = [], []
    for _ in range(2 if cfg.flow.expert_boundary and not device_pass else 1):
        with torch.device("meta"):
            models.append(build_model(model_cfg))  # the run's family: its blocks, its attentions
        hold_base_in(models[-1], dtype, fp8_base_layers(model_cfg))  # a LoRA run's frozen base, as the trainer holds it
        parallels.append(parallelize(models[-1], applied, ParallelDims(
            world_size=setup.world, device_type=device.type, gpus_per_node=setup.gpus_per_node),
            compute_dtype=dtype, mesh=parallels[0].mesh if parallels else None))
    bag_group, route_group = groups.for_topology(plan.topology)
    routed = routed_text_mask(plan, setup.rank, text_tokens)
    global_img = int(sum(plan.seq_lens) - text_tokens.sum())
    watch = StepWatch(device, dtype)
    result = StepResult(peak={}, collectives=[], watch=watch, seconds=0.0, routed_tokens=int(routed.size),
                        routed_text=int(routed.sum()),
                        routed_sequences=int(np.count_nonzero(plan.chunk_rank == setup.rank)))
    t0 = time.perf_counter()
    # The host side of the step (numpy from the host batch and the plan) runs outside the fake
    # mode, which would turn the host batch's tensors into fakes; its tensors are placed on the
    # device below.
    meta_layout = prepare_step(batch_host, plan, setup.rank, text_tokens, torch.device("meta"), bag_group=bag_group,
                               route_group=route_group, cross_pad=cross_text_pad(model_cfg))
    # A first step on no tokens at all (every rank empty; every unit still runs, on zero rows):
    # FSDP's lazy initialization and first-backward bookkeeping, and AdamW's state, happen
    # there, so the measured step is a run's steady state, and costs no second full step.
    empty_plan = plan_from_gathered([[] for _ in range(setup.world)], plan.topology)
    empty_host = host_batch([], model_cfg)
    empty_text = np.zeros(0, dtype=np.int64)
    empty_layout = prepare_step(empty_host, empty_plan, setup.rank, empty_text, torch.device("meta"),
                                bag_group=bag_group, route_group=route_group, cross_pad=cross_text_pad(model_cfg))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with fake, kernel_attention(watch), kernel_rms_norm():
            trained = []  # (model, parallel, optimizer, ema) of every resident model
            for m, par in zip(models, parallels):
                to_empty(m, device, sharded)
                trained.append((m, par, build_optimizer(m, cfg.optim, fused=cfg.scaling.use_gpu and not device_pass),
                                build_ema(m, cfg.optim)))  # the optimizer as a GPU runs it
            batch = fake_batch(batch_host, device)
            layout = on_device(meta_layout, device)
            autocast = not sharded and dtype != torch.float32
            # every resident model's first step (its AdamW state: an idle expert has trained before), then the measured
            steps = [(t, empty_plan, fake_batch(empty_host, device), on_device(empty_layout, device), 1, False)
                     for t in trained] + [(trained[0], plan, batch, layout, max(global_img, 1), True)]
            for (model, parallel, optimizer, ema), step_plan, step_batch, step_layout, images, measured in steps:
                tracker = _tracker(trained, sharded) if measured and not device_pass else contextlib.nullcontext()
                with tracker, watch:
                    watch.reset_counts()
                    watch.count_syncs = True  # the trainer's timed region: forward + backward
                    with _autocast(device, dtype, autocast):
                        out = balanced_forward(model, step_batch, step_plan, setup.rank, bag_group=bag_group,
                                               route_group=route_group, layout=step_layout)
                        loss = flow_loss(out, step_batch.targets, images)
                    loss.backward()
                    watch.count_syncs = False
                    parallel.reduce_gradients()  # then Trainer._apply_gradients, in its order
                    if cfg.optim.grad_clip > 0:
                        parallel.clip_grad_norm_(cfg.optim.grad_clip)
                    optimizer.step()
                    if ema is not None:
                        ema.update(model)
                    optimizer.zero_grad(set_to_none=True)
                    parallel.after_optimizer_step()
            if not device_pass:
                snap = tracker.get_tracker_snapshot("peak")
                # {device: {category: bytes}}; categories are enums (their value is torch's name)
                result.peak = {getattr(k, "value", k): v for k, v in next(iter(snap.values())).items()} if snap \
                    else {}
    except HostSync as e:
        result.error = f"host sync in the step's timed region: {e}"
    except FakeTensorDeviceMismatchError as e:
        watch.device_violations.append(f"{e} (a tensor made on another device inside the step)")
    except UnsupportedOperatorException as e:
        result.error = f"op without a fake implementation: {e.func}"
    result.seconds = time.perf_counter() - t0
    result.collectives = watch.collectives.rows()
    return result


def _tracker(trained: list, sharded: bool):
    """Torch's tracker of the step of ``trained[0]`` ((model, parallel, optimizer, ema)),
    counting too what every resident model holds all along: an idle expert's parameter
    shards and AdamW state, every EMA's shadow (made before the tracker: untracked
    otherwise; ``FSDPMemTracker.track_external`` is a no-op, so they are registered with the
    tracker's own method, in its categories and one of ours)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _RefType

    class _Held(_RefType):  # beside the tracker's own categories
        EMA = "EMA"

    (model, _, optimizer, _), idle = trained[0], trained[1:]
    if sharded:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

        tracker = FSDPMemTracker(model, optimizer)
        param, opt = _FSDPRefType.SHARDED_PARAM, _FSDPRefType.OPT
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        param, opt = _MemRefType.PARAM, _MemRefType.OPT
    tracker._ref_class = (*tracker._ref_class, *_Held)  # the keys of its per-device snapshot
    whole_peak_only(tracker)
    for m, _, o, _ in idle:
        for p in m.parameters():
            tracker._update_and_maybe_create_winfos(p, param)
        tracker._track_optimizer_states(opt, o)
    for *_, ema in trained:
        for shadow in (ema.shadow.values() if ema is not None else ()):
            tracker._update_and_maybe_create_winfos(shadow, _Held.EMA)
    return tracker


def whole_peak_only(tracker) -> None:
    """Have torch's memory ``tracker`` keep the device's peak only, not each module's: after
    every op it updates the peak of every module it has seen (a walk over all of them, a weak
    reference each), a fifth of a full-width dry run's time (FLUX.1-dev LoRA at 8 ranks:
    84,648 ops, 4.6 million steps of that walk) and most of a sampling phase's, for figures
    no dry run reads (they read ``get_tracker_snapshot("peak")``). The method and the
    attributes it keeps are the same in torch 2.10, 2.11 and 2.13; a torch that names them
    otherwise keeps its own."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    if not all(hasattr(tracker, a) for a in ("_update_peak_stats", "_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
        return

    def update_peak_stats(peak_state) -> None:
        for dev, snap in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                tracker._peak_mem[dev] = snap[_TOTAL_KEY]
                tracker._peak_mem_snap[dev] = deepcopy(snap)

    tracker._update_peak_stats = update_peak_stats


# ---- what the plan implies ------------------------------------------------------------------


def _embedder_units(model_cfg) -> int:
    """FSDP units the model runs before its blocks (``fsdp_units().embedders``: the
    conditioning MLPs, the token embedders; Qwen-Image's txt_norm, FLUX.2's shared
    modulation), built on the meta device: nothing allocated."""
    from knapray.models.families import get_family

    with torch.device("meta"):
        model = get_family(model_cfg.family).model_cls(model_cfg)
    return len(model.fsdp_units().embedders)


def expected_collectives(setup: Setup, plan, depth: tuple[int, int]) -> dict:
    """(kind, group size) -> count of one training step, from the plan and the parallelism."""
    from knapray.distributed.router import RoutePlan
    from knapray.models.families import cross_text_pad
    from knapray.distributed.parallel_dims import ParallelDims
    from knapray.planning.costs.checkpointing import checkpointed_blocks

    cfg, rank = setup.cfg, setup.rank
    exp: dict[tuple[str, int], int] = {}

    def add(kind: str, size: int, n: int) -> None:
        if n and size > 1:
            exp[(kind, size)] = exp.get((kind, size), 0) + n

    topo = plan.topology
    bag = int(topo.bag_of_rank[rank])
    group = topo.group_ranks(int(topo.group_of_bag[bag]))
    rp = RoutePlan.build(plan, rank, tuple(int(r) for r in group))
    # LoRA with adapters in the blocks only: nothing before the blocks trains, so autograd
    # runs no backward through the embedders, the conditioning and their routing
    frozen_front = cfg.model.lora.enabled
    if not rp.local_only:  # route, sequence features, route home; each sent back in backward
        add("alltoall_base_", len(group), 4 if frozen_front else 6)
    g = int(topo.bag_sizes[bag])
    blocks = depth[0] + depth[1]
    recomputed = sum(checkpointed_blocks(cfg.parallel.activation_checkpointing, cfg.parallel.ac_every, blocks))
    # Joint attention: q/k/v there, the output back (2 per block); Wan (cross-attention to its
    # text): self-attention's 2, and image q, text k/v there, the output back (5). Each once
    # in forward, once in backward, once more in a checkpointed block's recompute.
    per_block = 2 if cross_text_pad(cfg.model) is None else 5
    add("alltoall_base_", g, 2 * per_block * blocks + per_block * recomputed)
    if cfg.parallel.fsdp == "none":
        add("allreduce_", setup.world, 1)  # the flat gradient all-reduce
    else:
        (shape, _) = ParallelDims(world_size=setup.world, gpus_per_node=setup.gpus_per_node).mesh_shape(cfg.parallel.fsdp)
        shard, replicate = shape[-1], (shape[0] if len(shape) == 2 else 1)
        # The units before the blocks (the conditioning MLPs, the token embedders; Qwen-Image's
        # txt_norm, FLUX.2's shared modulation): each a unit of the model's own (``fsdp_units``).
        embedders = _embedder_units(cfg.model)
        units = embedders + blocks + 1
        # Every unit gathered in forward and again in backward, but the final layer (kept)
        # and, under LoRA, the embedders (no backward) but the last of them, which FSDP's
        # backward prefetch gathers after the first block's backward all the same; only
        # units that train reduce.
        add("_allgather_base_", shard, 2 * units - 1 - (embedders - 1 if frozen_front else 0))
        add("_reduce_scatter_base_", shard, blocks if frozen_front else units)
        add("allreduce_", replicate, blocks if frozen_front else units)
        if cfg.optim.grad_clip > 0:
            add("allreduce_", shard, 1)  # the sharded gradients' squared norm (distributed.grads.global_grad_norm)
        from knapray.worker.float8 import gathers_in_float8

        if cfg.parallel.fp8 and gathers_in_float8(cfg.parallel.fp8_scaling, True):
            add("all_reduce", shard, 1)  # the next step's float8 scales, every weight's amax at once
    return exp




# ---- the dry run ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The step every rank takes: the world's samples, planned, and this rank's host batch."""

    samples: list[list[Sample]]
    """Every rank's home samples (``draw_step``)."""
    text_tokens: np.ndarray
    """Text tokens of every sample of the world, in the plan's order."""
    plan: Any
    batch: Any
    """This rank's packed batch on the host (``host_batch``)."""
    planned: range
    """The ranks whose balance group was planned: the rank's own group when the topology has
    several (groups plan independently; the others' sequences stay home), else the world."""


def step_inputs(setup: Setup) -> StepInputs:
    """The world's samples drawn from the mix at the run's token budget, and their plan: of
    the rank's own balance group only when there are several (what it computes depends on
    that group alone; planning each of 16,384 groups took 25 s)."""
    from knapray.coordinator import plan_from_gathered
    from knapray.worker.step_planner import planning_model

    cfg = setup.cfg
    budget = cfg.data.max_tokens_per_gpu
    samples = draw_step(setup.mix, setup.world, budget, cfg.data.seed)
    lens = [[s.length for s in rank_samples] for rank_samples in samples]
    text_tokens = np.array([s.text for rank_samples in samples for s in rank_samples], dtype=np.int64)
    topo, planned, groups = setup.topology, range(setup.world), None
    if setup.per_step_node is None and topo.num_groups > 1:
        group = int(topo.group_of_bag[int(topo.bag_of_rank[setup.rank])])
        planned, groups = topo.group_ranks(group), [group]
    plan = plan_from_gathered(lens, topo, planning_model(cfg), cfg.balance.solver, budget or None,
                              setup.per_step_node, groups=groups, overlap=cfg.balance.overlap)
    return StepInputs(samples=samples, text_tokens=text_tokens, plan=plan, batch=host_batch(samples[setup.rank],
                                                                                           cfg.model),
                      planned=planned)


def measure(setup: Setup, inputs: StepInputs) -> tuple[StepResult, StepResult]:
    """The step (fake CPU tensors) and the device pass (meta); the fake world is gone after."""
    try:
        step = run_step(setup, inputs.plan, inputs.text_tokens, inputs.batch, device=torch.device("cpu"))
        device = run_step(setup, inputs.plan, inputs.text_tokens, inputs.batch, device=torch.device("meta"),
                          device_pass=True)
    finally:
        leave_world()
    return step, device


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One kind of collective on groups of one size: measured in one step, and implied."""

    kind: str
    group: int | None
    count: int
    nbytes: int
    expected: int
    measured: bool
    """Issued by the step (False: implied by the plan, never issued)."""

    @property
    def differs(self) -> bool:
        return self.count != self.expected


@dataclasses.dataclass(frozen=True)
class Findings:
    """The dry run judged: memory, collectives, device and dtype checks, and what failed."""

    memory: Any
    """The memory model of the run (``memory_model_for_run``)."""
    predicted: Any
    """Its breakdown at the step's routed tokens (``MemoryBreakdown``)."""
    measured_peak: int
    peak_error: float
    """(predicted - measured) / measured; NaN if nothing was measured."""
    usable: int
    """Bytes of a ``setup.gpu_gib`` GPU the run may use."""
    expected: dict
    """(kind, group size) -> count of one step (``expected_collectives``)."""
    collectives: list[CollectiveRow]
    """The measured kinds in the step's order, then those implied and never issued."""
    device_violations: list[str]
    dtype_violations: list[str]
    syncs: list[str]
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures


def assess(setup: Setup, inputs: StepInputs, step: StepResult, device: StepResult) -> Findings:
    """``step`` and ``device`` (``measure``) against the memory model's prediction (within
    ``MAX_PEAK_ERROR``), the collectives the plan implies, and the device and dtype checks."""
    from knapray.models.families import adapter_counts
    from knapray.planning.costs.memory import memory_model_for_run

    cfg, m = setup.cfg, setup.cfg.model
    mem = memory_model_for_run(cfg, world_size=setup.world, gpus_per_node=setup.gpus_per_node,
                               trainable=adapter_counts(m))
    pred = mem.breakdown(step.routed_tokens, text_tokens=step.routed_text, sequences=step.routed_sequences)
    failures = [f"{what}: {res.error}" for res, what in ((step, "step"), (device, "device pass")) if res.error]
    measured = step.peak.get("Total", 0)
    err = (pred.total - measured) / measured if measured else math.nan
    if not measured:
        failures.append("no memory was measured")
    elif abs(err) > MAX_PEAK_ERROR:
        failures.append(f"predicted peak {pred.total / GIB:.2f} GiB is {err:+.1%} off the measured "
                        f"{measured / GIB:.2f} GiB (more than {MAX_PEAK_ERROR:.0%})")
    expected = expected_collectives(setup, inputs.plan, (m.depth_double, m.depth_single))
    rows = [CollectiveRow(kind, size, count, nbytes, expected.get((kind, size), 0), True)
            for kind, size, count, nbytes in step.collectives]
    seen = {(r.kind, r.group) for r in rows}
    rows += [CollectiveRow(kind, size, 0, 0, want, False) for (kind, size), want in sorted(expected.items())
             if (kind, size) not in seen]
    for r in rows:
        if r.differs:
            failures.append(f"{r.kind} on groups of {r.group}: " + (f"{r.count} per step" if r.measured else "none")
                            + f", the plan implies {r.expected}")
    w = device.watch
    device_violations = w.device_violations + step.watch.device_violations
    dtype_violations = step.watch.dtype_violations + w.dtype_violations
    failures += [f"device: {v}" for v in device_violations]
    failures += [f"dtype: {v}" for v in dtype_violations]
    return Findings(memory=mem, predicted=pred, measured_peak=measured, peak_error=err,
                    usable=mem.usable_bytes(int(setup.gpu_gib * GIB)), expected=expected, collectives=rows,
                    device_violations=device_violations, dtype_violations=dtype_violations,
                    syncs=step.watch.syncs + w.syncs, failures=failures)
