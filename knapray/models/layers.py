"""Per-token building blocks of the packed DiT / MMDiT: norms, RoPE, embeddings, adaLN."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from knapray.indexing import gather_rows
from knapray.models.fp8 import input_for

TIME_EMBED_DIM = 256
"""Width of the sinusoidal timestep features fed to the timestep MLP (as in DiT and Flux)."""


class RMSNorm(nn.Module):
    """RMS normalization over the last dimension with a learned gain.

    Computed in fp32, gain included, and returned in the input's dtype (the compute dtype).
    Multiplying by the gain after casting back would promote to the gain's dtype: with fp32
    parameters under bf16 autocast, q and k would reach attention in fp32 beside a bf16 v.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # no copy when x is fp32
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension without affine parameters (adaLN supplies scale and
    shift), computed in fp32 and returned in the input's dtype.

    torch's layer_norm kernels accumulate half-precision inputs in fp32, so a bf16 input
    needs no upcast copy. Under autocast layer_norm runs in fp32 and returns fp32; casting
    back keeps what follows (adaLN modulation, the next linear) in the compute dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), eps=self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def rope_frequencies(
    pos: torch.Tensor, axes_dim: tuple[int, ...], theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles for integer positions.

    pos: (N, A) int64, one coordinate per axis (t, h, w). Axis ``a`` gets ``axes_dim[a]``
    channels of the head, i.e. ``axes_dim[a] // 2`` rotation frequencies.
    Returns cos, sin, each (N, sum(axes_dim) // 2) in fp32.
    """
    if pos.dim() != 2 or pos.shape[1] != len(axes_dim):
        raise ValueError(f"pos must be (N, {len(axes_dim)}), got {tuple(pos.shape)}")
    if pos.dtype.is_floating_point:
        raise ValueError(f"pos must hold integer positions, got dtype {pos.dtype}")
    angles = []
    for axis, dim in enumerate(axes_dim):
        exponents = torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim
        inv_freq = 1.0 / (theta**exponents)  # (dim/2,)
        # Integer positions are exact in fp32 below 2**24, far beyond any latent grid.
        angles.append(pos[:, axis].to(torch.float32)[:, None] * inv_freq[None, :])  # (N, dim/2)
    angle = torch.cat(angles, dim=-1)  # (N, D/2)
    return angle.cos(), angle.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs (2i, 2i+1) of x (N, H, D) by per-token angles (N, D/2).

    Computed in fp32 (cos, sin are fp32) and returned in x's dtype, so q and k leave RoPE in
    the same dtype as v.
    """
    n_tokens, n_heads, head_dim = x.shape
    # (N, H, D) -> (N, H, D/2, 2): channel pairs, rotated in fp32
    pairs = x.float().reshape(n_tokens, n_heads, head_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]  # (N, 1, D/2), broadcast over heads
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1)
    # (N, H, D/2, 2) -> (N, H, D)
    return rotated.reshape(n_tokens, n_heads, head_dim).to(x.dtype)


def timestep_embedding(
    t: torch.Tensor, dim: int = TIME_EMBED_DIM, max_period: float = 10000.0, time_factor: float = 1000.0
) -> torch.Tensor:
    """Sinusoidal features of timesteps t (S,) in [0, 1] -> (S, dim) fp32.

    t is scaled by ``time_factor`` first (Flux convention) so that [0, 1] spans many periods.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float() * time_factor)[:, None] * freqs[None, :]  # (S, half)
    emb = torch.cat((args.cos(), args.sin()), dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class MLP(nn.Module):
    """Linear -> activation -> Linear. GELU(tanh) in transformer blocks, SiLU in embedders;
    ``bias=False``: linears without biases (FLUX.2's)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, activation: str = "gelu_tanh", *,
                 bias: bool = True) -> None:
        super().__init__()
        if activation not in ("gelu_tanh", "silu"):
            raise ValueError(f"unknown activation {activation!r}; valid: ['gelu_tanh', 'silu']")
        self.fc1 = nn.Linear(in_dim, hidden_dim, bias=bias)
        self.fc2 = nn.Linear(hidden_dim, out_dim, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.gelu(h, approximate="tanh") if self.activation == "gelu_tanh" else F.silu(h)
        return self.fc2(h)


class GatedMLP(nn.Module):
    """SwiGLU: ``fc2(silu(a) * b)`` where ``(a, b)`` are the two halves of ``fc1(x)`` (the gate
    first), no biases: FLUX.2's feed-forward, ``fc1`` d -> 2·hidden, ``fc2`` hidden -> d."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.fc2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(swiglu(self.fc1(x)))


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` of the halves ``(a, b)`` of x's last dimension."""
    gate, value = x.chunk(2, dim=-1)
    return F.silu(gate) * value


class Modulation(nn.Module):
    """adaLN modulation: SiLU(vec) -> Linear -> ``n_chunks`` vectors of width ``dim``.

    Called on one conditioning vector per sequence (S rows), then gathered per token: the
    Linear costs S·dim·n·dim instead of N·dim·n·dim, which would rival the MLP. The gather's
    backward sums each sequence's token gradients in fp32 (``knapray.indexing.gather_rows``):
    in bf16 a long sequence's sum would lose 20-40% of its size.
    """

    def __init__(self, dim: int, n_chunks: int, *, bias: bool = True) -> None:
        super().__init__()
        self.n_chunks = n_chunks
        self.lin = nn.Linear(dim, n_chunks * dim, bias=bias)

    def per_sequence(self, vec_seq: torch.Tensor) -> torch.Tensor:
        """vec_seq (S, dim) -> (S, n_chunks·dim): the chunks of every sequence, side by side.

        vec_seq may be fp32 beside bf16 weights (``MMDiT.condition``): it is cast to the
        weights' dtype here (a float8 layer casts it itself), so its gradient comes back to it in fp32."""
        return self.lin(input_for(self.lin, F.silu(vec_seq)))

    def forward(self, vec_seq: torch.Tensor, seq_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """vec_seq (S, dim), seq_index (n,) -> n_chunks tensors of (n, dim)."""
        return per_token(self.per_sequence(vec_seq), seq_index, self.n_chunks)


def per_token(per_seq: torch.Tensor, seq_index: torch.Tensor, n_chunks: int) -> tuple[torch.Tensor, ...]:
    """Per-sequence modulation (S, n_chunks·dim) -> ``n_chunks`` tensors (n, dim), row i of
    each that of token i's sequence (``gather_rows``: its backward sums in fp32)."""
    return gather_rows(per_seq, seq_index).chunk(n_chunks, dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: x * (1 + scale) + shift, all (n, dim)."""
    return x * (1 + scale) + shift
