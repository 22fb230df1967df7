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

Modules: ``corpus`` (the corpus description against the model config), ``shards`` (shard
order, the Ray Dataset, bad shards, duplicate ids, parquet by rank), ``stream`` (steps of
decoded samples), ``batches`` (noised packed batches). Everything is importable from
``knapray.data`` itself.
"""

from knapray.corpus import shard_paths

from .batches import _as_tensor, build_packed_batch, sample_generator  # noqa: F401 - _as_tensor: tests use it
from .corpus import CorpusInfo, FamilyMismatch, check_model_config, corpus_info
from .shards import (
    SHUFFLE_ROWS_MAX,
    BadShard,
    DuplicateId,
    OnBadShard,
    check_shards,
    checked_shards,
    corpus_dataset,
    duplicate_ids,
    epoch_seed,
    ingest_execution_options,
    local_rows,
    mean_row_bytes,
    read_shard,
    shard_batches,
    shard_order,
    shuffle_rows,
)
from .stream import (
    CAPTION_DROPOUT_STREAM,
    CaptionDropout,
    DecodedStep,
    OnCorrupt,
    Row,
    StepMeta,
    StepStream,
    StreamStats,
    arrow_rows,
)

__all__ = [
    "CAPTION_DROPOUT_STREAM", "SHUFFLE_ROWS_MAX", "BadShard", "CaptionDropout", "CorpusInfo", "DecodedStep",
    "DuplicateId", "FamilyMismatch", "OnBadShard", "OnCorrupt", "Row", "StepMeta", "StepStream", "StreamStats",
    "arrow_rows", "build_packed_batch", "check_model_config", "check_shards", "checked_shards", "corpus_dataset",
    "corpus_info", "duplicate_ids", "epoch_seed", "ingest_execution_options", "local_rows", "mean_row_bytes",
    "read_shard", "sample_generator", "shard_batches", "shard_order", "shard_paths", "shuffle_rows",
]
