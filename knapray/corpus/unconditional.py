"""The corpus's unconditional conditioning: what its text encoder makes of the empty
caption, recorded once in ``schema.json`` by ingest, and the one thing both caption
dropout (training) and the unconditional / guidance branch of ``knapray sample`` use.

As knapray encodes captions, the empty caption has 0 text tokens and the pooled vector
the encoder gives ``""`` (CLIP's for Flux). A corpus without the record (synthetic ones,
corpora ingested before it existed) gets 0 text tokens and a zero pooled vector, which is
what sampling used before the record existed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

KEY = "unconditional"
"""schema.json's key of the record."""


def unconditional_record(encoder: Any, max_text_tokens: int) -> dict[str, Any]:
    """The record for ``encoder`` (a ``TextEncoder``): the empty caption's embeddings as
    JSON lists (float32 values survive JSON's float64 exactly)."""
    text, pooled = encoder.encode("", max_text_tokens)
    text, pooled = np.asarray(text, np.float32), np.asarray(pooled, np.float32)
    return {"caption": "", "text": text.tolist(), "pooled": pooled.tolist()}


def unconditional_embeddings(corpus: str | Path, text_dim: int, pooled_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(text (L, text_dim), pooled (pooled_dim,)) float32 of the corpus's unconditional
    conditioning; ValueError if the record's widths are not the corpus's."""
    from knapray.corpus.writer import read_schema_json

    record = read_schema_json(corpus).get(KEY)
    if record is None:
        return np.zeros((0, text_dim), np.float32), np.zeros(pooled_dim, np.float32)
    text = np.asarray(record["text"], np.float32) if record["text"] else np.zeros((0, text_dim), np.float32)
    pooled = np.asarray(record["pooled"], np.float32)
    if text.ndim != 2 or text.shape[1] != text_dim or pooled.shape != (pooled_dim,):
        raise ValueError(f"{corpus}/schema.json: the unconditional record is text {text.shape}, pooled "
                         f"{pooled.shape}; the corpus's widths are {text_dim} and {pooled_dim}")
    return text, pooled
