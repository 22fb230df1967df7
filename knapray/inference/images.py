"""Pictures of sampled latents: a latent's preview when nothing decodes it, and the grid of
titled requests ``knapray sample`` and validation write."""

from __future__ import annotations

import math

import numpy as np


def preview(latent: np.ndarray) -> np.ndarray:
    """(C, T, h, w) -> (T, h, w, 3) uint8 from the first three channels, each stretched
    to its own range: how a latent without a decoder looks."""
    x = latent[:3] if latent.shape[0] >= 3 else np.repeat(latent[:1], 3, axis=0)
    lo = x.min(axis=(1, 2, 3), keepdims=True)
    hi = x.max(axis=(1, 2, 3), keepdims=True)
    x = (x - lo) / np.maximum(hi - lo, 1e-6)
    return (x.transpose(1, 2, 3, 0) * 255).astype(np.uint8)


def save_grid(path: str, images: list[np.ndarray], titles: list[str]) -> str:
    """One row per request (a video's frames side by side, at most 8), titled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(images))
    rows = math.ceil(len(images) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 4 * rows), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for ax, frames, title in zip(axes.ravel(), images, titles):
        strip = np.concatenate(list(frames[:8]), axis=1)  # (T, H, W, 3) -> (H, T*W, 3)
        ax.imshow(strip)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
