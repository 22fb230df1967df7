"""Write corpus rows as parquet shards ``part-00000.parquet`` ... plus ``schema.json``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from knapray.corpus.schema import (BF16_TEXT, CONDITION_FIELDS, CORPUS_SCHEMA, FLOAT_LIST, FORMAT_VERSION,
                                   IMAGE_CONTEXT_FIELDS, INT_COLUMNS, PATCH, SCHEMA_FILE, bf16_bits, column_types,
                                   corpus_schema)


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def _float_lists(arrays: Sequence[np.ndarray] | None, n: int) -> pa.Array:
    """A list<float32> column from per-row arrays without a Python float per value."""
    if arrays is None:
        return pa.nulls(n, type=FLOAT_LIST)
    flats = [np.asarray(a, dtype=np.float32).reshape(-1) for a in arrays]
    offsets = np.zeros(len(flats) + 1, dtype=np.int32)
    np.cumsum([f.size for f in flats], out=offsets[1:])
    values = np.concatenate(flats) if flats else np.zeros(0, np.float32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.float32()))


def bf16_column(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A ``list<float32>`` text column -> the bf16 corpus's ``large_binary`` column: each
    row's values rounded to bfloat16 as torch rounds them, stored as their bit patterns."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if column.type == BF16_TEXT:
        return column
    if column.null_count == len(column):
        return pa.nulls(len(column), type=BF16_TEXT)
    if column.null_count:
        raise ValueError("a text column with some null rows: a corpus has payload in every row or in none")
    offsets = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    bits = bf16_bits(values)
    return pa.LargeBinaryArray.from_buffers(
        BF16_TEXT, len(column), [None, pa.py_buffer(2 * (offsets - offsets[0])), pa.py_buffer(bits)])


def with_text_dtype(table: pa.Table, text_dtype: str) -> pa.Table:
    """``table`` (in CORPUS_SCHEMA, with the conditioning columns it holds) in the schema of a
    corpus storing text as ``text_dtype``."""
    names = table.column_names
    schema = corpus_schema(text_dtype, condition="condition" in names, image_context="image_context" in names)
    if text_dtype == "fp32":
        return table.cast(schema) if not table.schema.equals(schema) else table
    i = table.schema.get_field_index("text")
    return table.set_column(i, schema.field("text"), bf16_column(table.column(i)))


def build_table(
    columns: dict[str, Any],
    latents: Sequence[np.ndarray] | None = None,
    texts: Sequence[np.ndarray] | None = None,
    pooleds: Sequence[np.ndarray] | None = None,
    *,
    conditions: Sequence[np.ndarray] | None = None,
    image_contexts: Sequence[np.ndarray] | None = None,
) -> pa.Table:
    """One table in CORPUS_SCHEMA. ``columns`` holds sample_id, kind, source and the int
    length columns (sequences of equal length); payloads are per-row arrays, or None
    for a lengths-only table. (``ShardWriter`` stores the text in the corpus's dtype.)
    ``conditions`` ((C_cond, T, H, W) each) and ``image_contexts`` ((L, image_dim) each)
    append the conditioning columns (``corpus_schema``'s), their counts taken from the shapes."""
    n = len(columns["sample_id"])
    arrays = [
        pa.array(np.asarray(columns["sample_id"], dtype=np.int64)),
        pa.array(list(columns["kind"]), type=pa.string()),
        pa.array(list(columns["source"]), type=pa.string()),
        *(pa.array(np.asarray(columns[c], dtype=np.int32)) for c in INT_COLUMNS),
        _float_lists(latents, n),
        _float_lists(texts, n),
        _float_lists(pooleds, n),
    ]
    table = pa.Table.from_arrays(arrays, schema=CORPUS_SCHEMA)
    for values, (count, column) in ((conditions, CONDITION_FIELDS), (image_contexts, IMAGE_CONTEXT_FIELDS)):
        if values is not None:
            counts = np.array([np.shape(v)[0] for v in values], dtype=np.int32)
            table = table.append_column(count, pa.array(counts)).append_column(column, _float_lists(values, n))
    return table


class ShardWriter:
    """Streams tables into consecutive shards of at most ``rows_per_shard`` rows."""

    def __init__(self, out_dir: str | Path, rows_per_shard: int, *, text_dtype: str = "fp32",
                 condition: bool = False, image_context: bool = False) -> None:
        if rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stale = sorted(self.out_dir.glob("part-*.parquet"))
        if stale:
            raise FileExistsError(
                f"{self.out_dir} already holds shards ({stale[0].name}, ...): "
                "write a corpus into an empty or new directory"
            )
        self.rows_per_shard = rows_per_shard
        self.text_dtype = text_dtype
        self.schema = corpus_schema(text_dtype, condition=condition, image_context=image_context)
        self.paths: list[Path] = []
        self.shard_rows: list[int] = []
        """Rows written to each shard (recorded in schema.json: a reader that cannot read a
        shard knows how many samples it loses)."""
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._in_shard = 0

    def add(self, table: pa.Table) -> None:
        """Append rows in CORPUS_SCHEMA (fp32 text is converted to the corpus's text dtype)."""
        if not table.schema.equals(self.schema):
            table = with_text_dtype(table, self.text_dtype)
        start = 0
        while start < table.num_rows:
            if self._writer is None or self._in_shard == self.rows_per_shard:
                self._open_next()
            take = min(self.rows_per_shard - self._in_shard, table.num_rows - start)
            assert self._writer is not None
            self._writer.write_table(table.slice(start, take))
            self._in_shard += take
            self.shard_rows[-1] += take
            self.rows += take
            start += take

    def _open_next(self) -> None:
        if self._writer is not None:
            self._writer.close()
        path = self.out_dir / shard_name(len(self.paths))
        self._writer = pq.ParquetWriter(path, self.schema)
        self.paths.append(path)
        self.shard_rows.append(0)
        self._in_shard = 0

    def close(self) -> list[Path]:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return self.paths


def length_stats(
    kinds: Sequence[str], seq_len: np.ndarray, sources: Sequence[str] | None = None
) -> dict[str, Any]:
    """Counts and sequence-length summary recorded in schema.json; per-source counts
    only when ``sources`` is given (data codes, not one file path per row)."""
    seq = np.asarray(seq_len, dtype=np.int64)
    counts: dict[str, Any] = {"samples": int(seq.size), "by_kind": _count(kinds)}
    if sources is not None:
        counts["by_source"] = _count(sources)
    counts["seq_len"] = {
        "min": int(seq.min()) if seq.size else 0,
        "max": int(seq.max()) if seq.size else 0,
        "mean": round(float(seq.mean()), 3) if seq.size else 0.0,
        "total": int(seq.sum()),
    }
    return counts


def _count(values: Sequence[str]) -> dict[str, int]:
    names, counts = np.unique(np.asarray(list(values), dtype=str), return_counts=True)
    return {str(k): int(c) for k, c in zip(names, counts)}


def write_schema_json(
    out_dir: str | Path,
    *,
    builder: str,
    dims: dict[str, int],
    payload: bool,
    shards: Sequence[Path],
    counts: dict[str, Any],
    extra: dict[str, Any],
    shard_rows: Sequence[int] | None = None,
    text_dtype: str = "fp32",
) -> Path:
    """Describe the corpus next to its shards; readers take dims from here."""
    doc = {
        "format_version": FORMAT_VERSION,
        "builder": builder,
        "columns": column_types(text_dtype, condition=bool(dims.get("condition_channels")),
                                image_context=bool(dims.get("image_dim"))),
        "text_dtype": text_dtype,
        "dims": {**dims, "patch": list(PATCH)},
        "payload": payload,
        "shards": [Path(p).name for p in shards],
        "shard_rows": [int(n) for n in shard_rows] if shard_rows is not None else None,
        "counts": counts,
        **extra,
    }
    path = Path(out_dir) / SCHEMA_FILE
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def read_schema_json(corpus_dir: str | Path) -> dict[str, Any]:
    path = Path(corpus_dir) / SCHEMA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {corpus_dir} a knapray corpus directory?")
    from knapray.corpus.schema import load_schema_json  # every field a reader takes, type-checked

    return load_schema_json(str(corpus_dir))


def shard_paths(corpus_dir: str | Path) -> list[Path]:
    """The corpus's parquet shards in order. Read these, not the directory: pyarrow's
    directory reader would also try to parse schema.json (Ray Data's ``read_parquet``
    filters by extension and takes the directory as is)."""
    paths = sorted(Path(corpus_dir).glob("part-*.parquet"))
    if not paths:
        raise FileNotFoundError(f"no part-*.parquet shards in {corpus_dir}")
    return paths


def read_corpus(corpus_dir: str | Path, columns: Sequence[str] | None = None) -> pa.Table:
    """The whole corpus as one table (small corpora and tests; stream large ones)."""
    import pyarrow.dataset as pads

    dataset = pads.dataset([str(p) for p in shard_paths(corpus_dir)], format="parquet")
    return dataset.to_table(columns=list(columns) if columns is not None else None)
