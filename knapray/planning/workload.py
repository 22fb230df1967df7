"""Cost of a sequence: what the planner balances.

Per transformer layer, a sequence of ``L`` tokens with model width ``d`` costs about

- ``24·L·d²`` FLOPs in per-token work: Q, K, V and output projections (4·d² multiply-adds
  per token) plus an MLP of ratio 4 (8·d² multiply-adds), at 2 FLOPs per multiply-add;
- ``4·L²·d`` FLOPs in attention: ``QKᵀ`` and ``PV`` are ``L²·d`` multiply-adds each;
  ``gamma`` scales this term for how efficiently the attention kernel runs compared with
  the GEMMs (and absorbs its memory-bound softmax part).

A sequence placed on a bag of ``g`` GPUs with Ulysses sequence parallelism costs each GPU
its chunk's per-token work (``≈ L/g`` tokens) plus ``1/g`` of the attention (each GPU
attends over the whole sequence for ``heads/g`` heads). Only relative costs matter for
balancing, so the unit (FLOPs per layer) cancels out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class WorkloadModel:
    """Estimated work of sequences of given lengths (vectorized over lengths)."""

    d_model: int = 3072
    """Transformer width ``d``."""
    gamma: float = 0.4
    """Relative cost of attention FLOPs versus GEMM FLOPs."""
    linear_coef: float = 24.0
    """FLOPs per token per ``d²`` in projections and MLP (24 for an MLP ratio of 4)."""
    attn_coef: float = 4.0
    """FLOPs per token pair per ``d`` in attention (4: QKᵀ and PV)."""

    def __post_init__(self) -> None:
        if self.d_model <= 0:
            raise ValueError(f"d_model must be > 0, got {self.d_model}")
        if self.gamma < 0 or self.linear_coef < 0 or self.attn_coef < 0:
            raise ValueError(
                "gamma, linear_coef and attn_coef must be >= 0, got "
                f"{self.gamma}, {self.linear_coef}, {self.attn_coef}"
            )

    def linear(self, tokens: np.ndarray | float) -> np.ndarray:
        """Per-token work of ``tokens`` tokens: ``linear_coef·tokens·d²``."""
        return self.linear_coef * np.asarray(tokens, dtype=np.float64) * float(self.d_model) ** 2

    def attention(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Attention work of whole sequences: ``gamma·attn_coef·L²·d``."""
        length = np.asarray(seq_len, dtype=np.float64)
        return self.gamma * self.attn_coef * length * length * float(self.d_model)

    def __call__(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Total work ``W(L)`` of sequences of length ``seq_len``."""
        return self.linear(seq_len) + self.attention(seq_len)

    def per_gpu(self, seq_len: np.ndarray | float, bag_size: np.ndarray | int) -> np.ndarray:
        """Work each GPU of a bag of ``bag_size`` does for one sequence: ``W(L)/g``."""
        return self(seq_len) / np.asarray(bag_size, dtype=np.float64)

    def chunk(
        self, chunk_len: np.ndarray, seq_len: np.ndarray, bag_size: np.ndarray
    ) -> np.ndarray:
        """Work of one chunk: its own tokens' per-token work plus ``1/g`` of the
        sequence's attention. Summed over a sequence's chunks this is ``W(L)``."""
        return self.linear(chunk_len) + self.attention(seq_len) / np.asarray(
            bag_size, dtype=np.float64
        )
