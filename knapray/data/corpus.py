"""The corpus description (schema.json) checked against the model config, once at start-up."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from knapray.corpus import read_schema_json
from knapray.models.config import DiTConfig


# --- corpus description ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CorpusInfo:
    """What a reader needs from a corpus's schema.json."""

    path: Path
    """The corpus directory."""
    channels: int
    """Latent channels C."""
    text_dim: int
    """Width of a text token embedding."""
    pooled_dim: int
    """Width of the pooled text embedding."""
    patch: tuple[int, int, int]
    """Patch (t, h, w) that the visual_tokens and seq_len columns count."""
    payload: bool
    """False for a lengths-only corpus (null latent/text/pooled)."""
    num_samples: int
    """Rows in the whole corpus."""
    max_seq_len: int
    """Longest sample (tokens)."""
    shards: tuple[str, ...]
    """Shard file names, in corpus order."""
    shard_rows: tuple[int, ...] | None = None
    """Rows of each shard (None for corpora written before it was recorded)."""
    text_dtype: str = "fp32"
    """How the text embeddings are stored (fp32 or bf16; corpora without the field: fp32).
    Decoding gives float32 either way."""
    family: str | None = None
    """The model family the corpus was made for (schema.json ``family``); None for corpora
    written before it was recorded: any family whose widths match."""
    text_pad_to: int | None = None
    """Text rows the corpus's text is meant to be padded to with zeros by the model
    (schema.json ``text_pad_to``: Wan's 512); None where it records none."""
    condition_channels: int = 0
    """Channels of each row's conditioning latent (schema.json ``dims.condition_channels``:
    Wan 2.1 I2V's 20, a mask and the first frame's latent); 0: the corpus holds none."""
    image_dim: int = 0
    """Width of each row's conditioning image tokens (``dims.image_dim``: CLIP's 1280); 0: none."""
    image_tokens: int = 0
    """Conditioning image tokens per row (``dims.image_tokens``: 257); 0 without ``image_dim``."""


def corpus_info(path: str | Path, doc: Mapping[str, Any] | None = None) -> CorpusInfo:
    """Read ``<path>/schema.json`` (or take its contents, ``doc``, read already); raises
    FileNotFoundError / ValueError naming the file."""
    doc = read_schema_json(path) if doc is None else doc
    dims = doc["dims"]
    return CorpusInfo(
        path=Path(path),
        channels=int(dims["channels"]),
        text_dim=int(dims["text_dim"]),
        pooled_dim=int(dims["pooled_dim"]),
        patch=tuple(int(p) for p in dims["patch"]),  # type: ignore[arg-type]
        payload=bool(doc["payload"]),
        num_samples=int(doc["counts"]["samples"]),
        max_seq_len=int(doc["counts"]["seq_len"]["max"]),
        shards=tuple(doc["shards"]),
        shard_rows=tuple(int(n) for n in doc["shard_rows"]) if doc.get("shard_rows") is not None else None,
        text_dtype=str(doc.get("text_dtype", "fp32")),
        family=doc.get("family"),
        text_pad_to=doc.get("text_pad_to"),
        condition_channels=int(dims.get("condition_channels", 0)),
        image_dim=int(dims.get("image_dim", 0)),
        image_tokens=int(dims.get("image_tokens", 0)),
    )


class FamilyMismatch(ValueError):
    """A corpus made for one model family and a model of another."""


def check_model_config(info: CorpusInfo, cfg: DiTConfig) -> None:
    """Raise ValueError if the model cannot train on this corpus, naming both values of
    every mismatch (:class:`FamilyMismatch` first, alone, when the corpus was made for
    another family). The patch must be equal, not merely compatible: the corpus's seq_len
    column (what the balancer plans with) counts patches of the corpus's size."""
    if info.family not in (None, cfg.family):
        raise FamilyMismatch(
            f"corpus {info.path} was made for model family {info.family} (schema.json family), the model is "
            f"model.family {cfg.family}: set model.family: {info.family}, or ingest the corpus with --family "
            f"{cfg.family}"
        )
    if not info.payload:
        raise ValueError(
            f"corpus {info.path} is lengths-only (schema.json payload=false): it has no "
            "latents to train on; rebuild it without --no-payload"
        )
    problems = []
    image_dim = getattr(cfg, "image_dim", 0)  # a family with an image context (Wan 2.1 I2V) or not
    if image_dim or (info.condition_channels and cfg.in_channels != info.channels):
        conditioned = _conditioning_problem(info, cfg, image_dim)
        if conditioned:
            problems.append(conditioned)
    elif info.channels != cfg.in_channels:
        problems.append(
            f"latent channels: corpus channels={info.channels}, model in_channels={cfg.in_channels}"
        )
    if info.text_dim != cfg.text_dim:
        problems.append(f"text width: corpus text_dim={info.text_dim}, model text_dim={cfg.text_dim}")
    if info.pooled_dim != cfg.pooled_dim:
        problems.append(
            f"pooled width: corpus pooled_dim={info.pooled_dim}, model pooled_dim={cfg.pooled_dim}"
        )
    pad_to = getattr(cfg, "text_pad_to", None)  # the model pads the text (Wan) or not
    if info.text_pad_to is not None and pad_to is not None and info.text_pad_to != pad_to:
        problems.append(f"text padding: corpus text_pad_to={info.text_pad_to} (its text was encoded for that many "
                        f"rows), model text_pad_to={pad_to}")
    if tuple(info.patch) != tuple(cfg.patch_size):
        problems.append(
            f"patch: corpus patch={tuple(info.patch)} (its seq_len column counts these), "
            f"model patch_size={tuple(cfg.patch_size)}"
        )
    if problems:
        raise ValueError(f"corpus {info.path} does not match the model config: " + "; ".join(problems))


def _conditioning_problem(info: CorpusInfo, cfg: DiTConfig, image_dim: int) -> str | None:
    """What keeps a model whose input is more than the latent (image-to-video: the latent's
    channels, then the conditioning latent's) or that cross-attends to image tokens from
    training on the corpus, in one line; None when it fits. A model that takes the latent
    alone trains on a conditioned corpus as on any other (its conditioning unread), and one
    without an image context leaves the corpus's image tokens unread."""
    out_channels = cfg.out_patch_dim // math.prod(cfg.patch_size)
    fits = (cfg.in_channels == info.channels + info.condition_channels and out_channels == info.channels
            and (not image_dim or (image_dim, getattr(cfg, "image_tokens", 0)) == (info.image_dim, info.image_tokens)))
    if fits:
        return None
    corpus = (f"corpus latent channels {info.channels} + condition channels {info.condition_channels} = "
              f"{info.channels + info.condition_channels}, image_dim {info.image_dim}"
              + (f" ({info.image_tokens} tokens)" if info.image_dim else ""))
    model = (f"model in_channels {cfg.in_channels}, out {out_channels}, image_dim {image_dim}"
             + (f" ({getattr(cfg, 'image_tokens', 0)} tokens)" if image_dim else ""))
    return (f"image-to-video conditioning: {corpus}; {model} (a conditioned model takes the latent's and the "
            "condition's channels, outputs the latent's and cross-attends to the corpus's image tokens)")
