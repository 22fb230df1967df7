"""A conditioning image for image-to-video sampling (Wan 2.2 TI2V: ``model.expand_timesteps``,
a time per token): read and bounded before it is decoded, resized to the request's size as
diffusers' ``WanImageToVideoPipeline`` preprocesses its ``image`` (``VideoProcessor.preprocess``:
Lanczos to WIDTHxHEIGHT, the aspect ratio not kept, no crop), and encoded by the corpus's VAE
into its normalized latent (what the corpus's own rows are: ``(z - latents_mean) /
latents_std`` of the posterior mean for ``AutoencoderKLWan``), the sample's first latent frame."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

FORMATS = ("PNG", "JPEG")
"""The image files a conditioning image may be."""


def open_image(data: bytes, name: str) -> Any:
    """``data`` opened as a PNG or JPEG (its header read, nothing decoded), bounded in bytes
    and pixels (``knapray.limits``); ValueError in one line naming ``name`` otherwise."""
    from PIL import Image

    from knapray.limits import MAX_CONDITION_IMAGE_BYTES, MAX_CONDITION_IMAGE_PIXELS

    if len(data) > MAX_CONDITION_IMAGE_BYTES:
        raise ValueError(f"{name}: {len(data)} bytes; at most {MAX_CONDITION_IMAGE_BYTES}")
    try:
        image = Image.open(io.BytesIO(data))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"{name}: not an image that can be read ({type(e).__name__}); a PNG or JPEG file") from None
    if image.format not in FORMATS:
        raise ValueError(f"{name}: a {image.format} image; a PNG or JPEG file")
    w, h = image.size
    if w * h > MAX_CONDITION_IMAGE_PIXELS:
        raise ValueError(f"{name}: {w}x{h} pixels; at most {MAX_CONDITION_IMAGE_PIXELS} pixels")
    return image


def image_pixels(data: bytes, name: str, width: int, height: int) -> np.ndarray:
    """(1, height, width, 3) uint8: the image decoded, turned upright by its EXIF orientation
    and made RGB (diffusers' ``load_image``), then resized with Lanczos to ``width`` x
    ``height`` (the pipeline's preprocessing). ValueError in one line naming ``name`` for a
    file that cannot be decoded."""
    from PIL import Image, ImageOps

    image = open_image(data, name)
    try:
        image = ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"{name}: the {image.format} file cannot be decoded ({type(e).__name__}: "
                         f"{str(e)[:80]})") from None
    resized = image.resize((width, height), resample=Image.Resampling.LANCZOS)
    return np.asarray(resized, dtype=np.uint8)[None]


def first_frame(encoder: Any, data: bytes, name: str, width: int, height: int) -> np.ndarray:
    """(C, 1, height / down, width / down) float32: the image's normalized latent by the
    corpus's latent encoder ``encoder`` (``inference.conditioning.corpus_decoder``'s object:
    it encodes as ingest did), a one-frame clip."""
    latent = encoder.encode(image_pixels(data, name, width, height))
    if latent.ndim != 4 or latent.shape[1] != 1:
        raise ValueError(f"{name}: the corpus's encoder gave a latent of shape {tuple(latent.shape)} for one image; "
                         "expected one latent frame (C, 1, h, w)")
    return np.ascontiguousarray(latent, dtype=np.float32)
