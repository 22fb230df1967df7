"""Sampling speed, measured side by side in one process: ``knapray bench sample`` (a CPU
size: fp32 eager against bf16 compiled, and the step cache) and the sampling section of
``make gpu-bench`` (a FLUX.1-dev-shaped model at 1024², 28 steps: knapray beside diffusers'
``FluxTransformer2DModel`` with the same weights, eager and compiled).

Every figure is a median over repeats of a whole denoising loop after one untimed run (the
compile and the warm-up are timed apart and reported as such), ended by reading the latents
back (so a GPU's queued work is inside the time). Text encoding and VAE decoding are left
out on both sides: the transformer loop is what is compared.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import numpy as np
import torch

from knapray.models.flops import formula, model_flops
from knapray.quiet_imports import load_torchao_quietly

CPU_SHAPE = {"hidden": 256, "heads": 4, "double": 2, "single": 4, "side": 256, "text": 64, "steps": 8}
"""``knapray bench sample``'s default: a Flux-shaped model a CPU runs in seconds, one 256²
request (256 image + 64 text tokens)."""
FLUX_DEV = {"hidden": 3072, "heads": 24, "double": 19, "single": 38, "side": 1024, "text": 512, "steps": 28}
"""FLUX.1-dev's shape at 1024² (4,096 image + 512 text tokens), 28 steps: the GPU section."""


def flux_config(hidden: int, heads: int, double: int, single: int, *, in_channels: int = 16, text_dim: int | None = None,
                pooled_dim: int = 768):
    """A FLUX.1-dev-shaped config (guidance embedded) of the given size; FLUX.1's widths for
    the text (4096) scaled with ``hidden`` below it."""
    from knapray.models.families.flux import FluxConfig

    head_dim = hidden // heads
    side = (head_dim * 7 // 16) // 2 * 2  # FLUX.1's 16/56/56 of 128 channels, scaled
    return FluxConfig(hidden_size=hidden, num_heads=heads, depth_double=double, depth_single=single,
                      in_channels=in_channels, text_dim=text_dim or min(4096, 4 * hidden),
                      pooled_dim=min(pooled_dim, 3 * hidden), rope_axes_dim=(head_dim - 2 * side, side, side),
                      guidance_embeds=True)


def random_model(cfg, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """``cfg``'s model made on ``device`` in ``dtype`` directly (built on meta: no fp32 copy of
    a 12B model anywhere), every parameter drawn N(0, 0.02) (norm gains 1 + that)."""
    from knapray.models.families import build_model

    with torch.device("meta"):
        model = build_model(cfg)
    model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.02, generator=gen)
    return model.eval()


def request(cfg, side: int, text: int, steps: int, seed: int = 0, frames: int = 1, guidance: float = 3.5):
    """One ``side``² request (``frames`` latent frames) with ``text`` tokens (a ``DenoiseJob``)."""
    from knapray.models.sampling import denoise_job, job_noise

    rng = np.random.default_rng(seed)
    cond = (rng.standard_normal((text, cfg.text_dim)).astype(np.float32),
            rng.standard_normal(cfg.pooled_dim).astype(np.float32))
    (noise,) = job_noise(cfg, [(frames * cfg.patch_size[0], side // 8, side // 8)], [seed])
    return denoise_job(cfg, noise, cond, steps=steps, guidance=guidance, shift=None, unconditional=None)


@dataclasses.dataclass(frozen=True)
class Timing:
    """One way of running the same loop."""

    name: str
    steps: int
    seconds: float
    """The loop's median wall time."""
    first_s: float
    """The first (untimed) run, compile and warm-up included."""
    latents: Any = dataclasses.field(repr=False, default=None)
    stats: dict = dataclasses.field(default_factory=dict)

    @property
    def per_step(self) -> float:
        return self.seconds / self.steps

    def row(self) -> dict:
        return {"name": self.name, "steps": self.steps, "seconds": self.seconds, "per_step_s": self.per_step,
                "first_s": self.first_s, **self.stats}


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_knapray(name: str, model: torch.nn.Module, job, *, repeats: int = 3, step_cache: float | None = None
                 ) -> Timing:
    """``job`` drawn by ``model`` (prepared already) through ``denoise_local``."""
    from knapray.worker.denoise import denoise_local

    t0 = time.perf_counter()
    denoise_local(model, [job], step_cache=step_cache)
    first = time.perf_counter() - t0
    times, out, stats = [], None, {}
    for _ in range(repeats):
        stats = {}
        t0 = time.perf_counter()
        (out,) = denoise_local(model, [job], step_cache=step_cache, stats=stats)
        times.append(time.perf_counter() - t0)
    return Timing(name, job.steps, statistics.median(times), first, out, stats)


def prepared(cfg, device: str, precision: str, compile: bool, seed: int = 0) -> torch.nn.Module:
    """A random model of ``cfg`` as ``knapray sample`` runs it (``prepare_model``, warmed up)."""
    from knapray.worker.denoise import prepare_model, warm_up
    from knapray.worker.parallelize import compute_dtype

    model = random_model(cfg, device, compute_dtype(precision, device), seed)
    prepare_model(model, device, precision=precision, compile=compile)
    if compile:
        warm_up(model)
    return model


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30))


# ---- the diffusers side (the GPU section) ----------------------------------------------------


def diffusers_flux(model: torch.nn.Module) -> torch.nn.Module:
    """diffusers' ``FluxTransformer2DModel`` with ``model``'s weights (the export layout's
    pieces: the same tensors ``knapray export`` writes), on its device in its dtype."""
    load_torchao_quietly()
    import diffusers

    from knapray.models.families import checkpoint_layout

    cfg = model.cfg
    params = {n: p.detach() for n, p in model.named_parameters()}
    state = checkpoint_layout(cfg, "diffusers").gather(params)
    dtype = next(iter(state.values())).dtype
    config = {k: v for k, v in cfg.to_diffusers().items() if not k.startswith("_")}
    with torch.device("meta"):
        ref = diffusers.FluxTransformer2DModel(**config)
    ref.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return ref.eval()


def time_diffusers(name: str, ref: torch.nn.Module, cfg, job, *, compiled: bool, repeats: int = 3) -> Timing:
    """``job``'s loop as ``FluxPipeline`` runs its transformer: packed latents in the model's
    dtype, (0, row, column) image ids, zero text ids, timestep t and guidance per call, the
    Euler step in fp32."""
    device = next(ref.parameters()).device
    dtype = next(ref.parameters()).dtype
    c, _, h, w = job.noise.shape
    x0 = torch.from_numpy(job.noise[:, 0]).reshape(1, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    x0 = x0.reshape(1, (h // 2) * (w // 2), 4 * c).to(device)
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    img_ids, txt_ids = ids.reshape(-1, 3), torch.zeros(job.text.shape[0], 3, device=device)
    text = torch.from_numpy(job.text)[None].to(device, dtype)
    pooled = torch.from_numpy(job.pooled)[None].to(device, dtype)
    guidance = torch.full((1,), float(job.guidance_input), device=device)
    times = torch.tensor(job.times, dtype=torch.float32, device=device)
    if compiled:
        if hasattr(ref, "compile_repeated_blocks"):  # diffusers' regional compile: each block class once
            ref.compile_repeated_blocks(fullgraph=True)
        else:
            ref = torch.compile(ref)

    def loop() -> torch.Tensor:
        x = x0.clone()
        with torch.no_grad():
            for i in range(job.steps):
                v = ref(hidden_states=x.to(dtype), encoder_hidden_states=text, pooled_projections=pooled,
                        timestep=times[i:i + 1].to(dtype), img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                        return_dict=False)[0]
                x = x + (times[i + 1] - times[i]) * v.float()
        return x

    t0 = time.perf_counter()
    loop()
    _sync(device)
    first = time.perf_counter() - t0
    out, runs = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = loop().cpu()
        runs.append(time.perf_counter() - t0)
    # packed (1, h/2 * w/2, 4c) -> knapray's latent (c, 1, h, w), to compare with its output
    latent = out.reshape(h // 2, w // 2, c, 2, 2).permute(2, 0, 3, 1, 4).reshape(c, 1, h, w).numpy()
    return Timing(name, job.steps, statistics.median(runs), first, latent)


def flux_side_by_side(shape: dict, device: str, *, repeats: int = 2, compile_diffusers: bool = True,
                      log=print) -> dict:
    """The GPU section: knapray (bf16 compiled: what ``knapray sample`` runs) beside diffusers'
    transformer (bf16, eager and compiled) on one FLUX.1-dev-shaped random model."""
    cfg = flux_config(shape["hidden"], shape["heads"], shape["double"], shape["single"])
    job = request(cfg, shape["side"], shape["text"], shape["steps"])
    # FLUX.1-dev embeds guidance: one pass per step (a classifier-free-guided model makes two)
    step_flops = model_flops([job.tokens], cfg, passes=1)
    log(f"model TFLOP/s = {formula(cfg).replace('3 (fwd+bwd)', '1 (forward)')}, L={job.tokens}: "
        f"{step_flops / 1e12:.1f} TFLOP a step, over the loop's median seconds per step")
    t0 = time.perf_counter()
    model = prepared(cfg, device, "bf16", compile=True)
    log(f"knapray: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters on {device}, "
        f"{job.tokens} tokens, prepared and warmed up in {time.perf_counter() - t0:.0f} s")
    rows = [time_knapray("knapray bf16 compiled", model, job, repeats=repeats)]
    log(_line(rows[-1], step_flops))
    ref = diffusers_flux(model)
    rows.append(time_diffusers("diffusers bf16 eager", ref, cfg, job, compiled=False, repeats=repeats))
    log(_line(rows[-1], step_flops))
    if compile_diffusers:
        rows.append(time_diffusers("diffusers bf16 compiled", ref, cfg, job, compiled=True, repeats=repeats))
        log(_line(rows[-1], step_flops))
    best = min(rows[1:], key=lambda r: r.seconds)
    ratio = best.seconds / rows[0].seconds
    agree = relative(rows[0].latents, best.latents)
    log(f"knapray over {best.name}: {ratio:.2f}x (>= 1: knapray faster); the two loops' latents differ by "
        f"{agree:.2e} (relative; bf16 both, knapray's stream fp32)")
    return {"shape": shape, "tokens": job.tokens, "step_flops": step_flops,
            "rows": [dict(r.row(), model_tflops=step_flops / r.per_step / 1e12) for r in rows],
            "ratio_over_best_diffusers": ratio,
            "best_diffusers": best.name, "agreement": agree}


def _line(r: Timing, step_flops: float) -> str:
    return (f"  {r.name:26s} {r.steps} steps: {r.seconds:8.3f} s, {1e3 * r.per_step:8.1f} ms/step, "
            f"{step_flops / r.per_step / 1e12:7.1f} model TFLOP/s (first run {r.first_s:.1f} s)")
