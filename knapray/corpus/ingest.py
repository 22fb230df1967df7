"""Ingest a folder of images (and videos, when a decoder is importable) into a corpus.

Each file becomes one row: frames are shrunk to at most ``max_side`` pixels, centre-
cropped to multiples of downsample x patch, encoded by a :class:`LatentEncoder`, and
its caption (sidecar ``<name>.txt``, else empty) by a :class:`TextEncoder`. Pillow is
required for images; videos use the first importable of PyAV, OpenCV and imageio and
are skipped, with a counted warning, when none is. Animated GIF/WebP/PNG files are
read as videos through Pillow.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import math
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from knapray.corpus.encoders import HashTextEncoder, LatentEncoder, PixelPatchEncoder, TextEncoder
from knapray.corpus.schema import PATCH, visual_token_count
from knapray.corpus.writer import ShardWriter, build_table, length_stats, write_schema_json
from knapray.planning.mix import MAX_TEXT_TOKENS
from knapray.progress import progress_bar

IMAGE_EXTS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff"})
VIDEO_EXTS = frozenset({".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v"})
VIDEO_DECODERS = ("av", "cv2", "imageio")
ROWS_PER_BATCH = 256


@dataclass(frozen=True, kw_only=True, slots=True)
class IngestConfig:
    max_side: int = 512
    """Frames larger than this (longest side, pixels) are shrunk to it, keeping aspect."""
    max_frames: int = 16
    """Frames kept per video, after striding."""
    frame_stride: int = 1
    """Keep every n-th decoded video frame."""
    max_text_tokens: int = MAX_TEXT_TOKENS
    """Caption tokens beyond this are dropped."""
    shards: int = 1
    """Target number of parquet files (fewer when files are skipped)."""

    def __post_init__(self) -> None:
        for name in ("max_side", "max_frames", "frame_stride", "shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_text_tokens < 0:
            raise ValueError(f"max_text_tokens must be >= 0, got {self.max_text_tokens}")


@dataclass(slots=True)
class IngestReport:
    written: int
    """Rows written."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Skipped files per reason: too_small, unreadable, video_no_decoder."""
    schema_path: Path | None = None
    """The corpus's schema.json."""


def _pil_image() -> Any:
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(
            "ingesting images needs Pillow, which is not importable here: pip install Pillow"
        ) from e
    return Image


def video_decoder() -> str | None:
    """Name of the first importable video decoder, or None."""
    for name in VIDEO_DECODERS:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return name
    return None


def _read_video(path: Path, decoder: str, max_frames: int, stride: int) -> list[np.ndarray]:
    frames: list[np.ndarray] = []

    def keep(i: int, frame: np.ndarray) -> bool:
        if i % stride == 0:
            frames.append(np.asarray(frame)[..., :3])
        return len(frames) < max_frames

    if decoder == "av":
        import av

        with av.open(str(path)) as container:
            for i, fr in enumerate(container.decode(video=0)):
                if not keep(i, fr.to_ndarray(format="rgb24")):
                    break
    elif decoder == "cv2":
        import cv2

        cap = cv2.VideoCapture(str(path))
        try:
            i = 0
            while True:
                ok, fr = cap.read()
                if not ok or not keep(i, cv2.cvtColor(fr, cv2.COLOR_BGR2RGB)):
                    break
                i += 1
        finally:
            cap.release()
    else:
        import imageio.v3 as iio

        for i, fr in enumerate(iio.imiter(path)):
            if not keep(i, fr):
                break
    return frames


def _read_image(path: Path, max_frames: int, stride: int) -> list[np.ndarray]:
    from PIL import ImageSequence

    with _pil_image().open(path) as img:
        if getattr(img, "n_frames", 1) <= 1:
            return [np.asarray(img.convert("RGB"))]
        frames: list[np.ndarray] = []
        for i, fr in enumerate(ImageSequence.Iterator(img)):
            if i % stride == 0:
                frames.append(np.asarray(fr.convert("RGB")))
            if len(frames) == max_frames:
                break
        return frames


def fit_frames(frames: list[np.ndarray], multiple: int, max_side: int) -> np.ndarray | None:
    """Shrink to ``max_side`` (aspect kept) and centre-crop both sides to a multiple of
    ``multiple``; None if a side would be smaller than ``multiple``."""
    image = _pil_image()
    h, w = frames[0].shape[:2]
    s = min(1.0, max_side / max(h, w))
    nh, nw = max(1, round(h * s)), max(1, round(w * s))
    ch, cw = nh // multiple * multiple, nw // multiple * multiple
    if ch == 0 or cw == 0:
        return None
    top, left = (nh - ch) // 2, (nw - cw) // 2
    out = np.empty((len(frames), ch, cw, 3), dtype=np.uint8)
    for i, fr in enumerate(frames):
        if fr.shape[:2] != (h, w):
            raise ValueError(f"frame {i} is {fr.shape[:2]}, frame 0 is {(h, w)}")
        if (nh, nw) != (h, w):
            fr = np.asarray(image.fromarray(fr).resize((nw, nh), image.Resampling.BICUBIC))
        out[i] = fr[top : top + ch, left : left + cw]
    return out


def sample_id_for(relpath: str) -> int:
    """A stable 63-bit id from the file's path relative to the input root."""
    digest = hashlib.blake2b(relpath.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _check_latent(latent: np.ndarray, encoder: LatentEncoder, frames: np.ndarray) -> None:
    _, h, w, _ = frames.shape
    d = encoder.downsample
    ok = (
        isinstance(latent, np.ndarray)
        and latent.ndim == 4
        and latent.shape[0] == encoder.channels
        and latent.shape[2:] == (h // d, w // d)
    )
    if not ok:
        raise ValueError(
            f"{type(encoder).__name__}.encode returned shape {getattr(latent, 'shape', None)} for "
            f"frames {frames.shape}; expected ({encoder.channels}, T, {h // d}, {w // d})"
        )


def list_media(input_dir: Path) -> list[Path]:
    exts = IMAGE_EXTS | VIDEO_EXTS
    return sorted(p for p in input_dir.rglob("*") if p.is_file() and p.suffix.lower() in exts)


def ingest(
    input_dir: str | Path,
    out_dir: str | Path,
    cfg: IngestConfig | None = None,
    *,
    encoder: LatentEncoder | None = None,
    text_encoder: TextEncoder | None = None,
    progress: bool = True,
) -> IngestReport:
    """Encode every image/video under ``input_dir`` into a corpus in ``out_dir``."""
    cfg = cfg or IngestConfig()
    encoder = encoder or PixelPatchEncoder()
    text_encoder = text_encoder or HashTextEncoder()
    for obj, proto in ((encoder, LatentEncoder), (text_encoder, TextEncoder)):
        if not isinstance(obj, proto):
            raise TypeError(f"{type(obj).__name__} does not implement {proto.__name__}")
    root = Path(input_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"input directory {root} does not exist")
    files = list_media(root)
    if not files:
        raise ValueError(f"no media under {root}; extensions read: {sorted(IMAGE_EXTS | VIDEO_EXTS)}")
    _pil_image()
    decoder = video_decoder()
    multiple = encoder.downsample * PATCH[1]
    writer = ShardWriter(out_dir, rows_per_shard=math.ceil(len(files) / cfg.shards))
    skipped: Counter[str] = Counter()
    examples: dict[str, Path] = {}
    seen: dict[int, str] = {}
    kinds: list[str] = []
    seq_lens: list[int] = []
    batch: list[tuple[dict[str, Any], np.ndarray, np.ndarray, np.ndarray]] = []

    def skip(reason: str, path: Path) -> None:
        skipped[reason] += 1
        examples.setdefault(reason, path)

    def flush() -> None:
        if batch:
            cols = {k: [row[0][k] for row in batch] for k in batch[0][0]}
            writer.add(build_table(cols, *zip(*(row[1:] for row in batch))))
            batch.clear()

    bar = progress_bar(len(files), "ingest", "file", disable=not progress)
    for path in files:
        bar.update(1)
        rel = path.relative_to(root).as_posix()
        is_video = path.suffix.lower() in VIDEO_EXTS
        if is_video and decoder is None:
            skip("video_no_decoder", path)
            continue
        try:
            if is_video:
                raw = _read_video(path, decoder, cfg.max_frames, cfg.frame_stride)  # type: ignore[arg-type]
            else:
                raw = _read_image(path, cfg.max_frames, cfg.frame_stride)
        except Exception:  # noqa: BLE001 - any decoder failure means an unreadable file
            skip("unreadable", path)
            continue
        if not raw:
            skip("unreadable", path)
            continue
        frames = fit_frames(raw, multiple, cfg.max_side)
        if frames is None:
            skip("too_small", path)
            continue
        latent = encoder.encode(frames)
        _check_latent(latent, encoder, frames)
        caption_path = path.with_suffix(".txt")
        caption = caption_path.read_text(errors="replace") if caption_path.is_file() else ""
        text, pooled = text_encoder.encode(caption, cfg.max_text_tokens)
        if text.ndim != 2 or text.shape[1] != text_encoder.dim or pooled.shape != (text_encoder.pooled_dim,):
            raise ValueError(
                f"{type(text_encoder).__name__}.encode returned text {text.shape} and pooled "
                f"{pooled.shape}; expected (L, {text_encoder.dim}) and ({text_encoder.pooled_dim},)"
            )
        sid = sample_id_for(rel)
        if sid in seen:
            raise ValueError(f"sample id collision between {seen[sid]!r} and {rel!r}")
        seen[sid] = rel
        c, t, h, w = latent.shape
        visual = visual_token_count(t, h, w)
        kind = "video" if is_video or len(raw) > 1 else "image"
        row = {
            "sample_id": sid, "kind": kind, "source": rel, "frames": t, "height": h,
            "width": w, "channels": c, "visual_tokens": visual,
            "text_tokens": text.shape[0], "seq_len": visual + text.shape[0],
        }
        kinds.append(kind)
        seq_lens.append(row["seq_len"])
        batch.append((row, latent, text, pooled))
        if len(batch) >= ROWS_PER_BATCH:
            flush()
    bar.close()
    flush()
    shards = writer.close()
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
    if not seen:
        raise ValueError(f"every file under {root} was skipped: {dict(skipped)}")
    counts = length_stats(kinds, np.asarray(seq_lens))
    counts["skipped"] = dict(skipped)
    schema_path = write_schema_json(
        out_dir,
        builder="ingest",
        dims={
            "channels": encoder.channels,
            "text_dim": text_encoder.dim,
            "pooled_dim": text_encoder.pooled_dim,
            "vae_downsample": encoder.downsample,
        },
        payload=True,
        shards=shards,
        shard_rows=writer.shard_rows,
        counts=counts,
        extra={
            "input": str(root),
            "encoder": type(encoder).__name__,
            "text_encoder": type(text_encoder).__name__,
            "video_decoder": decoder,
            "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
        },
    )
    return IngestReport(written=len(seen), skipped=dict(skipped), schema_path=schema_path)


def load_factory(spec: str) -> Callable[[], Any]:
    """``package.module:name`` -> the callable it names (a class or factory)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"bad factory {spec!r}: expected 'package.module:name'")
    obj = getattr(importlib.import_module(module), name, None)
    if not callable(obj):
        raise ValueError(f"{spec!r}: {module} has no callable {name!r}")
    return obj


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ingest_images",
        description="Encode a folder of images (and videos, if a decoder is installed) into "
        "a knapray corpus: parquet shards + schema.json. Captions come from sidecar .txt files.",
    )
    p.add_argument("--input", required=True, type=Path, help="folder searched recursively")
    p.add_argument("--out", required=True, type=Path, help="output directory (new or empty)")
    p.add_argument("--channels", type=int, default=4, help="latent channels of the default encoder")
    p.add_argument("--downsample", type=int, default=8, help="spatial downsample of the default encoder")
    p.add_argument("--text-dim", type=int, default=64, help="text embedding width of the default text encoder")
    p.add_argument("--pooled-dim", type=int, default=32, help="pooled width of the default text encoder")
    p.add_argument("--seed", type=int, default=0, help="seed of the default encoder's RGB->C matrix")
    p.add_argument("--encoder", help="'module:factory' returning a LatentEncoder (e.g. a VAE); "
                   "replaces --channels/--downsample/--seed")
    p.add_argument("--text-encoder", help="'module:factory' returning a TextEncoder; "
                   "replaces --text-dim/--pooled-dim")
    p.add_argument("--max-side", type=int, default=512, help="shrink frames to this longest side (px)")
    p.add_argument("--max-frames", type=int, default=16, help="frames kept per video")
    p.add_argument("--frame-stride", type=int, default=1, help="keep every n-th video frame")
    p.add_argument("--max-text-tokens", type=int, default=MAX_TEXT_TOKENS, help="caption token limit")
    p.add_argument("--shards", type=int, default=1, help="target number of parquet files")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = IngestConfig(
            max_side=args.max_side, max_frames=args.max_frames, frame_stride=args.frame_stride,
            max_text_tokens=args.max_text_tokens, shards=args.shards,
        )
        encoder = (
            load_factory(args.encoder)()
            if args.encoder
            else PixelPatchEncoder(channels=args.channels, downsample=args.downsample, seed=args.seed)
        )
        text_encoder = (
            load_factory(args.text_encoder)()
            if args.text_encoder
            else HashTextEncoder(dim=args.text_dim, pooled_dim=args.pooled_dim)
        )
        report = ingest(args.input, args.out, cfg, encoder=encoder, text_encoder=text_encoder,
                        progress=not args.quiet)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, ImportError) as e:
        parser.error(str(e))
    print(f"{report.written} samples, skipped {report.skipped or 'none'} -> {report.schema_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
