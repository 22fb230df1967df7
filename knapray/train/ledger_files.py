"""The ledger on disk: which samples each committed step trained, appended once per step.

Layout, in ``<run dir>/ledger/``:

- ``journal-<seq>.log``: one line per record, ``<crc32 hex8> <json>\\n``, appended and
  fsync'd. A commit record holds one step: ``{"t": "commit", "step", "epoch", "attempt",
  "ids": [...], "homes": [...]}``; a truncate record (a resume from an earlier
  checkpoint) holds ``{"t": "truncate", "after": step, "attempt": new attempt}``: rows of
  later steps are gone, and what follows is written by the new attempt.
- ``snapshot-<seq>.npz``: every ``SNAPSHOT_EVERY`` records the whole ledger, compacted
  (plain int64 arrays: step, epoch, attempt, sample_id, home_rank), written to a temporary
  file, fsync'd and renamed; a new journal segment ``<seq>`` starts after it.

Reading takes the newest snapshot and replays the journal segments after it. A torn
last line (a crash while appending) is dropped with a warning; a bad line anywhere else
is an error naming the file and the line. Nothing here unpickles: JSON lines, and
``np.load(allow_pickle=False)``.

The cost of a commit is one line of the step's ids and one fsync, whatever the size of
the ledger; a snapshot every ``SNAPSHOT_EVERY`` commits rewrites the ledger once (at
10 million rows about 400 MB, amortized over those commits).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

LEDGER_DIR = "ledger"
SNAPSHOT_EVERY = 10_000
COLUMNS = ("step", "epoch", "attempt", "sample_id", "home_rank")


class LedgerError(ValueError):
    """A ledger file that is not a ledger (a corrupt line in the middle, a foreign file)."""


def ledger_dir(run_dir: str) -> str:
    return os.path.join(run_dir, LEDGER_DIR)


@dataclass
class Rows:
    """The ledger as columns, one entry per trained sample."""

    step: np.ndarray
    epoch: np.ndarray
    attempt: np.ndarray
    sample_id: np.ndarray
    home_rank: np.ndarray

    @classmethod
    def empty(cls) -> "Rows":
        return cls(*(np.zeros(0, np.int64) for _ in COLUMNS))

    def __len__(self) -> int:
        return int(self.step.size)

    def where(self, keep: np.ndarray) -> "Rows":
        return Rows(*(getattr(self, c)[keep] for c in COLUMNS))

    def concat(self, parts: list["Rows"]) -> "Rows":
        return Rows(*(np.concatenate([getattr(self, c)] + [getattr(p, c) for p in parts]) for c in COLUMNS))


def _line(record: dict) -> bytes:
    body = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _segments(directory: str, prefix: str, suffix: str) -> list[tuple[int, str]]:
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        if name.startswith(prefix) and name.endswith(suffix):
            seq = name[len(prefix) : -len(suffix)]
            if seq.isdigit():
                out.append((int(seq), os.path.join(directory, name)))
    return sorted(out)


def _read_journal(path: str, last_segment: bool) -> list[dict]:
    records = []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # tail: bytes after the last newline (a torn append)
    for n, raw in enumerate(complete, 1):
        crc, _, body = raw.partition(b" ")
        ok = len(crc) == 8 and body and format(zlib.crc32(body), "08x").encode() == crc
        if not ok:
            if last_segment and n == len(complete) and not tail:
                logger.warning("%s: line %d is torn (a crash while appending); dropped", path, n)
                break
            raise LedgerError(f"{path}: line {n} is corrupt (checksum mismatch); the ledger cannot be trusted")
        records.append(json.loads(body))
    if tail:
        if not last_segment:
            raise LedgerError(f"{path}: ends in an incomplete line, but later segments follow")
        logger.warning("%s: incomplete last line (a crash while appending); dropped", path)
    return records


def _apply(rows: Rows, records: list[dict]) -> tuple[Rows, int]:
    """Rows after the records, and the current attempt."""
    attempt = int(rows.attempt.max()) if len(rows) else 0
    pending: list[Rows] = []
    for rec in records:
        if rec["t"] == "commit":
            n = len(rec["ids"])
            pending.append(Rows(np.full(n, rec["step"], np.int64), np.full(n, rec["epoch"], np.int64),
                                np.full(n, rec["attempt"], np.int64), np.asarray(rec["ids"], np.int64),
                                np.asarray(rec["homes"], np.int64)))
            attempt = max(attempt, int(rec["attempt"]))
        elif rec["t"] == "truncate":
            rows = rows.concat(pending)
            pending = []
            rows = rows.where(rows.step <= int(rec["after"]))
            attempt = int(rec["attempt"])
        else:
            raise LedgerError(f"unknown ledger record type {rec['t']!r}")
    return rows.concat(pending), attempt


def read_ledger(run_dir: str) -> tuple[Rows, int, int]:
    """(rows, current attempt, next segment number) of a run's ledger; empty if none."""
    directory = ledger_dir(run_dir)
    snaps = _segments(directory, "snapshot-", ".npz")
    rows, start = Rows.empty(), -1
    if snaps:
        start, path = snaps[-1]
        try:
            with np.load(path, allow_pickle=False) as z:
                rows = Rows(*(np.asarray(z[c], dtype=np.int64) for c in COLUMNS))
        except (ValueError, KeyError, OSError, zlib.error) as e:
            raise LedgerError(f"{path}: not a ledger snapshot ({e})") from None
        if len({getattr(rows, c).shape for c in COLUMNS}) != 1:
            raise LedgerError(f"{path}: columns of different lengths")
    # snapshot-N holds everything before journal-N
    journals = [(s, p) for s, p in _segments(directory, "journal-", ".log") if s >= start]
    records: list[dict] = []
    for i, (_, path) in enumerate(journals):
        records += _read_journal(path, last_segment=i == len(journals) - 1)
    rows, attempt = _apply(rows, records)
    nxt = max([start] + [s for s, _ in journals]) + 1
    return rows, attempt, nxt


class LocalLedger:
    """The writer: one per run (the coordinator, or rank 0 when there is none)."""

    def __init__(self, run_dir: str, rows: Rows, attempt: int, segment: int) -> None:
        self.dir = ledger_dir(run_dir)
        os.makedirs(self.dir, exist_ok=True)
        self.attempt = attempt
        self._file = None
        self._rows, self._new = rows, []  # committed steps are appended as chunks: O(step) each
        self._last_step = int(rows.step.max()) if len(rows) else -1
        self.records_in_segment = 0
        self._open_segment(segment)

    @property
    def rows(self) -> Rows:
        if self._new:
            self._rows, self._new = self._rows.concat(self._new), []
        return self._rows

    @classmethod
    def open(cls, run_dir: str, resume_step: int | None) -> "LocalLedger":
        """A fresh run starts an empty ledger; a resumed one (``resume_step``: the last
        step its checkpoint covers) appends a truncate record and a new attempt."""
        if resume_step is None:  # a fresh run: nothing of an earlier one counts
            if os.path.isdir(ledger_dir(run_dir)):
                for _, path in _segments(ledger_dir(run_dir), "journal-", ".log") + \
                        _segments(ledger_dir(run_dir), "snapshot-", ".npz"):
                    os.remove(path)
            return cls(run_dir, Rows.empty(), 0, 0)
        rows, attempt, segment = read_ledger(run_dir)
        ledger = cls(run_dir, rows, attempt, segment)
        ledger.truncate(resume_step)
        return ledger

    def append(self, step: int, epoch: int, sample_ids, home_ranks) -> int:
        """Record a committed step; returns the bytes written."""
        ids = [int(i) for i in sample_ids]
        homes = [int(h) for h in home_ranks]
        if len(ids) != len(homes):
            raise ValueError(f"step {step}: {len(ids)} sample ids but {len(homes)} home ranks")
        written = self._write({"t": "commit", "step": int(step), "epoch": int(epoch), "attempt": self.attempt,
                               "ids": ids, "homes": homes})
        n = len(ids)
        self._new.append(Rows(np.full(n, step, np.int64), np.full(n, epoch, np.int64),
                              np.full(n, self.attempt, np.int64), np.asarray(ids, np.int64),
                              np.asarray(homes, np.int64)))
        self._last_step = max(self._last_step, int(step))
        if self.records_in_segment >= SNAPSHOT_EVERY:
            self.snapshot()
        return written

    def truncate(self, after_step: int) -> None:
        self.attempt += 1
        self._write({"t": "truncate", "after": int(after_step), "attempt": self.attempt})
        self._rows = self.rows.where(self.rows.step <= after_step)
        self._last_step = int(self._rows.step.max()) if len(self._rows) else -1

    def position(self) -> dict:
        """What a checkpoint records: where the ledger stood (cheap: no copy of the rows)."""
        n = len(self._rows) + sum(len(c) for c in self._new)
        return {"attempt": self.attempt, "rows": n, "last_step": self._last_step,
                "segment": self._segment}

    def snapshot(self) -> None:
        """Write the compacted ledger and start a new journal segment after it."""
        seq = self._segment + 1
        tmp = os.path.join(self.dir, f".snapshot-{seq:06d}.tmp.npz")
        with open(tmp, "wb") as f:
            np.savez(f, **{c: getattr(self.rows, c) for c in COLUMNS})
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.dir, f"snapshot-{seq:06d}.npz"))
        old = [p for s, p in _segments(self.dir, "journal-", ".log") + _segments(self.dir, "snapshot-", ".npz")
               if s < seq]
        self._open_segment(seq)
        for path in old:  # the snapshot holds them now
            os.remove(path)

    def close(self) -> None:
        self._file.close()

    def _open_segment(self, seq: int) -> None:
        if self._file is not None:
            self._file.close()
        self._segment = seq
        self._file = open(os.path.join(self.dir, f"journal-{seq:06d}.log"), "ab")
        self.records_in_segment = 0

    def _write(self, record: dict) -> int:
        data = _line(record)
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records_in_segment += 1
        return len(data)


def committed_ids(run_dir: str, epoch: int, through_step: int | None) -> np.ndarray:
    """Sorted ids the ledger has for ``epoch`` (up to ``through_step``): what a resumed
    epoch skips."""
    rows, _, _ = read_ledger(run_dir)
    keep = rows.epoch == epoch
    if through_step is not None:
        keep &= rows.step <= through_step
    return np.unique(rows.sample_id[keep])


def ledger_rows(run_dir: str) -> list[dict]:
    """The ledger as row dicts for ``ledger.jsonl``, ordered by step."""
    rows, _, _ = read_ledger(run_dir)
    order = np.argsort(rows.step, kind="stable")
    return [dict(zip(COLUMNS, values)) for values in zip(*(getattr(rows, c)[order].tolist() for c in COLUMNS))]
