"""A first-block step cache for sampling (off by default: ``knapray sample --step-cache``).

Consecutive denoising steps change the model's hidden states little in places. Each step
runs the first block; if its residual (output minus input) moved less than ``threshold``
since the last step that ran every block (relative, mean absolute), the other blocks are
skipped and their residual from that step is added instead (first-block cache, TeaCache's
family of ideas):

    full step:    h_0 = B_0(h);  H = B_rest(h_0);  keep r_0 = h_0 - h and R = H - h_0
    cached step:  h_0 = B_0(h);  if |h_0 - h - r_0| / |r_0| < threshold:  H = h_0 + R

A family's ``blocks`` calls ``reuse`` after its first block and ``store`` at its end (both
on its packed stream: a double-stream block's two streams merged). The decision must be the
same on every rank whose blocks exchange with each other (Ulysses): ``agree`` sums the two
norms over them. It is a value read back to the host every step, so a cached run is not
free of host synchronization (an uncached one is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StepCache:
    """One stretch of steps over the same tokens (a new one when the tokens change)."""

    def __init__(self, threshold: float, agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if not threshold > 0:
            raise ValueError(f"the step cache's threshold must be > 0, got {threshold!r}")
        self.threshold = threshold
        self.agree = agree
        """Sums a (2,) tensor over the ranks that decide together (None: this rank alone)."""
        self.first: torch.Tensor | None = None
        """r_0 of the last full step."""
        self.rest: torch.Tensor | None = None
        """R of the last full step."""
        self._pending: torch.Tensor | None = None
        self.full = self.cached = 0
        self.changes: list[float] = []
        """The first block's relative change at each step after the first (what was compared)."""

    def reuse(self, h_in: torch.Tensor, h_0: torch.Tensor) -> bool:
        """After the first block: skip the others (then ``apply``)? Collective over ``agree``'s ranks."""
        r0 = h_0 - h_in
        if self.first is None:
            self._pending = r0
            return False
        norms = torch.stack(((r0 - self.first).abs().sum(), self.first.abs().sum())).float()
        if self.agree is not None:
            norms = self.agree(norms)
        change = float(norms[0] / norms[1].clamp_min(1e-30))  # a value the host reads: the cost of a cache
        self.changes.append(change)
        if change < self.threshold:
            self.cached += 1
            return True
        self._pending = r0
        return False

    def apply(self, h_0: torch.Tensor) -> torch.Tensor:
        """The blocks' output of a cached step."""
        return h_0 + self.rest.to(h_0.dtype)

    def store(self, h_0: torch.Tensor, h_out: torch.Tensor) -> None:
        """At the end of a full step: its first block's and its other blocks' residuals."""
        self.first, self.rest, self._pending = self._pending, h_out - h_0, None
        self.full += 1
