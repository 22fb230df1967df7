"""The distribution training draws rectified-flow timesteps from: ``sample_timesteps``'
kinds, then SD3's shift, or Flux's shift computed from each sequence's own image tokens."""

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
class ResolutionShift:
    """Flux's resolution-dependent shift (BFL's ``get_schedule``, diffusers'
    ``calculate_shift`` with the FLUX.1 scheduler's values): mu is linear in a sequence's
    image tokens, from ``base_shift`` at ``base_tokens`` to ``max_shift`` at ``max_tokens``
    (extrapolated beyond), and t -> e^mu·t / (1 + (e^mu - 1)·t), i.e. SD3's shift with
    shift = e^mu (BFL's ``time_shift(mu, 1, t)``)."""

    base_tokens: int = 256
    max_tokens: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15

    def __post_init__(self) -> None:
        if not (isinstance(self.base_tokens, int) and isinstance(self.max_tokens, int)
                and 0 <= self.base_tokens < self.max_tokens):
            raise ValueError(f"need integer image token counts 0 <= base < max, got base {self.base_tokens!r}, "
                             f"max {self.max_tokens!r}")
        for name in ("base_shift", "max_shift"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)!r}")

    def mu(self, image_tokens: int) -> float:
        slope = (self.max_shift - self.base_shift) / (self.max_tokens - self.base_tokens)
        return image_tokens * slope + (self.base_shift - slope * self.base_tokens)

    def shift(self, image_tokens: int) -> float:
        """The SD3-form shift for a sequence of ``image_tokens`` image tokens: e^mu."""
        return math.exp(self.mu(image_tokens))


@dataclass(frozen=True, slots=True)
class TimestepDistribution:
    kind: str = "logit_normal"
    """``logit_normal`` (sigmoid of N(mean, std)) or ``uniform`` (U(0, 1))."""
    mean: float = 0.0
    std: float = 1.0
    shift: float = 1.0
    """SD3's shift, applied to every drawn t (1: none)."""
    resolution: ResolutionShift | None = None
    """Flux's shift from each sequence's own image tokens instead (then ``shift`` is 1)."""

    def __post_init__(self) -> None:
        if self.kind not in TIMESTEP_KINDS:
            raise ValueError(f"unknown timestep distribution {self.kind!r}; valid: {list(TIMESTEP_KINDS)}")
        if not math.isfinite(self.mean):
            raise ValueError(f"timestep mean must be finite, got {self.mean!r}")
        if not (self.std > 0 and math.isfinite(self.std)):
            raise ValueError(f"timestep std must be a finite number > 0, got {self.std!r}")
        if not (self.shift > 0 and math.isfinite(self.shift)):
            raise ValueError(f"timestep shift must be a finite number > 0, got {self.shift!r}")
        if self.resolution is not None and self.shift != 1:
            raise ValueError(f"a fixed timestep shift ({self.shift!r}) and the resolution shift exclude each other")

    def sample(self, n: int, *, generator: torch.Generator, image_tokens: int | None = None) -> torch.Tensor:
        """(n,) fp32 timesteps in (0, 1), drawn from ``generator`` exactly as
        ``sample_timesteps`` draws them (the shift consumes no randomness). With the
        resolution shift, ``image_tokens`` is the sequence's image token count."""
        t = sample_timesteps(n, generator=generator, kind=self.kind, mean=self.mean, std=self.std)
        if self.resolution is None:
            return shift_timesteps(t, self.shift)
        if image_tokens is None or image_tokens < 0:
            raise ValueError(f"the resolution shift needs the sequence's image tokens, got {image_tokens!r}")
        return shift_timesteps(t, self.resolution.shift(image_tokens))
