"""Forward truth of sampling: a compiled bf16 denoising trajectory, step by step, against a
float64 eager one of the same model (``knapray.worker.denoise``, the engine ``knapray sample``
and the gang run).

bf16 and ``torch.compile`` change what is computed, not only how fast. The yardstick is what
bf16 costs anyway: the same float64 model with every matrix product's inputs rounded to
bf16 (activations into every linear layer, q, k, v and the softmax weights into attention),
nothing else. At every step of the float64 trajectory, the compiled bf16 model's velocity
(from that same latent and time) must be within ``RATIO_BAR`` times the yardstick's
relative error; the final latents of the compiled bf16 trajectory, run on its own, are
reported beside the yardstick's. Weights are the bf16 model's values in all three, so only
what the computation does differs.

The model is a family's real blocks at a small width (``small_config``), one request of
thousands of tokens (the sums that go wrong grow with them), compiled by ``prepare_model``
as ``knapray sample`` compiles it. ``tests/unit/test_sample_truth.py`` runs it on CPU
inductor, ``make gpu-bench`` on CUDA.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from knapray.models.families import FAMILIES as REGISTRY
from knapray.models.families import build_model, get_family

RATIO_BAR = 1.5
"""How much worse than the yardstick a step's velocity may be."""
FAMILIES = tuple(f.name for f in REGISTRY.values() if f.small_config is not None)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() else t


class RoundMatmulInputs(TorchFunctionMode):
    """Every matrix product's inputs rounded to bf16 (kept in their dtype): ``F.linear``'s
    input and weight, and attention as the fused kernels compute it (q, k and v rounded; the
    logits and softmax in the input dtype; the softmax weights rounded before they meet v)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, *rest = args
            return func(_bf16(x), _bf16(kwargs.pop("weight", w)), *rest, **kwargs)
        if func in (torch.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm):
            return func(*(_bf16(a) if isinstance(a, torch.Tensor) else a for a in args), **kwargs)
        if func is F.scaled_dot_product_attention:
            return _attention(*args, **kwargs)
        return func(*args, **kwargs)


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.matmul(_bf16(q), _bf16(k).transpose(-1, -2)) * scale
    if attn_mask is not None:
        logits = logits + attn_mask
    return torch.matmul(_bf16(logits.softmax(-1)), _bf16(v))


@dataclasses.dataclass(frozen=True)
class TrajectoryReport:
    family: str
    device: str
    compiled: bool
    tokens: int
    steps: int
    errors: tuple[float, ...]
    """Relative error of the tested velocity at each step (norm-wise, against float64)."""
    yardstick: tuple[float, ...]
    """The same for the float64 model with its matrix products' inputs rounded to bf16."""
    final_error: float
    """The tested trajectory's final latents (run on its own) against float64's."""

    @property
    def ratios(self) -> tuple[float, ...]:
        return tuple(e / max(y, 1e-30) for e, y in zip(self.errors, self.yardstick))

    @property
    def passed(self) -> bool:
        return max(self.ratios) <= RATIO_BAR

    def summary(self) -> str:
        r = self.ratios
        worst = int(np.argmax(r))
        return (f"{self.family:5s} {'compiled' if self.compiled else 'eager':8s} {self.device:5s} {self.tokens} tokens, "
                f"{self.steps} steps: velocity error / bf16 matmul inputs' worst at step {worst} "
                f"({self.errors[worst]:.2e} / {self.yardstick[worst]:.2e} = {r[worst]:.2f}, bar {RATIO_BAR}); "
                f"final latents {self.final_error:.2e} off float64's: "
                f"{'ok' if self.passed else 'FAIL'}")


def small_model(family: str, width: int = 64, seed: int = 0, config: dict | None = None) -> torch.nn.Module:
    """``family``'s ``small_config`` at ``width`` (``config``: fields set otherwise, a variant
    such as Wan 2.1 I2V's ``image_dim``) with weights drawn so that every block contributes
    (zero-initialized output layers given values), fp32, eval."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    torch.manual_seed(seed)
    cfg = get_family(family).small_config(width)
    model = build_model(dataclasses.replace(cfg, **config) if config else cfg)
    if get_family(family).zero_init:
        model.init_weights(std=0.05)
    return model.eval()


def long_job(cfg, side: int = 96, frames: int = 1, text: int = 64, steps: int = 8, seed: int = 0, guidance: float = 3.5):
    """One request of (side/2)² image tokens per latent frame (2,304 at side 96) with ``text``
    tokens, ``steps`` steps; classifier-free guidance where the model does not embed it. A
    model conditioned on an image gets one drawn at random: a clean first latent frame (a time
    per token, Wan 2.2 TI2V, ``frames`` >= 2), or the condition's channels and image tokens
    (Wan 2.1 I2V)."""
    from knapray.models.sampling import denoise_job, job_noise, latent_channels

    rng = np.random.default_rng(seed)
    cond = (rng.standard_normal((text, cfg.text_dim)).astype(np.float32),
            rng.standard_normal(cfg.pooled_dim).astype(np.float32))
    (noise,) = job_noise(cfg, [(frames * cfg.patch_size[0], side, side)], [seed])
    image: dict[str, np.ndarray] = {}
    if getattr(cfg, "expand_timesteps", False) and frames >= 2:
        image["first_frame"] = rng.standard_normal((noise.shape[0], 1, side, side)).astype(np.float32)
    if cfg.in_channels > latent_channels(cfg):
        image["condition"] = rng.standard_normal((cfg.in_channels - latent_channels(cfg), *noise.shape[1:]))
    if getattr(cfg, "image_dim", 0):
        image["image_context"] = rng.standard_normal((cfg.image_tokens, cfg.image_dim))
    return denoise_job(cfg, noise, cond, steps=steps, guidance=guidance, shift=None, unconditional=None, **image)


def _one_step(job, x: np.ndarray, i: int):
    """``job``'s step ``i`` alone, from latent ``x`` (C, T, H, W)."""
    return dataclasses.replace(job, noise=np.asarray(x, np.float32), times=job.times[i: i + 2])


def _velocity(run: Callable, job, x: np.ndarray, i: int) -> np.ndarray:
    """The velocity a model takes at step ``i`` from ``x``: (x - its one Euler step) / dt."""
    dt = job.times[i] - job.times[i + 1]
    return (x.astype(np.float64) - run([_one_step(job, x, i)])[0].astype(np.float64)) / dt


def bf16_stream(model: torch.nn.Module) -> None:
    """A ``variant``: the residual stream accumulated in bf16 and the velocity leaving the
    model in bf16 (every block's output summed into a bf16 stream), what sampling computed
    before the stream was fp32: the check fails on it (Flux 2.3x the yardstick, Wan 2.5x)."""
    del model.embed, model.blocks  # the class's own stages again
    model.fsdp_units().final.to(torch.bfloat16)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def trajectory_errors(family: str, *, device: str = "cpu", compile: bool = True, width: int = 64, side: int = 96,
                      frames: int = 1, steps: int = 8, seed: int = 0,
                      variant: Callable[[torch.nn.Module], None] | None = None,
                      config: dict | None = None) -> TrajectoryReport:
    """``family``'s small model in bf16 (compiled by ``prepare_model`` on ``device``) against
    its float64 eager copy over ``long_job``'s trajectory; see the module docstring.
    ``variant``: applied to the tested model after it is prepared (a deliberately worse one);
    ``config``: fields of the small config set otherwise (``small_model``)."""
    from knapray.worker.denoise import denoise_local, prepare_model

    model = small_model(family, width, seed, config).to(torch.bfloat16)
    truth = copy.deepcopy(model).double().to(device)  # the bf16 weights' values, in float64
    job = long_job(model.cfg, side=side, frames=frames, steps=steps, seed=seed)
    prepare_model(model, device, precision="bf16", compile=compile)
    if variant is not None:
        variant(model)

    def run_truth(jobs):
        return denoise_local(truth, jobs)

    def run_yardstick(jobs):
        with RoundMatmulInputs():
            return denoise_local(truth, jobs)

    def run_tested(jobs):
        return denoise_local(model, jobs)

    x = job.noise
    errors, yard = [], []
    # Each velocity from the same latent: float64's trajectory (its latents kept in fp32,
    # as the engine keeps them: 1e-7 beside bf16's 1e-3).
    with torch.no_grad():
        for i in range(job.steps):
            x_next = run_truth([_one_step(job, x, i)])[0]  # float64's trajectory, one step at a time
            v_true = (x.astype(np.float64) - x_next.astype(np.float64)) / (job.times[i] - job.times[i + 1])
            errors.append(_rel(_velocity(run_tested, job, x, i), v_true))
            yard.append(_rel(_velocity(run_yardstick, job, x, i), v_true))
            x = x_next
        final = _rel(run_tested([job])[0], x)
    return TrajectoryReport(family=family, device=str(device), compiled=compile, tokens=job.tokens, steps=job.steps,
                            errors=tuple(errors), yardstick=tuple(yard), final_error=final)
