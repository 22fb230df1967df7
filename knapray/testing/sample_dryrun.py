"""One rank of a sampling gang at full scale, without a GPU (the library of ``knapray dryrun
--sample``, ``knapray.commands.dryrun``).

Rank R of an N-rank gang in one process, no GPU, no Ray, over torch's fake process group:
the transformer is built on the meta device and cast there to the compute dtype (bf16, as
``worker.denoise.prepare_model`` holds it), the family's text encoders and VAE are built
from their public configs (``Family.encoders``: transformers / diffusers classes) on the
meta device, and each phase the rank runs is measured on fake tensors (``FakeTensorMode``:
shapes and dtypes, no data) by torch's ``MemTracker``, with exactly what the placement
policy keeps resident then (``knapray.planning.inference.sampling_memory``):

- *encode* (rank 0): the batch's captions through every text encoder at its length;
- *denoise*: one step of the rank's bag, as ``worker.denoise`` takes it: the lead's fp32
  latents and the segment's packed batch on the device, ``balanced_forward`` on the bag's
  ``bag_plan`` with its ``StepLayout`` (Ulysses over the bag or, CFG parallel, its halves),
  then the guided velocities mixed and the fp32 Euler update;
- *decode* (a lead): its largest job's latent, un-normalized, through the VAE, as
  ``corpus.hf.DiffusersVAE.decode`` does.

``assess`` compares each phase's measured peak with the memory model's prediction; more
than ``MAX_PEAK_ERROR`` apart fails. The CPU build of torch cannot index a fake CUDA tensor
(Python indexing needs the CUDA runtime: "not linked with support for cuda devices"), and
fake tensors of the meta device take SDPA's math path (a GPU's fused kernels keep no score
matrix; the VAEs' attention would count one): the phases run on fake **CPU** tensors, as
the training dry run's step does. The transformer is prepared by the engine's own
``worker.denoise.prepare_model`` on the meta device, before its parameters become fakes (torch
will not swap a fake parameter's dtype): bf16 weights, the final layer in fp32, the residual
stream in fp32 with the blocks under autocast (CPU autocast standing in for CUDA's: the same
matrix products in bf16), not compiled. It measures the transformer whole on every rank
(``--shard off``, and ``auto`` where the weights fit); the memory model also counts it sharded
over each bag (``--shard bags``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import torch

from knapray.limits import MAX_DRYRUN_WORLD, MAX_SAMPLE_REQUESTS
from knapray.planning.inference.sampling_memory import (
    ENCODER_POLICIES,
    PHASES,
    Alternative,
    ArchSpec,
    BagStep,
    LM_CLASSES,
    RankRole,
    SampleJob,
    SamplingMemoryModel,
    alternatives,
    bag_steps,
    rank_role,
)
from knapray.planning.shapes.topology import Topology
from knapray.quiet_imports import load_torchao_quietly
from knapray.testing.dryrun import GIB, MAX_PEAK_ERROR, whole_peak_only
from knapray.testing.fakes import fake_batch, fake_world, host_batch, kernel_attention, leave_world, on_device, \
    tensors_in, to_empty, Sample

DEFAULT_SIZE = "1024x1024"
DEFAULT_ENCODERS = "free"
"""``knapray sample``'s: one batch, the encoders freed before the transformer arrives."""
MEASURED_CATEGORIES = {"weights": ("Parameter", "Buffer"), "latents": ("Other",),
                       "working": ("Activation", "Temp", "Gradient", "Optstate")}
"""The tracker's categories as the memory model's: resident weights, inputs made before the
phase (latents, batch, layout: tracked as external tensors), what the phase allocates."""


class DoesNotFit(ValueError):
    """A placement the memory model predicts a GPU cannot hold (refused before anything is built)."""


@dataclasses.dataclass(frozen=True)
class SampleSetup:
    """Everything checked before anything is built."""

    cfg: Any
    world: int
    rank: int
    gpu_gib: float
    topology: Topology
    sizes: list[tuple[int, int]]
    """(width, height) in pixels of every request."""
    frames: int
    """Latent frames (``knapray sample --frames``)."""
    guidance: float
    embedded: bool
    """The model embeds the guidance (FLUX.1-dev): one pass; else guidance > 1 is two."""
    encoders: str
    text_models: tuple[ArchSpec, ...]
    vae: ArchSpec | None
    jobs: list[SampleJob]
    steps: list[BagStep]
    role: RankRole
    roles: list[RankRole]
    """The roles of the gang's ranks that differ (rank 0, the ranks of bags with jobs, an idle rank)."""
    memory: SamplingMemoryModel


def check_sample_setup(config: str, overrides: list[str], *, world_size: int | None = None, rank: int = 0,
                       gpu_gib: float = 80.0, sizes: list[str] | None = None, frames: int = 1,
                       guidance: float | None = None, encoders: str = DEFAULT_ENCODERS,
                       topology: str | None = None) -> SampleSetup:
    """The run config ``config`` with ``overrides`` sampling a request of each of ``sizes`` (WxH
    pixels, default one of ``DEFAULT_SIZE``), ``frames`` latent frames each, at ``guidance``
    (default: the family's, ``knapray sample``'s: FLUX.1-dev's embedded 3.5, FLUX.2's 4.0,
    Qwen-Image's classifier-free 4.0, else 1: none) on
    ``world_size`` ranks (default ``scaling.num_workers``) in bags of ``topology`` (default
    ``knapray sample``'s halving bags), as ``rank``, on GPUs of ``gpu_gib``; the encoders
    per ``encoders``. ValueError naming the flag; ``DoesNotFit`` (a ValueError) when the
    memory model predicts a rank of the gang over the GPU's usable bytes, naming what fits."""
    from knapray.distributed import TopologyDims
    from knapray.driver.preflight import load_run_config
    from knapray.inference.jobs import MAX_GUIDANCE
    from knapray.inference.requests import check_sizes, parse_size
    from knapray.models.families import get_family
    from knapray.planning.inference.sampling import AUTO, halving_topology
    from knapray.planning.inference.sampling_memory import VAEShape

    cfg = load_run_config(config, overrides)
    m = cfg.model
    world = cfg.scaling.num_workers if world_size is None else world_size
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"--world-size must be an integer >= 1, got {world!r}")
    if world > MAX_DRYRUN_WORLD:
        raise ValueError(f"--world-size {world}: a dry run plans the gang's bags and its ranks' roles in one process; "
                         f"at most {MAX_DRYRUN_WORLD}")
    if not 0 <= rank < world:
        raise ValueError(f"--rank must be in [0, {world}) for a world of {world}, got {rank}")
    if not (gpu_gib > 0 and math.isfinite(gpu_gib)):
        raise ValueError(f"--gpu-gib must be a finite number > 0, got {gpu_gib!r}")
    if encoders not in ENCODER_POLICIES:
        raise ValueError(f"--encoders {encoders!r}: one of {', '.join(ENCODER_POLICIES)}")
    family = get_family(m.family)
    text_models, vae = family.encoders.text_models, family.encoders.vae
    if frames < 1 or (frames > 1 and not family.video):
        raise ValueError(f"--frames {frames}: {family.title} samples images (1 frame)" if frames > 1 else
                         f"--frames must be >= 1, got {frames}")
    if len(sizes or ()) > MAX_SAMPLE_REQUESTS:
        raise ValueError(f"{len(sizes)} --size values (one request each); at most {MAX_SAMPLE_REQUESTS}")
    pixels = [parse_size(s) for s in (sizes or [DEFAULT_SIZE])]
    down = VAEShape.of(vae).downsample if vae is not None else 8
    _, ph, pw = m.patch_size
    check_sizes(pixels, frames, down, (ph, pw))
    embedded = bool(getattr(m, "guidance_embeds", False))
    if guidance is None:
        from knapray.inference.prepare import default_guidance

        scale = default_guidance(m)  # the family pipeline's (an embedded input, or classifier-free guidance)
    else:
        scale = guidance
    if not (isinstance(scale, (int, float)) and 0 <= scale <= MAX_GUIDANCE):
        raise ValueError(f"--guidance {scale!r}: a number in [0, {MAX_GUIDANCE:g}]")
    spec = topology or halving_topology(world, m.num_heads)
    if spec == AUTO:
        raise ValueError("--topology auto: the gang chooses bags per batch; give the bags to dry-run, e.g. "
                         f"g{world}n1 or {halving_topology(world, m.num_heads)}")
    try:
        topo = Topology.parse(spec, world_size=world)
        TopologyDims(topo, world, m.num_heads)
    except ValueError as e:
        raise ValueError(f"--topology {spec}: {e}") from None
    text = text_models[0].tokens if text_models else 0
    passes = 1 if embedded or scale == 1.0 else 2
    jobs = [SampleJob(latent=(frames, height // down, width // down), text_tokens=text, passes=passes,
                      image_tokens=frames * (height // (down * ph)) * (width // (down * pw)))
            for width, height in pixels]
    steps = bag_steps(topo, jobs)
    from knapray.models.families import adapter_counts

    adapters = adapter_counts(m)  # a LoRA run's adapters, held beside the base
    memory = SamplingMemoryModel.of(m, text_models, vae, encoders=encoders,
                                    adapter_params=adapters[0] if adapters else 0,
                                    experts=2 if cfg.flow.expert_boundary else 1)
    roles = gang_roles(topo, jobs, steps)
    role = next((r for r in roles if r.rank == rank), None) or rank_role(topo, rank, jobs, steps=steps)
    setup = SampleSetup(cfg=cfg, world=world, rank=rank, gpu_gib=gpu_gib, topology=topo, sizes=pixels,
                        frames=frames, guidance=float(scale), embedded=embedded, encoders=encoders,
                        text_models=text_models, vae=vae, jobs=jobs, steps=steps, role=role, roles=roles,
                        memory=memory)
    refused = refusal(setup)
    if refused:
        raise DoesNotFit(refused)
    return setup


def gang_roles(topology: Topology, jobs: list[SampleJob], steps: list[BagStep]) -> list[RankRole]:
    """The roles of the ranks whose memory differs: rank 0, every rank of a bag with jobs, and
    the first rank of a bag without (an idle rank holds the transformer alone)."""
    ranks = {0}
    busy = {s.bag for s in steps}
    idle = [b for b in range(topology.num_bags) if b not in busy][:1]  # one idle rank stands for all
    for bag in sorted(busy) + idle:
        members = [int(r) for r in topology.bag_ranks(bag)]
        ranks.update(members if bag in busy else members[:1])
    return [rank_role(topology, r, jobs, steps=steps) for r in sorted(ranks)]


def refusal(setup: SampleSetup) -> str | None:
    """One line when a rank of the gang does not fit (``None`` if all do): what it needs, and
    what would fit: another encoders' policy, the transformer sharded over each bag (the
    user's policy first), or a larger GPU."""
    mem, gpu = setup.memory, int(setup.gpu_gib * GIB)
    usable = mem.usable_bytes(gpu)
    peak, worst = max(((mem.breakdown(r).total, r) for r in setup.roles), key=lambda p: p[0])
    if peak <= usable:
        return None
    fits = alternatives(mem, setup.roles, gpu)
    options = []
    for placement in ("replicated", "bag-sharded"):
        mine = sorted((a for a in fits if a.placement == placement), key=lambda a: a.encoders != setup.encoders)
        if mine:
            options.append(_option(mine[0], setup.encoders))
    need = max(mem.gpu_gib_needed(r) for r in setup.roles)
    options.append(f"GPUs of {need:g} GiB as placed")
    return (f"rank {worst.rank} needs {peak / GIB:.2f} GiB at its peak ({mem.breakdown(worst).peak_phase}; the "
            f"transformer whole on every rank, --encoders {setup.encoders}), {usable / GIB:.2f} GiB are usable on "
            f"{setup.gpu_gib:g} GiB GPUs; would fit: " + "; or ".join(options))


def _option(a: Alternative, encoders: str) -> str:
    where = "--encoders " + a.encoders if a.placement == "replicated" else \
        "the gang's --shard bags (the transformer sharded over each bag; modelled, not measured here)" + \
        ("" if a.encoders == encoders else f" with --encoders {a.encoders}")
    return f"{where}: {a.peak / GIB:.2f} GiB"


# ---- the models ------------------------------------------------------------------------------


def build_text_model(spec: ArchSpec) -> torch.nn.Module:
    """A transformers text encoder of ``spec`` on the meta device, in its dtype."""
    load_torchao_quietly()
    import transformers

    cls = getattr(transformers, spec.cls)
    with torch.device("meta"):
        model = cls(cls.config_class(**spec.nested()))
    return model.to(_dtype(spec.dtype)).eval()


def build_vae(spec: ArchSpec) -> torch.nn.Module:
    """A diffusers VAE of ``spec`` on the meta device, in its dtype."""
    load_torchao_quietly()
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, spec.cls)(**spec.values)
    # nn.Module's cast, as from_pretrained(torch_dtype=...) loads it (diffusers' own warns on a cast)
    return torch.nn.Module.to(model, _dtype(spec.dtype)).eval()


def _dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


class _Decode(torch.nn.Module):
    """A VAE's ``decode`` as one module call: MemTracker refuses a module (Wan's decoder, once
    per latent frame) called again at the top level."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z).sample


# ---- measuring ---------------------------------------------------------------------------------


@dataclasses.dataclass
class PhaseMeasured:
    """One phase's peak as torch's tracker saw it."""

    phase: str
    peak: dict[str, int]
    """The tracker's categories at the phase's peak ("Total" among them)."""
    seconds: float

    @property
    def total(self) -> int:
        return int(self.peak.get("Total", 0))

    def category(self, name: str) -> int:
        return sum(int(self.peak.get(k, 0)) for k in MEASURED_CATEGORIES[name])


@dataclasses.dataclass
class SampleMeasured:
    phases: dict[str, PhaseMeasured]
    watch: Any
    seconds: float
    error: str | None = None


def measure(setup: SampleSetup) -> SampleMeasured:
    """Every phase ``setup.role`` runs, each under its own tracker (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedOperatorException

    from knapray.models.families import build_model
    from knapray.testing.step_watch import HostSync, StepWatch
    from knapray.worker.denoise import prepare_model

    role, device = setup.role, torch.device("cpu")
    t0 = time.perf_counter()
    fake_world(setup.rank, setup.world)
    watch = StepWatch(device, torch.bfloat16)
    out = SampleMeasured(phases={}, watch=watch, seconds=0.0)
    try:
        groups = _groups(setup.topology, setup.rank)
        # a run of two experts holds both (the step runs one of them: the first stands for it)
        with torch.device("meta"):
            transformers = [build_model(setup.cfg.model) for _ in range(setup.memory.experts)]
        transformer = transformers[0]
        for t in transformers:
            t.requires_grad_(True)  # a LoRA run's frozen base too: the tracker hooks every parameter
            # the engine's preparation, on the meta device (the parameters become fakes after):
            # weights in bf16 once, the final layer in fp32, the residual stream in fp32 with the
            # blocks under autocast (CPU autocast standing in for CUDA's), not compiled
            prepare_model(t, device, precision="bf16", compile=False)
        encoders = [build_text_model(s) for s in setup.text_models] if role.encodes else []
        vae = build_vae(setup.vae) if role.lead and setup.vae is not None else None
        step = _step_inputs(setup, groups)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake, kernel_attention(watch):
            for module in [*transformers, *encoders] + ([vae] if vae is not None else []):
                to_empty(module, device)
            keep = encoders if setup.encoders == "keep" else []
            held = [vae] if vae is not None else []
            if encoders:
                resident = encoders + held + ([] if setup.encoders == "free" else transformers)
                out.phases["encode"] = _phase("encode", resident, [], lambda: _encode(encoders, role.captions, setup))
            inputs = _on_device(step, setup.jobs, device) if step is not None else None
            out.phases["denoise"] = _phase(
                "denoise", [*transformers, *keep, *held], tensors_in(inputs) if inputs else [],
                (lambda: _denoise(transformer, inputs, setup, watch)) if inputs else None)
            if vae is not None:
                out.phases["decode"] = _phase("decode", [*transformers, *keep, vae], [],
                                              lambda: _decode(vae, setup))
    except HostSync as e:
        out.error = f"host sync in the denoising step: {e}"
    except UnsupportedOperatorException as e:
        out.error = f"op without a fake implementation: {e.func}"
    finally:
        leave_world()
    out.seconds = time.perf_counter() - t0
    return out


def _peak_tracker():
    """torch's ``MemTracker`` keeping the device's peak only (``whole_peak_only``)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    whole_peak_only(tracker)
    return tracker


def _phase(name: str, resident: list, inputs: list, run) -> PhaseMeasured:
    t0 = time.perf_counter()
    tracker = _peak_tracker()
    tracker.track_external(*resident, *inputs)
    with tracker, torch.no_grad():
        if run is not None:
            run()
    snap = tracker.get_tracker_snapshot("peak")
    # {device: {category: bytes}}; categories are enums (their value is torch's name)
    peak = {getattr(k, "value", k): v for k, v in next(iter(snap.values())).items()} if snap else {}
    return PhaseMeasured(name, peak, time.perf_counter() - t0)


def _groups(topology: Topology, rank: int) -> tuple[Any, Any]:
    """(bag group, half group) of ``rank``, every bag's made on every rank in one order, as
    ``worker.denoise.SamplingGroups`` makes them."""
    import torch.distributed as dist

    mine = int(topology.bag_of_rank[rank])
    whole = half = None
    for bag in range(topology.num_bags):
        ranks = [int(r) for r in topology.bag_ranks(bag)]
        g = len(ranks)
        if g > 1:
            group = dist.new_group(ranks)
            whole = group if bag == mine else whole
        if g % 2 == 0 and g > 2:
            for part in (ranks[: g // 2], ranks[g // 2:]):
                group = dist.new_group(part)
                half = group if rank in part else half
    return whole, half


@dataclasses.dataclass
class _StepInputs:
    """One denoising step of the rank's bag: built on the host (the layout on the meta device),
    its tensors made fakes on the device inside the fake mode (``_on_device``)."""

    step: BagStep
    batch: Any
    layout: Any
    whole: Any
    attention: Any
    latents: torch.Tensor | None = None
    """The lead's: every job's image tokens, fp32."""
    passes_in: torch.Tensor | None = None
    """The lead's: the passes' latents (the latents themselves, or a copy where guided rows repeat)."""
    guided_rows: torch.Tensor | None = None
    guided_scale: torch.Tensor | None = None


def _step_inputs(setup: SampleSetup, groups: tuple[Any, Any]) -> _StepInputs | None:
    from knapray.models.families import cross_text_pad
    from knapray.worker.balanced import prepare_step

    m = setup.cfg.model
    step = next((s for s in setup.steps if s.bag == int(setup.topology.bag_of_rank[setup.rank])), None)
    if step is None:
        return None
    whole, half = groups
    attention = half if step.halves else whole
    _, ph, pw = m.patch_size
    grid = {k: (j.latent[0], j.latent[1] // ph, j.latent[2] // pw) for k, j in enumerate(setup.jobs)}
    samples = [Sample(t, grid[k]) for k, t in zip(step.pass_jobs, step.text)] if setup.role.lead else []
    host = host_batch(samples, m, targets=False)
    layout = prepare_step(host, step.plan, setup.rank, np.asarray(step.text, dtype=np.int64), torch.device("meta"),
                          bag_group=attention, route_group=whole, cross_pad=cross_text_pad(m))
    return _StepInputs(step, host, layout, whole, attention)


def _on_device(inputs: _StepInputs, jobs: list[SampleJob], device: torch.device) -> _StepInputs:
    """The step's tensors as fakes on ``device``, and the lead's latents, passes' latents and
    guided rows' indices and scales, as the engine's segment holds them."""
    out = dataclasses.replace(inputs, batch=fake_batch(inputs.batch, device), layout=on_device(inputs.layout, device))
    if not out.batch.x_img.shape[0]:
        return out
    step = inputs.step
    patch = out.batch.x_img.shape[1]
    out.latents = torch.empty(sum(jobs[k].image_tokens for k in step.jobs), patch, dtype=torch.float32, device=device)
    guided = sum(jobs[k].image_tokens for k in step.pass_jobs[len(step.jobs):])
    if guided:
        out.passes_in = torch.empty(out.batch.x_img.shape, dtype=torch.float32, device=device)
        out.guided_rows = torch.empty(guided, dtype=torch.int64, device=device)
        out.guided_scale = torch.empty(guided, 1, dtype=torch.float32, device=device)
    else:
        out.passes_in = out.latents
    return out


def _encode(encoders: list[torch.nn.Module], captions: int, setup: SampleSetup) -> list:
    """Rank 0's captions through every text encoder in turn, each output kept."""
    outs = []
    for model, spec in zip(encoders, setup.text_models):
        ids = torch.zeros(captions, spec.tokens, dtype=torch.int64)
        mask = torch.ones(captions, spec.tokens, dtype=torch.int64)
        if spec.cls in LM_CLASSES:  # a language model's hidden states, every layer's kept, as the pipelines read them
            outs.append(model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False))
        else:
            outs.append(model(input_ids=ids, attention_mask=mask))
    return outs


def _denoise(model: torch.nn.Module, step: _StepInputs, setup: SampleSetup, watch) -> None:
    """One step of the bag as ``worker.denoise`` takes it (``_BagLoop._step``)."""
    from knapray.worker.balanced import balanced_forward

    batch = step.batch
    if step.latents is not None:
        batch = dataclasses.replace(batch, x_img=step.passes_in)
    with watch:
        watch.reset_counts()
        v = balanced_forward(model, batch, step.step.plan, setup.rank, bag_group=step.attention,
                             route_group=step.whole, layout=step.layout)
    if step.latents is None:
        return
    x = step.latents
    v = v.float()
    n = x.shape[0]
    if step.guided_rows is not None:  # v = v_u + s (v_c - v_u) on the guided rows
        from knapray.models.families import get_family
        from knapray.models.sampling import guided

        v_c, v_u = v[:n], v[n:]
        mixed = guided(v_c.index_select(0, step.guided_rows), v_u, step.guided_scale,
                       get_family(model.cfg.family).cfg_renorm)
        v = v_c.index_copy(0, step.guided_rows, mixed)
    torch.addcmul(x, torch.ones(n, 1), v, value=-1.0)


def _decode(vae: torch.nn.Module, setup: SampleSetup) -> None:
    """The lead's largest job's latent from the host, un-normalized, through the VAE."""
    role, spec = setup.role, setup.vae
    b = setup.memory.vae
    frames, h, w = max(role.latents, key=lambda lat: b.decode_bytes(*lat))
    c = b.latent_channels
    z = torch.empty(c, frames, h, w, dtype=torch.float32)
    shape = (1, c, 1, 1, 1) if b.video else (1, c, 1, 1)
    std, shift = torch.ones(shape), torch.zeros(shape)
    z = z[None] if b.video else z.permute(1, 0, 2, 3)  # a video as one clip; an image VAE's frames as a batch
    z = z / 0.5 * std + shift
    _Decode(vae)(z.to(_dtype(spec.dtype)))


# ---- judging -----------------------------------------------------------------------------------


def attention_dtype_violations(watch) -> list[str]:
    """q, k or v not in bf16 at an attention call (``StepWatch.check_attention``'s)."""
    return [v for v in watch.dtype_violations if v.startswith("attention ")]


def fp32_matmuls(watch) -> list[str]:
    """Where matrix products ran outside bf16: the final layer's, fp32 by the engine's choice."""
    return sorted({v.split(" at ", 1)[1] for v in watch.dtype_violations if not v.startswith("attention ")})


@dataclasses.dataclass(frozen=True)
class PhaseRow:
    phase: str
    predicted: Any
    """``PhaseBytes``."""
    measured: PhaseMeasured

    @property
    def error(self) -> float:
        m = self.measured.total
        return (self.predicted.total - m) / m if m else math.nan


@dataclasses.dataclass(frozen=True)
class SampleFindings:
    rows: list[PhaseRow]
    predicted_peak: int
    measured_peak: int
    peak_phase: str
    usable: int
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def peak_error(self) -> float:
        return (self.predicted_peak - self.measured_peak) / self.measured_peak if self.measured_peak else math.nan


def assess(setup: SampleSetup, measured: SampleMeasured) -> SampleFindings:
    """Every phase's measured peak against the memory model's, within ``MAX_PEAK_ERROR``;
    the dtype checks of the denoising step; and the measured peak within the GPU."""
    mem = setup.memory
    predicted = mem.breakdown(setup.role)
    rows, failures = [], []
    if measured.error:
        failures.append(measured.error)
    for phase in PHASES:
        p, got = predicted.phase(phase), measured.phases.get(phase)
        if p is None or got is None:
            if (p is None) != (got is None):
                failures.append(f"{phase}: {'measured' if got else 'predicted'} only")
            continue
        row = PhaseRow(phase, p, got)
        rows.append(row)
        if not got.total:
            failures.append(f"{phase}: nothing was measured")
        elif abs(row.error) > MAX_PEAK_ERROR:
            failures.append(f"{phase}: predicted {p.total / GIB:.2f} GiB is {row.error:+.1%} off the measured "
                            f"{got.total / GIB:.2f} GiB (more than {MAX_PEAK_ERROR:.0%})")
    # the engine keeps the final layer in fp32 (prepare_model): only attention's inputs must be bf16
    failures += [f"dtype: {v}" for v in attention_dtype_violations(measured.watch)]
    usable = mem.usable_bytes(int(setup.gpu_gib * GIB))
    measured_peak = max((r.measured.total for r in rows), default=0)
    if measured_peak > usable:
        failures.append(f"the measured peak {measured_peak / GIB:.2f} GiB is over the {usable / GIB:.2f} GiB usable "
                        f"on {setup.gpu_gib:g} GiB")
    return SampleFindings(rows=rows, predicted_peak=predicted.total, measured_peak=measured_peak,
                          peak_phase=predicted.peak_phase, usable=usable, failures=failures)

