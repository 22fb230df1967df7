"""A step's samples -> a noised ``PackedBatch``: timesteps, noise and targets per sample
from a (seed, epoch, sample id) generator."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from knapray.models.config import DiTConfig
from knapray.models.flow import add_noise
from knapray.models.timesteps import TimestepDistribution
from knapray.models.packing import PackedBatch, pack_samples


# --- packed batches (worker side) ----------------------------------------------------------


def sample_generator(seed: int, epoch: int, sample_id: int) -> torch.Generator:
    """A CPU generator for one sample in one epoch: its timestep and noise depend on
    nothing else, so they are the same whichever rank, step, world size or plan trains it
    (a run resumed at another world size draws the very same ones)."""
    if min(seed, epoch) < 0:
        raise ValueError(f"seed and epoch must be >= 0, got {seed}, {epoch}")
    key = (epoch, int(sample_id) & 0xFFFFFFFF, (int(sample_id) >> 32) & 0xFFFFFFFF)
    state = np.random.SeedSequence(seed, spawn_key=key).generate_state(2, dtype=np.uint32)
    gen = torch.Generator()
    gen.manual_seed(int(state[0]) << 32 | int(state[1]))
    return gen


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A float32 tensor over ``array``'s memory, without a copy. Decoded payloads are views
    of read-only Arrow buffers, which torch warns about (it cannot mark a tensor
    read-only); nothing writes to them: ``pack_samples`` patchifies and concatenates into
    new tensors, the batch's one copy of the data."""
    array = np.asarray(array, dtype=np.float32)
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _model_input(sample: Mapping[str, Any], latent: np.ndarray, cfg: DiTConfig, sid: Any) -> torch.Tensor:
    """The sample's model input (C_in, T, H, W): its latent, then, for a model that takes more
    channels than the latent has (Wan 2.1 I2V), its conditioning latent's. Patchify puts a
    token's channels outermost in its features, so the input's tokens are the latent's features
    then the condition's (what ``build_packed_batch`` noises: the first ``out_patch_dim``)."""
    tensor = _as_tensor(latent)
    if latent.ndim == 4 and latent.shape[0] < cfg.in_channels:
        condition = sample.get("condition")
        if condition is None:
            raise ValueError(f"sample {sid}: latent shape {tuple(latent.shape)} does not match the model's "
                             f"(in_channels={cfg.in_channels}, T, H, W), and the sample has no conditioning latent "
                             "to make up the difference (a corpus without condition)")
        if condition.ndim != 4 or condition.shape[1:] != latent.shape[1:]:
            raise ValueError(f"sample {sid}: condition shape {tuple(condition.shape)} is not (C, T, H, W) with "
                             f"the latent's (T, H, W)={tuple(latent.shape[1:])}")
        tensor = torch.cat((tensor, _as_tensor(condition)))  # (C + C_cond, T, H, W)
    out_channels = cfg.out_patch_dim // math.prod(cfg.patch_size)
    if tensor.ndim != 4 or tensor.shape[0] != cfg.in_channels or latent.shape[0] != out_channels:
        extra = tensor.shape[0] - latent.shape[0] if tensor.ndim == 4 else 0
        with_condition = f" and condition channels {extra}" if extra else ""
        raise ValueError(
            f"sample {sid}: latent shape {tuple(latent.shape)}{with_condition} does not match the model's "
            f"(in_channels={cfg.in_channels}, T, H, W) with {out_channels} output channels"
        )
    return tensor


def build_packed_batch(
    samples: Sequence[Mapping[str, Any]],
    cfg: DiTConfig,
    *,
    seed: int,
    epoch: int = 0,
    timesteps: TimestepDistribution = TimestepDistribution(),
    guidance: float | None = None,
    first_frame_share: float = 0.0,
) -> PackedBatch:
    """Pack decoded samples (``DecodedStep.samples``, each with its ``sample_id``) into a noised
    ``PackedBatch`` with targets.

    Each sample draws, from ``sample_generator(seed, epoch, sample_id)``, its timestep
    (shifted by its own image token count with the resolution shift) and then the noise of
    its image tokens; ``x_img`` is then x_t = (1-t)·x0 + t·noise and ``targets`` is
    noise - x0. ``guidance``: every sequence's guidance input (a model that embeds it,
    FLUX.1-dev), None for none. An empty list (a dry rank) gives an empty batch.

    A model with a time per token (``expand_timesteps``, Wan 2.2 TI2V-5B) gets each
    sequence's first-frame time; ``first_frame_share`` of its clips (drawn per sample from its
    generator, after its noise) are trained image-to-video on their own first frame: that
    latent frame stays clean (x_t = x0), its time is 0 and the loss leaves it out
    (``loss_tokens``); a single-frame sample is always generated whole.

    A model that takes more channels than the latent has (Wan 2.1 I2V: in_channels = the
    latent's + the conditioning latent's, ``out_patch_dim`` the latent's) gets each token's
    noised latent features then its sample's ``condition`` features, as it were the patchified
    channel concatenation; only the latent is noised (the same draws as a text-to-video model's
    of the same latent) and ``targets`` cover it alone. A model with ``image_dim`` gets each
    sample's ``image_context`` (a dry rank's empty batch: (0, image_tokens, image_dim)).
    """
    image_dim = getattr(cfg, "image_dim", 0)  # a model that cross-attends to image tokens (Wan 2.1 I2V)
    packed_input, gens = [], []
    for sample in samples:
        latent = sample["latent"]
        sid = sample.get("sample_id")
        if sid is None:
            raise ValueError("build_packed_batch needs each sample's sample_id (its noise is drawn from it)")
        latent = _model_input(sample, latent, cfg, sid)
        if any(size % p for size, p in zip(latent.shape[1:], cfg.patch_size)):
            raise ValueError(
                f"sample {sid}: latent (T, H, W)={tuple(latent.shape[1:])} is not divisible by "
                f"the model's patch_size={tuple(cfg.patch_size)}"
            )
        gen = sample_generator(seed, epoch, int(sid))
        gens.append(gen)
        image_tokens = math.prod(size // p for size, p in zip(latent.shape[1:], cfg.patch_size))
        packed_input.append(
            {
                "latent": latent,
                "text": _as_tensor(sample["text"]),
                "pooled": _as_tensor(sample["pooled"]),
                "timestep": float(timesteps.sample(1, generator=gen, image_tokens=image_tokens)[0]),
            }
        )
        if image_dim:
            if sample.get("image_context") is None:
                raise ValueError(f"sample {sid}: the model cross-attends to image tokens (image_dim {image_dim}); "
                                 "the sample has none (a corpus without image_context)")
            packed_input[-1]["image_context"] = _as_tensor(sample["image_context"])
    clean = pack_samples(packed_input, cfg)
    if image_dim and clean.image_context is None:  # a dry rank's empty batch: (0, L, image_dim)
        clean = dataclasses.replace(clean, image_context=torch.zeros(0, cfg.image_tokens, image_dim))
    if guidance is not None:  # also for an empty batch: the model's condition takes (0,)
        clean = dataclasses.replace(clean, guidance=torch.full((clean.num_sequences,), float(guidance)))
    # (Ni_s, P) per sample, in packing order: the sample's image tokens follow each other
    counts = torch.bincount(clean.image_seq_index, minlength=len(gens)).tolist()
    width = cfg.out_patch_dim  # the latent's features: a conditioned input's first ones (channels outermost)
    noise = [torch.randn((n, width), generator=g, dtype=clean.x_img.dtype) for n, g in zip(counts, gens)]
    noise = torch.cat(noise) if noise else clean.x_img.new_zeros(0, width)
    if width == clean.x_img.shape[1]:
        batch = add_noise(clean, noise)
    else:  # the condition's features stay as they are, after the noised latent's
        noised = add_noise(dataclasses.replace(clean, x_img=clean.x_img[:, :width]), noise)
        batch = dataclasses.replace(noised, x_img=torch.cat((noised.x_img, clean.x_img[:, width:]), dim=1))
    if not getattr(cfg, "expand_timesteps", False):
        if first_frame_share:
            raise ValueError(f"first_frame_share={first_frame_share}: the model has one time per sequence "
                             "(model.expand_timesteps false); only a model with a time per token keeps a frame clean")
        return batch
    return _first_frames(clean, batch, gens, first_frame_share)


def _first_frames(clean: PackedBatch, batch: PackedBatch, gens: list[torch.Generator], share: float) -> PackedBatch:
    """``batch`` with each sequence's first-frame time; the clips drawn image-conditioned
    (``build_packed_batch``) keep their first latent frame clean and out of the loss."""
    first = clean.timesteps.clone()
    if not share:
        return dataclasses.replace(batch, first_frame_timesteps=first)
    draws = [float(torch.rand((), generator=g)) for g in gens]
    conditioned = torch.tensor([d < share and grid[0] > 1 for d, grid in zip(draws, clean.grids)], dtype=torch.bool)
    first[conditioned] = 0.0
    img_seq = clean.image_seq_index
    clean_tokens = conditioned[img_seq] & (clean.pos[~clean.is_text][:, 0] == 0)  # (Ni,)
    x_img = torch.where(clean_tokens[:, None], clean.x_img, batch.x_img)
    return dataclasses.replace(batch, x_img=x_img, first_frame_timesteps=first, loss_tokens=~clean_tokens)
