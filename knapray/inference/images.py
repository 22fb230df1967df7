"""Pictures of sampled latents: a latent's preview when nothing decodes it, the grid of
titled requests ``knapray sample`` and validation write, and each request as a file of its
own at full resolution (a PNG, or a clip: MP4 with PyAV, else an animated PNG)."""

from __future__ import annotations

import io
import math
import os
from typing import Any

import numpy as np

CLIP_FPS = 16
"""Frames per second of a written clip (Wan 2.1's pipelines export at 16)."""


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


def encode_png(frame: Any) -> bytes:
    """One (H, W, 3) uint8 frame as PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(frame)).save(buf, format="PNG")
    return buf.getvalue()


def encode_clip(frames: Any, fps: int = CLIP_FPS) -> tuple[bytes, str]:
    """(bytes, media type) of a clip (T, H, W, 3) uint8: MP4 (H.264, yuv420p) with PyAV, else
    an animated PNG."""
    import importlib.util

    frames = np.asarray(frames)
    if importlib.util.find_spec("av") is None:
        from PIL import Image

        images = [Image.fromarray(f) for f in frames]
        buf = io.BytesIO()
        images[0].save(buf, format="PNG", save_all=True, append_images=images[1:], duration=1000 // fps, loop=0)
        return buf.getvalue(), "image/apng"
    import av

    t, h, w, _ = frames.shape
    if h % 2 or w % 2:  # yuv420p halves both sides: pad the last row / column
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue(), "video/mp4"


GRID_FILE = "grid.png"
"""The titled grid's name in a folder of requests."""


def save_requests(out_dir: str, images: list[np.ndarray], titles: list[str]) -> list[str]:
    """Each request (T, H, W, 3) uint8 as ``request_<i>.png`` (one frame) or a clip
    (``request_<i>.mp4``; ``.png``, animated, without PyAV) at the size it was drawn, and the
    titled grid as ``grid.png``, in the folder ``out_dir`` (made if missing). Returns the
    requests' file names, in order."""
    os.makedirs(out_dir, exist_ok=True)
    names = []
    for i, frames in enumerate(images):
        if len(frames) == 1:
            body, ext = encode_png(frames[0]), ".png"
        else:
            body, media_type = encode_clip(frames)
            ext = ".mp4" if media_type == "video/mp4" else ".png"
        names.append(f"request_{i}{ext}")
        with open(os.path.join(out_dir, names[-1]), "wb") as f:
            f.write(body)
    save_grid(os.path.join(out_dir, GRID_FILE), images, titles)
    return names
