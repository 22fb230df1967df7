"""The distribution training draws rectified-flow timesteps from: ``sample_timesteps``'
kinds, then SD3's shift, or Flux's shift computed from each sequence's own image tokens."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
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
    low: float = 0.0
    high: float = 1.0
    """Only t in [low, high) (after the shift): the distribution truncated there, e.g. one
    of Wan 2.2's two experts, each trained on its side of the boundary (0.875 for T2V
    A14B: the high-noise expert on [0.875, 1), the low-noise one on [0, 0.875))."""

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
        if not (0 <= self.low < self.high <= 1):
            raise ValueError(f"timestep range must have 0 <= low < high <= 1, got [{self.low!r}, {self.high!r})")
        if self.resolution is not None and self.truncated:
            raise ValueError("a timestep range and the resolution shift exclude each other (the range's bounds "
                             "would move with each sequence's shift)")

    @property
    def truncated(self) -> bool:
        return (self.low, self.high) != (0.0, 1.0)

    def _unshift(self, t: float) -> float:
        """The drawn value the shift maps to ``t`` (the shift's inverse: s' = 1/s)."""
        return t if t in (0.0, 1.0) else float(shift_timesteps(torch.tensor(t, dtype=torch.float64), 1 / self.shift))

    def _cdf(self, u: torch.Tensor) -> torch.Tensor:
        """P(drawn <= u) before the shift, u in [0, 1] (float64)."""
        if self.kind == "uniform":
            return u
        z = (torch.logit(u.clamp(1e-300, 1.0)) - self.mean) / self.std
        return torch.special.ndtr(torch.where(u <= 0, torch.full_like(z, -math.inf), z))

    def _inverse_cdf(self, p: torch.Tensor) -> torch.Tensor:
        if self.kind == "uniform":
            return p
        return torch.sigmoid(torch.special.ndtri(p) * self.std + self.mean)

    def sample(self, n: int, *, generator: torch.Generator, image_tokens: int | None = None) -> torch.Tensor:
        """(n,) fp32 timesteps in (0, 1), drawn from ``generator`` exactly as
        ``sample_timesteps`` draws them (the shift consumes no randomness). With the
        resolution shift, ``image_tokens`` is the sequence's image token count."""
        if self.truncated:
            # Inverse-CDF sampling between the bounds' probabilities: the distribution's own
            # shape on [low, high), nothing drawn outside it (no rejection loop).
            lo, hi = (self._cdf(torch.tensor(self._unshift(x), dtype=torch.float64)) for x in (self.low, self.high))
            u = lo + (hi - lo) * torch.rand(n, generator=generator, dtype=torch.float64)
            t = self._inverse_cdf(u).clamp(self._unshift(self.low), self._unshift(self.high))
            t = shift_timesteps(t, self.shift).clamp(self.low, self.high)
            return torch.where(t >= self.high, torch.nextafter(torch.tensor(self.high, dtype=torch.float64),
                                                               torch.tensor(0.0, dtype=torch.float64)), t).float()
        t = sample_timesteps(n, generator=generator, kind=self.kind, mean=self.mean, std=self.std)
        if self.resolution is None:
            return shift_timesteps(t, self.shift)
        if image_tokens is None or image_tokens < 0:
            raise ValueError(f"the resolution shift needs the sequence's image tokens, got {image_tokens!r}")
        return shift_timesteps(t, self.resolution.shift(image_tokens))


EXPERT_NAMES = ("transformer", "transformer_2")
"""The two experts' names, as a Wan 2.2 pipeline folder calls them: the high-noise one first."""


@dataclass(frozen=True, slots=True)
class ExpertSplit:
    """Two experts trained in one run, one per side of a timestep ``boundary`` (Wan 2.2
    A14B's: ``transformer`` denoises t >= boundary, where t = 1 is noise; ``transformer_2``
    below). Each optimizer step trains one of them, on timesteps drawn from its side only
    (the run's distribution truncated there); which one is a function of the run's seed and
    the optimizer step's index alone, so every rank, a resume and a run at another world size
    choose alike. ``share``: the high-noise expert's share of optimizer steps (0: the share
    of the distribution's own timesteps at or above the boundary, so that the pair is trained
    on the distribution the run would draw for one model)."""

    boundary: float
    share: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.boundary < 1:
            raise ValueError(f"the experts' boundary must be in (0, 1), got {self.boundary!r}")
        if not 0 <= self.share < 1:
            raise ValueError(f"the high-noise expert's share must be in [0, 1) (0: the timesteps' own), "
                             f"got {self.share!r}")

    def high_share(self, dist: TimestepDistribution) -> float:
        """The high-noise expert's share of optimizer steps under ``dist``."""
        if self.share:
            return self.share
        below = float(dist._cdf(torch.tensor(dist._unshift(self.boundary), dtype=torch.float64)))
        return 1.0 - below

    def distribution(self, expert: int, dist: TimestepDistribution) -> TimestepDistribution:
        """``dist`` truncated to expert ``expert``'s side (0: [boundary, 1), 1: [0, boundary))."""
        if dist.truncated or dist.resolution is not None:
            raise ValueError("two experts split the timesteps at their boundary: the run's distribution must "
                             "cover [0, 1) without a per-sequence shift")
        low, high = (self.boundary, 1.0) if expert == 0 else (0.0, self.boundary)
        return dataclasses.replace(dist, low=low, high=high)

    def chooser(self, seed: int, dist: TimestepDistribution) -> Callable[[int], int]:
        """``step -> expert``: the expert the optimizer step starting at ``step`` trains, 0 (high
        noise) with probability ``high_share(dist)`` (computed once), from a draw of its own
        seeded by (seed, step)."""
        share, seed = self.high_share(dist), int(seed) & 0xFFFFFFFF

        def expert(step: int) -> int:
            return 0 if np.random.default_rng([seed, int(step), 0x5EED]).random() < share else 1

        return expert
