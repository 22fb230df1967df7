"""Tiny random Flux.1 transformers saved by diffusers (``save_pretrained``), for the flux
family's tests: several head counts, RoPE axes, depths, with and without guidance."""

from __future__ import annotations

from pathlib import Path

TINY_FLUX = {
    # name: (heads, head_dim, axes_dims_rope, num_layers, num_single_layers, guidance_embeds)
    "dev_h2": (2, 16, (4, 6, 6), 1, 1, True),
    "schnell_h4": (4, 8, (2, 2, 4), 2, 1, False),
    "dev_h6": (6, 8, (0, 4, 4), 1, 2, True),
}
"""Every head count divides 2, the largest bag of the 4-rank tests' g1n2+g2n1."""


def save_tiny_flux(out: Path, heads: int, head_dim: int, axes: tuple[int, int, int], double: int, single: int,
                   guidance: bool, *, seed: int = 0, latent_channels: int = 4, text_dim: int = 24,
                   pooled_dim: int = 20, max_shard_size: str | None = None) -> Path:
    """A ``FluxTransformer2DModel`` with diffusers' own random init, saved as diffusers saves
    it (sharded with an index when ``max_shard_size`` is small)."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=double, num_single_layers=single,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_dim,
        pooled_projection_dim=pooled_dim, guidance_embeds=guidance, axes_dims_rope=tuple(axes),
    )
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return Path(out)


def save_all(root: Path) -> dict[str, Path]:
    """Every ``TINY_FLUX`` config under ``root`` (the first sharded into several files)."""
    return {name: save_tiny_flux(root / name, *spec, seed=i, max_shard_size="40KB" if i == 0 else None)
            for i, (name, spec) in enumerate(TINY_FLUX.items())}
