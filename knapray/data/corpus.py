"""The corpus description (schema.json) checked against the model config, once at start-up."""

from __future__ import annotations

import dataclasses
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
    if info.channels != cfg.in_channels:
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
