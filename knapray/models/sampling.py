"""Sampling a flow model: rectified-flow Euler steps from noise to data over packed
requests of any sizes (``knapray sample`` is its command: knapray/commands/sample.py).

Every request, each at its own resolution and frame count, is one sequence of ONE varlen
batch (the model's own packed attention), and every Euler step is one forward pass over
all of them:

    x_1 = noise;  x_{t - dt} = x_t - dt * v(x_t, t)      (x_t = (1-t)·x_0 + t·noise)

with classifier-free guidance against unconditional embeddings, or a FLUX.1-dev model's
embedded guidance input; each request's timesteps shifted by its own shift (the family's
``sample_shift``: FLUX.1-dev from its image tokens; Wan 5.0)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

# torch and the model load in the functions that need them.


def flow_timesteps(steps: int, shift: float = 1.0) -> list[float]:
    """``steps + 1`` times from 1 to 0; ``shift`` > 1 spends more steps at high noise (SD3)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    ts = np.linspace(1.0, 0.0, steps + 1)
    return (shift * ts / (1 + (shift - 1) * ts)).tolist()


def embeds_guidance(model) -> bool:
    """Whether ``model`` takes a guidance input (FLUX.1-dev) instead of classifier-free guidance."""
    return bool(getattr(model.cfg, "guidance_embeds", False))


def request_shifts(model, shapes: list[tuple[int, int, int]], shift: float | None) -> list[float]:
    """Each request's timestep shift: ``shift`` for all when given; else the family's
    (``Family.sample_shift``: 1 for the MMDiT and FLUX.1-schnell, which samples unshifted as
    BFL's ``get_schedule(..., shift=not is_schnell)``; Wan 5, its pipelines' ``flow_shift``),
    or, where that is None (FLUX.1-dev), the per-request resolution shift from its image
    tokens, as BFL's and diffusers' dev pipelines."""
    from knapray.models.families import get_family

    if shift is not None:
        return [shift] * len(shapes)
    own = get_family(model.cfg.family).sample_shift(model.cfg)
    if own is not None:
        return [own] * len(shapes)
    from knapray.models.timesteps import ResolutionShift

    pt, ph, pw = model.cfg.patch_size
    return [ResolutionShift().shift((t // pt) * (h // ph) * (w // pw)) for t, h, w in shapes]


def sample_latents(model, conds: list[tuple[np.ndarray, np.ndarray]], shapes: list[tuple[int, int, int]],
                   *, steps: int, seed: int, guidance: float = 1.0, shift: float | None = 1.0,
                   unconditional: tuple[np.ndarray, np.ndarray] | None = None) -> list[np.ndarray]:
    """Euler-integrate the learned velocity of ``model`` (any family's) from noise to data
    for every request at once.

    ``conds``: (text (L, text_dim), pooled (pooled_dim,)) per request; ``shapes``: latent
    (T, H, W) per request; ``shift``: None for the family's own (``request_shifts``);
    ``guidance``: the guidance input of a model that embeds it, else the classifier-free
    guidance scale against ``unconditional`` (default: 0 text tokens, zero pooled).
    Returns latents (C, T, H, W)."""
    import torch

    with torch.no_grad():
        return _integrate(model, conds, shapes, steps=steps, seed=seed, guidance=guidance, shift=shift,
                          unconditional=unconditional)


def _integrate(model, conds, shapes, *, steps: int, seed: int, guidance: float, shift: float | None,
               unconditional) -> list[np.ndarray]:
    import torch

    from knapray.models import pack_samples

    cfg = model.cfg
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    embedded = embeds_guidance(model)
    items = []
    for (text, pooled), (t, h, w) in zip(conds, shapes):
        items.append({"latent": torch.randn(cfg.in_channels, t, h, w, generator=gen),
                      "text": torch.as_tensor(text, dtype=torch.float32),
                      "pooled": torch.as_tensor(pooled, dtype=torch.float32), "timestep": 1.0,
                      **({"guidance": guidance} if embedded else {})})
    shifts = request_shifts(model, list(shapes), shift)
    cfg_scale = 1.0 if embedded else guidance
    if cfg_scale != 1.0:  # the same requests, unconditioned, for classifier-free guidance
        text_u, pooled_u = unconditional if unconditional is not None else (
            np.zeros((0, cfg.text_dim), np.float32), np.zeros(cfg.pooled_dim, np.float32))
        items += [dict(it, text=torch.as_tensor(text_u), pooled=torch.as_tensor(pooled_u)) for it in items]
        shifts += shifts
    batch = pack_samples(items, cfg).to(device)
    n = len(conds)
    image_rows = batch.image_seq_index  # (Ni,) request of each image token
    x = batch.x_img.clone()
    times = torch.tensor([flow_timesteps(steps, s) for s in shifts], dtype=torch.float64, device=device)  # (S, steps+1)
    for i in range(steps):
        v = model(replace(batch, x_img=x, timesteps=times[:, i].float()))  # (Ni, patch_dim)
        if cfg_scale != 1.0:
            cond = image_rows < n
            v_c, v_u = v[cond], v[~cond]
            v_g = v_u + cfg_scale * (v_c - v_u)
            v = torch.cat((v_g, v_g))  # both halves move together
        dt = (times[:, i] - times[:, i + 1])[image_rows, None].to(x.dtype)  # (Ni, 1): each token its request's step
        x = x - dt * v
    return _unpack(x[image_rows < n].cpu(), batch, n, cfg)


def _unpack(x, batch, n: int, cfg) -> list[np.ndarray]:
    """The first ``n`` requests' image tokens (Ni, P) -> latents (C, T, H, W)."""
    from knapray.models.packing import unpatchify

    out, start = [], 0
    for grid in batch.grids[:n]:
        count = grid[0] * grid[1] * grid[2]
        out.append(unpatchify(x[start : start + count], grid, cfg.patch_size, cfg.in_channels).numpy())
        start += count
    return out
