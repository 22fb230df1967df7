"""The coordinator's files on disk: ledger journal, ledger snapshots, small JSON state.

A state directory holds

``journal-<n>.bin``
    A ledger journal segment; its first record is record number ``n`` (12 digits). An
    8-byte magic, then records, each ``<u32 payload bytes><u32 crc32 of payload><payload>``
    with payload ``<u8 kind><i64 step><i64 epoch><i64 attempt><i64 through><u32 n>``
    followed by ``n`` int64 sample ids and ``n`` int32 home ranks (little-endian); a
    ``COMMIT_EXPERT`` record has one more byte after the header, the expert that trained
    the step (a run of two experts; any other commit was trained by expert 0). A record
    is appended with one ``write`` and fsync'd before the call returns.
``snapshot-<n>.npz``
    The ledger after its first ``n`` records: plain numpy arrays, read with
    ``allow_pickle=False``: ``meta`` (format, records, attempt, committed step, ledger id),
    ``steps`` ((k, 4): step, epoch, attempt, rows), ``sample_id``, ``home_rank`` and
    ``cuts`` ((c, 2): record number and step of every truncate).
``run.json``, ``stats.json``
    The coordinator's small run state and its statistics.

Snapshots and JSON files are written to a temporary file, fsync'd and renamed over the
old one, so a crash leaves the old file or the new one, never a mix. Nothing here is
ever unpickled: a planted file can make a restore fail, not run code. A write the file
system refuses (a full disk) is a ``FileError`` naming the file and what was being done to
it (``appending to the ledger journal <path>: No space left on device``).

Reading a journal: a last record cut short (a crash mid-append: an incomplete frame, a
payload running past the end of the file, a zero-filled tail, or a payload checksum
mismatch in the record that ends the file) is a torn tail, reported to the caller, which
drops it; anything else that does not parse (a frame checksum mismatch, a payload
checksum mismatch with records after it, a malformed record) is a ``LedgerFileError``
naming the file and the byte offset. The frame's own checksum keeps a damaged length
field from passing for a torn tail.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from knapray.file_errors import file_op
from knapray.files import read_json
from knapray.nofollow import open_nofollow

MAGIC = b"KRLJ\x00\x00\x00\x01"
"""First bytes of every journal segment: format name and version 1."""
SNAPSHOT_FORMAT = 2
"""Format 2's step table has the expert column; format 1's (read as expert 0) had not."""
COMMIT, TRUNCATE, COMMIT_EXPERT = 1, 2, 3
"""Record kinds: a committed step's rows (or, with no rows, only the committed step
moving on); a cut back to an earlier step with a new attempt; a committed step's rows
trained by an expert other than 0 (its number follows the header)."""
MAX_STATE_FILE_BYTES = 1 << 28
"""``run.json`` and ``stats.json`` hold a few steps' sample ids and recent lengths
(megabytes at a large world); a larger file is not one the coordinator wrote."""

_FRAME = struct.Struct("<III")  # payload bytes, crc32 of payload, crc32 of the 8 bytes before
_HEAD = struct.Struct("<BqqqqI")  # kind, step, epoch, attempt, through, n
_SEGMENT = re.compile(r"^journal-(\d{12})\.bin$")
_SNAPSHOT = re.compile(r"^snapshot-(\d{12})\.npz$")
SNAPSHOT_KEYS = ("meta", "steps", "sample_id", "home_rank", "cuts")


class LedgerFileError(ValueError):
    """A coordinator file is corrupt or not what its name says; the message names it."""


@dataclass(frozen=True, slots=True)
class Record:
    """One journal record. ``COMMIT``: step ``step`` of ``epoch`` trained in ``attempt``
    with these rows (by ``expert``: written as ``COMMIT_EXPERT`` when it is not 0); the
    committed step is ``through`` after it. ``TRUNCATE``: rows of steps after ``step`` are
    gone, the committed step is ``step``, the attempt ``attempt``."""

    kind: int
    step: int
    epoch: int = -1
    attempt: int = 0
    through: int = -1
    sample_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    home_ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    expert: int = 0

    def encode(self) -> bytes:
        ids = np.ascontiguousarray(self.sample_ids, dtype="<i8")
        home = np.ascontiguousarray(self.home_ranks, dtype="<i4")
        if ids.shape != home.shape or ids.ndim != 1:
            raise ValueError(f"sample ids and home ranks must be equal-length vectors, got {ids.shape}, {home.shape}")
        if not 0 <= self.expert < 256 or (self.expert and self.kind != COMMIT):
            raise ValueError(f"expert {self.expert}: a commit's expert is in [0, 255]")
        kind = COMMIT_EXPERT if self.expert else self.kind
        payload = _HEAD.pack(kind, self.step, self.epoch, self.attempt, self.through, ids.size)
        payload += (bytes([self.expert]) if self.expert else b"") + ids.tobytes() + home.tobytes()
        head = struct.pack("<II", len(payload), zlib.crc32(payload))
        return head + struct.pack("<I", zlib.crc32(head)) + payload

    @classmethod
    def decode(cls, payload: bytes) -> Record:
        """Raises ``ValueError`` if the payload is not a well-formed record."""
        if len(payload) < _HEAD.size:
            raise ValueError(f"record of {len(payload)} bytes is shorter than its {_HEAD.size}-byte header")
        kind, step, epoch, attempt, through, n = _HEAD.unpack_from(payload)
        if kind not in (COMMIT, TRUNCATE, COMMIT_EXPERT):
            raise ValueError(f"unknown record kind {kind}")
        head = _HEAD.size + (kind == COMMIT_EXPERT)
        if len(payload) != head + 12 * n:
            raise ValueError(f"record says {n} rows but holds {len(payload) - head} bytes of them")
        expert = payload[_HEAD.size] if kind == COMMIT_EXPERT else 0
        ids = np.frombuffer(payload, "<i8", n, head).astype(np.int64)
        home = np.frombuffer(payload, "<i4", n, head + 8 * n).astype(np.int32)
        return cls(COMMIT if kind == COMMIT_EXPERT else kind, step, epoch, attempt, through, ids, home, expert)


@dataclass(slots=True)
class Segment:
    """What reading one journal segment found."""

    first: int
    path: str
    records: list[Record]
    end: int
    """Byte offset just past the last good record."""
    torn: str | None
    """Why the bytes after ``end`` were not a record (a torn tail), or None."""


class StateStore:
    """The files of one state directory. One writer at a time (the coordinator actor)."""

    def __init__(self, directory: str) -> None:
        with file_op("creating the ledger folder", directory):
            os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.bytes_written = 0
        """Bytes this store wrote so far (journal, snapshots, JSON files)."""
        self.segment_bytes = 0
        """Size of the open journal segment."""
        self._fd: int | None = None
        self._journal = ""
        """The open journal segment's path."""
        for name in os.listdir(directory):  # leftovers of writes a crash interrupted
            if name.endswith(".tmp"):
                os.remove(self._path(name))

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    # ---- journal ----------------------------------------------------------------------------

    def segments(self) -> list[tuple[int, str]]:
        """``(first record number, path)`` of every journal segment, oldest first."""
        return self._numbered(_SEGMENT)

    def read_segment(self, first: int, path: str, last: bool) -> Segment:
        """Every record of a segment. A torn tail is allowed only in the ``last`` segment."""
        with open(path, "rb") as f:
            buf = f.read()

        def bad(offset: int, why: str) -> LedgerFileError:
            return LedgerFileError(f"ledger journal {path} is corrupt at byte offset {offset}: {why}")

        if len(buf) < len(MAGIC) or buf[: len(MAGIC)] != MAGIC:
            if last and MAGIC.startswith(buf):  # created, header not fully written
                return Segment(first, path, [], 0, f"incomplete {len(buf)}-byte file header")
            raise bad(0, f"not a knapray ledger journal (first bytes {buf[:8]!r})")
        records: list[Record] = []
        off = len(MAGIC)
        while off < len(buf):
            torn = None
            if len(buf) - off < _FRAME.size:
                torn = f"incomplete record frame ({len(buf) - off} bytes)"
            else:
                size, crc, frame_crc = _FRAME.unpack_from(buf, off)
                end = off + _FRAME.size + size
                payload = buf[off + _FRAME.size : end]
                if zlib.crc32(buf[off : off + 8]) != frame_crc:
                    if buf.count(0, off) != len(buf) - off:
                        raise bad(off, f"frame checksum mismatch in record {first + len(records)}")
                    torn = "zero-filled tail"
                elif end > len(buf):
                    torn = f"record of {size} bytes runs past the end of the file"
                elif zlib.crc32(payload) != crc:
                    if end != len(buf):
                        raise bad(off, f"payload checksum mismatch in record {first + len(records)}")
                    torn = "payload checksum mismatch in the last record"
            if torn is not None:
                if not last:
                    raise bad(off, f"{torn}, and a later segment follows")
                return Segment(first, path, records, off, torn)
            try:
                records.append(Record.decode(payload))
            except ValueError as e:
                raise bad(off, f"record {first + len(records)}: {e}") from None
            off = end
        return Segment(first, path, records, off, None)

    def open_segment(self, first: int, keep_bytes: int | None = None) -> None:
        """Append from now on to segment ``first``: a new one, or (``keep_bytes`` given) an
        existing one cut to its first ``keep_bytes`` bytes (dropping a torn tail)."""
        self.close()
        path = self._journal = self._path(f"journal-{first:012d}.bin")
        if keep_bytes is None or keep_bytes < len(MAGIC):
            with file_op("creating the ledger journal", path):
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            self._write(MAGIC)
            self.segment_bytes = len(MAGIC)
            _fsync_dir(self.directory)
        else:
            with file_op("cutting the torn tail of the ledger journal", path):
                self._fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
                os.ftruncate(self._fd, keep_bytes)
                os.lseek(self._fd, keep_bytes, os.SEEK_SET)
                os.fsync(self._fd)
            self.segment_bytes = keep_bytes

    def append(self, record: Record) -> None:
        """Append one record and fsync: when this returns, the record survives a crash."""
        if self._fd is None:
            raise RuntimeError("no open journal segment: call open_segment first")
        data = record.encode()
        self._write(data)
        self.segment_bytes += len(data)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        with file_op("appending to the ledger journal", self._journal):
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        self.bytes_written += len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- snapshots --------------------------------------------------------------------------

    def snapshots(self) -> list[tuple[int, str]]:
        """``(record count, path)`` of every snapshot, oldest first."""
        return self._numbered(_SNAPSHOT)

    def write_snapshot(self, n: int, arrays: dict[str, np.ndarray]) -> str:
        """Write the ledger after ``n`` records, atomically."""
        path = self._path(f"snapshot-{n:012d}.npz")
        with _AtomicFile(path, self) as f:
            np.savez(f, **arrays)
        return path

    def read_snapshot(self, n: int, path: str) -> dict[str, np.ndarray]:
        """The arrays of a snapshot, checked for shape and consistency."""
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = [k for k in SNAPSHOT_KEYS if k not in z.files]
                if missing:
                    raise LedgerFileError(f"ledger snapshot {path} lacks arrays {missing}")
                arrays = {k: z[k] for k in SNAPSHOT_KEYS}
        except LedgerFileError:
            raise
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
            raise LedgerFileError(f"ledger snapshot {path} is unreadable: {e}") from None
        meta, steps, ids, home, cuts = (arrays[k] for k in SNAPSHOT_KEYS)
        fmt = int(meta[0]) if meta.shape == (5,) else 0
        ok = (
            meta.shape == (5,) and steps.ndim == 2 and steps.shape[1] == {1: 4, 2: 5}.get(fmt, 5) and ids.ndim == 1
            and home.shape == ids.shape and cuts.ndim == 2 and cuts.shape[1] == 2
            and all(np.issubdtype(a.dtype, np.integer) for a in arrays.values())
        )
        if not ok:
            raise LedgerFileError(f"ledger snapshot {path} has arrays of the wrong shape or type")
        if fmt not in (1, SNAPSHOT_FORMAT) or int(meta[1]) != n:
            raise LedgerFileError(
                f"ledger snapshot {path}: format {fmt} after {int(meta[1])} records, "
                f"expected format 1 or {SNAPSHOT_FORMAT} after {n} (its name)"
            )
        if fmt == 1:  # before the expert column: every step trained by expert 0
            arrays["steps"] = np.concatenate([steps, np.zeros((len(steps), 1), steps.dtype)], axis=1)
        elif ((steps[:, 4] < 0) | (steps[:, 4] > 255)).any():
            raise LedgerFileError(f"ledger snapshot {path}: an expert number outside [0, 255]")
        if int(steps[:, 3].sum()) != ids.size or (steps[:, 3] < 0).any():
            raise LedgerFileError(f"ledger snapshot {path}: per-step row counts do not add up to {ids.size} rows")
        return arrays

    def prune(self, keep_snapshots: int) -> None:
        """Delete all but the newest ``keep_snapshots`` snapshots, and the journal segments
        whose records all precede the oldest snapshot kept."""
        snaps = self.snapshots()
        if not snaps:
            return
        for _, path in snaps[:-keep_snapshots]:
            with file_op("removing the old ledger snapshot", path):
                os.remove(path)
        oldest = snaps[-keep_snapshots:][0][0]
        segs = self.segments()
        for (_, path), (nxt, _) in zip(segs, segs[1:]):
            if nxt <= oldest:
                with file_op("removing the old ledger journal", path):
                    os.remove(path)

    # ---- JSON files -------------------------------------------------------------------------

    def write_json(self, name: str, obj: Any) -> None:
        data = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
        with _AtomicFile(self._path(name), self) as f:
            f.write(data)

    def read_json(self, name: str) -> dict | None:
        """The object in ``name``, None if there is no such file."""
        return read_json(self._path(name), MAX_STATE_FILE_BYTES, "coordinator file", LedgerFileError, missing=None)

    def _numbered(self, pattern: re.Pattern) -> list[tuple[int, str]]:
        found = [(pattern.match(name), name) for name in os.listdir(self.directory)]
        return sorted((int(m.group(1)), self._path(name)) for m, name in found if m)


class _AtomicFile:
    """Write ``path`` through ``path.tmp``: fsync, rename over ``path``, fsync the directory."""

    def __init__(self, path: str, store: StateStore) -> None:
        self.path, self.tmp, self.store = path, path + ".tmp", store

    def __enter__(self):
        self.f = open_nofollow(self.tmp, "wb")
        return self.f

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            try:
                self.f.close()
            except OSError:
                pass  # the error in flight says what failed
            os.remove(self.tmp)
            return
        with file_op("writing", self.tmp):
            self.f.flush()
            os.fsync(self.f.fileno())
            self.store.bytes_written += self.f.tell()
            self.f.close()
        with file_op(f"renaming {self.tmp} over", self.path):
            os.replace(self.tmp, self.path)
        _fsync_dir(os.path.dirname(self.path))


def _fsync_dir(directory: str) -> None:
    """Make a rename or a new file in ``directory`` survive a power loss."""
    with file_op("syncing the folder", directory):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
