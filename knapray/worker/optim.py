"""The optimizer, its learning-rate schedule and gradient accumulation's bookkeeping.

Steps count optimizer steps from 0. Per optimizer step the trainer runs
``grad_accum_steps`` micro-batches (``is_last_micro_step`` says which one ends the
group), then ``optimizer.step()``, then ``schedule.step()``: the optimizer step ``s``
uses ``lr_at(s, cfg, max_steps)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from knapray.config.run import OptimSection


def decay_horizon(cfg: OptimSection, max_steps: int = 0) -> int:
    """The step where ``cosine`` reaches min_lr_ratio·lr: ``cfg.decay_steps``, else the
    run's ``max_steps``; 0 for ``constant``. Raises ValueError for a cosine without a
    horizon or one that ends before warm-up does."""
    if cfg.schedule == "constant":
        return 0
    if cfg.schedule != "cosine":
        raise ValueError(f"optim.schedule {cfg.schedule!r}: valid values are 'constant', 'cosine'")
    horizon = cfg.decay_steps or max_steps
    if horizon <= 0:
        raise ValueError(
            "optim.schedule=cosine needs to know where to end: set optim.decay_steps or run.max_steps "
            "(a run that runs its epochs out has no known length)"
        )
    if horizon <= cfg.warmup_steps:
        source = "optim.decay_steps" if cfg.decay_steps else "run.max_steps"
        raise ValueError(
            f"{source}={horizon} must be > optim.warmup_steps={cfg.warmup_steps}: the cosine runs after warm-up"
        )
    return horizon


def lr_at(step: int, cfg: OptimSection, max_steps: int = 0) -> float:
    """The learning rate of optimizer step ``step`` (from 0).

    Warm-up (step < W = warmup_steps): lr·(step+1)/(W+1), a line from 0 that reaches lr at
    step W and never trains a step at 0. Then ``constant``: lr; ``cosine`` with horizon D
    (``decay_horizon``): lr·(m + (1-m)·(1 + cos(π·(step-W)/(D-W)))/2) with m = min_lr_ratio,
    which is m·lr from step D on.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    w = cfg.warmup_steps
    if step < w:
        return cfg.lr * (step + 1) / (w + 1)
    horizon = decay_horizon(cfg, max_steps)
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - w) / (horizon - w))
    m = cfg.min_lr_ratio
    return cfg.lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * progress)))


class LRSchedule:
    """Sets every param group's lr to ``lr_at(step)``; ``step()`` after each optimizer step.

    Like ``torch.optim.lr_scheduler.LambdaLR`` but its state is the step alone
    (``{"step": int}``), and the schedule comes from the config: a run resumed with another
    lr or schedule follows the new one from the step it resumes at (LambdaLR would restore
    the old base lr). ``start_step`` (the first step this run trains) is enough to resume,
    so the trainer may skip the state dict.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimSection, max_steps: int = 0,
                 start_step: int = 0) -> None:
        decay_horizon(cfg, max_steps)  # refuse a schedule without an end now, not at warm-up's end
        self.optimizer, self.cfg, self.max_steps = optimizer, cfg, max_steps
        self.load_state_dict({"step": start_step})

    @property
    def current_step(self) -> int:
        """The optimizer step the param groups' lr is set for."""
        return self._step

    def step(self) -> None:
        self.load_state_dict({"step": self._step + 1})

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, int]:
        return {"step": self._step}

    def load_state_dict(self, state: dict) -> None:
        step = state.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"LRSchedule state: expected {{'step': int >= 0}}, got {state!r}")
        self._step = step
        lr = lr_at(step, self.cfg, self.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr


def _decays(param: torch.Tensor, embeddings: set[int]) -> bool:
    """Matrices decay; vectors (biases, norm scales, adaLN shifts) and embedding tables do not."""
    return param.ndim >= 2 and id(param) not in embeddings


def build_optimizer(
    params: torch.nn.Module | Iterable[tuple[str, torch.Tensor]] | Iterable[torch.Tensor], cfg: OptimSection,
    *, fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW on fp32 master weights with ``cfg``'s lr, betas and weight decay.

    ``params``: a module, its ``named_parameters()``, or bare parameters (plain tensors or
    FSDP2 DTensor shards), frozen ones skipped. Weight decay applies to the parameters with
    2 or more dimensions only: decaying a bias, a norm's scale or an adaLN shift toward 0
    changes what the layer computes rather than limiting its capacity (GPT-2/nanoGPT,
    torchtitan's practice); embedding tables (``nn.Embedding``, seen only when a module is
    given) do not decay either. One param group per weight decay (empty ones left out).
    The lr is ``cfg.lr`` until ``LRSchedule`` (build it next) sets the step's.

    Parameters that are not fp32 are refused: the optimizer updates the weights in their
    own dtype, and bf16 weights lose small updates (keep them fp32 and compute in bf16
    under autocast or an FSDP2 MixedPrecisionPolicy).

    ``fused``: torch's fused kernel (one launch per group, no temporaries) instead of
    foreach's; None: fused where the parameters are on CUDA (the GPU check's foreach AdamW
    took ~18 ms a step at 1.3B parameters), foreach elsewhere, the default the CPU tests'
    bit-exact resumes were written against. The dry run asks for what the GPU would run.
    """
    embeddings: set[int] = set()
    if isinstance(params, torch.nn.Module):
        embeddings = {id(m.weight) for m in params.modules() if isinstance(m, torch.nn.Embedding)}
        params = params.named_parameters()
    named = [item if isinstance(item, tuple) else (f"params[{i}]", item) for i, item in enumerate(params)]
    decay, no_decay = [], []
    for name, p in named:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"build_optimizer: {name} is a {type(p).__name__}, expected a parameter tensor")
        if not p.requires_grad:
            continue
        if p.dtype != torch.float32:
            raise ValueError(
                f"build_optimizer: parameter {name} is {p.dtype}; master weights must be torch.float32 "
                "(compute in bf16 under autocast or an FSDP2 MixedPrecisionPolicy instead)"
            )
        (decay if _decays(p, embeddings) else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("build_optimizer: no trainable parameters")
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if fused is None:
        fused = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas),
                             **({"fused": True} if fused else {}))


def is_last_micro_step(micro_step: int, grad_accum_steps: int) -> bool:
    """Whether micro-batch ``micro_step`` (counted from 0 over the run) ends its group of
    ``grad_accum_steps``: after its backward the trainer reduces the gradients, clips, steps
    the optimizer, the schedule and the EMA, and zeroes the gradients; before it, gradients
    only accumulate locally (no all-reduce; under FSDP2
    ``model.set_requires_gradient_sync(False)``)."""
    if grad_accum_steps < 1 or micro_step < 0:
        raise ValueError(f"expected micro_step >= 0 and grad_accum_steps >= 1, got {micro_step}, {grad_accum_steps}")
    return (micro_step + 1) % grad_accum_steps == 0
