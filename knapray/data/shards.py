"""Reading the corpus: shard order per epoch, the Ray Dataset over the shards (driver side),
bad shards and duplicate ids found before training, and plain parquet by rank (torchrun)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from knapray.corpus import shard_paths

from .corpus import CorpusInfo, corpus_info

if TYPE_CHECKING:
    import ray.data


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
    parquet_v2: bool = False,
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
    ``parquet_v2``: through Ray Data's V2 parquet reader, Ray's default, instead of V1
    (``_read_listed_parquet``; ``knapray bench data`` runs both).

    ``preserve_order`` is set on this dataset's own context so that the row order, and
    with it which rows each split receives, is the same on every run. Ray Train replaces
    a dataset's execution options with ``DataConfig``'s: pass
    ``DataConfig(execution_options=ingest_execution_options())`` to TorchTrainer.
    """
    if rows_per_block < 1:
        raise ValueError(f"rows_per_block must be >= 1, got {rows_per_block}")
    files = checked_shards(path) if shards is None else list(shards)
    order = shard_order(len(files), shuffle_seed=shuffle_seed, epoch=epoch)
    ds = _read_listed_parquet([str(files[i]) for i in order], v2=parquet_v2)
    ds = ds.repartition(target_num_rows_per_block=rows_per_block)
    ds.context.execution_options.preserve_order = True
    return ds


def _read_listed_parquet(paths: list[str], *, v2: bool = False) -> ray.data.Dataset:
    """``ray.data.read_parquet`` of files already listed and checked (their footers read by
    the pre-flight), through Ray Data's V1 parquet reader. The V2 reader (Ray's default)
    first indexes the footers again on a pool of up to 32 ``FooterReader`` actors, a
    process each, at every epoch's read: 14 of them took 20 of the 116 CPU-seconds of a
    node-loss run on a 3-node emulated cluster, for files whose list is known."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    chosen = ctx.use_datasource_v2
    ctx.use_datasource_v2 = v2  # read_parquet consults it at the call
    try:
        return ray.data.read_parquet(paths)
    finally:
        ctx.use_datasource_v2 = chosen


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

    from knapray.corpus.schema import corpus_schema

    info = corpus_info(path) if info is None else info
    # the text column's type is schema.json's text_dtype; the conditioning columns those its dims record
    wanted = corpus_schema(info.text_dtype, condition=bool(info.condition_channels), image_context=bool(info.image_dim))
    good, bad = [], []
    for i, file in enumerate(checked_shards(path, info)):
        expected = info.shard_rows[i] if info.shard_rows is not None else None
        try:
            meta = pq.ParquetFile(file).metadata
            have = meta.schema.to_arrow_schema()
            missing = sorted(set(wanted.names) - set(have.names))
            if missing:
                raise ValueError(f"columns {missing} missing")
            wrong = [f"{f.name} is {have.field(f.name).type}, not {f.type}" for f in wanted
                     if not have.field(f.name).type.equals(f.type)]
            if wrong:
                raise ValueError("; ".join(wrong[:3]) + (f" (schema.json: text_dtype {info.text_dtype})"
                                                        if any(w.startswith("text ") for w in wrong) else ""))
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
