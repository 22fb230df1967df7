"""Ingest a folder of images (and videos, when a decoder is importable) into a corpus.

Each file becomes one row: frames are shrunk to at most ``max_side`` pixels, centre-
cropped to multiples of downsample x patch, encoded by a latent encoder (a diffusers
VAE, or the weightless stand-in), and its caption (metadata.jsonl, else a sidecar
``<name>.txt``, else empty) by a text encoder (T5/CLIP, or the stand-in).

Two ways to run the same stages (:mod:`knapray.corpus.stages`): in this process
(``workers=0``: small jobs, tests), or as a Ray Data pipeline whose decoding runs as CPU
tasks and whose encoding runs in a pool of ``workers`` actors, each holding its own
models, one GPU per actor when the encoders run on CUDA. Both write the same rows in
the same order: the driver writes the shards either way.
"""

from __future__ import annotations

import argparse
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
    list_media,
    media_items,
    pil_image,
    sample_id_for,
    video_decoder,
)
from knapray.corpus.schema import CORPUS_SCHEMA, FAMILIES, PATCH, TEXT_DTYPES, WAN_TEXT_LENGTH
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
from knapray.planning.mix import MAX_TEXT_TOKENS
from knapray.progress import progress_bar

__all__ = [
    "EncoderSpec", "IngestConfig", "IngestReport", "build_parser", "fit_frames", "ingest",
    "list_media", "load_factory", "main", "sample_id_for", "video_decoder",
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


@dataclass(slots=True)
class IngestReport:
    written: int
    """Rows written."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Skipped files per reason: too_small, unreadable, video_no_decoder."""
    schema_path: Path | None = None
    """The corpus's schema.json."""
    seconds: float = 0.0
    """Wall time of decoding + encoding + writing (Ray start-up included)."""


def _gpu_count() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


def _run_ray(
    batches: list[pa.Table],
    opts: DecodeOptions,
    build: Callable[[], tuple[LatentEncoder, TextEncoder]],
    cfg: IngestConfig,
    use_gpu: bool,
) -> Iterator[pa.Table]:
    """The stages as a Ray Data pipeline: decode tasks, then an actor pool of encoders.
    Blocks come back in file order (preserve_order), so the shards match the in-process
    path's row for row."""
    import ray

    if not ray.is_initialized():
        ray.init()  # joins the cluster RAY_ADDRESS names, or starts a local one
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
        fn_constructor_kwargs={"build": build, "max_text_tokens": cfg.max_text_tokens},
        batch_size=None,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=cfg.workers),
        num_cpus=cfg.cpus_per_worker,
        num_gpus=1 if use_gpu else 0,
    )
    ds.context.execution_options.preserve_order = True
    yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")


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

        if not ray.is_initialized():
            ray.init()  # joins the cluster RAY_ADDRESS names, or starts a local one
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
    if cfg.workers == 0:
        stage = EncodeStage(build, cfg.max_text_tokens)
        info = EncoderInfo.of(stage.encoder, stage.text_encoder)
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
    tables = _run_local(batches, opts, stage) if stage is not None else _run_ray(batches, opts, build, cfg, use_gpu)

    writer = ShardWriter(out_dir, rows_per_shard=math.ceil(len(items) / cfg.shards), text_dtype=cfg.text_dtype)
    caption_from = {item.source: item.caption_from for item in items}
    skipped: Counter[str] = Counter()
    examples: dict[str, Path] = {}
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
        kept = table.filter(pc.equal(table.column("skip"), "")).drop_columns(["skip"])
        for sid, source in zip(kept.column("sample_id").to_pylist(), kept.column("source").to_pylist()):
            if sid in seen:
                raise ValueError(f"sample id collision between {seen[sid]!r} and {source!r}")
            seen[sid] = source
            captions[caption_from[source]] += 1
        kinds.extend(kept.column("kind").to_pylist())
        seq_lens.extend(kept.column("seq_len").to_pylist())
        # Ray Data hands tables back with every field nullable: restore the corpus schema.
        writer.add(pa.Table.from_arrays(kept.columns, schema=CORPUS_SCHEMA))
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
        dims={
            "channels": info.channels,
            "text_dim": info.text_dim,
            "pooled_dim": info.pooled_dim,
            "vae_downsample": info.downsample,
        },
        payload=True,
        shards=shards,
        shard_rows=writer.shard_rows,
        counts=counts,
        text_dtype=cfg.text_dtype,
        extra={
            "input": str(root),
            "encoder": info.latent_record["class"],
            "text_encoder": info.text_record["class"],
            "encoders": {"latent": info.latent_record, "text": info.text_record},
            "captions": {"column": cfg.caption_column, **dict(captions)},
            UNCONDITIONAL_KEY: unconditional,
            "video_decoder": decoder,
            **({"family": family.family} if family is not None else {}),
            **({"text_pad_to": text_length} if text_length else {}),
            "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
        },
    )
    return IngestReport(written=len(seen), skipped=dict(skipped), schema_path=schema_path,
                        seconds=time.perf_counter() - started)


DESCRIPTION = (
    "Encode a folder of images (and videos, if a decoder is installed) into "
    "a knapray corpus: parquet shards + schema.json. Latents from a diffusers VAE (--vae), "
    "text from T5/CLIP (--text-encoder, --pooled-encoder), all from local directories; "
    "without them, weightless stand-ins. Captions from metadata.jsonl, else sidecar .txt."
)


def build_parser() -> argparse.ArgumentParser:
    from knapray.commands.flags import Parser

    p = Parser(prog="ingest_images", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    from knapray.commands.flags import add_device, add_dtype, add_seed, float_in, int_at_least, text_tokens
    from knapray.limits import MAX_EMBED_DIM, MAX_SHARDS

    p.add_argument("--input", required=True, help="folder searched recursively")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    g = p.add_argument_group("encoders (local directories; pip install 'knapray[encoders]')")
    g.add_argument("--vae", metavar="DIR", help="diffusers VAE: AutoencoderKL (Flux, SD3, SDXL; videos "
                   "frame by frame) or AutoencoderKLWan / AutoencoderKLHunyuanVideo (time compressed)")
    g.add_argument("--text-encoder", metavar="DIR", help="T5 (T5EncoderModel) or CLIP text model: its "
                   "token embeddings are the text tokens")
    g.add_argument("--text-tokenizer", metavar="DIR", help="tokenizer of --text-encoder, when not in its "
                   "directory (Flux: tokenizer_2/)")
    g.add_argument("--pooled-encoder", metavar="DIR", help="CLIP text model: its pooled output is the "
                   "pooled vector (default: --text-encoder's when CLIP, the token mean when T5)")
    g.add_argument("--pooled-tokenizer", metavar="DIR", help="tokenizer of --pooled-encoder, when not in "
                   "its directory (Flux: tokenizer/)")
    add_device(g)
    add_dtype(g, help="model dtype (auto: bf16 on cuda, fp32 on cpu); rows are float32")
    g.add_argument("--vae-batch", type=int_at_least(1), default=8, help="frames per VAE call")
    g.add_argument("--text-batch", type=int_at_least(1), default=32, help="captions per text-model call")
    g.add_argument("--encoder-factory", metavar="MODULE:NAME", help="callable returning a LatentEncoder, "
                   "instead of --vae")
    g.add_argument("--text-encoder-factory", metavar="MODULE:NAME", help="callable returning a "
                   "TextEncoder, instead of --text-encoder")
    g.add_argument("--family", default=None, help=f"the model family the corpus is for ({', '.join(FAMILIES)}), "
                   "recorded in schema.json (pre-flight refuses a model of another family). wan: umT5 tokens "
                   f"unpadded (WanPipeline pads to {WAN_TEXT_LENGTH} with zeros: schema.json text_pad_to), at most "
                   f"{WAN_TEXT_LENGTH}, prompts cleaned as WanPipeline does, no pooled vector (pooled_dim 0)")
    s = p.add_argument_group("stand-in encoders (used without --vae / --text-encoder)")
    s.add_argument("--channels", type=int_at_least(1, MAX_EMBED_DIM), default=4, help="latent channels")
    s.add_argument("--downsample", type=int_at_least(1), default=8, help="spatial downsample")
    add_seed(s, help="seed of the RGB->C matrix")
    s.add_argument("--text-dim", type=int_at_least(1, MAX_EMBED_DIM), default=64, help="text embedding width")
    s.add_argument("--pooled-dim", type=int_at_least(1, MAX_EMBED_DIM), default=32, help="pooled width")
    r = p.add_argument_group("parallelism")
    r.add_argument("--workers", type=int_at_least(0), default=0, help="0: in this process, no Ray; N: Ray Data with "
                   "N encode actors (one GPU each when on cuda); joins RAY_ADDRESS's cluster if set")
    r.add_argument("--cpus-per-worker", type=float_in(gt=0), default=1.0, help="CPUs reserved per encode actor")
    r.add_argument("--batch-size", type=int_at_least(1), default=16, help="files per decode task / encode call")
    d = p.add_argument_group("data")
    d.add_argument("--caption-column", default="text", help="caption key in metadata.jsonl")
    d.add_argument("--max-side", type=int_at_least(1), default=512, help="shrink frames to this longest side (px)")
    d.add_argument("--max-frames", type=int_at_least(1), default=16, help="frames kept per video")
    d.add_argument("--frame-stride", type=int_at_least(1), default=1, help="keep every n-th video frame")
    d.add_argument("--max-text-tokens", type=text_tokens, help=f"caption token limit (default {MAX_TEXT_TOKENS}; "
                   f"--family wan: {WAN_TEXT_LENGTH})")
    d.add_argument("--shards", type=int_at_least(1, MAX_SHARDS), default=1, help="target number of parquet files")
    d.add_argument("--text-dtype", choices=TEXT_DTYPES, default="fp32", help="store text embeddings as fp32 or "
                   "bf16 (half the bytes; rounded as torch rounds, read back exactly; default fp32)")
    d.add_argument("--follow-symlinks", action="store_true",
                   help="also read files that are symbolic links, wherever they point (default: only regular "
                        "files whose real path lies inside --input; folders reached through a link are never entered)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, ImportError) as e:
        parser.error(str(e))


def cli(args: argparse.Namespace) -> int:
    """``knapray ingest``: ``run``, with a factory that does not fit or a missing extra as
    one line (ValueError) like every other bad input."""
    try:
        return run(args)
    except (TypeError, ImportError) as e:
        raise ValueError(str(e)) from None


def _family(name: str | None) -> FamilyEncoding | None:
    """``--family``'s encoding (``knapray.models.families.Family.encoders``)."""
    if name is None:
        return None
    from knapray.models.families import FAMILIES, FAMILY_NAMES  # the command line knows the families

    if name not in FAMILIES:
        raise ValueError(f"family {name!r} is not one of {FAMILY_NAMES}")
    return FAMILIES[name].encoders


def _max_text_tokens(args: argparse.Namespace, family: FamilyEncoding | None) -> int:
    if args.max_text_tokens is not None:
        return int(args.max_text_tokens)
    return (family.text_length if family is not None else 0) or MAX_TEXT_TOKENS


def run(args: argparse.Namespace) -> int:
    """Ingest as the parsed arguments say; bad input raises (ValueError, FileExistsError, ...)."""
    family = _family(args.family)
    cfg = IngestConfig(
        max_side=args.max_side, max_frames=args.max_frames, frame_stride=args.frame_stride,
        max_text_tokens=_max_text_tokens(args, family), shards=args.shards, caption_column=args.caption_column,
        batch_size=args.batch_size, workers=args.workers, cpus_per_worker=args.cpus_per_worker,
        text_dtype=args.text_dtype, follow_symlinks=args.follow_symlinks,
    )
    spec = EncoderSpec(
        vae=args.vae, text_encoder=args.text_encoder, text_tokenizer=args.text_tokenizer,
        pooled_encoder=args.pooled_encoder, pooled_tokenizer=args.pooled_tokenizer,
        device=args.device, dtype=args.dtype, vae_batch=args.vae_batch, text_batch=args.text_batch,
        encoder_factory=args.encoder_factory, text_encoder_factory=args.text_encoder_factory,
        channels=args.channels, downsample=args.downsample, seed=args.seed,
        text_dim=args.text_dim, pooled_dim=args.pooled_dim, family=family,
    )
    report = ingest(Path(args.input), Path(args.out), cfg, encoders=spec, progress=not args.quiet)
    print(
        f"{report.written} samples in {report.seconds:.1f} s, skipped {report.skipped or 'none'} "
        f"-> {report.schema_path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
