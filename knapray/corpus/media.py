"""Finding, captioning and decoding media files for ingestion (no encoders here).

Pillow is required for images; videos use the first importable of PyAV, OpenCV and
imageio. Animated GIF/WebP/PNG files are read as videos through Pillow. Captions come
from ``metadata.jsonl`` files (the HuggingFace imagefolder convention) or sidecar
``<name>.txt`` files; an entry in a metadata.jsonl wins over a sidecar.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_EXTS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff"})
VIDEO_EXTS = frozenset({".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v"})
VIDEO_DECODERS = ("av", "cv2", "imageio")
METADATA_FILE = "metadata.jsonl"
CAPTION_SOURCES = ("metadata", "sidecar", "none")


@dataclass(frozen=True, slots=True)
class MediaItem:
    path: Path
    """The file."""
    source: str
    """Its path relative to the input root, POSIX style (the corpus's ``source``)."""
    caption: str
    """Its caption, "" when it has none."""
    caption_from: str
    """Where the caption came from: one of CAPTION_SOURCES."""
    skip: str = ""
    """Why the file is left out before it is read (``NOT_TEXT``), "" when it is not."""
    skip_at: str = ""
    """What to name for it: the metadata.jsonl entry (file:line), or the file's path as bytes."""


NOT_TEXT = {"caption": "caption_not_text", "name": "name_not_text"}
"""Skip reasons of a file whose metadata.jsonl caption, or whose own name, has no UTF-8 (a lone
surrogate such as ``"\\ud800"`` is valid JSON; a name of bytes that are not UTF-8 is a valid
file name): the corpus and its schema.json hold text, so the file is left out, the ingest goes on."""


def pil_image() -> Any:
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


def readable_inside(path: Path, root: Path, follow_symlinks: bool = False) -> bool:
    """Whether ingest may read ``path``: a regular file that is not a symbolic link and whose
    real path lies inside ``root`` (``follow_symlinks``: links too, wherever they point).
    A folder of pictures is not a license to read ``/etc/passwd`` through ``link.png``."""
    if follow_symlinks:
        return path.is_file()
    if path.is_symlink() or not path.is_file():
        return False
    real, top = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, top]) == top


def list_media(input_dir: Path, follow_symlinks: bool = False) -> list[Path]:
    """Media files under ``input_dir`` in path order (``readable_inside`` each; folders
    reached through a link are never entered)."""
    exts = IMAGE_EXTS | VIDEO_EXTS
    return sorted(p for p in input_dir.rglob("*")
                  if p.suffix.lower() in exts and readable_inside(p, input_dir, follow_symlinks))


def is_video_file(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_EXTS


def read_metadata_captions(root: Path, column: str = "text", follow_symlinks: bool = False
                           ) -> tuple[dict[str, str], dict[str, str]]:
    """Captions from every ``metadata.jsonl`` under ``root`` (``readable_inside`` each):
    one JSON object per line with ``file_name`` (relative to the metadata file's folder)
    and ``column``. Returns source (relative to ``root``) -> caption (a null caption is ""),
    and source -> the entry (file:line) of each caption that is not text (no UTF-8 for it):
    those files are skipped, not the ingest."""
    captions: dict[str, str] = {}
    refused: dict[str, str] = {}
    for meta in sorted(m for m in root.rglob(METADATA_FILE) if readable_inside(m, root, follow_symlinks)):
        base = meta.parent.relative_to(root)
        for lineno, line in enumerate(meta.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{meta}:{lineno}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON object ({e.msg})") from None
            if not isinstance(entry, dict) or "file_name" not in entry:
                raise ValueError(f"{where}: expected an object with 'file_name', got {line[:80]!r}")
            if column not in entry:
                raise ValueError(
                    f"{where}: no caption column {column!r} (keys: {sorted(entry)}); "
                    "pick one with --caption-column"
                )
            caption = entry[column]
            if caption is not None and not isinstance(caption, str):
                raise ValueError(f"{where}: {column!r} is {type(caption).__name__}, expected a string")
            source = (base / str(entry["file_name"])).as_posix()
            if source in captions:
                raise ValueError(f"{where}: {source!r} is captioned twice")
            captions[source] = caption or ""
            if not _is_text(captions[source]):
                refused[source] = where
    return captions, refused


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def media_items(root: Path, caption_column: str = "text", follow_symlinks: bool = False
                ) -> tuple[list[MediaItem], int]:
    """Every media file under ``root`` with its caption, in path order (a file whose caption
    or name is not text marked to ``skip``), and the number of metadata.jsonl entries that name no
    media file (a typo or a removed file). Only files ``readable_inside`` ``root`` are read:
    media, metadata and sidecar captions."""
    files = list_media(root, follow_symlinks)
    metadata, refused = read_metadata_captions(root, caption_column, follow_symlinks)
    items: list[MediaItem] = []
    for path in files:
        source = path.relative_to(root).as_posix()
        if not _is_text(source):
            items.append(MediaItem(path, source, "", "none", NOT_TEXT["name"], repr(os.fsencode(path))[2:-1]))
            continue
        sidecar = path.with_suffix(".txt")
        if source in metadata:
            caption, origin = metadata[source], "metadata"
        elif readable_inside(sidecar, root, follow_symlinks):
            caption, origin = sidecar.read_text(errors="replace"), "sidecar"
        else:
            caption, origin = "", "none"
        bad = refused.get(source)
        items.append(MediaItem(path, source, caption, origin, *((NOT_TEXT["caption"], bad) if bad else ())))
    orphans = len(set(metadata) - {item.source for item in items})
    return items, orphans


def read_video(path: Path, decoder: str, max_frames: int, stride: int) -> list[np.ndarray]:
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


def read_image(path: Path, max_frames: int, stride: int) -> list[np.ndarray]:
    from PIL import ImageSequence

    with pil_image().open(path) as img:
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
    image = pil_image()
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


MAX_REPEATS = 1000
"""The most times a folder's files may repeat (``folder_repeats``)."""


def folder_repeats(source: str) -> int:
    """How many samples a file is (kohya's convention): N for a file under a top-level folder
    named ``<N>_<name>`` (``10_mychar/a.png``), else 1. ValueError (one line) naming the folder
    for N out of [1, ``MAX_REPEATS``]."""
    top, sep, _ = source.partition("/")
    match = re.fullmatch(r"(\d+)_(.+)", top) if sep else None
    if match is None:
        return 1
    n = int(match.group(1))
    if not 1 <= n <= MAX_REPEATS:
        raise ValueError(f"folder {top!r}: {n} repeats (its name's <N>_ prefix); valid: 1 to {MAX_REPEATS}")
    return n


def with_trigger(caption: str, trigger: str) -> str:
    """``trigger`` before ``caption`` ("trigger, caption"; the trigger alone for an empty one)."""
    if not trigger:
        return caption
    return f"{trigger}, {caption}" if caption.strip() else trigger


def sample_id_for(relpath: str) -> int:
    """A stable 63-bit id from the file's path relative to the input root."""
    digest = hashlib.blake2b(relpath.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
