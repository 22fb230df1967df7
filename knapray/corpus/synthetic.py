"""Synthetic corpora in the paper's data-code notation.

Every data code ``gGbBiRfFsS`` of a mix contributes ``G*B`` samples per step, so a
corpus of ``steps`` steps has the mix's proportions. ``scale`` divides the resolution
(and the text length) so a CPU demo stays at tens to hundreds of tokens per sample;
scale 1 is the paper's sizes. Latents are smooth random fields (a few low-frequency
sinusoids mixed across channels) whose generating parameters are also encoded into
the pooled and text embeddings, so a model can learn the data and its conditioning.
Everything is deterministic from the seed; a sample's content depends only on
(seed, sample_id), not on sharding.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from knapray.corpus.schema import KINDS, PATCH, TEXT_DTYPES, visual_token_count
from knapray.corpus.writer import ShardWriter, build_table, length_stats, write_schema_json
from knapray.limits import (MAX_CORPUS_SAMPLES, MAX_EMBED_DIM, MAX_SEED, MAX_SHARDS, MAX_STEPS,
                            MAX_TEXT_LENGTH)
from knapray.planning.shapes.mix import MAX_TEXT_TOKENS, PAPER_MIXES, SPATIAL_TOKEN_STRIDE, DataCode, parse_mix
from knapray.progress import progress_bar

VAE_DOWNSAMPLE = SPATIAL_TOKEN_STRIDE // PATCH[1]
FIELD_COMPONENTS = 4
ROWS_PER_BATCH = 4096
VALUES_PER_BATCH = 1 << 25  # ~128 MB of float32 latents buffered before a write
MAX_SAMPLE_VALUES = 1 << 27  # one sample's latent is built in float64 with its basis: ~1 GB at most


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticConfig:
    mix: str
    """Comma-separated data codes, or a paper mix name: low-res, mixed-res, image+video."""
    steps: int = 1
    """The corpus holds this many steps of the mix: steps * sum(G*B) samples."""
    scale: int = 1
    """Divides resolution and max text tokens; 1 = paper sizes, 8 = a CPU demo."""
    channels: int = 4
    """Latent channels C (4 for the demo, 16 for a Flux VAE)."""
    text_dim: int = 64
    """Width of a text token embedding."""
    pooled_dim: int = 32
    """Width of the pooled text embedding."""
    max_text_tokens: int = MAX_TEXT_TOKENS
    """Text tokens per sample are uniform in [0, max_text_tokens // scale]."""
    shards: int = 4
    """Number of parquet files (at most the number of samples)."""
    seed: int = 0
    """Everything (order, lengths, contents) is a function of the seed."""
    payload: bool = True
    """False writes lengths only: payload columns are null (cheap full-size corpora)."""
    noise: float = 0.05
    """Std of white noise added to the smooth latent field."""
    text_dtype: str = "fp32"
    """How the text embeddings are stored: fp32, or bf16 (half the bytes; rounded as torch
    rounds, read back exactly)."""
    condition_channels: int = 0
    """Channels of a conditioning latent written beside each latent (the ``condition``
    column: standard normal values, (condition_channels, T, H, W)), for image-to-video models
    (Wan 2.1 I2V takes in_channels = channels + condition_channels); 0: none."""
    image_dim: int = 0
    """Width of conditioning image tokens written with each sample (the ``image_context``
    column: ``image_tokens`` standard normal rows); 0: none."""
    image_tokens: int = 257
    """Conditioning image tokens per sample, with ``image_dim`` (Wan 2.1 I2V's CLIP: 257)."""

    def __post_init__(self) -> None:
        for name in ("steps", "scale", "channels", "text_dim", "pooled_dim", "shards", "condition_channels",
                     "image_dim", "image_tokens"):
            value = getattr(self, name)
            # 0: no pooled vector, as a Wan corpus (umT5 only); no conditioning
            low = 0 if name in ("pooled_dim", "condition_channels", "image_dim") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.max_text_tokens < 0:
            raise ValueError(f"max_text_tokens must be >= 0, got {self.max_text_tokens}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.text_dtype not in TEXT_DTYPES:
            raise ValueError(f"text_dtype must be one of {TEXT_DTYPES}, got {self.text_dtype!r}")
        if not math.isfinite(self.noise) or self.noise < 0:
            raise ValueError(f"noise must be a finite value >= 0, got {self.noise}")
        codes = self.codes
        too_small = [c.code for c in codes if c.resolution // (SPATIAL_TOKEN_STRIDE * self.scale) < 1]
        if too_small:
            largest = min(c.resolution for c in codes) // SPATIAL_TOKEN_STRIDE
            raise ValueError(
                f"scale {self.scale} leaves {too_small} without a visual token "
                f"(resolution / scale must be >= {SPATIAL_TOKEN_STRIDE}); "
                f"valid scales for this mix are 1..{largest}"
            )
        for name, high in (("steps", MAX_STEPS), ("channels", MAX_EMBED_DIM), ("text_dim", MAX_EMBED_DIM),
                           ("pooled_dim", MAX_EMBED_DIM), ("shards", MAX_SHARDS), ("max_text_tokens", MAX_TEXT_LENGTH),
                           ("seed", MAX_SEED), ("condition_channels", MAX_EMBED_DIM), ("image_dim", MAX_EMBED_DIM),
                           ("image_tokens", MAX_TEXT_LENGTH)):
            if getattr(self, name) > high:
                raise ValueError(f"{name} must be at most {high}, got {getattr(self, name)!r}")
        samples = self.steps * sum(c.ranks * c.batch for c in codes)
        if samples > MAX_CORPUS_SAMPLES:
            raise ValueError(f"steps={self.steps} of mix {self.mix!r} make {samples} samples; at most "
                             f"{MAX_CORPUS_SAMPLES} (steps <= {max(1, MAX_CORPUS_SAMPLES * self.steps // samples)} here)")
        if (self.condition_channels or self.image_dim) and not self.payload:
            raise ValueError("condition_channels and image_dim write payload columns: a lengths-only corpus "
                             "(payload false) has none")
        if self.payload:
            values = max(max(self.channels, self.condition_channels) * c.latent_frames * latent_side(c, self.scale) ** 2
                         for c in codes)
            if values > MAX_SAMPLE_VALUES:
                raise ValueError(f"a sample of {values} latent values (channels x frames x height x width); at most "
                                 f"{MAX_SAMPLE_VALUES} with payload (fewer --channels, a larger --scale, or "
                                 "--no-payload)")
        if self.shards > samples:
            raise ValueError(f"shards={self.shards} exceeds the corpus's {samples} samples")

    @property
    def mix_codes(self) -> str:
        return PAPER_MIXES.get(self.mix, self.mix)

    @property
    def codes(self) -> list[DataCode]:
        return parse_mix(self.mix_codes)

    @property
    def text_token_limit(self) -> int:
        return self.max_text_tokens // self.scale


@dataclass(frozen=True, slots=True)
class SampleLengths:
    """Per-sample shape columns of a synthetic corpus (numpy arrays of one length)."""

    sample_id: np.ndarray
    code_index: np.ndarray
    frames: np.ndarray
    height: np.ndarray
    width: np.ndarray
    text_tokens: np.ndarray

    @property
    def visual_tokens(self) -> np.ndarray:
        return visual_token_count(self.frames, self.height, self.width)

    @property
    def seq_len(self) -> np.ndarray:
        return self.visual_tokens + self.text_tokens


def kind_of(code: DataCode) -> str:
    if code.frames == 1:
        return KINDS[0]
    return KINDS[2] if code.compressed else KINDS[1]


def latent_side(code: DataCode, scale: int) -> int:
    """Latent H (= W): tokens per side times the patch, at 1/scale resolution."""
    return code.resolution // (SPATIAL_TOKEN_STRIDE * scale) * PATCH[1]


def sample_lengths(cfg: SyntheticConfig) -> SampleLengths:
    """Shapes and text lengths of every sample, in corpus order (shuffled across codes)."""
    codes = cfg.codes
    per_step = np.repeat(np.arange(len(codes)), [c.ranks * c.batch for c in codes])
    rng = np.random.default_rng(np.random.SeedSequence(cfg.seed, spawn_key=(0,)))
    code_index = rng.permutation(np.tile(per_step, cfg.steps))
    n = code_index.size
    frames = np.array([c.latent_frames for c in codes], dtype=np.int64)[code_index]
    side = np.array([latent_side(c, cfg.scale) for c in codes], dtype=np.int64)[code_index]
    text = rng.integers(0, cfg.text_token_limit + 1, size=n)
    return SampleLengths(np.arange(n, dtype=np.int64), code_index, frames, side, side.copy(), text)


def _param_size(channels: int) -> int:
    k = FIELD_COMPONENTS
    return 3 * k + 2 * k + channels * k + channels


def smooth_field(
    rng: np.random.Generator, channels: int, frames: int, height: int, width: int, noise: float
) -> tuple[np.ndarray, np.ndarray]:
    """A (C, T, H, W) float32 field of low-frequency sinusoids mixed across channels,
    and the parameter vector that generated it."""
    k = FIELD_COMPONENTS
    freqs = rng.uniform(0.0, 1.5, size=(k, 3))  # cycles across the (t, h, w) extent
    phases = rng.uniform(0.0, 2 * np.pi, size=k)
    mixing = rng.normal(size=(channels, k)) / np.sqrt(k)
    bias = rng.normal(scale=0.3, size=channels)
    t = np.arange(frames) / frames
    h = np.arange(height) / height
    w = np.arange(width) / width
    arg = (
        freqs[:, 0, None, None, None] * t[None, :, None, None]
        + freqs[:, 1, None, None, None] * h[None, None, :, None]
        + freqs[:, 2, None, None, None] * w[None, None, None, :]
    )
    basis = np.sin(2 * np.pi * arg + phases[:, None, None, None])  # (K, T, H, W)
    field = np.tensordot(mixing, basis, axes=1) + bias[:, None, None, None]  # (C, T, H, W)
    if noise:
        field += noise * rng.standard_normal(field.shape)
    params = np.concatenate([freqs.ravel(), np.cos(phases), np.sin(phases), mixing.ravel(), bias])
    return field.astype(np.float32), params


class _PayloadMaker:
    """Per-sample latent, text and pooled arrays; fixed projections tie the embeddings
    to the field's parameters so conditioning carries information."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        self.cfg = cfg
        p = _param_size(cfg.channels)
        rng = np.random.default_rng(np.random.SeedSequence(cfg.seed, spawn_key=(1,)))
        self.to_pooled = rng.normal(size=(cfg.pooled_dim, p)) / np.sqrt(p)
        self.to_text = rng.normal(size=(cfg.text_dim, p)) / np.sqrt(p)

    def make(
        self, sample_id: int, frames: int, height: int, width: int, text_tokens: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cfg = self.cfg
        rng = np.random.default_rng(np.random.SeedSequence(cfg.seed, spawn_key=(2, sample_id)))
        latent, params = smooth_field(rng, cfg.channels, frames, height, width, cfg.noise)
        pooled = np.tanh(self.to_pooled @ params).astype(np.float32)
        text = 0.5 * rng.standard_normal((text_tokens, cfg.text_dim)) + 0.5 * (self.to_text @ params)
        return latent, text.astype(np.float32), pooled

    def conditioning(self, sample_id: int, frames: int, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The sample's conditioning latent (condition_channels, T, H, W) and image tokens
        (image_tokens, image_dim), from a stream of their own (the latent, text and pooled
        arrays are those of a corpus without them)."""
        cfg = self.cfg
        rng = np.random.default_rng(np.random.SeedSequence(cfg.seed, spawn_key=(3, sample_id)))
        condition = rng.standard_normal((cfg.condition_channels, frames, height, width), dtype=np.float32)
        return condition, rng.standard_normal((cfg.image_tokens if cfg.image_dim else 0, cfg.image_dim),
                                              dtype=np.float32)


def build_synthetic(cfg: SyntheticConfig, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Write the corpus's shards and schema.json into ``out_dir``; returns schema.json."""
    lengths = sample_lengths(cfg)
    codes = cfg.codes
    n = lengths.sample_id.size
    kinds = [kind_of(c) for c in codes]
    names = [c.code for c in codes]
    writer = ShardWriter(out_dir, rows_per_shard=math.ceil(n / cfg.shards), text_dtype=cfg.text_dtype,
                         condition=bool(cfg.condition_channels), image_context=bool(cfg.image_dim))
    maker = _PayloadMaker(cfg) if cfg.payload else None
    latent_values = cfg.channels * lengths.frames * lengths.height * lengths.width
    bar = progress_bar(n, "synthetic corpus", "sample", disable=not progress)
    start = 0
    while start < n:
        stop = start + 1
        budget = VALUES_PER_BATCH - latent_values[start]
        while stop < n and stop - start < ROWS_PER_BATCH and (maker is None or budget > 0):
            budget -= latent_values[stop]
            stop += 1
        sl = slice(start, stop)
        columns: dict[str, Any] = {
            "sample_id": lengths.sample_id[sl],
            "kind": [kinds[i] for i in lengths.code_index[sl]],
            "source": [names[i] for i in lengths.code_index[sl]],
            "frames": lengths.frames[sl],
            "height": lengths.height[sl],
            "width": lengths.width[sl],
            "channels": np.full(stop - start, cfg.channels),
            "visual_tokens": lengths.visual_tokens[sl],
            "text_tokens": lengths.text_tokens[sl],
            "seq_len": lengths.seq_len[sl],
        }
        if maker is None:
            table = build_table(columns)
        else:
            rows = [
                maker.make(int(i), int(t), int(h), int(w), int(x))
                for i, t, h, w, x in zip(
                    lengths.sample_id[sl], lengths.frames[sl], lengths.height[sl],
                    lengths.width[sl], lengths.text_tokens[sl],
                )
            ]
            conditions = [
                maker.conditioning(int(i), int(t), int(h), int(w))
                for i, t, h, w in zip(lengths.sample_id[sl], lengths.frames[sl], lengths.height[sl], lengths.width[sl])
            ] if cfg.condition_channels or cfg.image_dim else []
            table = build_table(columns, *zip(*rows),
                                conditions=[c for c, _ in conditions] if cfg.condition_channels else None,
                                image_contexts=[x for _, x in conditions] if cfg.image_dim else None)
        writer.add(table)
        bar.update(stop - start)
        start = stop
    bar.close()
    shards = writer.close()
    counts = length_stats(
        [kinds[i] for i in lengths.code_index], lengths.seq_len,
        sources=[names[i] for i in lengths.code_index],
    )
    return write_schema_json(
        out_dir,
        builder="synthetic",
        dims={
            "channels": cfg.channels,
            "text_dim": cfg.text_dim,
            "pooled_dim": cfg.pooled_dim,
            "vae_downsample": VAE_DOWNSAMPLE,
            **({"condition_channels": cfg.condition_channels} if cfg.condition_channels else {}),
            **({"image_dim": cfg.image_dim, "image_tokens": cfg.image_tokens} if cfg.image_dim else {}),
        },
        payload=cfg.payload,
        shards=shards,
        shard_rows=writer.shard_rows,
        counts=counts,
        text_dtype=cfg.text_dtype,
        extra={"mix": cfg.mix_codes, "scale": cfg.scale, "config": _recorded_config(cfg)},
    )


def _recorded_config(cfg: SyntheticConfig) -> dict[str, Any]:
    """The config as schema.json records it: without the conditioning fields when it writes no
    conditioning (a corpus without them is as it was before they existed)."""
    doc = asdict(cfg)
    if not (cfg.condition_channels or cfg.image_dim):
        for name in ("condition_channels", "image_dim", "image_tokens"):
            del doc[name]
    return doc


DEMO = SyntheticConfig(mix="image+video", steps=2, scale=8, channels=4, text_dim=32, pooled_dim=32)
"""The corpus of ``make run`` and the chaos demo (jobs/configs/demo.yaml's model): the
paper's image+video mix at 1/8 resolution, sequences of 4..437 tokens, 178 samples."""
