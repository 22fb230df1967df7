"""A conditioning image for image-to-video sampling: read and bounded before it is decoded,
resized to the request's size as diffusers' ``WanImageToVideoPipeline`` preprocesses its
``image`` (``VideoProcessor.preprocess``: Lanczos to WIDTHxHEIGHT, the aspect ratio not kept, no
crop), then encoded as the model takes it:

- Wan 2.2 TI2V (``model.expand_timesteps``, a time per token): by the corpus's VAE into its
  normalized latent (what the corpus's own rows are: ``(z - latents_mean) / latents_std`` of the
  posterior mean for ``AutoencoderKLWan``), the sample's first latent frame (``first_frame``);
- Wan 2.1 I2V (``model.image_dim``): into the conditioning channels and image tokens ingest
  wrote for its clips (``image_condition``: ``corpus.hf.WanI2VConditioning``, the pipeline's
  ``prepare_latents`` and ``encode_image``)."""

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
    return _resized(_upright(data, name), width, height)[None]


def _upright(data: bytes, name: str) -> Any:
    """The image decoded, turned upright by its EXIF orientation and made RGB (a PIL image)."""
    from PIL import Image, ImageOps

    image = open_image(data, name)
    try:
        return ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"{name}: the {image.format} file cannot be decoded ({type(e).__name__}: "
                         f"{str(e)[:80]})") from None


def _resized(image: Any, width: int, height: int) -> np.ndarray:
    """(height, width, 3) uint8: ``image`` resized with Lanczos (the pipeline's preprocessing)."""
    from PIL import Image

    return np.asarray(image.resize((width, height), resample=Image.Resampling.LANCZOS), dtype=np.uint8)


def first_frame(encoder: Any, data: bytes, name: str, width: int, height: int) -> np.ndarray:
    """(C, 1, height / down, width / down) float32: the image's normalized latent by the
    corpus's latent encoder ``encoder`` (``inference.conditioning.corpus_decoder``'s object:
    it encodes as ingest did), a one-frame clip."""
    latent = encoder.encode(image_pixels(data, name, width, height))
    if latent.ndim != 4 or latent.shape[1] != 1:
        raise ValueError(f"{name}: the corpus's encoder gave a latent of shape {tuple(latent.shape)} for one image; "
                         "expected one latent frame (C, 1, h, w)")
    return np.ascontiguousarray(latent, dtype=np.float32)


def image_condition(conditioning: Any, data: bytes, name: str, width: int, height: int,
                    latent_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """(condition (C_cond, latent_frames, height / down, width / down), image_context (L, dim))
    float32 of a request of ``latent_frames`` latent frames, by ``conditioning`` (a
    ``corpus.hf.WanI2VConditioning`` over the corpus's VAE: what ingest wrote for a clip of as
    many pixel frames, 1 + temporal_downsample·(latent_frames - 1)): the mask and the VAE's
    latent of the image resized to the request's size, then zero frames; the image encoder's
    tokens of the image as given (``WanImageToVideoPipeline.encode_image`` takes it unresized:
    its processor resizes and crops)."""
    image = _upright(data, name)
    first = _resized(image, width, height)
    frames = 1 + conditioning.vae.temporal_downsample * (latent_frames - 1)
    clip = np.broadcast_to(first, (frames, *first.shape))  # the first frame is all the condition reads
    ((condition, context),) = conditioning.encode_many([clip], images=[np.asarray(image, dtype=np.uint8)])
    if condition.shape[1] != latent_frames:
        raise ValueError(f"{name}: the corpus's VAE gave {condition.shape[1]} latent frames for {frames} frames; "
                         f"expected {latent_frames}")
    return np.ascontiguousarray(condition, dtype=np.float32), np.ascontiguousarray(context, dtype=np.float32)
