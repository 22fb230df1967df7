"""Rectified-flow objective on packed image tokens."""

from __future__ import annotations

import dataclasses

import torch

from knapray.models.packing import PackedBatch

TIMESTEP_KINDS = ("logit_normal", "uniform")


def flow_inputs(
    x0: torch.Tensor, noise: torch.Tensor, t_per_token: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x0, noise (Ni, patch_dim), t_per_token (Ni,) -> x_t = (1-t)·x0 + t·noise, target = noise - x0."""
    if x0.shape != noise.shape or t_per_token.shape != x0.shape[:1]:
        raise ValueError(
            f"expected x0 == noise shape (Ni, P) and t (Ni,), got {tuple(x0.shape)}, "
            f"{tuple(noise.shape)}, {tuple(t_per_token.shape)}"
        )
    t = t_per_token.to(x0.dtype)[:, None]  # (Ni,) -> (Ni, 1), broadcast over patch features
    return (1 - t) * x0 + t * noise, noise - x0


def add_noise(batch: PackedBatch, noise: torch.Tensor) -> PackedBatch:
    """The batch with x_img replaced by x_t at each sequence's timestep and targets set.

    ``batch.x_img`` holds the clean latents x0; ``noise`` has the same shape.
    """
    x_t, target = flow_inputs(batch.x_img, noise, batch.timesteps[batch.image_seq_index])
    return dataclasses.replace(batch, x_img=x_t, targets=target)


def flow_loss(pred: torch.Tensor, target: torch.Tensor, global_token_count: int,
              tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of squared errors over local image tokens and features / (global tokens · patch_dim).

    ``global_token_count`` is the number of image tokens in the whole step across all ranks
    that share the optimizer step. Dividing the local *sum* by that global count (instead of
    taking a local mean) makes the ranks' losses add up to the single-process mean loss, and
    their gradients add up to its gradient — whatever number of tokens each rank holds after
    balancing. So gradients must be SUM-reduced across ranks; a mean-reducing wrapper (DDP)
    needs the loss multiplied by the world size. A rank with no image tokens returns 0 that
    is still connected to ``pred``.

    Computed in fp32 whatever the dtypes of ``pred`` and ``target`` (a bf16 sum over many
    tokens would lose the loss's low digits), also under autocast; the loss is fp32.

    ``tokens``: (Ni,) bool, the tokens the loss covers (``PackedBatch.loss_tokens``; then
    ``global_token_count`` counts those), by a product rather than an index, so that the
    host never waits for the device to count them.
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    if global_token_count < 1:
        raise ValueError(f"global_token_count must be >= 1, got {global_token_count}")
    sq = (pred.float() - target.float()).pow(2)
    if tokens is not None:
        sq = sq * tokens.to(sq.dtype)[:, None]
    sq_err = sq.sum()
    return sq_err / (global_token_count * pred.shape[-1])


def sample_timesteps(
    n: int,
    *,
    generator: torch.Generator,
    kind: str = "logit_normal",
    mean: float = 0.0,
    std: float = 1.0,
) -> torch.Tensor:
    """n timesteps in (0, 1), fp32, from ``generator`` (seeded by the caller for reproducibility).

    ``logit_normal``: sigmoid(N(mean, std)), SD3's default that favors mid-range t.
    ``uniform``: U(0, 1).
    """
    if kind not in TIMESTEP_KINDS:
        raise ValueError(f"unknown timestep distribution {kind!r}; valid: {list(TIMESTEP_KINDS)}")
    if kind == "uniform":
        return torch.rand(n, generator=generator)
    return torch.sigmoid(torch.randn(n, generator=generator) * std + mean)
