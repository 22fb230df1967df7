"""Ingest a folder of images (and videos, when a decoder is importable) into a corpus.

Each file becomes one row: frames are shrunk to at most ``max_side`` pixels, centre-
cropped to multiples of downsample x patch, encoded by a latent encoder (a diffusers
VAE, or the weightless stand-in), and its caption (metadata.jsonl, else a sidecar
``<name>.txt``, else empty) by a text encoder (T5/CLIP, or the stand-in).

Two conventions of LoRA datasets (kohya's): ``trigger`` is prepended to every caption
("trigger, caption"), and a file under a top-level folder named ``<N>_<name>`` is N samples
(its row written N times under N sample ids: each copy is seen once an epoch, as every
sample); both recorded in schema.json (``captions.trigger``, ``repeats``).

With an image encoder (a CLIP vision model, for a family whose pipeline takes an image: Wan
2.1 I2V) each row also holds its clip's conditioning from its first frame, as the family's
image-to-video pipeline computes it (:class:`knapray.corpus.hf.WanI2VConditioning`): the
``condition`` latent and the ``image_context`` tokens, their widths in schema.json's dims and
the image encoder in its ``encoders.image``.

Two ways to run the same stages (:mod:`knapray.corpus.stages`): in this process
(``workers=0``: small jobs, tests), or as a Ray Data pipeline whose decoding runs as CPU
tasks and whose encoding runs in a pool of ``workers`` actors, each holding its own
models, one GPU per actor when the encoders run on CUDA. Both write the same rows in
the same order: the driver writes the shards either way.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from knapray.corpus import hf
from knapray.corpus.encoders import LatentEncoder, TextEncoder
from knapray.corpus.media import (
    CAPTION_SOURCES,
    IMAGE_EXTS,
    METADATA_FILE,
    VIDEO_DECODERS,
    VIDEO_EXTS,
    fit_frames,
    folder_repeats,
    list_media,
    media_items,
    pil_image,
    sample_id_for,
    video_decoder,
    with_trigger,
)
from knapray.corpus.schema import PATCH, TEXT_DTYPES, corpus_schema
from knapray.corpus.stages import (
    DecodeOptions,
    EncoderInfo,
    EncoderSpec,
    EncodeStage,
    FamilyEncoding,
    decode_batch,
    items_table,
    load_factory,
    prebuilt,
)
from knapray.corpus.unconditional import KEY as UNCONDITIONAL_KEY
from knapray.corpus.unconditional import unconditional_record
from knapray.corpus.writer import ShardWriter, length_stats, write_schema_json
from knapray.planning.shapes.mix import MAX_TEXT_TOKENS
from knapray.progress import progress_bar

__all__ = [
    "EncoderSpec", "IngestConfig", "IngestReport", "fit_frames", "ingest",
    "list_media", "load_factory", "sample_id_for", "video_decoder",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class IngestConfig:
    max_side: int = 512
    """Frames larger than this (longest side, pixels) are shrunk to it, keeping aspect."""
    max_frames: int = 16
    """Frames kept per video, after striding (a video VAE then keeps 1 + k * its temporal
    factor of them)."""
    frame_stride: int = 1
    """Keep every n-th decoded video frame."""
    max_text_tokens: int = MAX_TEXT_TOKENS
    """Caption tokens beyond this are dropped."""
    shards: int = 1
    """Target number of parquet files (fewer when files are skipped)."""
    caption_column: str = "text"
    """The caption's key in metadata.jsonl lines."""
    batch_size: int = 16
    """Files per batch: per decode task and per call of an encode actor."""
    workers: int = 0
    """0: run in this process, no Ray. N >= 1: Ray Data with an actor pool of N encoders
    (each loads its own models; one GPU each when the encoders run on CUDA)."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each encode actor (torch uses as many threads)."""
    text_dtype: str = "fp32"
    """How the text embeddings are stored: fp32, or bf16 (half the bytes of the corpus's
    largest column; rounded as torch rounds, read back exactly into fp32)."""
    follow_symlinks: bool = False
    """Read files that are symbolic links, wherever they point (default: only regular files
    whose real path lies inside the input folder)."""
    trigger: str = ""
    """A word (or words) put before every caption, "trigger, caption" (a LoRA's trigger word)."""

    def __post_init__(self) -> None:
        for name in ("max_side", "max_frames", "frame_stride", "shards", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_text_tokens < 0:
            raise ValueError(f"max_text_tokens must be >= 0, got {self.max_text_tokens}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0 = no Ray), got {self.workers}")
        if self.cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker must be > 0, got {self.cpus_per_worker}")
        if self.text_dtype not in TEXT_DTYPES:
            raise ValueError(f"text_dtype must be one of {TEXT_DTYPES}, got {self.text_dtype!r}")
        if not self.caption_column:
            raise ValueError("caption_column must be a non-empty metadata.jsonl key")
        if self.trigger != self.trigger.strip() or any(c in self.trigger for c in "\n\r\t") or len(self.trigger) > 200:
            raise ValueError(f"trigger must be one line of at most 200 characters without surrounding spaces, got "
                             f"{self.trigger[:40]!r}")


@dataclass(slots=True)
class IngestReport:
    written: int
    """Rows written."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Skipped files per reason: too_small, unreadable, video_no_decoder, caption_not_text, name_not_text."""
    schema_path: Path | None = None
    """The corpus's schema.json."""
    seconds: float = 0.0
    """Wall time of decoding + encoding + writing (Ray start-up included)."""


def _repeated(table: pa.Table, repeats: dict[str, int]) -> pa.Table:
    """``table``'s rows, each followed by its copies when its file repeats (``folder_repeats``):
    copy k of ``source`` under the sample id of ``source#k``."""
    counts = [repeats.get(src, 1) for src in table.column("source").to_pylist()]
    if all(n == 1 for n in counts):
        return table
    rows, ids = [], []
    for i, (n, src, sid) in enumerate(zip(counts, table.column("source").to_pylist(),
                                          table.column("sample_id").to_pylist())):
        rows += [i] * n
        ids += [sid] + [sample_id_for(f"{src}#{k}") for k in range(1, n)]
    out = table.take(pa.array(rows, type=pa.int64()))
    at = out.schema.get_field_index("sample_id")
    return out.set_column(at, out.schema.field(at), pa.array(ids, type=out.schema.field(at).type))


def _repeated_folders(repeats: dict[str, int]) -> dict[str, int]:
    """{top-level folder: repeats} of the folders whose files repeat."""
    return dict(sorted({src.partition("/")[0]: n for src, n in repeats.items() if n > 1}.items()))


def _gpu_count() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


def _run_ray(
    batches: list[pa.Table],
    opts: DecodeOptions,
    build: Callable[[], tuple[LatentEncoder, TextEncoder]],
    cfg: IngestConfig,
    use_gpu: bool,
    conditioning: Callable[[LatentEncoder], Any] | None,
) -> Iterator[pa.Table]:
    """The stages as a Ray Data pipeline: decode tasks, then an actor pool of encoders.
    Blocks come back in file order (preserve_order), so the shards match the in-process
    path's row for row."""
    import ray

    _start_ray(ray)
    if use_gpu and _gpu_count() < cfg.workers:
        warnings.warn(
            f"{cfg.workers} GPU encode workers asked for, the cluster has {_gpu_count():g} GPUs now: "
            "the rest start when GPUs join",
            stacklevel=3,
        )
    ds = ray.data.from_arrow(batches)  # one block per batch of files
    ds = ds.map_batches(decode_batch, fn_kwargs={"opts": opts}, batch_size=None, batch_format="pyarrow",
                        num_cpus=1)
    ds = ds.map_batches(
        EncodeStage,
        fn_constructor_kwargs={"build": build, "max_text_tokens": cfg.max_text_tokens, "conditioning": conditioning},
        batch_size=None,
        batch_format="pyarrow",
        # no more encoder actors than batches: the rest would load the models for nothing
        compute=ray.data.ActorPoolStrategy(size=max(1, min(cfg.workers, len(batches)))),
        num_cpus=cfg.cpus_per_worker,
        num_gpus=1 if use_gpu else 0,
    )
    ds.context.execution_options.preserve_order = True
    yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")


def _start_ray(ray: Any) -> None:
    """Join the cluster ``$RAY_ADDRESS`` names, or start a local Ray on 127.0.0.1, once. Ray's
    and Ray Data's own lines (its start, the dataset's execution plan and progress, the
    actors' output) stay in the session's logs, as ``knapray train``'s do: the console shows
    ingest's progress bar and its summary."""
    import logging

    from knapray.local_ray import init_ray, quiet_ray_data

    if ray.is_initialized():
        return
    init_ray(ray, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    quiet_ray_data()


def _remote_unconditional(build: Callable[[], tuple[LatentEncoder, TextEncoder]], max_text_tokens: int,
                          use_gpu: bool) -> dict[str, Any]:
    """The empty caption's record, encoded in one Ray task by the encoders the actors use."""
    import ray

    task = ray.remote(num_gpus=1 if use_gpu else 0)(_encode_empty)
    return ray.get(task.remote(build, max_text_tokens))


def _encode_empty(build: Callable[[], tuple[LatentEncoder, TextEncoder]], max_text_tokens: int) -> dict[str, Any]:
    return unconditional_record(build()[1], max_text_tokens)


def _run_local(
    batches: list[pa.Table], opts: DecodeOptions, stage: EncodeStage
) -> Iterator[pa.Table]:
    for batch in batches:
        yield stage(decode_batch(batch, opts))


def _settle_device(cfg: IngestConfig, spec: EncoderSpec) -> tuple[EncoderSpec, bool]:
    """The spec with its 'auto' device and dtype settled where the GPUs are known (this
    process's for ``workers=0``, the cluster's otherwise), and whether Ray actors take a
    GPU each."""
    if not spec.uses_models:
        return spec, False
    if cfg.workers == 0:
        return spec.resolved(hf.resolve_device(spec.device)), False
    use_gpu = spec.device == "cuda"
    if spec.device == "auto":
        import ray

        _start_ray(ray)
        use_gpu = _gpu_count() > 0
    return spec.resolved("cuda" if use_gpu else "cpu"), use_gpu


def _check_family_widths(family: FamilyEncoding | None, info: EncoderInfo) -> None:
    """A family whose corpus has no pooled vector (Wan) takes none; the others need one."""
    if family is None:
        return
    if not family.pooled and info.pooled_dim != 0:
        raise ValueError(f"family {family.family} has no pooled vector, but the text encoder gives pooled_dim "
                         f"{info.pooled_dim}")
    if family.pooled and info.pooled_dim == 0:
        raise ValueError(f"family {family.family} needs a pooled vector, but the text encoder gives pooled_dim 0")


def ingest(
    input_dir: str | Path,
    out_dir: str | Path,
    cfg: IngestConfig | None = None,
    *,
    encoders: EncoderSpec | None = None,
    encoder: LatentEncoder | None = None,
    text_encoder: TextEncoder | None = None,
    progress: bool = True,
) -> IngestReport:
    """Encode every image/video under ``input_dir`` into a corpus in ``out_dir``.

    The encoders come from ``encoders`` (paths to a VAE and T5/CLIP, or the stand-ins),
    or are given made (``encoder``/``text_encoder``, the missing one a stand-in; with
    ``workers > 0`` they are pickled into every actor)."""
    started = time.perf_counter()
    cfg = cfg or IngestConfig()
    spec = encoders or EncoderSpec()
    made = encoder is not None or text_encoder is not None
    if made and spec.uses_models:
        raise ValueError("give encoder/text_encoder objects or an EncoderSpec with model paths, not both")
    root = Path(input_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"input directory {root} does not exist")
    items, orphans = media_items(root, cfg.caption_column, cfg.follow_symlinks)
    if not items:
        raise ValueError(f"no media under {root}; extensions read: {sorted(IMAGE_EXTS | VIDEO_EXTS)}")
    skipped: Counter[str] = Counter()
    examples: dict[str, Path | str] = {}
    for item in items:
        if item.skip:  # a caption or a name that is not text: named, the file left out, the ingest goes on
            skipped[item.skip] += 1
            examples.setdefault(item.skip, item.skip_at)
    items = [item for item in items if not item.skip]
    if not items:
        raise ValueError(f"every file under {root} was skipped: {dict(skipped)}, e.g. {next(iter(examples.values()))}")
    repeats = {item.source: folder_repeats(item.source) for item in items}  # before any file is read
    items = [dataclasses.replace(item, caption=with_trigger(item.caption, cfg.trigger)) for item in items]
    pil_image()
    spec.check()
    family = spec.family
    text_length = family.text_length if family is not None else 0
    if text_length and cfg.max_text_tokens > text_length:
        raise ValueError(f"family {family.family}: max_text_tokens {cfg.max_text_tokens} is over {family.model}'s "
                         f"text length {text_length} ({family.pipeline} truncates prompts there)")

    spec, use_gpu = _settle_device(cfg, spec)
    build: Callable[[], tuple[LatentEncoder, TextEncoder]] = spec.build
    if made:
        standin_encoder, standin_text = spec.build()  # the spec has no models (checked above)
        build = prebuilt(encoder or standin_encoder, text_encoder or standin_text)
    stage: EncodeStage | None = None
    unconditional = None
    conditioning = spec.conditioning if spec.image_encoder else None
    if cfg.workers == 0:
        stage = EncodeStage(build, cfg.max_text_tokens, conditioning)
        info = EncoderInfo.of(stage.encoder, stage.text_encoder, stage.conditioning)
        unconditional = unconditional_record(stage.text_encoder, cfg.max_text_tokens)
    elif made:
        built = build()
        info = EncoderInfo.of(*built)
        unconditional = unconditional_record(built[1], cfg.max_text_tokens)
    else:
        info = spec.describe()  # from the configs: the models load in the actors only

    _check_family_widths(spec.family, info)
    decoder = video_decoder()
    opts = DecodeOptions(max_side=cfg.max_side, max_frames=cfg.max_frames, frame_stride=cfg.frame_stride,
                         multiple=info.downsample * PATCH[1], video_decoder=decoder)
    batches = [items_table(items[i : i + cfg.batch_size]) for i in range(0, len(items), cfg.batch_size)]
    tables = (_run_local(batches, opts, stage) if stage is not None else
              _run_ray(batches, opts, build, cfg, use_gpu, conditioning))

    conditioned = info.image_record is not None
    writer = ShardWriter(out_dir, rows_per_shard=math.ceil(len(items) / cfg.shards), text_dtype=cfg.text_dtype,
                         condition=conditioned, image_context=conditioned)
    rows_schema = corpus_schema(condition=conditioned, image_context=conditioned)
    caption_from = {item.source: item.caption_from for item in items}
    seen: dict[int, str] = {}
    kinds: list[str] = []
    seq_lens: list[int] = []
    captions: Counter[str] = Counter({k: 0 for k in CAPTION_SOURCES})
    bar = progress_bar(len(items), "ingest", "file", disable=not progress)
    for table in tables:
        bar.update(table.num_rows)
        for reason, source in zip(table.column("skip").to_pylist(), table.column("source").to_pylist()):
            if reason:
                skipped[reason] += 1
                examples.setdefault(reason, root / source)
        kept = _repeated(table.filter(pc.equal(table.column("skip"), "")).drop_columns(["skip"]), repeats)
        for sid, source in zip(kept.column("sample_id").to_pylist(), kept.column("source").to_pylist()):
            if sid in seen:
                raise ValueError(f"sample id collision between {seen[sid]!r} and {source!r}")
            seen[sid] = source
            captions[caption_from[source]] += 1
        kinds.extend(kept.column("kind").to_pylist())
        seq_lens.extend(kept.column("seq_len").to_pylist())
        # Ray Data hands tables back with every field nullable: restore the corpus schema.
        writer.add(pa.Table.from_arrays(kept.columns, schema=rows_schema))
    bar.close()
    shards = writer.close()
    if unconditional is None:  # the models live in the Ray actors: one task encodes ""
        unconditional = _remote_unconditional(build, cfg.max_text_tokens, use_gpu)
    for reason, count in sorted(skipped.items()):
        hint = (
            f"; install one of {VIDEO_DECODERS} (PyAV, opencv-python, imageio[ffmpeg]) to read videos"
            if reason == "video_no_decoder"
            else ""
        )
        warnings.warn(
            f"skipped {count} file(s) under {root} ({reason}), e.g. {examples[reason]}{hint}",
            stacklevel=2,
        )
    if orphans:
        warnings.warn(f"{orphans} {METADATA_FILE} entries under {root} name no media file", stacklevel=2)
    if not seen:
        raise ValueError(f"every file under {root} was skipped: {dict(skipped)}")
    counts = length_stats(kinds, np.asarray(seq_lens))
    counts["skipped"] = dict(skipped)
    schema_path = write_schema_json(
        out_dir,
        builder="ingest",
        dims=info.dims(),
        payload=True,
        shards=shards,
        shard_rows=writer.shard_rows,
        counts=counts,
        text_dtype=cfg.text_dtype,
        extra={
            "input": str(root),
            "encoder": info.latent_record["class"],
            "text_encoder": info.text_record["class"],
            **({"image_encoder": info.image_record["class"]} if info.image_record is not None else {}),
            "encoders": {"latent": info.latent_record, "text": info.text_record,
                         **({"image": info.image_record} if info.image_record is not None else {})},
            "captions": {"column": cfg.caption_column, **dict(captions), **({"trigger": cfg.trigger} if cfg.trigger
                                                                               else {})},
            **({"repeats": _repeated_folders(repeats)} if any(n > 1 for n in repeats.values()) else {}),
            UNCONDITIONAL_KEY: unconditional,
            "video_decoder": decoder,
            **({"family": family.family} if family is not None else {}),
            **({"text_pad_to": text_length} if text_length else {}),
            "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
        },
    )
    return IngestReport(written=len(seen), skipped=dict(skipped), schema_path=schema_path,
                        seconds=time.perf_counter() - started)
