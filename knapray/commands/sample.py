"""``knapray sample``: images (and videos) from a trained run, by rectified-flow Euler steps.

    knapray sample --run runs/NAME --caption "a red bicycle" --caption "a cat" \\
        --size 512x512 --size 768x384 --steps 28 --out bicycles/

Sizes are WIDTHxHEIGHT in pixels. Requests pair captions (then ``--like`` ids) with sizes:
one size for all of them, one per request, or, for a single caption, one request per
size. Every argument is checked against the run (its config, checkpoint and corpus
record) before any weights load.

The model is rebuilt from the run's saved ``config.json`` and loaded from its newest
checkpoint (``--checkpoint`` picks one), with the EMA weights when the checkpoint has
them (``--no-ema`` for the raw ones); a run of two experts (``flow.expert_boundary``, Wan
2.2 A14B's pair) loads both and denoises a step at t >= the boundary (t of the shifted
schedule) with the high-noise one, a step below with the low-noise one, as ``WanPipeline``
switches them. Captions are encoded with the text encoder the corpus records in its
``schema.json`` (a T5/CLIP directory, or the hash stand-in); for a corpus without one,
``--like SAMPLE_ID`` borrows a corpus sample's text embeddings. The requests, each at its
own resolution, are packed into ONE varlen batch (the model's own packed attention), and
every Euler step is one forward pass over all of them:

    x_1 = noise;  x_{t - dt} = x_t - dt * v(x_t, t)      (x_t = (1-t)·x_0 + t·noise)

with ``--guidance g > 1`` adding classifier-free guidance against the corpus's
unconditional embeddings (the empty caption's, knapray/corpus/unconditional.py: what caption
dropout trains with). A FLUX.1-dev run samples with its conventions instead: each
request's own timestep shift from its image tokens (FluxPipeline's ``calculate_shift``),
and ``--guidance`` (default 3.5) is the embedded guidance input, one forward pass per
step, no classifier-free guidance (schnell: no shift, no guidance input). Latents are
decoded with the corpus's VAE when it has one, the stand-in pixel encoder's inverse, or
(synthetic corpora) shown as their first three channels. ``--out FOLDER`` holds each request
at the size it was drawn (``request_0.png``, a clip as ``request_1.mp4``) and ``grid.png``;
``--out FILE.png`` is the grid alone, each request's caption and size over its tile.

A model with a time per token (``model.expand_timesteps``, Wan 2.2 TI2V) samples image to
video with ``--image PATH`` (one for every request, or one per request): the image, resized to
the request's size as ``WanImageToVideoPipeline`` resizes it, is encoded by the corpus's VAE
into the first latent frame, which every Euler step keeps as it is, at time 0 (the other
frames at the step's t), as that pipeline keeps its condition. A Wan 2.1 I2V run (``model.image_dim``)
samples only from an image: resized the same way, it is encoded as ingest encoded its clips'
first frames (``WanI2VConditioning``: a 4-channel mask and the VAE's latent of the image followed
by zero frames, concatenated to the latents at every step; the image encoder's tokens, the
model's image context), with the image encoder the corpus records or ``--image-encoder DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from knapray.inference.conditioning import TEXT_ENCODERS, corpus_records
from knapray.inference.images import GRID_FILE, save_grid, save_requests
from knapray.inference.prepare import default_guidance
from knapray.inference.requests import Request, check_sizes, pair_requests, parse_size
from knapray.driver.trained import read_run
from knapray.limits import MAX_CONDITION_IMAGE_BYTES

# The registry imports this module only for `knapray sample` itself (knapray.models, and
# so torch, comes with it); `knapray --help` and the planning commands never load it.


@dataclass(frozen=True)
class SamplePlan:
    """Everything ``run`` checked before loading weights."""

    cfg: Any
    checkpoint: str
    requests: list[Request]
    device: str = "cpu"
    """``--device`` resolved (``auto``: cuda where there is a GPU), every rank with a GPU of its own."""
    topology: str | None = None
    """The bags of ``--world-size N`` > 1 (default ``planning.inference.sampling.halving_topology``), or
    ``auto`` (chosen for the batch among ``planning.inference.sampling.candidate_topologies``)."""
    folder: str | None = None
    """``--out`` as a folder (each request and the grid), or None: ``--out`` is the grid's file."""
    images: dict[str, bytes] | None = None
    """Every ``--image`` file's bytes, by path (read and decoded once here)."""
    image_encoder: tuple[str, str] | None = None
    """(directory, processor directory) of ``--image-encoder`` (a Wan 2.1 I2V run), checked; None:
    the corpus's record, where the run needs one."""


def plan_sampling(args: argparse.Namespace) -> SamplePlan:
    """Check every argument against the run (config.json, its checkpoint, the corpus's
    record) without loading weights; ValueError naming the first bad value."""
    from knapray.worker.checkpoint import check_checkpoint

    sizes = [parse_size(s) for s in (args.size or ["256x256"])]
    prompts: list[tuple[str | None, int | None]] = [(c, None) for c in (args.caption or [])]
    prompts += [(None, int(i)) for i in (args.like or [])]
    pairs = pair_requests(prompts or [(None, None)], sizes)
    from knapray.commands.flags import gang_device
    from knapray.driver.placement import local_gpus

    device = gang_device(getattr(args, "device", "auto"), getattr(args, "world_size", 1), local_gpus(), "this machine")
    cfg, ckpt = read_run(args.run, args.checkpoint)
    text_rec, _, dims = corpus_records(cfg.data.corpus)
    if args.caption and text_rec.get("class") not in TEXT_ENCODERS:
        raise ValueError(f"the corpus {cfg.data.corpus} records no text encoder knapray can rebuild; "
                         "use --like SAMPLE_ID to borrow a sample's text embeddings")
    down = int(dims.get("vae_downsample", 8))
    _, ph, pw = cfg.model.patch_size
    check_sizes([size for _, size in pairs], args.frames, down, (ph, pw))
    encoder = _image_encoder(args, cfg)
    paths, images = _images(args, cfg, len(pairs), encoder is not None)
    requests = [Request(caption=caption, height=h, width=w, frames=args.frames, like=like, image=path)
                for ((caption, like), (w, h)), path in zip(pairs, paths)]
    topology = _topology(args, cfg)
    folder = out_folder(args.out) if getattr(args, "out", None) else None
    check_checkpoint(ckpt)  # before anything is built from it: a planted file is refused, never run
    return SamplePlan(cfg=cfg, checkpoint=ckpt, requests=requests, device=device, topology=topology, folder=folder,
                      images=images or None, image_encoder=encoder)


def _image_encoder(args: argparse.Namespace, cfg: Any) -> tuple[str, str] | None:
    """``--image-encoder`` (and ``--image-processor``) checked against the run's model (a Wan 2.1
    I2V run's image tokens: their width and count); None where not given. A recorded encoder
    that cannot be read is refused here too, where the run samples from an image."""
    from knapray.inference.conditioning import conditioning_image_encoder

    path, processor = getattr(args, "image_encoder", None), getattr(args, "image_processor", None)
    if path is None and not (getattr(args, "image", None) and getattr(cfg.model, "image_dim", 0)):
        if processor is not None:
            raise ValueError(f"--image-processor {processor}: given without --image-encoder")
        return None
    info = conditioning_image_encoder(cfg.data.corpus, cfg.model, path, processor)
    return None if path is None or info is None else (info.path, info.processor)


def _images(args: argparse.Namespace, cfg: Any, requests: int, encoder: bool = False
            ) -> tuple[list[str | None], dict[str, bytes]]:
    """(each request's ``--image`` path or None, every image's bytes by path): one image for
    every request or one per request, for a model that takes one (``RunRules.check_image``;
    ``encoder``: ``--image-encoder`` given), each file read and decoded here (ValueError naming
    it); a model that needs one (Wan 2.1 I2V) refuses none."""
    from knapray.inference.first_frames import image_pixels
    from knapray.inference.jobs import run_rules

    given = list(getattr(args, "image", None) or [])
    rules = run_rules(cfg, vision_encoder=encoder)
    if not given:
        if rules.condition:
            raise ValueError("--image: this run's model (Wan 2.1 I2V, model.image_dim) samples from a conditioning "
                             "image; give --image PATH (one for every request, or one per request)")
        return [None] * requests, {}
    rules.check_image(args.frames, "--image")
    if len(given) not in (1, requests):
        raise ValueError(f"{len(given)} --image values and {requests} requests: give one --image for all of them, "
                         "or one per request (in the order of --caption, then --like)")
    images: dict[str, bytes] = {}
    for path in dict.fromkeys(given):
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_CONDITION_IMAGE_BYTES:
                    raise ValueError(f"--image {path}: {size} bytes; at most {MAX_CONDITION_IMAGE_BYTES}")
                images[path] = f.read()
        except OSError as e:
            raise ValueError(f"--image {path}: cannot be read ({e.strerror or type(e).__name__})") from None
        image_pixels(images[path], f"--image {path}", 16, 16)  # decodes the whole file: refused now, not later
    return given * requests if len(given) == 1 else given, images


def out_folder(out: str) -> str | None:
    """The folder ``--out`` names, new or empty: a directory, a path ending in ``/``, or a name
    without an extension (``samples``); None for a file name (``grid.png``: the grid alone)."""
    name = out.rstrip("/" + os.sep)
    if not (os.path.isdir(out) or name != out or not os.path.splitext(name)[1]):
        return None
    if os.path.isdir(out):
        if os.listdir(out):
            raise ValueError(f"--out {out}: a folder that is not empty; choose a new or empty one (it receives "
                             f"request_0.png, ... and {GRID_FILE}), or a FILE.png for the grid alone")
    elif os.path.lexists(out):
        raise ValueError(f"--out {out}: a file without an extension; give a folder for every request at full "
                         "resolution, or FILE.png for the grid alone")
    return out


def _topology(args: argparse.Namespace, cfg: Any) -> str | None:
    """``--topology`` checked against ``--world-size`` and the model's heads (None: one process)."""
    world = getattr(args, "world_size", 1)
    shard = getattr(args, "shard", "auto") == "bags"
    if world == 1:
        if getattr(args, "topology", None):
            raise ValueError("--topology: bags need --world-size N > 1")
        if shard:
            raise ValueError("--shard bags: a model is sharded over bags of several ranks; give --world-size N > 1 "
                             "and a --topology of bags of 2 or more")
        return None
    from knapray.commands.flags import check_local_processes
    from knapray.distributed.groups import check_heads
    from knapray.planning import Topology
    from knapray.planning.inference.sampling import candidate_topologies, halving_topology

    check_local_processes(world, "knapray sample")
    spec = args.topology or halving_topology(world, cfg.model.num_heads)
    for one in candidate_topologies(spec, world, cfg.model.num_heads):
        try:
            topo = Topology.parse(one, world_size=world)
            check_heads(cfg.model.num_heads, topo)
        except ValueError as e:
            raise ValueError(f"--topology {one}: {e}") from None
        if shard and (spec == "auto" or min(topo.bags) < 2):
            raise ValueError(f"--shard bags: the model is sharded over each bag, so every bag needs 2 ranks or more "
                             f"and one topology; --topology {spec} has {'several' if spec == 'auto' else 'bags of one'}"
                             f" (e.g. --topology g2n{world // 2})")
    return spec


def run(args: argparse.Namespace) -> dict:
    """The requests drawn by one process (``--world-size 1``) or N local ones, planned over
    bags (``driver.gang.sample_local``: rank 0 encodes the captions together and frees its
    encoder, every rank loads the model in the compute dtype, each bag's lead decodes its
    own requests), then the grid as one process draws it."""
    from knapray.driver.gang import LocalSampling, sample_local
    from knapray.inference.jobs import Job
    from knapray.models.sampling import config_shifts

    plan = plan_sampling(args)  # every argument checked before anything loads
    cfg = plan.cfg
    device = plan.device
    dims = corpus_records(cfg.data.corpus)[2]
    down, pt = int(dims.get("vae_downsample", 8)), cfg.model.patch_size[0]
    jobs = [Job(caption=r.caption, width=r.width, height=r.height, frames=r.frames, steps=args.steps,
                guidance=args.guidance, shift=args.shift, seed=args.seed, like=r.like,
                image=None if r.image is None else plan.images[r.image]) for r in plan.requests]
    world = getattr(args, "world_size", 1)
    image_encoder, image_processor = plan.image_encoder or (None, None)
    what = LocalSampling(run_dir=args.run, checkpoint=args.checkpoint, jobs=jobs, topology=plan.topology or "g1n1",
                         device=device, ema=not args.no_ema, cfg_parallel=not args.no_cfg_parallel,
                         precision=args.precision, compile=True if args.compile else False if args.eager else None,
                         seed=args.seed, max_text_tokens=args.max_text_tokens, step_cache=args.step_cache,
                         shard=args.shard, image_encoder=image_encoder, image_processor=image_processor)
    got = sample_local(what, world)
    _save_latents(args, got.latents)
    titles = [f"{r.caption or (f'like sample {r.like}' if r.like is not None else 'unconditional')}\n"
              f"{r.width}x{r.height}" + (f" from {os.path.basename(r.image)}" if r.image else "")
              for r in plan.requests]
    shapes = [(r.frames * pt, r.height // down, r.width // down) for r in plan.requests]
    if plan.folder is None:
        out, files = save_grid(args.out, got.frames, titles), []
    else:
        names = save_requests(plan.folder, got.frames, titles)
        out, files = os.path.join(plan.folder, GRID_FILE), [os.path.join(plan.folder, n) for n in names]
    report = {"out": out, "files": files, "checkpoint": plan.checkpoint, "ema": got.ema,
              "requests": len(got.frames), "family": cfg.model.family,
              "guidance": args.guidance if args.guidance is not None else default_guidance(cfg.model),
              "shifts": config_shifts(cfg.model, shapes, args.shift, args.steps),
              "shapes": [list(f.shape) for f in got.frames],
              "decoder": _decoder_name(cfg), "recompiles": got.recompiles,
              "expert_boundary": cfg.flow.expert_boundary or None, "images": [r.image for r in plan.requests]}
    if plan.topology is not None:
        report.update(world_size=world, topology=got.topology, bags=got.bags)
    return report


def _decoder_name(cfg) -> str:
    latent_rec = corpus_records(cfg.data.corpus)[1]
    return "DiffusersVAE" if "path" in latent_rec else latent_rec.get("class") or "preview"


def _save_latents(args: argparse.Namespace, latents: list) -> None:
    if args.latents:
        import numpy as np

        np.savez(args.latents, **{f"request_{i}": z for i, z in enumerate(latents)})


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_device, add_json, add_seed, float_in, int_at_least, ranks, step_count, \
        text_tokens

    p.add_argument("--run", required=True, help="run directory (runs/NAME)")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the run's newest)")
    p.add_argument("--no-ema", action="store_true", help="the raw weights, not the EMA ones")
    p.add_argument("--caption", action="append", help="a caption (repeat for several images)")
    p.add_argument("--like", action="append", type=int_at_least(0), metavar="SAMPLE_ID",
                   help="use a corpus sample's text embeddings (corpora without a text encoder)")
    p.add_argument("--size", action="append", metavar="WIDTHxHEIGHT",
                   help="pixels: one for all requests, one per request, or several for one caption (default 256x256)")
    p.add_argument("--frames", type=int_at_least(1), default=1, help="latent frames (videos; default 1)")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="a PNG or JPEG to sample a video from (the image resized to --size): its latent (the "
                   "corpus's VAE) is the first latent frame, kept clean, for a model with model.expand_timesteps "
                   "(Wan 2.2 TI2V); its conditioning channels and image tokens for a model with model.image_dim "
                   "(Wan 2.1 I2V, which needs one); one for every request, or one per request (repeat)")
    p.add_argument("--image-encoder", metavar="DIR",
                   help="Wan 2.1 I2V: the CLIPVisionModel that encodes --image into the model's image tokens "
                   "(default: the one the corpus was ingested with, its schema.json's encoders.image)")
    p.add_argument("--image-processor", metavar="DIR",
                   help="the CLIPImageProcessor of --image-encoder where it is not in its directory (a pipeline's "
                   "image_processor/)")
    p.add_argument("--steps", type=step_count, default=28, help="Euler steps (default 28)")
    p.add_argument("--shift", type=float_in(gt=0), default=None,
                   help="timestep shift, > 1 favours high noise (default: 1; FLUX.1-dev: each request's own from "
                   "its image tokens, as FluxPipeline; Wan: 5, its pipelines' flow_shift at 720p)")
    p.add_argument("--guidance", type=float_in(ge=0), default=None,
                   help="classifier-free guidance scale against the corpus's unconditional embeddings (default 1: "
                   "off); FLUX.1-dev: its embedded guidance input (default 3.5)")
    p.add_argument("--max-text-tokens", type=text_tokens, default=256, help="caption token limit (default 256)")
    add_seed(p)
    add_device(p, help="where the model runs (auto: cuda if present)")
    p.add_argument("--world-size", type=ranks, default=1, metavar="N",
                   help="local processes drawing the requests together, planned over bags (default 1)")
    p.add_argument("--topology", default=None,
                   help="bags of --world-size N (default: halving bags, 4 ranks: g2n1+g1n2), or auto: for each "
                   "batch the candidate of least predicted time, from one rank per bag to one bag of all")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="compute dtype of the model's weights and blocks (auto: bf16 on a GPU, fp32 on the CPU); "
                   "the latents and the Euler update are fp32 always")
    p.add_argument("--compile", action="store_true", help="torch.compile the blocks (default: on a GPU only)")
    p.add_argument("--eager", action="store_true", help="never compile the blocks (not even on a GPU)")
    p.add_argument("--shard", choices=("auto", "off", "bags"), default="auto",
                   help="the transformer whole on every rank, or sharded (FSDP2) over each bag's ranks (auto: sharded "
                   "only where its weights would not fit one GPU; bags need 2 ranks or more)")
    p.add_argument("--step-cache", type=float_in(gt=0), default=None, metavar="THRESHOLD",
                   help="skip the blocks after the first on a step where the first block's residual moved less than "
                   "THRESHOLD (relative) since the last full step, adding the others' residual from then (off by "
                   "default; knapray bench sample prints its speedup and error)")
    p.add_argument("--no-cfg-parallel", action="store_true",
                   help="guided requests run both passes over their whole bag (default: on two halves of an even bag)")
    p.add_argument("--out", default="samples.png",
                   help="a new or empty folder for every request at full resolution (request_0.png, a clip as "
                   ".mp4) and grid.png; or FILE.png for the grid alone (default samples.png)")
    p.add_argument("--latents", metavar="FILE.npz", help="also write every request's latent (C, T, H, W), "
                   "request_0, request_1, ... (before decoding)")
    add_json(p)


def cli(args: argparse.Namespace) -> int:
    """``knapray sample``."""
    print_report(run(args), args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    from knapray.commands.flags import Parser

    p = Parser(prog="knapray sample", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return cli(p.parse_args(argv))


def print_report(report: dict, as_json: bool) -> None:
    sizes = [f"{w}x{h}" for _, h, w, _ in report["shapes"]]  # (frames, height, width, 3) each
    experts = f" (both experts, switched at t = {report['expert_boundary']:g})" if report.get("expert_boundary") else ""
    weights = (f"{'EMA' if report['ema'] else 'raw'} weights of {report['checkpoint']}{experts}, decoded by "
               f"{report['decoder']}")
    if report["files"]:
        each = ", ".join(f"{os.path.basename(f)} {size}" for f, size in zip(report["files"], sizes))
        print(f"wrote {os.path.dirname(report['out'])}: {each} at full resolution, and {GRID_FILE} ({weights})")
    else:
        print(f"wrote {report['out']} ({report['requests']} images: {', '.join(sizes)} pixels; {weights})")
    if as_json:
        print(json.dumps(report))


if __name__ == "__main__":
    raise SystemExit(main())
