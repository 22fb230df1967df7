"""Gradient truth: a compiled bf16 step's gradients, parameter by parameter, against a
float64 eager copy of the same model on the same batch.

bf16 and ``torch.compile`` change what is computed, not only how fast: a sum over tokens
done in bf16 (a gather's backward as an atomic scatter-add, say) loses a long sequence's
gradient while the loss still falls. Every parameter's error is judged against the blocks'
own per-token matrix products (their weights and biases, whose gradients are torch's own
matmul and column sums, accumulated in fp32 on every backend): their bf16 error is what
bf16 compute costs anyway, and no other parameter (the conditioning path, norm gains,
tables, embedders, the final layer) may be more than ``RATIO_BAR`` times worse than the
worst of them. (Biases belong to the yardstick: a key projection's bias gradient is a sum
that nearly cancels, attention being blind to a shift shared by every key, and comes out
about 2x worse than the weights' in any bf16 run, eager or compiled.)

The model is a family's real blocks at a small width (Flux: a double- and a single-stream
block; Wan: two blocks), run on a few sequences of thousands of tokens (the sums that go
wrong grow with them), compiled by ``parallelize`` exactly as training compiles them, in
either bf16 mode a run uses: ``autocast`` (fp32 parameters, no FSDP) or ``bf16_params``
(FSDP's bf16 parameters). ``tests/unit/test_grad_truth.py`` runs it on CPU inductor (which
lowers the same way as on a GPU for what matters here: atomics and accumulation dtypes);
``make gpu-bench`` runs it on CUDA.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn as nn

from knapray.models.families import FAMILIES as REGISTRY
from knapray.models.families import build_model, get_family
from knapray.models.packing import PackedBatch, pack_samples

RATIO_BAR = 1.5
"""The most any parameter's relative gradient error may exceed the worst matmul weight's."""
FAMILIES = tuple(f.name for f in REGISTRY.values() if f.small_config is not None)
"""The families checked: those with a ``small_config`` (the MMDiT's blocks are Flux's)."""
MODES = ("autocast", "bf16_params")


@dataclasses.dataclass(frozen=True)
class GradientReport:
    family: str
    mode: str
    device: str
    compiled: bool
    tokens: int
    errors: dict[str, float]
    """Relative (norm-wise) error of each parameter's gradient against float64."""
    per_token: tuple[str, ...]
    """The blocks' per-token matrix products' parameters (the yardstick)."""

    @property
    def yardstick(self) -> float:
        return max(self.errors[n] for n in self.per_token)

    @property
    def worst(self) -> tuple[str, float]:
        """The worst parameter outside the yardstick."""
        others = {n: e for n, e in self.errors.items() if n not in self.per_token}
        name = max(others, key=others.get)
        return name, others[name]

    @property
    def ratio(self) -> float:
        return self.worst[1] / self.yardstick

    @property
    def passed(self) -> bool:
        return self.ratio <= RATIO_BAR

    def summary(self) -> str:
        name, err = self.worst
        return (f"{self.family:5s} {self.mode:11s} {'compiled' if self.compiled else 'eager':8s} {self.device:5s} "
                f"{self.tokens} tokens: per-token matmuls <= {self.yardstick:.2e}, worst other parameter {err:.2e} "
                f"({name}), ratio {self.ratio:.2f} (bar {RATIO_BAR}): {'ok' if self.passed else 'FAIL'}")


def small_config(family: str, width: int = 64):
    """A family's architecture at ``width`` (heads of 32 channels): its ``small_config``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    return get_family(family).small_config(width)


def long_batch(cfg, sequences: int = 3, side: int = 96, text: int = 64, seed: int = 0, frames: int = 1) -> PackedBatch:
    """``sequences`` clips of ``frames`` latent frames of (side/2)² tokens each (2,304 at side
    96) with ``text`` text tokens, noised, with targets; for a model with a time per token,
    every other clip image-conditioned (its first frame at time 0)."""
    from knapray.models import add_noise

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(sequences):
        sample = {"latent": torch.randn(cfg.in_channels, frames, side, side, generator=gen),
                  "timestep": (i + 1) / (sequences + 1), "text": torch.randn(text, cfg.text_dim, generator=gen)}
        if getattr(cfg, "expand_timesteps", False):
            sample["first_frame_timestep"] = 0.0 if i % 2 == 0 else sample["timestep"]
        if getattr(cfg, "image_dim", 0):  # Wan 2.1 I2V: CLIP-like image tokens
            sample["image_context"] = torch.randn(cfg.image_tokens, cfg.image_dim, generator=gen)
        if cfg.pooled_dim:
            sample["pooled"] = torch.randn(cfg.pooled_dim, generator=gen)
        if getattr(cfg, "guidance_embeds", False):
            sample["guidance"] = 3.5
        samples.append(sample)
    batch = pack_samples(samples, cfg)
    batch = add_noise(batch, torch.randn(batch.x_img.shape, generator=gen))
    # targets of the model's output features (fewer than its input's for I2V: the latent's
    # channels come first in a token's features)
    return dataclasses.replace(batch, targets=batch.targets[:, :cfg.out_patch_dim].contiguous())


def _grads(model: nn.Module, batch: PackedBatch, autocast: torch.dtype | None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(batch.x_img.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(batch)  # the family's single-process composition of its stages
    # A loss whose gradient has the same sign pattern over a sequence's tokens: the sums over
    # tokens that go wrong in bf16 are largest then.
    loss = (out.double() * batch.targets.double()).sum() / out.shape[0]
    loss.backward()
    return {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}


def _per_token_linears(model: nn.Module) -> tuple[str, ...]:
    """The parameters of the blocks' per-token matrix products (weights and biases; not the
    modulation's, which runs once per sequence): the yardstick."""
    from knapray.models.layers import Modulation

    blocks = model.fsdp_units().blocks
    per_sequence = {id(m.lin) for b in blocks for m in b.modules() if isinstance(m, Modulation)}
    ids = {id(p) for b in blocks for m in b.modules()
           if isinstance(m, nn.Linear) and id(m) not in per_sequence for p in m.parameters()}
    return tuple(n for n, p in model.named_parameters() if id(p) in ids)


def gradient_errors(family: str, mode: str, *, device: str = "cpu", compile: bool = True, width: int = 64,
                    sequences: int = 3, side: int = 96, seed: int = 0, fp8: str | None = None,
                    config: dict | None = None, frames: int = 1) -> GradientReport:
    """Compile ``family``'s small model (``small_config``) by ``parallelize`` in bf16 ``mode``
    on ``device``, run one forward and backward on ``long_batch``, and compare every
    parameter's gradient with a float64 eager copy's (same weights: the bf16 parameters'
    values for ``bf16_params``). ``fp8``: with ``parallel.fp8`` in that scaling (its block
    matmuls in float8: the yardstick is then float8's error). ``config``: fields of the
    small config set otherwise (a variant: Wan 2.2 TI2V's ``expand_timesteps``); ``frames``:
    latent frames a sequence has."""
    from knapray.config.parallel import ParallelConfig
    from knapray.worker.parallelize import parallelize

    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    cfg = small_config(family, width)
    if config:
        cfg = dataclasses.replace(cfg, **config)
    torch.manual_seed(seed)
    model = build_model(cfg)
    if get_family(family).zero_init:
        model.init_weights(std=0.05)  # every parameter gets a gradient (adaLN-Zero would zero most)
    if mode == "bf16_params":
        model = model.to(torch.bfloat16)
    reference = copy.deepcopy(model).double().to(device)
    model = model.to(device)
    batch = long_batch(cfg, sequences, side, seed=seed, frames=frames).to(device)
    truth = _grads(reference, batch, None)
    del reference
    parallelize(model, ParallelConfig(compile=compile, **({"fp8": True, "fp8_scaling": fp8} if fp8 else {})))
    got = _grads(model, batch, torch.bfloat16 if mode == "autocast" else None)
    errors = {n: float((got[n] - truth[n]).norm() / truth[n].norm().clamp_min(1e-30)) for n in truth}
    return GradientReport(family=family, mode=mode if not fp8 else f"{mode}+fp8-{fp8}", device=str(device),
                          compiled=compile,
                          tokens=int(batch.is_text.shape[0]), errors=errors, per_token=_per_token_linears(model))
