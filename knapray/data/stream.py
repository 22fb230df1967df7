"""A rank's rows -> steps of decoded samples, one step ahead (``StepStream``), with the
corrupt rows and the samples a resumed epoch already trained skipped."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from knapray.corpus import CorruptSample, decode_row
from knapray.corpus.schema import CONDITION_COLUMNS, INT_COLUMNS, PAYLOAD_COLUMNS

from .corpus import CorpusInfo

logger = logging.getLogger(__name__)

Row = Mapping[str, Any]
OnCorrupt = Callable[[Any, str], None]


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
        if name in PAYLOAD_COLUMNS or name in CONDITION_COLUMNS:
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
        condition_channels: int | None = None,
        image_dim: int | None = None,
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
        self.condition_channels = condition_channels
        self.image_dim = image_dim
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
        """A stream that decodes with the corpus's text, pooled and conditioning widths."""
        return cls(source, text_dim=info.text_dim, pooled_dim=info.pooled_dim,
                   condition_channels=info.condition_channels, image_dim=info.image_dim, **kwargs)

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
            sample = decode_row(row, text_dim=self.text_dim, pooled_dim=self.pooled_dim,
                                condition_channels=self.condition_channels, image_dim=self.image_dim)
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
