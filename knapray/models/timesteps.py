"""The distribution training draws rectified-flow timesteps from: ``sample_timesteps``'
kinds, then SD3's shift."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from knapray.models.flow import TIMESTEP_KINDS, sample_timesteps


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """t -> shift·t / (1 + (shift-1)·t) (SD3): shift > 1 moves t toward 1 (noise),
    which a higher resolution needs to destroy the same share of its signal. Monotone,
    keeps 0 and 1 fixed; shift = 1 returns ``t`` unchanged."""
    if not (shift > 0 and math.isfinite(shift)):
        raise ValueError(f"timestep shift must be a finite number > 0, got {shift!r}")
    if shift == 1:
        return t
    return shift * t / (1 + (shift - 1) * t)


@dataclass(frozen=True, slots=True)
class TimestepDistribution:
    kind: str = "logit_normal"
    """``logit_normal`` (sigmoid of N(mean, std)) or ``uniform`` (U(0, 1))."""
    mean: float = 0.0
    std: float = 1.0
    shift: float = 1.0
    """SD3's shift, applied to every drawn t (1: none)."""

    def __post_init__(self) -> None:
        if self.kind not in TIMESTEP_KINDS:
            raise ValueError(f"unknown timestep distribution {self.kind!r}; valid: {list(TIMESTEP_KINDS)}")
        if not math.isfinite(self.mean):
            raise ValueError(f"timestep mean must be finite, got {self.mean!r}")
        if not (self.std > 0 and math.isfinite(self.std)):
            raise ValueError(f"timestep std must be a finite number > 0, got {self.std!r}")
        if not (self.shift > 0 and math.isfinite(self.shift)):
            raise ValueError(f"timestep shift must be a finite number > 0, got {self.shift!r}")

    def sample(self, n: int, *, generator: torch.Generator) -> torch.Tensor:
        """(n,) fp32 timesteps in (0, 1), drawn from ``generator`` exactly as
        ``sample_timesteps`` draws them (the shift consumes no randomness)."""
        t = sample_timesteps(n, generator=generator, kind=self.kind, mean=self.mean, std=self.std)
        return shift_timesteps(t, self.shift)
