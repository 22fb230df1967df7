"""The ledger: which samples were trained in which committed step, exactly once.

Rows are ``(step, sample_id, home_rank, attempt, epoch, expert)``; ``expert`` is the
model that trained the step (0, or in a run of two experts the one its optimizer step
trained: ``flow.expert_boundary``). A planned step's rows are
*staged* until rank 0 commits it (after the optimizer step that consumed it); a commit
appends one journal record per step and fsyncs it, so a committed step survives the
coordinator's death. A resume from a checkpoint at step ``c`` *truncates*: rows of steps
after ``c`` go, the attempt counter goes up, and those steps are trained again and
recorded with the new attempt. A truncate is a journal record too.

In memory the ledger is columnar numpy (a per-step table ``(step, epoch, attempt, rows,
expert)``
and two row columns), so its queries stay fast at ten million rows, and a commit costs
the same at any ledger size (bytes: one record per step; time: one append and fsync).

On disk (given a ``StateStore``) it is an append-only journal plus a compacted snapshot
every ``snapshot_every`` records (or ``snapshot_bytes`` of journal); the newest two
snapshots and the journal after the older one are kept. Restore = the newest readable
snapshot + replay of the journal after it; a torn last record is dropped with a warning.

Position: ``position()`` is what a training checkpoint carries instead of the rows: the
ledger's identity (``ledger_id``, new at every reset), its journal record count and its
committed step and attempt. On resume, ``covers(position)`` says whether the live ledger
(restored from its files) still holds everything the checkpoint covers: the same ledger,
at least as many records, and no cut back below the checkpoint's step since.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping

import numpy as np

from knapray.nofollow import open_nofollow, truncate_nofollow

from .store import COMMIT, SNAPSHOT_FORMAT, TRUNCATE, LedgerFileError, Record, StateStore

log = logging.getLogger(__name__)

_STEP, _EPOCH, _ATTEMPT, _ROWS, _EXPERT = range(5)
COLUMNS = ("step", "sample_id", "home_rank", "attempt", "epoch", "expert")
"""Columns of ``Ledger.columns()`` and keys of ``ledger.jsonl`` rows, in order."""
_JSONL_ROW = '{"step": %d, "sample_id": %d, "home_rank": %d, "attempt": %d, "epoch": %d, "expert": %d}\n'


class _Column:
    """A growable numpy array (amortized O(1) appends)."""

    def __init__(self, dtype, width: int | None = None) -> None:
        self._a = np.empty((0,) if width is None else (0, width), dtype)
        self.n = 0

    @property
    def view(self) -> np.ndarray:
        return self._a[: self.n]

    def extend(self, values) -> None:
        values = np.asarray(values, self._a.dtype)
        k = len(values)
        if self.n + k > len(self._a):
            self._grow(max(self.n + k, 2 * len(self._a), 1024))
        self._a[self.n : self.n + k] = values
        self.n += k

    def replace(self, values) -> None:
        """Hold exactly ``values``, with room for a quarter more before the next copy."""
        values = np.asarray(values, self._a.dtype)
        self._a = np.empty((len(values) + max(1024, len(values) // 4),) + self._a.shape[1:], self._a.dtype)
        self._a[: len(values)] = values
        self.n = len(values)

    def _grow(self, capacity: int) -> None:
        new = np.empty((capacity,) + self._a.shape[1:], self._a.dtype)
        new[: self.n] = self._a[: self.n]
        self._a = new


class Ledger:
    """Committed rows, staged (planned, uncommitted) steps, and their journal."""

    def __init__(self, store: StateStore | None = None, *, snapshot_every: int = 1024,
                 snapshot_bytes: int = 64 << 20, writable: bool = True) -> None:
        """``writable=False``: read another process's ledger (a training rank reading what
        the coordinator or rank 0 writes): restore only; no file is opened for writing,
        cut, or created."""
        self._store = store
        self._writable = writable
        self._snapshot_every, self._snapshot_bytes = snapshot_every, snapshot_bytes
        self._staged: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        self._clear()
        self.records = 0
        """Journal records so far (monotonic: a reset does not restart the count)."""
        self._last_snapshot = 0
        if store is not None:
            self._restore()

    def _clear(self) -> None:
        self._table = _Column(np.int64, 5)  # (k, 5): step, epoch, attempt, rows, expert
        self._ids = _Column(np.int64)
        self._home = _Column(np.int32)
        self._index = _Column(np.int64)  # the table's steps, sorted (for membership)
        self._cuts: list[tuple[int, int]] = []  # (record number, step) of every truncate
        self.attempt = 0
        self.committed_step = -1
        self.ledger_id = (1 << 61) + secrets.randbits(61)  # random, always 19 digits: fixed-size records

    # ---- state --------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return self._ids.n

    @property
    def cuts(self) -> list[list[int]]:
        """``[record number, step]`` of every truncate of this ledger."""
        return [[i, s] for i, s in self._cuts]

    def has_step(self, step: int) -> bool:
        """Whether committed rows of ``step`` are here (a binary search)."""
        index = self._index.view
        i = int(np.searchsorted(index, step))
        return i < index.size and int(index[i]) == step

    def position(self) -> dict:
        """What a checkpoint carries to find this ledger's state again (see module doc)."""
        return {"ledger_id": self.ledger_id, "records": self.records,
                "committed_step": self.committed_step, "attempt": self.attempt}

    def covers(self, position: dict) -> str | None:
        """None if this ledger holds everything a checkpoint at ``position`` covers, else why not."""
        if int(position["ledger_id"]) != self.ledger_id:
            return (f"it is another ledger (id {self.ledger_id}, the checkpoint's is {position['ledger_id']}): "
                    "it was reset by a fresh run, or its files were lost")
        if self.records < int(position["records"]):
            return (f"it holds {self.records} journal records, the checkpoint was taken after "
                    f"{position['records']}: the journal's tail was lost")
        cut = [(i, s) for i, s in self._cuts if i >= int(position["records"]) and s < int(position["committed_step"])]
        if cut:
            return (f"it was cut back to step {cut[0][1]} (record {cut[0][0]}) after the checkpoint at step "
                    f"{position['committed_step']} was taken")
        return None

    # ---- changes ------------------------------------------------------------------------------

    def stage(self, step: int, epoch: int, sample_ids: np.ndarray, home_ranks: np.ndarray) -> None:
        """A planned step's rows, committed by a later ``commit_through``."""
        self._staged[step] = (int(epoch), np.asarray(sample_ids, np.int64), np.asarray(home_ranks, np.int32))

    def staged(self) -> dict[int, tuple[int, np.ndarray, np.ndarray]]:
        """``step -> (epoch, sample_ids, home_ranks)`` of planned, uncommitted steps."""
        return dict(self._staged)

    def commit_through(self, step: int, experts: Mapping[int, int] | None = None) -> list[int]:
        """Every staged step ``<= step`` is trained (step ``t`` by expert ``experts[t]``,
        0 if not there): one journal record each (fsync'd); the committed step becomes
        ``step``. Returns the steps whose rows were committed."""
        experts = experts or {}
        due = sorted(t for t in self._staged if t <= step)
        committed = []
        for i, t in enumerate(due):
            epoch, ids, home = self._staged.pop(t)
            if self.has_step(t):
                continue  # recorded by ``add`` meanwhile (the ranks planned it locally)
            # The committed step moves past a staged step only once its record is down, so
            # a crash between two records leaves the second one in flight, not lost.
            through = step if i == len(due) - 1 else t
            self._append(Record(COMMIT, t, epoch, self.attempt, through, ids, home, int(experts.get(t, 0))))
            committed.append(t)
        if step > self.committed_step:
            self._append(Record(COMMIT, step, -1, self.attempt, step))  # no rows: the count moves on
        return committed

    def add(self, step: int, epoch: int, sample_ids, home_ranks, expert: int = 0) -> bool:
        """Rows of a step planned elsewhere (the ranks, while the coordinator was away),
        committed as they are. False if the step's rows are already here (a resend)."""
        if self.has_step(step):
            return False
        self._staged.pop(step, None)
        self._append(Record(COMMIT, step, int(epoch), self.attempt, step,
                            np.asarray(sample_ids, np.int64), np.asarray(home_ranks, np.int32), int(expert)))
        return True

    def truncate(self, step: int, attempt: int) -> None:
        """Rows of steps after ``step`` go, the committed step is ``step``, the attempt ``attempt``."""
        self._staged.clear()
        self._append(Record(TRUNCATE, step, -1, attempt, step))

    def reset(self) -> None:
        """An empty ledger with a new identity (a fresh run); old files are removed."""
        self._staged.clear()
        self._clear()
        if self._store is not None:
            self.snapshot(keep_snapshots=1)

    def replace(self, table: np.ndarray, sample_ids: np.ndarray, home_ranks: np.ndarray,
                committed_step: int, attempt: int) -> None:
        """Hold exactly these rows (``table``: (k, 4) step, epoch, attempt, rows per step, or
        (k, 5) with the expert), as a new ledger written as one snapshot: for building large
        ledgers fast (benchmarks)."""
        table = np.asarray(table, np.int64)
        table = table.reshape(-1, table.shape[-1] if table.ndim == 2 and table.shape[-1] == 5 else 4)
        if table.shape[1] == 4:
            table = np.concatenate([table, np.zeros((len(table), 1), np.int64)], axis=1)
        if int(table[:, _ROWS].sum()) != len(sample_ids) or len(sample_ids) != len(home_ranks):
            raise ValueError(f"{len(sample_ids)} sample ids, {len(home_ranks)} home ranks and "
                             f"{int(table[:, _ROWS].sum())} rows in the step table must agree")
        self.reset()
        self._load(table, np.asarray(sample_ids), np.asarray(home_ranks), [], committed_step, attempt)
        if self._store is not None:
            self.snapshot(keep_snapshots=1)

    def _append(self, record: Record) -> None:
        if not self._writable:
            raise RuntimeError("this ledger was opened read-only")
        if self._store is not None:
            self._store.append(record)
        self._apply(record)
        if self._store is not None and (
            self.records - self._last_snapshot >= self._snapshot_every
            or self._store.segment_bytes >= self._snapshot_bytes
        ):
            self.snapshot()

    def _apply(self, rec: Record) -> None:
        if rec.kind == COMMIT:
            n = rec.sample_ids.size
            if n:
                self._table.extend([[rec.step, rec.epoch, rec.attempt, n, rec.expert]])
                self._ids.extend(rec.sample_ids)
                self._home.extend(rec.home_ranks)
                index = self._index.view
                if not index.size or rec.step > index[-1]:
                    self._index.extend([rec.step])
                else:  # a step recorded late (rare): keep the index sorted
                    self._index.replace(np.insert(index, np.searchsorted(index, rec.step), rec.step))
            self.committed_step = max(self.committed_step, rec.through)
        else:
            self._cut(rec.step)
            self.committed_step, self.attempt = rec.step, rec.attempt
            self._cuts.append((self.records, rec.step))
        self.records += 1

    def _cut(self, step: int) -> None:
        table = self._table.view
        keep = table[:, _STEP] <= step
        if not keep.all():
            rows = np.repeat(keep, table[:, _ROWS])
            self._ids.replace(self._ids.view[rows])
            self._home.replace(self._home.view[rows])
            self._table.replace(table[keep])
        self._index.n = int(np.searchsorted(self._index.view, step, side="right"))

    # ---- snapshots and restore ----------------------------------------------------------------

    def snapshot(self, keep_snapshots: int = 2) -> None:
        """Write the whole ledger as snapshot ``records`` (atomic), start a new journal
        segment, and delete what the newest ``keep_snapshots`` snapshots make unneeded."""
        if self._store is None:
            raise RuntimeError("this ledger has no state directory to write a snapshot to")
        meta = [SNAPSHOT_FORMAT, self.records, self.attempt, self.committed_step, self.ledger_id]
        self._store.write_snapshot(self.records, {
            "meta": np.asarray(meta, np.int64), "steps": self._table.view, "sample_id": self._ids.view,
            "home_rank": self._home.view, "cuts": np.asarray(self._cuts, np.int64).reshape(-1, 2),
        })
        self._store.open_segment(self.records)
        self._store.prune(keep_snapshots)
        self._last_snapshot = self.records

    def _load(self, table, ids, home, cuts, committed_step: int, attempt: int) -> None:
        self._table.replace(table)
        self._ids.replace(ids)
        self._home.replace(home)
        self._index.replace(np.sort(table[:, _STEP]))
        self._cuts = [(int(i), int(s)) for i, s in cuts]
        self.committed_step, self.attempt = int(committed_step), int(attempt)

    def _restore(self) -> None:
        store = self._store
        snaps = store.snapshots()
        base = None
        for n, path in reversed(snaps):
            try:
                a = store.read_snapshot(n, path)
            except LedgerFileError as e:
                log.warning("ledger: skipping a snapshot: %s", e)
                continue
            meta = a["meta"]
            self._load(a["steps"], a["sample_id"], a["home_rank"], a["cuts"], int(meta[3]), int(meta[2]))
            self.records, self.ledger_id, base = n, int(meta[4]), n
            break
        segs = store.segments()
        if base is None:
            if snaps and (not segs or segs[0][0] != 0):
                raise LedgerFileError(f"no readable ledger snapshot in {store.directory}, and the journal "
                                      "does not go back to record 0")
            base = 0
        held = [i for i, (first, _) in enumerate(segs) if first <= base]
        segs = segs[held[-1] if held else 0 :]
        if segs and segs[0][0] > base:
            raise LedgerFileError(f"ledger journal records {base}..{segs[0][0] - 1} are missing in {store.directory}")
        expected, last = (segs[0][0] if segs else base), None
        for k, (first, path) in enumerate(segs):
            if first != expected:
                raise LedgerFileError(f"ledger journal {path} starts at record {first}, expected {expected}: "
                                      "a segment is missing")
            last = store.read_segment(first, path, last=k == len(segs) - 1)
            for j, rec in enumerate(last.records):
                if first + j >= base:
                    self._apply(rec)
            expected = first + len(last.records)
        self._last_snapshot = base
        if not self._writable:
            return  # a reader leaves the files as they are (a torn tail is the writer's to cut)
        if not snaps and not segs:  # a new directory: give this ledger's identity a file
            self.snapshot(keep_snapshots=1)
            return
        if last is not None and last.torn is not None:
            log.warning("ledger journal %s: dropped a torn last record at byte offset %d (%s)",
                        last.path, last.end, last.torn)
        if last is not None and expected == self.records:
            store.open_segment(last.first, keep_bytes=last.end)
        else:
            if last is not None and last.torn is not None:
                truncate_nofollow(last.path, last.end)
            store.open_segment(self.records)
        if snaps or segs:
            log.info("ledger restored from %s: %d rows, %d records, committed step %d, attempt %d",
                     store.directory, self.rows, self.records, self.committed_step, self.attempt)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    # ---- queries ------------------------------------------------------------------------------

    def columns(self) -> dict[str, np.ndarray]:
        """Every committed row as columns ``COLUMNS``, ordered by step (rows of one step in
        plan order). Copies: later changes do not show through."""
        table = self._table.view
        counts = table[:, _ROWS]
        order = np.argsort(table[:, _STEP], kind="stable")
        starts = np.cumsum(counts) - counts
        if np.all(order == np.arange(order.size)):
            rows = slice(None)
        else:  # out of step order (a step recorded late): gather the row ranges in order
            ordered_counts = counts[order]
            rows = np.repeat(starts[order] - (np.cumsum(ordered_counts) - ordered_counts), ordered_counts)
            rows += np.arange(rows.size)
        per_row = {name: np.repeat(table[order, col], counts[order])
                   for name, col in (("step", _STEP), ("attempt", _ATTEMPT), ("epoch", _EPOCH), ("expert", _EXPERT))}
        return {"step": per_row["step"], "sample_id": self._ids.view[rows].copy(),
                "home_rank": self._home.view[rows].astype(np.int64), "attempt": per_row["attempt"],
                "epoch": per_row["epoch"], "expert": per_row["expert"]}

    def rows_list(self) -> list[tuple[int, int, int, int]]:
        """``(step, sample_id, home_rank, attempt)`` per row, by step (small ledgers, tests)."""
        c = self.columns()
        return list(zip(*(c[k].tolist() for k in ("step", "sample_id", "home_rank", "attempt"))))

    def epoch_sample_ids(self, epoch: int) -> np.ndarray:
        """(n,) int64 sample ids committed in ``epoch``, in commit order. Rows of cut-back
        attempts are gone, so each trained sample of the epoch appears once."""
        table = self._table.view
        return self._ids.view[np.repeat(table[:, _EPOCH] == epoch, table[:, _ROWS])].copy()

    def write_jsonl(self, path: str) -> int:
        """Write every row as one JSON object per line (``COLUMNS``), atomically; returns the
        number of rows."""
        c = self.columns()
        n = c["step"].size
        tmp = f"{path}.tmp"
        with open_nofollow(tmp, "w") as f:
            for lo in range(0, n, 1 << 18):
                block = np.stack([c[k][lo : lo + (1 << 18)] for k in COLUMNS], axis=1)
                f.write("".join(_JSONL_ROW % tuple(r) for r in block.tolist()))
        os.replace(tmp, path)
        return n
