"""The corpus row format: one parquet row per sample, variable shapes as flat lists.

A latent of shape (C, T, H, W) travels as a flat ``list<float32>`` plus int columns for
its shape, because Arrow (and Ray Data after it) has no ragged tensor type. This module
owns the Arrow schema and the only code that turns a row back into arrays; everything
it refuses raises :class:`CorruptSample` so the training loop can quarantine the row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

PATCH = (1, 2, 2)
"""Patch size (t, h, w) of the DiT's patch embedding: one visual token per patch."""

KINDS = ("image", "keyframe", "video")
"""image: one frame; keyframe: several frames without temporal compression (the paper's
``f4s0`` codes); video: frames temporally compressed by a video VAE or decoded from a
video file."""

FLOAT_LIST = pa.list_(pa.float32())

CORPUS_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.int64(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("frames", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("channels", pa.int32(), nullable=False),
        pa.field("visual_tokens", pa.int32(), nullable=False),
        pa.field("text_tokens", pa.int32(), nullable=False),
        pa.field("seq_len", pa.int32(), nullable=False),
        # Null in a lengths-only corpus (built with --no-payload).
        pa.field("latent", FLOAT_LIST),
        pa.field("text", FLOAT_LIST),
        pa.field("pooled", FLOAT_LIST),
    ]
)

INT_COLUMNS = ("frames", "height", "width", "channels", "visual_tokens", "text_tokens", "seq_len")
PAYLOAD_COLUMNS = ("latent", "text", "pooled")


class CorruptSample(ValueError):
    """A row that cannot be trained on. ``reason`` is a short code, one of REASONS."""

    REASONS = (
        "missing_column",
        "bad_kind",
        "non_positive_length",
        "visual_tokens_mismatch",
        "seq_len_mismatch",
        "missing_payload",
        "latent_size",
        "text_size",
        "pooled_size",
        "non_finite",
        "too_long",  # over the run's memory budget (data.max_tokens_per_gpu x largest bag)
    )

    def __init__(self, sample_id: Any, reason: str, detail: str) -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown corruption reason {reason!r}; valid: {self.REASONS}")
        self.sample_id = sample_id
        self.reason = reason
        self.detail = detail
        super().__init__(f"corrupt sample {sample_id}: {reason}: {detail}")


def visual_token_count(frames: int, height: int, width: int, patch: tuple[int, int, int] = PATCH) -> int:
    """Visual tokens of a (T, H, W) latent cut into ``patch`` patches."""
    pt, ph, pw = patch
    return (frames // pt) * (height // ph) * (width // pw)


def _flat(row: Mapping[str, Any], name: str) -> np.ndarray | None:
    value = row[name]
    if value is None:
        return None
    return np.asarray(value, dtype=np.float32).reshape(-1)


def validate_row(
    row: Mapping[str, Any],
    *,
    payload: bool = True,
    text_dim: int | None = None,
    pooled_dim: int | None = None,
) -> None:
    """Raise CorruptSample if ``row`` (a dict from pyarrow ``to_pylist`` or a Ray Data
    batch row) is inconsistent. ``payload=False`` checks only the length columns, as a
    lengths-only corpus has null payload columns. ``text_dim``/``pooled_dim`` (from
    schema.json) are checked when given."""
    _check_row(row, payload=payload, text_dim=text_dim, pooled_dim=pooled_dim)


def _check_row(
    row: Mapping[str, Any], *, payload: bool, text_dim: int | None, pooled_dim: int | None
) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    sid = row.get("sample_id", "<no sample_id>")
    needed = ("sample_id", "kind", *INT_COLUMNS) + (PAYLOAD_COLUMNS if payload else ())
    missing = [c for c in needed if c not in row]
    if missing:
        raise CorruptSample(sid, "missing_column", f"row lacks {missing}")
    if row["kind"] not in KINDS:
        raise CorruptSample(sid, "bad_kind", f"kind {row['kind']!r} is not one of {KINDS}")

    n = {c: int(row[c]) for c in INT_COLUMNS}
    bad = {c: v for c, v in n.items() if v <= 0 and c != "text_tokens"}
    if n["text_tokens"] < 0:
        bad["text_tokens"] = n["text_tokens"]
    if bad:
        raise CorruptSample(
            sid, "non_positive_length", f"{bad} (text_tokens must be >= 0, the others >= 1)"
        )
    expected_visual = visual_token_count(n["frames"], n["height"], n["width"])
    if n["visual_tokens"] != expected_visual or n["height"] % PATCH[1] or n["width"] % PATCH[2]:
        raise CorruptSample(
            sid,
            "visual_tokens_mismatch",
            f"visual_tokens={n['visual_tokens']} but frames x height x width = "
            f"{n['frames']}x{n['height']}x{n['width']} with patch {PATCH} gives {expected_visual}"
            " (height and width must be multiples of the patch)",
        )
    if n["seq_len"] != n["visual_tokens"] + n["text_tokens"]:
        raise CorruptSample(
            sid,
            "seq_len_mismatch",
            f"seq_len={n['seq_len']} != visual_tokens {n['visual_tokens']} + "
            f"text_tokens {n['text_tokens']}",
        )
    if not payload:
        return n, {}

    arrays: dict[str, np.ndarray] = {}
    for name in PAYLOAD_COLUMNS:
        flat = _flat(row, name)
        if flat is None:
            raise CorruptSample(sid, "missing_payload", f"{name} is null (a lengths-only row?)")
        arrays[name] = flat

    latent_size = n["channels"] * n["frames"] * n["height"] * n["width"]
    if arrays["latent"].size != latent_size:
        raise CorruptSample(
            sid,
            "latent_size",
            f"latent has {arrays['latent'].size} values, shape columns C,T,H,W = "
            f"{n['channels']},{n['frames']},{n['height']},{n['width']} need {latent_size}",
        )
    text_size = arrays["text"].size
    if n["text_tokens"] == 0:
        text_ok = text_size == 0
    elif text_dim is not None:
        text_ok = text_size == n["text_tokens"] * text_dim
    else:
        text_ok = text_size > 0 and text_size % n["text_tokens"] == 0
    if not text_ok:
        want = f"text_tokens {n['text_tokens']} x text_dim {text_dim if text_dim else '?'}"
        raise CorruptSample(sid, "text_size", f"text has {text_size} values, expected {want}")
    pooled_size = arrays["pooled"].size
    if pooled_size == 0 or (pooled_dim is not None and pooled_size != pooled_dim):
        raise CorruptSample(
            sid, "pooled_size", f"pooled has {pooled_size} values, expected {pooled_dim or '>= 1'}"
        )
    for name, arr in arrays.items():
        if not np.isfinite(arr).all():
            bad_count = int(arr.size - np.isfinite(arr).sum())
            raise CorruptSample(sid, "non_finite", f"{name} has {bad_count} NaN/inf values")
    return n, arrays


def decode_row(
    row: Mapping[str, Any], *, text_dim: int | None = None, pooled_dim: int | None = None
) -> dict[str, Any]:
    """Validate a row and return its arrays in model layout: ``latent`` (C, T, H, W),
    ``text`` (text_tokens, text_dim), ``pooled`` (pooled_dim,), all float32, plus the
    id, kind, source and int length columns. A row with zero text tokens decodes to a
    (0, text_dim) text array, (0, 0) when ``text_dim`` is not given."""
    n, arrays = _check_row(row, payload=True, text_dim=text_dim, pooled_dim=pooled_dim)
    if n["text_tokens"]:
        dim = arrays["text"].size // n["text_tokens"]
    else:
        dim = text_dim or 0
    out: dict[str, Any] = {
        "sample_id": int(row["sample_id"]),
        "kind": str(row["kind"]),
        "source": str(row.get("source", "")),
        **n,
        "latent": arrays["latent"].reshape(n["channels"], n["frames"], n["height"], n["width"]),
        "text": arrays["text"].reshape(n["text_tokens"], dim),
        "pooled": arrays["pooled"],
    }
    return out


def column_types() -> dict[str, str]:
    """Column name -> Arrow type name, as written into schema.json."""
    return {f.name: str(f.type) for f in CORPUS_SCHEMA}


# ---- schema.json, read as untrusted input --------------------------------------------------

MAX_SCHEMA_BYTES = 64 << 20
"""schema.json holds a few numbers per shard: anything larger is not one."""


class SchemaFileError(ValueError):
    """A corpus's schema.json that cannot be used; the message names the file, in one line."""


def load_schema_json(corpus_dir: str) -> dict[str, Any]:
    """``<corpus_dir>/schema.json``, with every field a reader takes from it checked for its
    type (``FileNotFoundError`` if there is none; ``SchemaFileError`` naming the file and the
    field otherwise): what pre-flight reads before any worker starts."""
    import json
    import os

    from knapray.corpus.writer import FORMAT_VERSION, SCHEMA_FILE

    path = os.path.join(corpus_dir, SCHEMA_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SCHEMA_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SchemaFileError(f"corpus file {path} cannot be read: {e.strerror or e}") from None
    if len(data) > MAX_SCHEMA_BYTES:
        raise SchemaFileError(f"corpus file {path} is over {MAX_SCHEMA_BYTES >> 20} MiB: not a knapray schema.json")
    try:
        doc = json.loads(data.decode("utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise SchemaFileError(f"corpus file {path} is not JSON ({e}): rebuild the corpus or restore the file") from None
    if not isinstance(doc, dict):
        raise SchemaFileError(f"corpus file {path} holds a {type(doc).__name__}, not an object")
    if doc.get("format_version") != FORMAT_VERSION:
        raise SchemaFileError(f"corpus file {path}: format_version {str(doc.get('format_version'))[:40]!r}, "
                              f"this knapray reads {FORMAT_VERSION}")
    problem = schema_doc_problem(doc)
    if problem:
        raise SchemaFileError(f"corpus file {path}: {problem}; rebuild the corpus or restore the file")
    return doc


def schema_doc_problem(doc: Mapping[str, Any]) -> str | None:
    """What is wrong with the fields of a schema.json's contents that readers use
    (``knapray.data.corpus_info``), or None."""

    def count(value: Any, low: int) -> bool:
        return type(value) is int and value >= low

    dims, counts = doc.get("dims"), doc.get("counts")
    if not isinstance(dims, dict):
        return f"dims is {_short(dims)}, not an object"
    for name in ("channels", "text_dim", "pooled_dim"):
        if not count(dims.get(name), 1):
            return f"dims.{name} is {_short(dims.get(name))}, not an int >= 1"
    patch = dims.get("patch")
    if not (isinstance(patch, list) and len(patch) == 3 and all(count(p, 1) for p in patch)):
        return f"dims.patch is {_short(patch)}, not three ints >= 1"
    if type(doc.get("payload")) is not bool:
        return f"payload is {_short(doc.get('payload'))}, not true or false"
    if not isinstance(counts, dict) or not count(counts.get("samples"), 0):
        return f"counts.samples is {_short(counts.get('samples') if isinstance(counts, dict) else counts)}, " \
               "not an int >= 0"
    seq = counts.get("seq_len")
    if not (isinstance(seq, dict) and count(seq.get("max"), 0)):
        return f"counts.seq_len.max is {_short(seq.get('max') if isinstance(seq, dict) else seq)}, not an int >= 0"
    shards = doc.get("shards")
    if not (isinstance(shards, list) and all(isinstance(s, str) for s in shards)):
        return f"shards is {_short(shards)}, not a list of file names"
    rows = doc.get("shard_rows")
    if rows is not None and not (isinstance(rows, list) and len(rows) == len(shards)
                                 and all(count(n, 0) for n in rows)):
        return f"shard_rows is {_short(rows)}, not one int >= 0 per shard"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
