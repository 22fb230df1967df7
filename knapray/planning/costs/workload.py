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

Two attention kinds (``attention_kind``):

- ``joint`` (Flux): a sequence's ``L`` tokens are its text and visual tokens together,
  attending to each other (the terms above);
- ``cross`` (Wan): ``L`` counts visual tokens only; they self-attend (``4·L²·d``) and
  cross-attend to a fixed ``T = text_tokens`` text tokens (umT5, padded to 512 in Wan's
  pipeline): ``4·L·T·d`` more attention FLOPs (``QKᵀ`` and ``PV`` over ``L·T`` pairs, at
  the same ``gamma``) and ``text_kv_coef·T·d²`` for the text keys' and values'
  projections (4: two ``d x d`` GEMMs). Text tokens are not updated by the blocks, so the
  per-token work covers the ``L`` visual tokens only (for Wan its coefficient is
  ``2·(6 + 2·ffn/d)``: self-attention q, k, v, o; cross-attention q, o; the FFN). Under
  Ulysses each GPU of a bag holds ``heads/g`` heads of the text keys and values as of the
  visual queries, so the cross term splits over the bag like self-attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ATTENTION_KINDS = ("joint", "cross")
"""``joint``: text and visual tokens in one sequence (Flux); ``cross``: visual tokens
self-attend and cross-attend to a fixed-length text (Wan)."""

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
    attention_kind: str = "joint"
    """``joint`` (Flux) or ``cross`` (Wan: lengths are visual tokens; a fixed text is
    cross-attended); see the module docstring."""
    text_tokens: int = 512
    """``cross``: text tokens every sequence cross-attends to (Wan pads umT5 to 512)."""
    text_kv_coef: float = 4.0
    """``cross``: FLOPs per text token per ``d²`` of the text keys' and values' projections."""

    def __post_init__(self) -> None:
        if self.d_model <= 0:
            raise ValueError(f"d_model must be > 0, got {self.d_model}")
        if self.gamma < 0 or self.linear_coef < 0 or self.attn_coef < 0:
            raise ValueError(
                "gamma, linear_coef and attn_coef must be >= 0, got "
                f"{self.gamma}, {self.linear_coef}, {self.attn_coef}"
            )
        if self.attention_kind not in ATTENTION_KINDS:
            raise ValueError(f"attention_kind must be one of {ATTENTION_KINDS}, got {self.attention_kind!r}")
        if isinstance(self.text_tokens, bool) or int(self.text_tokens) != self.text_tokens or self.text_tokens < 0:
            raise ValueError(f"text_tokens must be an integer >= 0, got {self.text_tokens!r}")
        if not (np.isfinite(self.text_kv_coef) and self.text_kv_coef >= 0):
            raise ValueError(f"text_kv_coef must be a number >= 0, got {self.text_kv_coef!r}")

    def linear(self, tokens: np.ndarray | float) -> np.ndarray:
        """Per-token work of ``tokens`` tokens: ``linear_coef·tokens·d²``."""
        return self.linear_coef * np.asarray(tokens, dtype=np.float64) * float(self.d_model) ** 2

    def self_attention(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Self-attention work of whole sequences: ``gamma·attn_coef·L²·d``."""
        length = np.asarray(seq_len, dtype=np.float64)
        return self.gamma * self.attn_coef * length * length * float(self.d_model)

    def cross_attention(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Cross-attention work of whole sequences (0 for ``joint``):
        ``gamma·attn_coef·L·T·d + text_kv_coef·T·d²``."""
        length = np.asarray(seq_len, dtype=np.float64)
        if self.attention_kind == "joint":
            return np.zeros_like(length)
        d, t = float(self.d_model), float(self.text_tokens)
        return self.gamma * self.attn_coef * length * t * d + self.text_kv_coef * t * d * d

    def attention(self, seq_len: np.ndarray | float) -> np.ndarray:
        """Work of whole sequences that splits over a bag's heads: self-attention, plus
        cross-attention for ``cross``."""
        if self.attention_kind == "joint":
            return self.self_attention(seq_len)
        return self.self_attention(seq_len) + self.cross_attention(seq_len)

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
