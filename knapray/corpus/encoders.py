"""Pluggable encoders for ingestion: pixels -> latent, caption -> text embeddings.

The defaults need no weights, so the pipeline runs anywhere: ``PixelPatchEncoder`` is
a fixed average-pool plus RGB->C linear map, ``HashTextEncoder`` turns words into
deterministic pseudo-embeddings. They are stand-ins for a real VAE and text encoder
(T5/CLIP), which live in :mod:`knapray.corpus.hf`; anything with the same attributes
and ``encode`` method plugs in. An encoder may also have ``encode_many`` (several
inputs in one call, for batching on a GPU) and ``describe()`` (what schema.json records
about it).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class LatentEncoder(Protocol):
    """Maps frames to a latent. ``downsample`` is the spatial factor: an (F, H, W, 3)
    input with H, W multiples of it gives a (channels, T, H/downsample, W/downsample)
    float32 latent."""

    channels: int
    downsample: int

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """(F, H, W, 3) uint8 -> (C, T, H/downsample, W/downsample) float32."""
        ...


@runtime_checkable
class TextEncoder(Protocol):
    """Maps a caption to per-token embeddings (L, dim) and a pooled vector (pooled_dim,)."""

    dim: int
    pooled_dim: int

    def encode(self, caption: str, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        ...


@dataclass(slots=True)
class PixelPatchEncoder:
    """Average-pools ``downsample`` x ``downsample`` pixel blocks (and groups of
    ``temporal_downsample`` frames), then maps RGB in [-1, 1] to ``channels`` with a
    fixed matrix drawn from ``seed``."""

    channels: int = 4
    downsample: int = 8
    temporal_downsample: int = 1
    seed: int = 0
    _mix: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("channels", "downsample", "temporal_downsample"):
            if getattr(self, name) < 1:
                raise ValueError(f"PixelPatchEncoder.{name} must be >= 1, got {getattr(self, name)}")
        rng = np.random.default_rng(self.seed)
        self._mix = (rng.normal(size=(self.channels, 3)) / np.sqrt(3)).astype(np.float32)

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        if pixels.ndim != 4 or pixels.shape[-1] != 3:
            raise ValueError(f"expected pixels of shape (F, H, W, 3), got {pixels.shape}")
        f, h, w, _ = pixels.shape
        d, td = self.downsample, self.temporal_downsample
        if h % d or w % d:
            raise ValueError(f"frame size {h}x{w} is not a multiple of downsample {d}")
        t = max(1, f // td)
        frames = pixels[: t * td] if f >= td else np.repeat(pixels[:1], td, axis=0)
        x = frames.astype(np.float32) / 127.5 - 1.0
        # (t*td, h, w, 3) -> (t, td, h/d, d, w/d, d, 3) -> mean over the block axes
        x = x.reshape(t, td, h // d, d, w // d, d, 3).mean(axis=(1, 3, 5))  # (t, h/d, w/d, 3)
        latent = np.einsum("cr,thwr->cthw", self._mix, x)  # (C, t, h/d, w/d)
        return np.ascontiguousarray(latent, dtype=np.float32)

    def describe(self) -> dict[str, Any]:
        return {"channels": self.channels, "downsample": self.downsample,
                "temporal_downsample": self.temporal_downsample, "seed": self.seed}

    def decode(self, latent: np.ndarray) -> np.ndarray:
        """(C, T, h, w) -> (T, h*downsample, w*downsample, 3) uint8: the least-squares RGB
        of each latent cell (the mix's pseudo-inverse), repeated over its pixel block. What
        the encoder averaged away does not come back; for previews of samples."""
        rgb = np.einsum("rc,cthw->thwr", np.linalg.pinv(self._mix), latent.astype(np.float32))
        d = self.downsample
        rgb = rgb.repeat(d, axis=1).repeat(d, axis=2)
        return np.clip((rgb + 1.0) * 127.5, 0, 255).astype(np.uint8)


_WORD = re.compile(r"\w+|[^\w\s]")


def tokenize(caption: str) -> list[str]:
    return _WORD.findall(caption.lower())


@lru_cache(maxsize=65536)
def _token_vector(token: str, salt: str, dim: int) -> np.ndarray:
    digest = hashlib.blake2b(f"{salt}\x00{token}".encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    vec = rng.standard_normal(dim).astype(np.float32)
    vec.setflags(write=False)
    return vec


@dataclass(frozen=True, slots=True)
class HashTextEncoder:
    """Deterministic pseudo-embeddings: each word maps to a fixed random vector seeded by
    a hash of the word; the pooled vector is the mean of per-word vectors of another
    hash family. Same caption, same embeddings, on every machine."""

    dim: int = 64
    pooled_dim: int = 32

    def encode(self, caption: str, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = tokenize(caption)[:max_tokens]
        text = np.zeros((len(tokens), self.dim), dtype=np.float32)
        pooled = np.zeros(self.pooled_dim, dtype=np.float32)
        for i, tok in enumerate(tokens):
            text[i] = _token_vector(tok, "text", self.dim)
            pooled += _token_vector(tok, "pooled", self.pooled_dim)
        if tokens:
            pooled /= len(tokens)
        return text, pooled

    def describe(self) -> dict[str, Any]:
        return {"dim": self.dim, "pooled_dim": self.pooled_dim}


def encoder_record(encoder: object) -> dict[str, Any]:
    """What schema.json records about an encoder: its class and its ``describe()``."""
    describe = getattr(encoder, "describe", None)
    return {"class": type(encoder).__name__, **(describe() if callable(describe) else {})}


def encode_latents(encoder: LatentEncoder, items: list[np.ndarray]) -> list[np.ndarray]:
    """``encoder.encode_many(items)`` where it has one, else one ``encode`` per item."""
    many = getattr(encoder, "encode_many", None)
    return list(many(items)) if callable(many) else [encoder.encode(px) for px in items]


def encode_captions(
    encoder: TextEncoder, captions: list[str], max_tokens: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``encoder.encode_many(captions, max_tokens)`` where it has one, else one by one."""
    many = getattr(encoder, "encode_many", None)
    if callable(many):
        return list(many(captions, max_tokens))
    return [encoder.encode(c, max_tokens) for c in captions]
