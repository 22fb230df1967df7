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

FORMAT_VERSION = 1
"""The corpus format this knapray writes and reads (``format_version`` in schema.json)."""
SCHEMA_FILE = "schema.json"

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

FAMILIES = ("mmdit", "flux", "wan", "qwen_image", "flux2")
"""Model families a corpus can be made for (schema.json ``family``; a corpus without the
field was made before it was recorded and fits any family whose widths match). The same
names as ``knapray.models.families.FAMILY_NAMES`` (a test keeps them equal; this module
does not import the models)."""

WAN_TEXT_LENGTH = 512
"""Wan's text length: ``WanPipeline`` truncates a prompt's umT5 tokens to 512 and pads its
embeddings with zero rows to 512 (schema.json ``text_pad_to`` of a Wan corpus)."""

TEXT_DTYPES = ("fp32", "bf16")
"""How a corpus stores its text token embeddings (schema.json ``text_dtype``; a corpus
without the field is fp32). fp32: ``list<float32>``. bf16: ``large_binary``, each row the
little-endian bfloat16 bit patterns of its (text_tokens, text_dim) values: half the bytes
of the column that holds 76-98% of a corpus's bytes (T5-XXL: 16 KB per token in fp32), and
read back exactly (bf16 -> fp32 is a widening). Parquet has no bfloat16 type; a binary
column is stored, read and sliced without conversion (``list<uint16>`` is stored as INT32
and converted on read, ~3x slower)."""

BF16_TEXT = pa.large_binary()
"""The text column's type in a bf16 corpus (int64 offsets: a shuffle buffer's
concatenation of many 4 MB rows must not overflow 2 GiB)."""


CONDITION_FIELDS = (pa.field("condition_channels", pa.int32()), pa.field("condition", FLOAT_LIST))
"""Columns of a corpus that holds each clip's conditioning latent (image-to-video, Wan 2.1
I2V): the channels it has, and its (condition_channels, T, H, W) values, T, H, W the
latent's. Wan 2.1 I2V's are 20: a 4-channel mask of the given frames (1 on the first latent
frame, 0 after) and the 16-channel VAE latent of the video [first frame, zeros], normalized
as the latents are. schema.json's ``dims.condition_channels`` says the corpus has them."""
IMAGE_CONTEXT_FIELDS = (pa.field("image_tokens", pa.int32()), pa.field("image_context", FLOAT_LIST))
"""Columns of a corpus that holds each clip's conditioning image's encoder tokens (Wan 2.1
I2V: CLIP ViT-H/14's penultimate hidden states, 257 of 1280): how many, and their
(image_tokens, image_dim) values. schema.json's ``dims.image_dim`` says the corpus has them."""


def corpus_schema(text_dtype: str = "fp32", *, condition: bool = False, image_context: bool = False) -> pa.Schema:
    """The Arrow schema of a corpus whose text embeddings are stored as ``text_dtype``, with
    the conditioning latent's columns (``condition``) and the image tokens' (``image_context``)
    after the others when it holds them."""
    if text_dtype not in TEXT_DTYPES:
        raise ValueError(f"text dtype {text_dtype!r} is not one of {TEXT_DTYPES}")
    schema = CORPUS_SCHEMA
    if text_dtype != "fp32":
        schema = schema.set(schema.get_field_index("text"), pa.field("text", BF16_TEXT))
    for wanted, fields in ((condition, CONDITION_FIELDS), (image_context, IMAGE_CONTEXT_FIELDS)):
        for field in fields if wanted else ():
            schema = schema.append(field)
    return schema


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values -> their bfloat16 bit patterns (uint16), rounded as torch rounds
    (``tensor.to(torch.bfloat16)``: to nearest, ties to even)."""
    import torch

    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if not flat.flags.writeable:  # an Arrow buffer: torch only reads it (.to makes a new tensor)
        flat = flat.copy()
    return torch.from_numpy(flat).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def bf16_to_fp32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly (bf16 is fp32's upper half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


INT_COLUMNS = ("frames", "height", "width", "channels", "visual_tokens", "text_tokens", "seq_len")
PAYLOAD_COLUMNS = ("latent", "text", "pooled")
CONDITION_COLUMNS = ("condition", "image_context")
"""Payload columns a corpus holds or not (image-to-video conditioning); a row that has one
decodes it, a corpus whose schema.json records it (``condition_channels``, ``image_dim``)
needs it in every row."""


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
        "condition_size",
        "image_context_size",
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
    """A payload column's values as a flat float32 array: a view where the row holds
    float32 already (the columnar readers' Arrow views), widened from bf16 where it holds
    bf16 bits (uint16 views, or ``bytes`` from ``to_pylist``)."""
    value = row[name]
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) % 2:
            raise _OddBytes(len(value))
        value = np.frombuffer(value, dtype="<u2")
    if isinstance(value, np.ndarray) and value.dtype == np.uint16:
        return bf16_to_fp32(value.reshape(-1))
    return np.asarray(value, dtype=np.float32).reshape(-1)


class _OddBytes(ValueError):
    """A bf16 payload with an odd number of bytes."""


def _all_finite(values: np.ndarray) -> bool:
    # min and max propagate NaN and show +-inf: two passes without a temporary the size of
    # the payload (np.isfinite(values).all() allocates one bool per value).
    return values.size == 0 or bool(np.isfinite(values.min()) and np.isfinite(values.max()))


def validate_row(
    row: Mapping[str, Any],
    *,
    payload: bool = True,
    text_dim: int | None = None,
    pooled_dim: int | None = None,
    condition_channels: int | None = None,
    image_dim: int | None = None,
) -> None:
    """Raise CorruptSample if ``row`` (a dict from pyarrow ``to_pylist`` or a Ray Data
    batch row) is inconsistent. ``payload=False`` checks only the length columns, as a
    lengths-only corpus has null payload columns. ``text_dim``/``pooled_dim`` (from
    schema.json) are checked when given. ``condition_channels``/``image_dim`` (schema.json's,
    of a corpus that holds them): the row must hold its conditioning latent / image tokens of
    that width; without them, a row that holds either is checked against its own counts."""
    _check_row(row, payload=payload, text_dim=text_dim, pooled_dim=pooled_dim,
               condition_channels=condition_channels, image_dim=image_dim)


def _check_row(
    row: Mapping[str, Any], *, payload: bool, text_dim: int | None, pooled_dim: int | None,
    condition_channels: int | None = None, image_dim: int | None = None,
) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    sid = row.get("sample_id", "<no sample_id>")
    needed = ("sample_id", "kind", *INT_COLUMNS) + (PAYLOAD_COLUMNS if payload else ())
    if payload:
        needed += (("condition_channels", "condition") if condition_channels else ()) + \
                  (("image_tokens", "image_context") if image_dim else ())
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
        try:
            flat = _flat(row, name)
        except _OddBytes as e:
            raise CorruptSample(sid, f"{name}_size", f"{name} holds {e.args[0]} bytes, not whole bf16 values") from None
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
    # A corpus without a pooled vector (pooled_dim 0: Wan) has empty pooled lists.
    if (pooled_size == 0 and pooled_dim != 0) or (pooled_dim is not None and pooled_size != pooled_dim):
        raise CorruptSample(
            sid, "pooled_size", f"pooled has {pooled_size} values, expected "
            f"{'>= 1' if pooled_dim is None else pooled_dim}"
        )
    _check_conditions(sid, row, n, arrays, condition_channels, image_dim)
    for name, arr in arrays.items():
        if not _all_finite(arr):
            bad_count = int(arr.size - np.isfinite(arr).sum())
            raise CorruptSample(sid, "non_finite", f"{name} has {bad_count} NaN/inf values")
    return n, arrays


def _check_conditions(sid: Any, row: Mapping[str, Any], n: dict[str, int], arrays: dict[str, np.ndarray],
                      condition_channels: int | None, image_dim: int | None) -> None:
    """Adds the row's conditioning latent and image tokens to ``arrays`` (those it holds, and
    those the corpus records: a null one is missing), each checked against its count column."""
    for name, count_name, width in (("condition", "condition_channels", condition_channels),
                                    ("image_context", "image_tokens", image_dim)):
        flat = _flat(row, name) if name in row else None
        if flat is None:
            if width:
                raise CorruptSample(sid, "missing_payload", f"{name} is null in a corpus that records it")
            continue
        count = row.get(count_name)
        count = -1 if count is None else int(count)
        if name == "condition":
            per_channel = n["frames"] * n["height"] * n["width"]
            ok = count >= 1 and flat.size == count * per_channel and (not width or count == width)
            want = (f"condition_channels {count} (corpus: {width or 'any'}) x frames x height x width "
                    f"{n['frames']}x{n['height']}x{n['width']}")
        else:
            ok = count >= 1 and flat.size > 0 and flat.size % count == 0 and (not width or flat.size == count * width)
            want = f"image_tokens {count} (>= 1) x image_dim {width or '?'}"
        if not ok:
            raise CorruptSample(sid, f"{name}_size", f"{name} has {flat.size} values, expected {want}")
        arrays[name] = flat


def decode_row(
    row: Mapping[str, Any], *, text_dim: int | None = None, pooled_dim: int | None = None,
    condition_channels: int | None = None, image_dim: int | None = None,
) -> dict[str, Any]:
    """Validate a row and return its arrays in model layout: ``latent`` (C, T, H, W),
    ``text`` (text_tokens, text_dim), ``pooled`` (pooled_dim,), all float32, plus the
    id, kind, source and int length columns. A row with zero text tokens decodes to a
    (0, text_dim) text array, (0, 0) when ``text_dim`` is not given. A row that holds its
    conditioning (``validate_row``) also gives ``condition`` (condition_channels, T, H, W)
    and ``image_context`` (image_tokens, image_dim)."""
    n, arrays = _check_row(row, payload=True, text_dim=text_dim, pooled_dim=pooled_dim,
                           condition_channels=condition_channels, image_dim=image_dim)
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
    if "condition" in arrays:
        out["condition"] = arrays["condition"].reshape(-1, n["frames"], n["height"], n["width"])
    if "image_context" in arrays:
        out["image_context"] = arrays["image_context"].reshape(int(row["image_tokens"]), -1)
    return out


def column_types(text_dtype: str = "fp32", *, condition: bool = False, image_context: bool = False) -> dict[str, str]:
    """Column name -> Arrow type name, as written into schema.json."""
    return {f.name: str(f.type) for f in corpus_schema(text_dtype, condition=condition, image_context=image_context)}


# ---- schema.json, read as untrusted input --------------------------------------------------

MAX_SCHEMA_BYTES = 64 << 20
"""schema.json holds a few numbers per shard: anything larger is not one."""


class SchemaFileError(ValueError):
    """A corpus's schema.json that cannot be used; the message names the file, in one line."""


def load_schema_json(corpus_dir: str) -> dict[str, Any]:
    """``<corpus_dir>/schema.json``, with every field a reader takes from it checked for its
    type (``FileNotFoundError`` if there is none; ``SchemaFileError`` naming the file and the
    field otherwise): what pre-flight reads before any worker starts."""
    import errno
    import os

    from knapray.files import read_json

    path = os.path.join(corpus_dir, SCHEMA_FILE)
    doc = read_json(path, MAX_SCHEMA_BYTES, "corpus file", SchemaFileError,
                    advice="rebuild the corpus or restore the file", missing=None)
    if doc is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        which = version if type(version) is int and 0 <= version < 1 << 20 else f"is {_short(version)}"
        raise SchemaFileError(f"corpus file {path}: format_version {which}, this knapray reads {FORMAT_VERSION}")
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
    for name in ("channels", "text_dim"):
        if not count(dims.get(name), 1):
            return f"dims.{name} is {_short(dims.get(name))}, not an int >= 1"
    if not count(dims.get("pooled_dim"), 0):  # 0: no pooled vector (Wan)
        return f"dims.pooled_dim is {_short(dims.get('pooled_dim'))}, not an int >= 0"
    for name in ("condition_channels", "image_dim", "image_tokens"):  # absent or 0: none held
        if name in dims and not count(dims[name], 0):
            return f"dims.{name} is {_short(dims[name])}, not an int >= 0"
    if bool(dims.get("image_dim")) != bool(dims.get("image_tokens")):
        return "dims.image_dim and dims.image_tokens are not both given (an image context has both)"
    family = doc.get("family")  # absent: made before it was recorded, fits any family
    if family is not None and family not in FAMILIES:
        return f"family is {_short(family)}, not one of {', '.join(FAMILIES)}"
    pad_to = doc.get("text_pad_to")
    if pad_to is not None and not count(pad_to, 1):
        return f"text_pad_to is {_short(pad_to)}, not an int >= 1"
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
    text_dtype = doc.get("text_dtype", "fp32")  # corpora written before the field are fp32
    if text_dtype not in TEXT_DTYPES:
        return f"text_dtype is {_short(text_dtype)}, not one of {', '.join(TEXT_DTYPES)}"
    rows = doc.get("shard_rows")
    if rows is not None and not (isinstance(rows, list) and len(rows) == len(shards)
                                 and all(count(n, 0) for n in rows)):
        return f"shard_rows is {_short(rows)}, not one int >= 0 per shard"
    return None


def _short(value: Any) -> str:
    """What a value of schema.json is, without its content ("a str", "an int", "null"): a
    corpus is untrusted input, and a message never shows what a file holds."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
