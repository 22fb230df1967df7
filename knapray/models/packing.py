"""Patchify latents and pack many (text, image/video) samples into one token batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from knapray.models.config import DiTConfig
from knapray.transfer import host_to_device


def _grid(shape: Sequence[int], patch_size: Sequence[int]) -> tuple[int, int, int]:
    if len(patch_size) != 3 or len(shape) != 3:
        raise ValueError(f"expected (T, H, W) and a 3-entry patch_size, got {tuple(shape)} and {tuple(patch_size)}")
    if any(s % p for s, p in zip(shape, patch_size)):
        raise ValueError(
            f"latent (T, H, W)={tuple(shape)} is not divisible by patch_size={tuple(patch_size)}"
        )
    t, h, w = (s // p for s, p in zip(shape, patch_size))
    return t, h, w


def grid_positions(grid: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """(t, h, w) integer coordinates of every patch of a grid, raster order -> (Ti*Hi*Wi, 3) int64."""
    axes = [torch.arange(n, device=device, dtype=torch.int64) for n in grid]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)


def patchify(latent: torch.Tensor, patch_size: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """latent (C, T, H, W) -> tokens (Ti*Hi*Wi, C*pt*ph*pw) in raster order, pos (Ti*Hi*Wi, 3) int64."""
    if latent.dim() != 4:
        raise ValueError(f"latent must be (C, T, H, W), got shape {tuple(latent.shape)}")
    c = latent.shape[0]
    pt, ph, pw = patch_size
    ti, hi, wi = _grid(latent.shape[1:], patch_size)
    # (C, Ti*pt, Hi*ph, Wi*pw) -> (C, Ti, pt, Hi, ph, Wi, pw) -> (Ti, Hi, Wi, C, pt, ph, pw)
    x = latent.reshape(c, ti, pt, hi, ph, wi, pw).permute(1, 3, 5, 0, 2, 4, 6)
    tokens = x.reshape(ti * hi * wi, c * pt * ph * pw)
    return tokens, grid_positions((ti, hi, wi), device=latent.device)


def unpatchify(
    tokens: torch.Tensor,
    grid_or_pos: Sequence[int] | torch.Tensor,
    patch_size: Sequence[int],
    channels: int,
) -> torch.Tensor:
    """Inverse of patchify. ``grid_or_pos``: the grid (Ti, Hi, Wi) for raster-ordered tokens, or
    their positions (n, 3) int64 in any order. Returns (C, Ti*pt, Hi*ph, Wi*pw)."""
    pt, ph, pw = patch_size
    patch_dim = channels * pt * ph * pw
    if tokens.dim() != 2 or tokens.shape[1] != patch_dim:
        raise ValueError(
            f"tokens must be (n, channels*pt*ph*pw)=(n, {patch_dim}), got shape {tuple(tokens.shape)}"
        )
    if isinstance(grid_or_pos, torch.Tensor):
        pos = grid_or_pos
        if pos.shape != (tokens.shape[0], 3) or pos.shape[0] == 0:
            raise ValueError(f"pos must be ({tokens.shape[0]}, 3) and non-empty, got {tuple(pos.shape)}")
        grid = tuple(int(g) + 1 for g in pos.max(dim=0).values.tolist())
        flat = (pos[:, 0] * grid[1] + pos[:, 1]) * grid[2] + pos[:, 2]  # raster index
        # Scatter into raster order; every grid cell must be hit exactly once.
        if grid[0] * grid[1] * grid[2] != tokens.shape[0] or torch.unique(flat).numel() != tokens.shape[0]:
            raise ValueError(f"pos does not cover a full grid {grid} exactly once")
        tokens = tokens.new_zeros(tokens.shape).index_copy(0, flat, tokens)
    else:
        grid = tuple(int(g) for g in grid_or_pos)
        if len(grid) != 3 or grid[0] * grid[1] * grid[2] != tokens.shape[0]:
            raise ValueError(f"grid {grid} does not match {tokens.shape[0]} tokens")
    ti, hi, wi = grid
    # (Ti*Hi*Wi, C*pt*ph*pw) -> (Ti, Hi, Wi, C, pt, ph, pw) -> (C, Ti, pt, Hi, ph, Wi, pw)
    x = tokens.reshape(ti, hi, wi, channels, pt, ph, pw).permute(3, 0, 4, 1, 5, 2, 6)
    return x.reshape(channels, ti * pt, hi * ph, wi * pw)


@dataclasses.dataclass(kw_only=True, slots=True)
class PackedBatch:
    """S sequences packed into N = Nt + Ni tokens.

    Layout: sequence after sequence; within one, its text tokens then its image tokens.
    ``x_txt`` rows are the text tokens in packed order (row j = j-th True of ``is_text``),
    ``x_img`` rows likewise for image tokens. Text tokens sit at RoPE position (0, 0, 0).
    """

    x_txt: torch.Tensor
    """(Nt, text_dim) text-encoder features."""
    x_img: torch.Tensor
    """(Ni, patch_dim) patchified latents (model input)."""
    is_text: torch.Tensor
    """(N,) bool, modality of each packed token."""
    pos: torch.Tensor
    """(N, 3) int64 (t, h, w) RoPE coordinates."""
    seq_index: torch.Tensor
    """(N,) int64, sequence of each token, in [0, S)."""
    cu_seqlens: torch.Tensor
    """(S+1,) int32 cumulative sequence lengths, starting at 0."""
    max_seqlen: int
    """Longest sequence (tokens)."""
    timesteps: torch.Tensor
    """(S,) float flow-matching time per sequence."""
    pooled: torch.Tensor
    """(S, pooled_dim) pooled conditioning per sequence."""
    seq_lens: torch.Tensor
    """(S,) int64 tokens per sequence (text + image)."""
    grids: tuple[tuple[int, int, int], ...] = ()
    """Per sequence, the image token grid (Ti, Hi, Wi), for unpatchify."""
    targets: torch.Tensor | None = None
    """(Ni, out_patch_dim) regression target of the image tokens, if set (the model's
    output features: ``cfg.out_patch_dim``, fewer than x_img's for Wan 2.1 I2V)."""
    guidance: torch.Tensor | None = None
    """(S,) float guidance strength per sequence, for a model that embeds it (Flux.1-dev);
    None for the others."""
    image_context: torch.Tensor | None = None
    """(S, L, image_dim) the conditioning image's encoder tokens per sequence, for a model
    that cross-attends to them (Wan 2.1 I2V: CLIP ViT-H/14's, L = 257 of 1280); None for
    the others."""
    first_frame_timesteps: torch.Tensor | None = None
    """(S,) float flow-matching time of each sequence's first latent frame, for a model with
    per-token times (Wan 2.2 TI2V-5B): 0 where an image conditions the sequence (its first
    frame is the image's clean latent), the sequence's ``timesteps`` where none does; None
    for the others."""
    loss_tokens: torch.Tensor | None = None
    """(Ni,) bool: the image tokens the loss covers, None for all (a sequence whose first
    latent frame is its conditioning image's clean latent leaves that frame out)."""

    def __post_init__(self) -> None:
        n, s = self.is_text.shape[0], self.seq_lens.shape[0]
        if self.x_txt.shape[0] + self.x_img.shape[0] != n:
            raise ValueError(
                f"x_txt rows ({self.x_txt.shape[0]}) + x_img rows ({self.x_img.shape[0]}) != N={n}"
            )
        if self.pos.shape != (n, 3) or self.seq_index.shape != (n,):
            raise ValueError(f"pos must be ({n}, 3) and seq_index ({n},), got {tuple(self.pos.shape)}, "
                             f"{tuple(self.seq_index.shape)}")
        if self.cu_seqlens.shape != (s + 1,) or self.timesteps.shape != (s,) or self.pooled.shape[0] != s:
            raise ValueError(
                f"per-sequence fields disagree on S={s}: cu_seqlens {tuple(self.cu_seqlens.shape)}, "
                f"timesteps {tuple(self.timesteps.shape)}, pooled {tuple(self.pooled.shape)}"
            )
        if self.guidance is not None and self.guidance.shape != (s,):
            raise ValueError(f"guidance must be ({s},), one value per sequence, got {tuple(self.guidance.shape)}")
        if self.targets is not None and (self.targets.dim() != 2 or self.targets.shape[0] != self.x_img.shape[0]):
            raise ValueError(f"targets {tuple(self.targets.shape)} must have one row per x_img row "
                             f"{tuple(self.x_img.shape)}")
        if self.image_context is not None and (self.image_context.dim() != 3 or self.image_context.shape[0] != s):
            raise ValueError(f"image_context must be ({s}, L, image_dim), one per sequence, got "
                             f"{tuple(self.image_context.shape)}")
        if self.loss_tokens is not None and self.loss_tokens.shape != (self.x_img.shape[0],):
            raise ValueError(f"loss_tokens must be ({self.x_img.shape[0]},), one per image token, got "
                             f"{tuple(self.loss_tokens.shape)}")
        if self.first_frame_timesteps is not None and self.first_frame_timesteps.shape != (s,):
            raise ValueError(f"first_frame_timesteps must be ({s},), one value per sequence, got "
                             f"{tuple(self.first_frame_timesteps.shape)}")

    @property
    def num_sequences(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def image_seq_index(self) -> torch.Tensor:
        """(Ni,) sequence of each image token, in x_img row order."""
        return self.seq_index[~self.is_text]

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch on ``device``; from the host, copied from pinned memory without blocking
        (``knapray.transfer.host_to_device``)."""
        moved = {
            f.name: (host_to_device(v, device) if isinstance(v, torch.Tensor) else v)
            for f in dataclasses.fields(self)
            for v in (getattr(self, f.name),)
        }
        return PackedBatch(**moved)

    def text_tokens_per_sequence(self) -> np.ndarray:
        """(S,) int64 text tokens of each sequence; read from a host (CPU) batch."""
        if self.is_text.device.type != "cpu":
            raise ValueError("text_tokens_per_sequence reads a host batch; call it before .to(device)")
        return np.bincount(self.seq_index[self.is_text].numpy(), minlength=self.num_sequences).astype(np.int64)


def pack_samples(samples: Sequence[dict[str, Any]], cfg: DiTConfig) -> PackedBatch:
    """Pack samples ``{latent (C,T,H,W), text (Lt, text_dim), pooled (pooled_dim,), timestep}``.

    ``text`` may have Lt = 0 (or be absent when cfg.text_dim == 0); ``pooled`` may be absent
    when cfg.pooled_dim == 0; ``guidance`` (a float, for a model that embeds it),
    ``image_context`` ((L, image_dim), L the same for all) and ``first_frame_timestep`` (a
    float) are each given by every sample or by none. An empty list gives an empty batch
    (S = 0, N = 0).
    Packing runs on the data-loading side: samples are CPU tensors; move the result with ``.to``.
    """
    x_txt, x_img, is_text, pos, seq_index, lens, grids, tsteps, pooled = ([] for _ in range(9))
    optional = {"guidance": [], "image_context": [], "first_frame_timestep": []}
    for i, sample in enumerate(samples):
        latent = sample["latent"]
        if latent.dim() != 4 or latent.shape[0] != cfg.in_channels:
            raise ValueError(
                f"sample {i}: latent must be (C={cfg.in_channels}, T, H, W), got {tuple(latent.shape)}"
            )
        tokens, img_pos = patchify(latent, cfg.patch_size)
        text = sample.get("text", latent.new_zeros(0, cfg.text_dim))
        if text.dim() != 2 or text.shape[1] != cfg.text_dim:
            raise ValueError(f"sample {i}: text must be (Lt, {cfg.text_dim}), got {tuple(text.shape)}")
        vec = sample.get("pooled", latent.new_zeros(cfg.pooled_dim))
        if vec.shape != (cfg.pooled_dim,):
            raise ValueError(f"sample {i}: pooled must be ({cfg.pooled_dim},), got {tuple(vec.shape)}")
        n_txt, n_img = text.shape[0], tokens.shape[0]
        x_txt.append(text)
        x_img.append(tokens)
        is_text.append(torch.arange(n_txt + n_img) < n_txt)
        pos.append(torch.cat((torch.zeros(n_txt, 3, dtype=torch.int64), img_pos)))
        seq_index.append(torch.full((n_txt + n_img,), i, dtype=torch.int64))
        lens.append(n_txt + n_img)
        grids.append(tuple(s // p for s, p in zip(latent.shape[1:], cfg.patch_size)))
        tsteps.append(float(sample["timestep"]))
        pooled.append(vec)
        for name, values in optional.items():
            if (name in sample) != (name in samples[0]):
                raise ValueError(f"sample {i}: give {name} for every sample or for none")
            if name == "image_context" and name in sample:
                ctx = sample[name]
                if ctx.dim() != 2 or ctx.shape != samples[0][name].shape:
                    raise ValueError(f"sample {i}: image_context must be (L, image_dim) as sample 0's "
                                     f"{tuple(samples[0][name].shape)}, got {tuple(ctx.shape)}")
                values.append(ctx)
            elif name in sample:
                values.append(float(sample[name]))

    seq_lens = torch.tensor(lens, dtype=torch.int64)
    cu_seqlens = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(seq_lens, 0)
    return PackedBatch(
        x_txt=torch.cat(x_txt) if x_txt else torch.zeros(0, cfg.text_dim),
        x_img=torch.cat(x_img) if x_img else torch.zeros(0, cfg.patch_dim),
        is_text=torch.cat(is_text) if is_text else torch.zeros(0, dtype=torch.bool),
        pos=torch.cat(pos) if pos else torch.zeros(0, 3, dtype=torch.int64),
        seq_index=torch.cat(seq_index) if seq_index else torch.zeros(0, dtype=torch.int64),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lens, default=0),
        timesteps=torch.tensor(tsteps, dtype=torch.float32),
        pooled=torch.stack(pooled) if pooled else torch.zeros(0, cfg.pooled_dim),
        seq_lens=seq_lens,
        grids=tuple(grids),
        guidance=torch.tensor(optional["guidance"], dtype=torch.float32) if optional["guidance"] else None,
        image_context=torch.stack(optional["image_context"]) if optional["image_context"] else None,
        first_frame_timesteps=(torch.tensor(optional["first_frame_timestep"], dtype=torch.float32)
                               if optional["first_frame_timestep"] else None),
    )
