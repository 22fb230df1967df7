"""Ray Data side of training: read the corpus, cut each rank's shard into steps, pack batches.

Three pieces, used in this order by a training worker:

1. ``corpus_dataset`` (driver): a Ray Dataset over the corpus's parquet shards in a
   deterministic order, handed to ``TorchTrainer(datasets={"train": ...})``.
2. ``StepStream`` (worker): turns this rank's rows (from ``get_dataset_shard("train")``,
   or any iterable of rows) into steps of decoded samples, one step ahead, so the step
   after the current one can be sent to the coordinator while the current one computes.
   Corrupt rows are reported and skipped, samples the ledger already holds are skipped.
3. ``build_packed_batch`` (worker): a step's samples -> a ``PackedBatch`` with flow-matching
   timesteps, noise and targets drawn per sample from a (seed, epoch, sample id) generator.

``corpus_info`` / ``check_model_config`` compare the corpus's schema.json with the model
config once at start-up, so a mismatch fails with both values named instead of a shape
error deep inside the model.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from knapray.corpus import CorruptSample, decode_row, read_schema_json, shard_paths
from knapray.corpus.schema import INT_COLUMNS, PAYLOAD_COLUMNS
from knapray.models.config import MMDiTConfig
from knapray.models.flow import add_noise
from knapray.models.timesteps import TimestepDistribution
from knapray.models.packing import PackedBatch, pack_samples

if TYPE_CHECKING:
    import ray.data

logger = logging.getLogger(__name__)

Row = Mapping[str, Any]
OnCorrupt = Callable[[Any, str], None]


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


def check_model_config(info: CorpusInfo, cfg: MMDiTConfig) -> None:
    """Raise ValueError if the model cannot train on this corpus, naming both values of
    every mismatch (:class:`FamilyMismatch` first, alone, when the corpus was made for
    another family). The patch must be equal, not merely compatible: the corpus's seq_len
    column (what the balancer plans with) counts patches of the corpus's size."""
    if info.family is not None and info.family != cfg.family:
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


# --- Ray Data (driver side) ----------------------------------------------------------------


def epoch_seed(seed: int, epoch: int) -> int:
    """A 32-bit seed for (seed, epoch): the shard order of ``corpus_dataset`` and a good
    ``local_shuffle_seed`` for ``shard_batches``. Stable across processes and restarts
    (Python's ``hash`` is not, for strings)."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    return int(np.random.SeedSequence(seed, spawn_key=(epoch,)).generate_state(1)[0])


def shard_order(num_shards: int, *, shuffle_seed: int | None, epoch: int = 0) -> list[int]:
    """Indices of the corpus's shards in the order an epoch reads them: corpus order
    without a seed, else a permutation that depends only on (shuffle_seed, epoch)."""
    if shuffle_seed is None:
        return list(range(num_shards))
    rng = np.random.default_rng(epoch_seed(shuffle_seed, epoch))
    return rng.permutation(num_shards).tolist()


def checked_shards(path: str | Path, info: CorpusInfo | None = None) -> list[Path]:
    """The corpus's shard files, which must be exactly those schema.json lists: a shard
    missing or left over (an interrupted copy) would silently change the epoch.
    ``info``: the corpus's ``corpus_info``, when read already."""
    info = corpus_info(path) if info is None else info
    files = shard_paths(path)
    names = tuple(p.name for p in files)
    if names != info.shards:
        raise ValueError(
            f"{path}: shards on disk {list(names)} differ from schema.json shards {list(info.shards)}"
        )
    return files


def corpus_dataset(
    path: str | Path,
    *,
    shuffle_seed: int | None = None,
    epoch: int = 0,
    rows_per_block: int = 32,
    shards: Sequence[Path] | None = None,
) -> ray.data.Dataset:
    """A Ray Dataset of the corpus's rows in a deterministic order.

    Shards are read in corpus order, or, with ``shuffle_seed``, in a permutation drawn
    from (shuffle_seed, epoch). Shuffling whole files keeps the read streaming; a block
    shuffle (``randomize_block_order``) would read the entire epoch before yielding its
    first row. Rows keep their order within a shard; use many shards for a finer mix.

    Blocks are cut to ``rows_per_block`` rows because Ray hands whole blocks to the
    consumers of ``streaming_split``: its parquet reader merges small files into one
    block, which would give one rank everything. ``samples_per_step`` is a good value.

    ``shards``: the files to read (default: all; the driver passes the readable ones).

    ``preserve_order`` is set on this dataset's own context so that the row order, and
    with it which rows each split receives, is the same on every run. Ray Train replaces
    a dataset's execution options with ``DataConfig``'s: pass
    ``DataConfig(execution_options=ingest_execution_options())`` to TorchTrainer.
    """
    import ray.data

    if rows_per_block < 1:
        raise ValueError(f"rows_per_block must be >= 1, got {rows_per_block}")
    files = checked_shards(path) if shards is None else list(shards)
    order = shard_order(len(files), shuffle_seed=shuffle_seed, epoch=epoch)
    ds = ray.data.read_parquet([str(files[i]) for i in order])
    ds = ds.repartition(target_num_rows_per_block=rows_per_block)
    ds.context.execution_options.preserve_order = True
    return ds


def ingest_execution_options() -> ray.data.ExecutionOptions:
    """The driver's current Ray Data execution options with ``preserve_order`` on, for
    ``ray.train.DataConfig(execution_options=...)`` (whose default would copy the
    driver's context and lose the dataset's own setting)."""
    from ray.data import DataContext

    options = copy.deepcopy(DataContext.get_current().execution_options)
    options.preserve_order = True
    return options


def shard_batches(
    shard: Any,
    *,
    batch_size: int,
    shuffle_buffer: int = 0,
    shuffle_seed: int | None = None,
    prefetch_batches: int = 2,
) -> Iterable[pa.Table]:
    """Arrow batches of a ``ray.data.DataIterator`` (``get_dataset_shard("train")``), the
    input ``StepStream`` expects. Arrow, not numpy or torch: ``StepStream`` takes the
    payload columns' buffers as they are (``arrow_rows``), where Ray's numpy format would
    build an object array of per-row arrays and the default torch collate cannot stack
    ragged rows. ``shuffle_buffer`` > 0 shuffles rows locally among that many
    (``shuffle_rows`` sizes it in bytes), deterministically when ``shuffle_seed`` is given
    (use ``epoch_seed(seed, epoch)``: a Ray Train dataset is read in the same order every
    epoch)."""
    if shuffle_buffer < 0:
        raise ValueError(f"shuffle_buffer must be >= 0, got {shuffle_buffer}")
    return shard.iter_batches(
        batch_format="pyarrow",
        batch_size=batch_size,
        prefetch_batches=prefetch_batches,
        local_shuffle_buffer_size=shuffle_buffer or None,
        local_shuffle_seed=shuffle_seed if shuffle_buffer else None,
    )


SHUFFLE_ROWS_MAX = 256
"""At most this many rows in a worker's shuffle buffer, however small they are: the
row-sized buffer knapray had before ``data.shuffle_buffer_mb``, so a corpus of small rows
shuffles (and orders its epochs) as it did."""


def shuffle_rows(buffer_mb: int, row_bytes: float) -> int:
    """Rows of a ``buffer_mb`` MiB shuffle buffer for rows of ``row_bytes`` bytes on average,
    at least 1 and at most ``SHUFFLE_ROWS_MAX``; 0 when ``buffer_mb`` is 0 (no shuffle).
    Ray's buffer yields once it holds this many rows and holds up to about twice as many
    between compactions."""
    if buffer_mb < 0:
        raise ValueError(f"shuffle buffer must be >= 0 MiB, got {buffer_mb}")
    if buffer_mb == 0:
        return 0
    return int(min(SHUFFLE_ROWS_MAX, max(1, (buffer_mb << 20) // max(1.0, row_bytes))))


def mean_row_bytes(path: str | Path, *, shards: int = 8) -> float:
    """Bytes per row of the corpus in memory (Arrow), from the parquet footers of up to
    ``shards`` shards spread over the corpus (uncompressed sizes; no data is read)."""
    import pyarrow.parquet as pq

    files = shard_paths(path)
    picked = [files[i] for i in sorted({round(k * (len(files) - 1) / max(1, shards - 1)) for k in range(shards)})]
    size = rows = 0
    for file in picked:
        try:
            meta = pq.ParquetFile(file).metadata
        except Exception:  # noqa: BLE001 - an unreadable shard (pre-flight quarantined it): size from the others
            continue
        rows += meta.num_rows
        size += sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    return size / rows if rows else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class BadShard:
    """A shard that could not be read (whole or from some row on)."""

    shard: str
    """File name in the corpus directory."""
    rows: int | None
    """Rows lost (None if the corpus does not record the shard's size)."""
    reason: str

    def to_json(self) -> dict:
        return {"shard": self.shard, "rows": self.rows, "reason": self.reason}


OnBadShard = Callable[[BadShard], None]


def check_shards(path: str | Path, info: CorpusInfo | None = None) -> tuple[list[Path], list[BadShard]]:
    """Readable shards and the ones that are not, from each file's parquet footer (no data
    is read): truncated files, garbage, other files under a shard's name and shards whose
    row count differs from schema.json are found before training starts. ``info``: the
    corpus's ``corpus_info``, when read already."""
    import pyarrow.parquet as pq

    from knapray.corpus.schema import CORPUS_SCHEMA

    info = corpus_info(path) if info is None else info
    good, bad = [], []
    for i, file in enumerate(checked_shards(path, info)):
        expected = info.shard_rows[i] if info.shard_rows is not None else None
        try:
            meta = pq.ParquetFile(file).metadata
            missing = sorted(set(CORPUS_SCHEMA.names) - set(meta.schema.to_arrow_schema().names))
            if missing:
                raise ValueError(f"columns {missing} missing")
            if expected is not None and meta.num_rows != expected:
                raise ValueError(f"{meta.num_rows} rows where schema.json records {expected}")
        except Exception as e:  # noqa: BLE001 - whatever pyarrow raises, the shard is unusable
            bad.append(BadShard(file.name, expected, f"unreadable: {type(e).__name__}: {e}"))
            continue
        good.append(file)
    return good, bad


@dataclasses.dataclass(frozen=True, slots=True)
class DuplicateId:
    """A sample id that more than one row of the corpus carries."""

    sample_id: int
    rows: tuple[tuple[str, int], ...]
    """(shard file name, row in the shard) of every row carrying it, in corpus order."""

    def where(self, limit: int = 3) -> str:
        shown = ", ".join(f"{shard} row {row}" for shard, row in self.rows[:limit])
        return shown + (f" and {len(self.rows) - limit} more" if len(self.rows) > limit else "")


def duplicate_ids(shards: Sequence[Path]) -> list[DuplicateId]:
    """Sample ids carried by more than one row of ``shards`` (only the id column is read):
    the ledger counts samples by id, so a duplicated id would be trained twice in an epoch,
    or once for two samples across a resume."""
    import pyarrow.parquet as pq

    ids, where = [], []
    for i, file in enumerate(shards):
        col = pq.read_table(file, columns=["sample_id"]).column("sample_id").to_numpy()
        ids.append(np.asarray(col, dtype=np.int64))
        where.append(np.full(col.size, i, dtype=np.int32))
    if not ids:
        return []
    all_ids, shard_of = np.concatenate(ids), np.concatenate(where)
    row_of = np.concatenate([np.arange(a.size) for a in ids])
    order = np.argsort(all_ids, kind="stable")  # corpus order within an id
    sorted_ids = all_ids[order]
    dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if dup.size == 0:
        return []
    out, groups = [], np.split(order, np.flatnonzero(np.diff(sorted_ids)) + 1)
    for g in groups:
        if g.size > 1:
            out.append(DuplicateId(int(all_ids[g[0]]), tuple((shards[shard_of[j]].name, int(row_of[j])) for j in g)))
    return out


def read_shard(file: Path, *, read_rows: int, expected_rows: int | None,
               on_bad_shard: OnBadShard) -> Iterator[pa.RecordBatch]:
    """Record batches of one shard; if reading fails part-way, ``on_bad_shard`` learns the
    shard and the rows not read (when the corpus records its size) and the shard ends there."""
    import pyarrow.parquet as pq

    done = 0
    try:
        for batch in pq.ParquetFile(file).iter_batches(batch_size=read_rows):
            done += batch.num_rows
            yield batch
    except Exception as e:  # noqa: BLE001 - a corrupt page, a vanished file: quarantine the rest
        lost = expected_rows - done if expected_rows is not None else None
        on_bad_shard(BadShard(file.name, lost, f"unreadable after row {done}: {type(e).__name__}: {e}"))


def local_rows(
    path: str | Path,
    rank: int,
    world_size: int,
    *,
    shuffle_seed: int | None = None,
    epoch: int = 0,
    read_rows: int = 64,
    on_bad_shard: OnBadShard | None = None,
) -> Iterator[pa.RecordBatch]:
    """This rank's rows of the corpus without Ray (the torchrun launcher): shards in
    ``shard_order``, and of the rows in that order every ``world_size``-th, starting at
    ``rank``. Record batches of at most ``read_rows`` rows are read one at a time, so a
    rank holds little more than a step's samples in memory. A shard that fails to read
    goes to ``on_bad_shard`` (every rank reports it; default: raise), and the epoch goes on
    with the next shard. Ranks keep their row assignment as long as they all see the
    same failure, which a file read fails for every reader alike."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    info = corpus_info(path)
    good, _ = check_shards(path)  # the driver quarantined the others before training
    index_of = {p.name: i for i, p in enumerate(checked_shards(path))}

    def raise_bad(bad: BadShard) -> None:
        raise ValueError(f"corpus {path}: shard {bad.shard} {bad.reason}")

    index = 0  # global row index of the next row read
    for k in shard_order(len(good), shuffle_seed=shuffle_seed, epoch=epoch):
        i = index_of[good[k].name]
        expected = info.shard_rows[i] if info.shard_rows is not None else None
        for batch in read_shard(good[k], read_rows=read_rows, expected_rows=expected,
                                on_bad_shard=on_bad_shard or raise_bad):
            first = (rank - index) % world_size  # first row of this batch that is ours
            mine = np.arange(first, batch.num_rows, world_size)
            index += batch.num_rows
            if mine.size == batch.num_rows:  # a world of one: every row, no copy
                yield batch
            elif mine.size:
                yield batch.take(pa.array(mine))


# --- steps (worker side) -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class StepMeta:
    """What the coordinator plans with: one rank's sequences for one step."""

    index: int
    """Steps taken from this stream before this one."""
    seq_lens: tuple[int, ...]
    """Tokens per sample (text + visual), in sample order."""
    sample_ids: tuple[int, ...]
    """Corpus sample ids, in sample order."""

    @property
    def exhausted(self) -> bool:
        """No samples: this rank's shard is used up (submit ``exhausted=True``)."""
        return not self.sample_ids


@dataclasses.dataclass(frozen=True, slots=True)
class DecodedStep:
    """One rank's decoded samples for one step (``decode_row`` dicts, numpy arrays)."""

    meta: StepMeta
    samples: tuple[dict[str, Any], ...]


@dataclasses.dataclass(slots=True)
class StreamStats:
    samples: int = 0
    """Samples decoded into steps, the step held ahead included."""
    skipped: int = 0
    """Rows dropped because their id was in ``skip_sample_ids``."""
    corrupt: int = 0
    """Rows that failed to decode and went to ``on_corrupt``."""
    corrupt_by_reason: dict[str, int] = dataclasses.field(default_factory=dict)
    captions_dropped: int = 0
    """Samples whose caption ``CaptionDropout`` replaced by the unconditional one."""


CAPTION_DROPOUT_STREAM = 1
"""Spawn-key suffix of the caption-dropout draw: a stream of its own, so dropping a caption
changes no sample's timestep or noise (``sample_generator``)."""


@dataclasses.dataclass(frozen=True, eq=False)
class CaptionDropout:
    """Trains a fraction ``rate`` of the samples unconditionally (``data.caption_dropout``):
    their text and pooled embeddings become the corpus's unconditional ones
    (knapray/corpus/unconditional.py), which changes their token count, so it is decided
    where lengths are read, before planning. Whether a sample is dropped depends only on
    (seed, epoch, sample id): the same on any rank, world size or resumed run."""

    rate: float
    seed: int
    epoch: int
    text: np.ndarray
    """(L, text_dim) float32: the unconditional text tokens."""
    pooled: np.ndarray
    """(pooled_dim,) float32."""

    def __post_init__(self) -> None:
        if not 0 <= self.rate < 1:
            raise ValueError(f"caption dropout rate must be in [0, 1), got {self.rate!r}")
        if min(self.seed, self.epoch) < 0:
            raise ValueError(f"seed and epoch must be >= 0, got {self.seed}, {self.epoch}")

    def drops(self, sample_id: int) -> bool:
        key = (self.epoch, int(sample_id) & 0xFFFFFFFF, (int(sample_id) >> 32) & 0xFFFFFFFF, CAPTION_DROPOUT_STREAM)
        draw = np.random.SeedSequence(self.seed, spawn_key=key).generate_state(1, dtype=np.uint64)[0]
        return float(draw) / 2.0**64 < self.rate

    def apply(self, sample: dict[str, Any]) -> dict[str, Any]:
        """The sample with the unconditional text and pooled embeddings, its length adjusted."""
        seq_len = int(sample["seq_len"]) - sample["text"].shape[0] + self.text.shape[0]
        return {**sample, "text": self.text, "pooled": self.pooled, "seq_len": seq_len,
                "text_tokens": self.text.shape[0]}


def _payload_views(column: pa.Array) -> list[np.ndarray | None]:
    """Each row of a payload column as a numpy view of the column's own buffer (no copy,
    no Python object per value): float32 for ``list<float32>``, uint16 bf16 bits for the
    bf16 corpus's ``large_binary``, None for a null row. A binary row of an odd number of
    bytes comes back as ``bytes`` for ``decode_row`` to reject."""
    n = len(column)
    if column.null_count == n:
        return [None] * n
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        offsets = column.offsets.to_numpy()
        child = column.values
        values = child.to_numpy(zero_copy_only=child.null_count == 0 and pa.types.is_primitive(child.type))
    elif pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        wide = pa.types.is_large_binary(column.type)
        _, off_buf, data_buf = column.buffers()
        offsets = np.frombuffer(off_buf, dtype=np.int64 if wide else np.int32)[column.offset:column.offset + n + 1]
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        out: list[np.ndarray | None] = []
        for i in range(n):
            a, b = int(offsets[i]), int(offsets[i + 1])
            raw = data[a:b]
            out.append(raw.view("<u2") if (b - a) % 2 == 0 and a % 2 == 0 else raw.tobytes())
        values = None
    else:
        raise TypeError(f"payload column of type {column.type}: expected list<float> or large_binary (bf16)")
    if values is not None:
        out = [values[offsets[i]:offsets[i + 1]] for i in range(n)]
    if column.null_count:
        for i in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False)):
            out[i] = None
    return out


def arrow_rows(batch: pa.RecordBatch) -> Iterator[Row]:
    """Rows of a record batch as dicts whose payloads are numpy views of the batch's
    buffers (``_payload_views``) and whose ints are numpy scalars: what ``decode_row``
    takes, without ``to_pylist``'s Python float per value."""
    names = batch.schema.names
    columns: dict[str, Any] = {}
    for name in names:
        column = batch.column(name)
        if name in PAYLOAD_COLUMNS:
            columns[name] = _payload_views(column)
        elif name in INT_COLUMNS or name == "sample_id":
            columns[name] = column.to_numpy(zero_copy_only=column.null_count == 0).tolist()
        else:
            columns[name] = column.to_pylist()
    for i in range(batch.num_rows):
        yield {name: columns[name][i] for name in names}


def _rows(source: Iterable[Any]) -> Iterator[Row]:
    """Rows from row dicts, column batches (dict of arrays or lists, as Ray Data's numpy
    batches) or pyarrow tables/record batches (read through ``arrow_rows``), in order."""
    for item in source:
        if isinstance(item, pa.Table):
            for batch in item.to_batches():
                yield from arrow_rows(batch)
        elif isinstance(item, pa.RecordBatch):
            yield from arrow_rows(item)
        elif isinstance(item, Mapping):
            ids = item.get("sample_id")
            # A row's sample_id is a scalar; a column batch's is a 1-D array or a list.
            if isinstance(ids, (np.ndarray, list, tuple)) and np.ndim(ids) == 1:
                for i in range(len(ids)):
                    yield {name: column[i] for name, column in item.items()}
            else:
                yield item
        else:
            raise TypeError(
                f"StepStream source items must be row dicts, column batches or pyarrow "
                f"tables, got {type(item).__name__}"
            )


def _log_corrupt(sample_id: Any, reason: str) -> None:
    logger.warning("skipping corrupt sample %s (%s)", sample_id, reason)


class StepStream:
    """Steps of ``samples_per_step`` decoded samples from one rank's rows, one step ahead.

    ``peek_next()`` is the metadata of the step the next ``next_step()`` returns; it is
    decoded ahead so the training loop can submit step t+1 while step t computes. Rows
    whose sample id is in ``skip_sample_ids`` are dropped unread (a resumed run's ledger);
    rows that ``decode_row`` rejects go to ``on_corrupt(sample_id, reason)`` (reason: the
    ``CorruptSample`` code) and the step is filled from the following rows. After the last
    (possibly partial) step, every step is empty and ``exhausted``; iterating the stream
    stops there. ``caption_dropout`` replaces some samples' captions by the unconditional
    one as they are decoded (their lengths, and so the plan, follow).
    """

    def __init__(
        self,
        source: Iterable[Any],
        *,
        samples_per_step: int,
        text_dim: int | None = None,
        pooled_dim: int | None = None,
        on_corrupt: OnCorrupt | None = None,
        skip_sample_ids: Collection[int] | np.ndarray = (),
        max_seq_len: int | None = None,
        caption_dropout: CaptionDropout | None = None,
    ) -> None:
        self.caption_dropout = caption_dropout
        if max_seq_len is not None and max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1 or None, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        if not isinstance(samples_per_step, int) or samples_per_step < 1:
            raise ValueError(f"samples_per_step must be an integer >= 1, got {samples_per_step!r}")
        self.samples_per_step = samples_per_step
        self.text_dim = text_dim
        self.pooled_dim = pooled_dim
        self.on_corrupt: OnCorrupt = on_corrupt or _log_corrupt
        # Sorted int64: 10 million ids take 80 MB here, a Python set of them ten times that.
        self.skip_sample_ids = np.unique(np.fromiter((int(i) for i in skip_sample_ids), dtype=np.int64)
                                         if not isinstance(skip_sample_ids, np.ndarray)
                                         else skip_sample_ids.astype(np.int64))
        self.stats = StreamStats()
        self._rows: Iterator[Row] | None = _rows(source)
        self._ahead: DecodedStep | None = None  # filled on first use, not here: reading starts Ray execution
        self._taken = 0

    @classmethod
    def for_corpus(cls, source: Iterable[Any], info: CorpusInfo, **kwargs: Any) -> StepStream:
        """A stream that decodes with the corpus's text and pooled widths."""
        return cls(source, text_dim=info.text_dim, pooled_dim=info.pooled_dim, **kwargs)

    def peek_next(self) -> StepMeta:
        """The next step's lengths and ids, before it is taken."""
        return self._lookahead().meta

    def next_step(self) -> DecodedStep:
        """The next step; decodes the one after it, so ``peek_next`` is ready."""
        step = self._lookahead()
        self._taken += 1
        self._ahead = self._read_step(self._taken)
        return step

    @property
    def exhausted(self) -> bool:
        """True once the next step would be empty."""
        return self.peek_next().exhausted

    def __iter__(self) -> Iterator[DecodedStep]:
        while not self.exhausted:
            yield self.next_step()

    def _lookahead(self) -> DecodedStep:
        if self._ahead is None:
            self._ahead = self._read_step(self._taken)
        return self._ahead

    def _read_step(self, index: int) -> DecodedStep:
        samples: list[dict[str, Any]] = []
        while self._rows is not None and len(samples) < self.samples_per_step:
            row = next(self._rows, None)
            if row is None:
                self._rows = None  # drop the source iterator (and what it buffers)
                break
            sample = self._decode(row)
            if sample is not None:
                samples.append(sample)
        self.stats.samples += len(samples)
        meta = StepMeta(
            index,
            tuple(int(s["seq_len"]) for s in samples),
            tuple(int(s["sample_id"]) for s in samples),
        )
        return DecodedStep(meta, tuple(samples))

    def _skipped(self, sample_id: int) -> bool:
        ids = self.skip_sample_ids
        i = int(np.searchsorted(ids, sample_id))
        return i < ids.size and int(ids[i]) == sample_id

    def _decode(self, row: Row) -> dict[str, Any] | None:
        sid = row.get("sample_id")
        if sid is not None and self._skipped(int(sid)):
            self.stats.skipped += 1
            return None
        try:
            sample = decode_row(row, text_dim=self.text_dim, pooled_dim=self.pooled_dim)
            if self.caption_dropout is not None and self.caption_dropout.drops(int(sample["sample_id"])):
                sample = self.caption_dropout.apply(sample)
                self.stats.captions_dropped += 1
            if self.max_seq_len is not None and int(sample["seq_len"]) > self.max_seq_len:
                raise CorruptSample(
                    sid, "too_long",
                    f"{int(sample['seq_len'])} tokens exceed the memory budget of {self.max_seq_len} "
                    "(max_tokens_per_gpu x the largest bag)",
                )
            return sample
        except CorruptSample as e:
            self.stats.corrupt += 1
            self.stats.corrupt_by_reason[e.reason] = self.stats.corrupt_by_reason.get(e.reason, 0) + 1
            logger.debug("corrupt sample %s: %s", e.sample_id, e.detail)
            self.on_corrupt(e.sample_id, e.reason)
            return None


# --- packed batches (worker side) ----------------------------------------------------------


def sample_generator(seed: int, epoch: int, sample_id: int) -> torch.Generator:
    """A CPU generator for one sample in one epoch: its timestep and noise depend on
    nothing else, so they are the same whichever rank, step, world size or plan trains it
    (a run resumed at another world size draws the very same ones)."""
    if min(seed, epoch) < 0:
        raise ValueError(f"seed and epoch must be >= 0, got {seed}, {epoch}")
    key = (epoch, int(sample_id) & 0xFFFFFFFF, (int(sample_id) >> 32) & 0xFFFFFFFF)
    state = np.random.SeedSequence(seed, spawn_key=key).generate_state(2, dtype=np.uint32)
    gen = torch.Generator()
    gen.manual_seed(int(state[0]) << 32 | int(state[1]))
    return gen


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A float32 tensor over ``array``'s memory, without a copy. Decoded payloads are views
    of read-only Arrow buffers, which torch warns about (it cannot mark a tensor
    read-only); nothing writes to them: ``pack_samples`` patchifies and concatenates into
    new tensors, the batch's one copy of the data."""
    array = np.asarray(array, dtype=np.float32)
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def build_packed_batch(
    samples: Sequence[Mapping[str, Any]],
    cfg: MMDiTConfig,
    *,
    seed: int,
    epoch: int = 0,
    timesteps: TimestepDistribution = TimestepDistribution(),
    guidance: float | None = None,
) -> PackedBatch:
    """Pack decoded samples (``DecodedStep.samples``, each with its ``sample_id``) into a noised
    ``PackedBatch`` with targets.

    Each sample draws, from ``sample_generator(seed, epoch, sample_id)``, its timestep
    (shifted by its own image token count with the resolution shift) and then the noise of
    its image tokens; ``x_img`` is then x_t = (1-t)·x0 + t·noise and ``targets`` is
    noise - x0. ``guidance``: every sequence's guidance input (a model that embeds it,
    FLUX.1-dev), None for none. An empty list (a dry rank) gives an empty batch.
    """
    packed_input, gens = [], []
    for sample in samples:
        latent = sample["latent"]
        sid = sample.get("sample_id")
        if sid is None:
            raise ValueError("build_packed_batch needs each sample's sample_id (its noise is drawn from it)")
        if latent.ndim != 4 or latent.shape[0] != cfg.in_channels:
            raise ValueError(
                f"sample {sid}: latent shape {tuple(latent.shape)} does not match the model's "
                f"(in_channels={cfg.in_channels}, T, H, W)"
            )
        if any(size % p for size, p in zip(latent.shape[1:], cfg.patch_size)):
            raise ValueError(
                f"sample {sid}: latent (T, H, W)={tuple(latent.shape[1:])} is not divisible by "
                f"the model's patch_size={tuple(cfg.patch_size)}"
            )
        gen = sample_generator(seed, epoch, int(sid))
        gens.append(gen)
        image_tokens = math.prod(size // p for size, p in zip(latent.shape[1:], cfg.patch_size))
        packed_input.append(
            {
                "latent": _as_tensor(latent),
                "text": _as_tensor(sample["text"]),
                "pooled": _as_tensor(sample["pooled"]),
                "timestep": float(timesteps.sample(1, generator=gen, image_tokens=image_tokens)[0]),
            }
        )
    clean = pack_samples(packed_input, cfg)
    if guidance is not None:  # also for an empty batch: the model's condition takes (0,)
        clean = dataclasses.replace(clean, guidance=torch.full((clean.num_sequences,), float(guidance)))
    # (Ni_s, P) per sample, in packing order: the sample's image tokens follow each other
    counts = torch.bincount(clean.image_seq_index, minlength=len(gens)).tolist()
    noise = [torch.randn((n, clean.x_img.shape[1]), generator=g, dtype=clean.x_img.dtype) for n, g in zip(counts, gens)]
    return add_noise(clean, torch.cat(noise) if noise else torch.zeros_like(clean.x_img))
