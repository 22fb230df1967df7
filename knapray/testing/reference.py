"""`knapray reference`: a family's model loaded from a checkpoint against the reference
implementation loaded from the same checkpoint (diffusers), on the same random inputs.

Per checkpoint: ``sequences`` random sequences, each of its own resolution and text length
(and timestep, pooled vector, guidance for a model that embeds it, regression target).
The reference runs each sequence as its own batch-of-one call of the diffusers model
(``FluxTransformer2DModel.from_pretrained``) with the pipelines' packing of latents and
ids; knapray runs all of them packed into one varlen batch, single-process, or balanced on
``world_size`` local gloo ranks (sequences dealt round-robin to ranks, planned on
``topology``, routed, Ulysses in bags, routed home; optionally FSDP-sharded), with its
model built on the meta device and streamed from the checkpoint (knapray/weights/load).
Both sides backpropagate the same loss (sum of squared errors over all image tokens /
(tokens · features), knapray's ``flow_loss``). Reported: the largest relative error
(``max|a-b| / max|b|`` per tensor) of the outputs and of the parameter gradients (knapray's
gathered and mapped onto the checkpoint's tensors by the family's layout), and, for the
distributed run, the largest difference between the loaded weights and the file's.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import TYPE_CHECKING, Any

import torch

from knapray.quiet_imports import load_torchao_quietly

if TYPE_CHECKING:
    from knapray.config.parallel import ParallelConfig

DEFAULT_TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One sequence of the check, as knapray packs it (latent (C, 1, H, W), text (L, text_dim))."""

    latent: torch.Tensor
    text: torch.Tensor
    pooled: torch.Tensor
    timestep: float
    guidance: float | None
    target: torch.Tensor
    """(H/2 · W/2, 4·C_out): the regression target of its image tokens, raster order."""
    image_context: torch.Tensor | None = None
    """(L, image_dim): its conditioning image's tokens, for a model that takes them (Wan I2V)."""
    first_frame_timestep: float | None = None
    """Its first latent frame's time, for a model with per-token times (Wan 2.2 TI2V)."""


SIZES = ((4, 4), (6, 8), (8, 6), (2, 10), (10, 4), (6, 6))
"""Latent (H, W) of the sequences, cycled: several resolutions and aspect ratios."""
TEXT_LENS = (5, 1, 12, 0, 8, 3)
"""Text tokens of the sequences, cycled (one without text)."""


VIDEO_GRIDS = ((1, 2, 2), (2, 3, 2), (3, 2, 3), (2, 1, 4), (1, 4, 3), (2, 2, 2))
"""A family whose latents have frames (``Family.video``: Wan): patch grids (frames, rows,
columns) of the sequences, cycled (latent = grid x patch)."""
CROSS_TEXT_LENS = (5, 1, 12, 3, 8, 2)
"""A family that cross-attends to its text (Wan): text tokens of the sequences, cycled (at
least one: the reference compares the bare model call, whose cross-attention over no keys
is undefined; with the model's ``text_pad_to`` both sides would pad, as Wan's pipeline pads
to 512)."""


def make_inputs(cfg: Any, sequences: int, seed: int) -> list[Inputs]:
    """``sequences`` random sequences for a model config (knapray field names), shaped as
    its family's reference takes them: clips or images, a pooled vector or none."""
    from knapray.models.families import get_family

    fam = get_family(cfg.family)
    text_lens = CROSS_TEXT_LENS if cfg.attention_kind == "cross" or fam.reference_needs_text else TEXT_LENS
    if fam.video:
        return _clip_inputs(cfg, sequences, seed, text_lens)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(sequences):
        h, w = SIZES[i % len(SIZES)]
        n_txt = text_lens[i % len(text_lens)]
        guidance = 1.0 + 4.0 * float(torch.rand((), generator=gen)) if getattr(cfg, "guidance_embeds", False) else None
        out.append(Inputs(
            latent=torch.randn(cfg.in_channels, 1, h, w, generator=gen),
            text=torch.randn(n_txt, cfg.text_dim, generator=gen),
            pooled=torch.randn(cfg.pooled_dim, generator=gen),
            timestep=float(torch.rand((), generator=gen)),
            guidance=guidance,
            target=torch.randn((h // 2) * (w // 2), cfg.out_patch_dim, generator=gen),
        ))
    return out


def _clip_inputs(cfg: Any, sequences: int, seed: int, text_lens: tuple[int, ...]) -> list[Inputs]:
    """Clips of ``VIDEO_GRIDS``, no pooled vector or guidance (Wan's); an image context for a
    model with ``image_dim``; with ``expand_timesteps``, every other sequence conditioned
    (its first frame at time 0), the others not (their first frame at their time)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(sequences):
        grid = VIDEO_GRIDS[i % len(VIDEO_GRIDS)]
        shape = tuple(g * p for g, p in zip(grid, cfg.patch_size))
        timestep = float(torch.rand((), generator=gen))
        image_dim = getattr(cfg, "image_dim", 0)
        out.append(Inputs(
            latent=torch.randn(cfg.in_channels, *shape, generator=gen),
            text=torch.randn(text_lens[i % len(text_lens)], cfg.text_dim, generator=gen),
            pooled=torch.zeros(0), timestep=timestep, guidance=None,
            target=torch.randn(grid[0] * grid[1] * grid[2], cfg.out_patch_dim, generator=gen),
            image_context=torch.randn(cfg.image_tokens, image_dim, generator=gen) if image_dim else None,
            first_frame_timestep=(0.0 if i % 2 == 0 else timestep) if getattr(cfg, "expand_timesteps", False) else None,
        ))
    return out


def _pack(cfg: Any, inputs: list[Inputs]):
    """knapray's packed batch of ``inputs`` (x_img the latents' patches, targets set). No
    inputs (a rank without sequences): an empty batch with the per-sequence fields the
    model conditions on, without rows (its ``condition`` still runs every embedder)."""
    from knapray.models import pack_samples

    optional = ("guidance", "image_context", "first_frame_timestep")
    items = [{"latent": s.latent, "text": s.text, "pooled": s.pooled, "timestep": s.timestep,
              **{name: getattr(s, name) for name in optional if getattr(s, name) is not None}} for s in inputs]
    batch = pack_samples(items, cfg)
    targets = torch.cat([s.target for s in inputs]) if inputs else torch.zeros(0, cfg.out_patch_dim)
    empty = {}
    if not inputs:
        if getattr(cfg, "guidance_embeds", False):
            empty["guidance"] = torch.zeros(0)
        if getattr(cfg, "image_dim", 0):
            empty["image_context"] = torch.zeros(0, cfg.image_tokens, cfg.image_dim)
        if getattr(cfg, "expand_timesteps", False):
            empty["first_frame_timesteps"] = torch.zeros(0)
    return dataclasses.replace(batch, targets=targets, **empty)


# ---- the reference side (diffusers) ---------------------------------------------------------


def diffusers_call(ref, cfg: Any, s: Inputs) -> torch.Tensor:
    """One sequence through diffusers' model ``ref`` of ``cfg``'s family, as the family's
    pipeline calls it (``Family.diffusers_call``) -> its output as knapray's image tokens."""
    from knapray.models.families import get_family

    return get_family(cfg.family).diffusers_call(ref, cfg, s)


def diffusers_reference(path: str, inputs: list[Inputs], cfg: Any = None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """(outputs per sequence, gradient per checkpoint tensor) of diffusers' model at
    ``path`` (fp32), every sequence its own call, the loss summed over them. ``cfg``: the
    model config the inputs were made for (None: the checkpoint's, ``reference_config``)."""
    load_torchao_quietly()
    import diffusers

    from knapray.models.families import get_family

    if cfg is None:
        from knapray.weights.checks import checkpoint_family
        from knapray.weights.source import open_pretrained

        source = open_pretrained(path)
        cfg = reference_config(source, checkpoint_family(source, None))
    fam = get_family(cfg.family)
    if os.path.isfile(os.path.join(path, "model_index.json")):  # a pipeline folder: its transformer
        path = os.path.join(path, "transformer")
    ref = getattr(diffusers, fam.diffusers_class).from_pretrained(path, torch_dtype=torch.float32)
    total = sum(s.target.numel() for s in inputs)
    outs = []
    for s in inputs:
        out = fam.diffusers_call(ref, cfg, s)
        ((out - s.target).pow(2).sum() / total).backward()
        outs.append(out.detach())
    # A tensor the outputs do not depend on has no gradient in diffusers' model (Qwen-Image's
    # last block's text stream: its text tokens are never output); its gradient is zero, and
    # knapray's must be too.
    return outs, {k: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                  for k, p in ref.named_parameters()}


# ---- the knapray side ---------------------------------------------------------------------


def reference_config(source: Any, family: str) -> Any:
    """The model config the reference compares: the checkpoint's, with the family's
    ``reference_overrides`` (Wan T2V: without the text padding its pipeline adds, ``text_pad_to``
    0: the reference is the model's own call, which takes the text as given; the padding is
    tests/dist/test_wan.py's float64 check. Wan I2V: padded to 512, as diffusers' model needs)."""
    from knapray.models.families import config_class, get_family
    from knapray.weights.checks import section_values

    values = section_values(source, family)
    extra = dict(get_family(family).reference_overrides(values))
    return config_class(family)(**values, pretrained=source.path, **extra)


def load_model(path: str, family: str | None, device: str = "cpu", *, parallel: ParallelConfig | None = None,
               world_size: int = 1):
    """(model, cfg, ParallelModel or None, LoadReport): the family's model built on the meta
    device from the checkpoint's config, parallelized if asked, allocated, loaded."""
    from knapray.models.families import build_model
    from knapray.weights.checks import checkpoint_family
    from knapray.weights.load import load_pretrained
    from knapray.weights.source import open_pretrained

    source = open_pretrained(path)
    cfg = reference_config(source, checkpoint_family(source, family))
    with torch.device("meta"):
        model = build_model(cfg)
    par = None
    if parallel is not None:
        from knapray.distributed.parallel_dims import ParallelDims
        from knapray.worker.parallelize import parallelize

        par = parallelize(model, parallel, ParallelDims(world_size=world_size, device_type=torch.device(device).type))
    model.to_empty(device=device)
    report = load_pretrained(model, cfg)
    return model, cfg, par, report


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _grads_as_checkpoint(cfg: Any, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """knapray's parameter gradients cut into the checkpoint's tensors (the diffusers layout)."""
    from knapray.models.families import checkpoint_layout

    layout = checkpoint_layout(cfg, "diffusers")
    out = {k: torch.zeros(shape) for k, shape in layout.shapes.items()}
    for p in layout.pieces:
        out[p.key][p.src : p.src + p.rows] = grads[p.param][p.dst : p.dst + p.rows]
    return out


def compare(cfg: Any, outs: list[torch.Tensor], grads: dict[str, torch.Tensor],
            ref_outs: list[torch.Tensor], ref_grads: dict[str, torch.Tensor]) -> dict:
    """Largest relative errors of outputs (per sequence) and gradients (per checkpoint tensor)."""
    mapped = _grads_as_checkpoint(cfg, grads)
    out_rels = [_rel(a, b) for a, b in zip(outs, ref_outs)]
    grad_rels = {k: _rel(mapped[k], g) for k, g in ref_grads.items()}
    missing = sorted(set(mapped) - set(ref_grads))
    if missing:
        raise ValueError(f"diffusers' model has no gradient for {missing[0]!r}")
    worst = max(grad_rels, key=grad_rels.get)
    return {"out_rel": max(out_rels), "grad_rel": grad_rels[worst], "worst_grad": worst,
            "out_rel_per_sequence": out_rels, "num_grads": len(grad_rels)}


def _split(batch_out: torch.Tensor, inputs: list[Inputs]) -> list[torch.Tensor]:
    sizes = [s.target.shape[0] for s in inputs]
    return list(batch_out.split(sizes))


def single_process(path: str, family: str | None, inputs_seed: int, sequences: int) -> tuple[Any, list, dict]:
    """(cfg, outputs per sequence, gradients) of knapray's model in one process."""
    from knapray.models.flow import flow_loss

    model, cfg, _, _ = load_model(path, family)
    inputs = make_inputs(cfg, sequences, inputs_seed)
    batch = _pack(cfg, inputs)
    out = model(batch)
    flow_loss(out, batch.targets, batch.x_img.shape[0]).backward()
    return cfg, _split(out.detach(), inputs), {n: p.grad.detach() for n, p in model.named_parameters()}


def balanced_results(rank: int, world: int, paths: list[str], family: str | None, topology: str, seed: int,
                     sequences: int, parallel: ParallelConfig) -> dict:
    """This rank's side of the balanced check, in an initialized process group of
    ``world`` ranks (every rank calls it with the same arguments): per checkpoint, its
    outputs, the summed gradients (rank 0), how far its loaded rows are from the file's,
    and what it read. ``summarize_balanced`` turns every rank's into the report."""
    from safetensors import safe_open

    from knapray.distributed import BagGroups
    from knapray.models.families import checkpoint_layout
    from knapray.models.flow import flow_loss
    from knapray.planning import Topology, WorkloadModel, plan_balance
    from knapray.worker.balanced import balanced_forward
    from knapray.distributed.param_rows import shard_rows
    from knapray.weights.source import open_pretrained

    results = {}
    for i, path in enumerate(paths):
        model, cfg, par, report = load_model(path, family, parallel=parallel, world_size=world)
        # The loaded local rows against the file's, before anything else touches them.
        source, weights_diff = open_pretrained(path), 0.0
        params = dict(model.named_parameters())
        for p in checkpoint_layout(cfg, source.layout).pieces:
            local, start, rows = shard_rows(params[p.param])
            lo, hi = max(p.dst, start), min(p.dst + p.rows, start + rows)
            if lo < hi:
                with safe_open(source.tensors[p.key].file, framework="pt") as f:
                    want = f.get_slice(source.tensors[p.key].name)[p.src + lo - p.dst : p.src + hi - p.dst]
                weights_diff = max(weights_diff, (local[lo - start : hi - start] - want.float()).abs().max().item())
        inputs = make_inputs(cfg, sequences, seed + i)
        batch = _pack(cfg, inputs[rank::world])
        lens = [[int(n) for n in _pack(cfg, inputs[r::world]).seq_lens] for r in range(world)]
        topo = Topology.parse(topology, world_size=world)
        groups = BagGroups.build(topo, cfg.num_heads)
        plan = plan_balance(lens, topo, WorkloadModel(d_model=cfg.hidden_size))
        out = balanced_forward(model, batch, plan, rank, bag_group=groups.bag_group, route_group=groups.balance_group)
        global_tokens = sum(s.target.shape[0] for s in inputs)
        flow_loss(out, batch.targets, global_tokens).backward()
        par.reduce_gradients()
        grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()}  # collective
        results[path] = {"out": out.detach(), "grads": grads if rank == 0 else None, "weights_diff": weights_diff,
                         "bytes_read": report.bytes_read, "checkpoint_bytes": report.checkpoint_bytes,
                         "peak_host_bytes": report.peak_host_bytes, "imbalance": plan.imbalance,
                         "baseline_imbalance": plan.baseline_imbalance}
    return results


def _worker(rank: int, world: int, port: int, out_dir: str, *args: Any) -> None:
    import torch.distributed as dist

    from knapray.distributed.local import init_local_gloo

    init_local_gloo(rank, world, port, timeout_s=120)
    try:
        torch.save(balanced_results(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def summarize_balanced(paths: list[str], per_rank: list[dict], *, family: str | None, seed: int,
                       sequences: int) -> dict:
    """{path: {out_rel, grad_rel, weights_diff, ...}} from every rank's ``balanced_results``,
    against diffusers' model run here, sequence by sequence."""
    from knapray.weights.checks import checkpoint_family
    from knapray.weights.source import open_pretrained

    world = len(per_rank)
    report = {}
    for i, path in enumerate(paths):
        source = open_pretrained(path)
        cfg = reference_config(source, checkpoint_family(source, family))
        inputs = make_inputs(cfg, sequences, seed + i)
        outs: list[torch.Tensor | None] = [None] * sequences
        for r in range(world):
            mine = list(range(r, sequences, world))
            for j, piece in zip(mine, _split(per_rank[r][path]["out"], [inputs[j] for j in mine])):
                outs[j] = piece
        ref_outs, ref_grads = diffusers_reference(path, inputs, cfg)
        res = compare(cfg, outs, per_rank[0][path]["grads"], ref_outs, ref_grads)
        res.update(
            weights_diff=max(per_rank[r][path]["weights_diff"] for r in range(world)),
            bytes_read_per_rank=[per_rank[r][path]["bytes_read"] for r in range(world)],
            checkpoint_bytes=per_rank[0][path]["checkpoint_bytes"],
            peak_host_bytes_per_rank=[per_rank[r][path]["peak_host_bytes"] for r in range(world)],
            imbalance=per_rank[0][path]["imbalance"], baseline_imbalance=per_rank[0][path]["baseline_imbalance"],
        )
        report[path] = res
    return report


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _parallel(fsdp: str) -> ParallelConfig:
    from knapray.config.parallel import ParallelConfig

    return ParallelConfig(fsdp=fsdp)


def run_reference(paths: list[str], *, family: str | None = None, world_size: int = 1, topology: str | None = None,
                  seed: int = 0, sequences: int = 4, fsdp: str = "none") -> dict:
    """The check for every checkpoint in ``paths``: {path: {out_rel, grad_rel, ...}} plus
    ``_meta``. ValueError (one line) for a checkpoint, family or topology that cannot run."""
    from knapray.distributed import check_heads
    from knapray.distributed.local import free_port, spawn_local
    from knapray.planning import Topology
    from knapray.weights.checks import check_tensors, checkpoint_family
    from knapray.weights.source import open_pretrained

    if sequences < 1:
        raise ValueError(f"sequences must be >= 1, got {sequences}")
    try:
        load_torchao_quietly()
        import diffusers  # noqa: F401 - the reference implementation
    except ImportError:
        raise ValueError("knapray reference runs diffusers' model: pip install 'knapray[encoders]'") from None
    if world_size > 1 and not topology:
        raise ValueError(f"--world-size {world_size}: give the bags with --topology (e.g. g1n2+g2n1 for 4 ranks)")
    if world_size == 1 and (topology or fsdp != "none"):
        raise ValueError("--topology and --fsdp apply to a balanced run: give --world-size N > 1 with them")
    cfgs = {}
    for path in paths:  # every checkpoint checked, from headers, before any process starts
        source = open_pretrained(path)
        fam = checkpoint_family(source, family)
        if source.layout != "diffusers":
            raise ValueError(f"{source.path}: the reference model loads diffusers' layout; this is a "
                             f"{source.layout} file (knapray reads it, diffusers' from_pretrained does not)")
        cfg = reference_config(source, fam)
        check_tensors(source, cfg)
        if world_size > 1:
            check_heads(cfg.num_heads, Topology.parse(topology, world_size=world_size))
        cfgs[path] = cfg
    t0 = time.perf_counter()
    report: dict[str, Any] = {}
    if world_size == 1:
        for i, path in enumerate(paths):
            cfg, outs, grads = single_process(path, family, seed + i, sequences)
            ref_outs, ref_grads = diffusers_reference(path, make_inputs(cfg, sequences, seed + i), cfg)
            report[path] = compare(cfg, outs, grads, ref_outs, ref_grads)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            spawn_local(_worker, (world_size, free_port(), tmp, list(paths), family, topology, seed, sequences,
                                  _parallel(fsdp)), world_size)
            per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(world_size)]
        report.update(summarize_balanced(list(paths), per_rank, family=family, seed=seed, sequences=sequences))
    for path, cfg in cfgs.items():
        report[path].update(family=cfg.family, heads=cfg.num_heads, hidden=cfg.hidden_size,
                            depth=[cfg.depth_double, cfg.depth_single], rope_axes=list(cfg.rope_axes_dim),
                            guidance=bool(getattr(cfg, "guidance_embeds", False)))
    report["_meta"] = {"world_size": world_size, "topology": topology, "fsdp": fsdp, "seed": seed,
                       "sequences": sequences, "seconds": time.perf_counter() - t0}
    return report


def passed(report: dict, tol: float = DEFAULT_TOL) -> bool:
    return all(max(r["out_rel"], r["grad_rel"], r.get("weights_diff", 0.0)) <= tol
               for k, r in report.items() if not k.startswith("_"))
