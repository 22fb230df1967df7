"""The bad-data guard: corrupt samples and unreadable shards go to quarantine files in the
run directory with their reason, and a run whose corpus is mostly bad stops, on every
rank at the same step, instead of training on what is left.

Files: each rank appends to ``quarantine-rank<r>.jsonl`` (one JSON object per line:
``sample_id``, ``reason``, ``rank`` for a sample; ``shard``, ``rows``, ``reason`` for a
shard); the driver's shard check writes ``quarantine-shards.jsonl``; at the end of the
run they are merged into ``quarantine.jsonl`` (``knapray.driver.report``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from knapray.data import BadShard, DuplicateId, StreamStats
from knapray.nofollow import open_nofollow

SHARD_FILE = "quarantine-shards.jsonl"
DUPLICATES_FILE = "quarantine-duplicates.jsonl"


class BadCorpus(ValueError):
    """Too much of the corpus could not be read; the message names what and where."""


class NonFiniteSteps(BadCorpus):
    """Optimizer steps in a row whose loss or gradients were not finite (their updates not
    applied, their samples quarantined): the model diverged, or the corpus holds values it
    cannot take. A ``BadCorpus``, so every launcher says it in its one line."""


@dataclass
class BadDataGuard:
    run_dir: str
    rank: int
    corpus: str
    max_bad_fraction: float
    bad_rows: float = 0.0
    """Rows quarantined so far, summed over ranks (what ``check`` saw)."""
    rows: float = 0.0
    """Rows read or lost so far, summed over ranks."""
    _reported: tuple[int, int] = (0, 0)
    _shard_rows_lost: int = 0
    _shard_rows_reported: int = 0
    bad_shards: list[BadShard] = field(default_factory=list)

    @property
    def path(self) -> str:
        return os.path.join(self.run_dir, f"quarantine-rank{self.rank}.jsonl")

    def on_corrupt(self, sample_id, reason: str) -> None:
        self._append({"sample_id": int(sample_id) if sample_id is not None else None,
                      "reason": reason, "rank": self.rank})

    def on_nonfinite(self, step: int, sample_ids) -> None:
        """This rank's samples of ``step``, whose loss or gradients were not finite (the
        step's update was not applied): quarantined with the step, never trained again."""
        for sample_id in sample_ids:
            self._append({"sample_id": int(sample_id), "reason": "non_finite_loss", "rank": self.rank,
                          "step": int(step)})

    def on_bad_shard(self, bad: BadShard) -> None:
        """Every rank reading the shard sees the failure; rank 0 records and counts it."""
        self.bad_shards.append(bad)
        if self.rank == 0:
            self._append(bad.to_json())
            self._shard_rows_lost += bad.rows or 0

    def step_counts(self, stats: StreamStats) -> dict[str, int]:
        """This rank's new bad and read rows since the last call, for the step's all-reduce.
        Rows skipped as trained already count as read: a resumed epoch reads its bad rows
        before the checkpoint again (and quarantines them again) but skips its good ones, and
        without them the fraction of a resume was the bad rows' alone (a run resumed after a
        worker failure stopped as "mostly bad" on a corpus it had trained on)."""
        bad, read = stats.corrupt, stats.samples + stats.corrupt + stats.skipped
        lost = self._shard_rows_lost - self._shard_rows_reported
        counts = {"bad_rows": bad - self._reported[0] + lost, "rows": read - self._reported[1] + lost}
        self._reported = (bad, read)
        self._shard_rows_reported = self._shard_rows_lost
        return counts

    def check(self, summed: dict[str, float], step: int) -> None:
        """Raise ``BadCorpus`` once more than ``max_bad_fraction`` of the rows (after at
        least 16) were bad. Every rank sees the same sums, so every rank raises together."""
        self.bad_rows += summed["bad_rows"]
        self.rows += summed["rows"]
        if self.rows >= 16 and self.bad_rows > self.max_bad_fraction * self.rows:
            raise BadCorpus(
                f"corpus {self.corpus!r} is mostly bad: {int(self.bad_rows)} of {int(self.rows)} rows read by step "
                f"{step} were quarantined (limit data.max_bad_fraction={self.max_bad_fraction}); reasons are in "
                f"{self.run_dir}/quarantine-rank*.jsonl"
            )

    def _append(self, record: dict) -> None:
        with open_nofollow(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def check_bad_shards(corpus: str, total_rows: int, good: list, bad: list[BadShard],
                     max_bad_fraction: float) -> None:
    """The driver's verdict on the shards whose footers could not be read (``check_shards``),
    before any worker starts: a few are left out (``write_shard_quarantine``), more than
    ``max_bad_fraction`` of the corpus's rows stop the run with their names (``BadCorpus``)."""
    if not bad:
        return
    lost = sum(b.rows or 0 for b in bad)
    if not good or (total_rows and lost > max_bad_fraction * total_rows):
        names = ", ".join(f"{b.shard} ({b.reason})" for b in bad)
        raise BadCorpus(
            f"corpus {corpus!r}: {len(bad)} unreadable shard(s) hold {lost} of {total_rows} rows, more than "
            f"data.max_bad_fraction={max_bad_fraction}: {names}"
        )


def write_shard_quarantine(run_dir: str, bad: list[BadShard]) -> None:
    """``quarantine-shards.jsonl``: the shards the driver left out (merged at the end)."""
    if not bad:
        return
    with open_nofollow(os.path.join(run_dir, SHARD_FILE), "w") as f:
        for b in bad:
            f.write(json.dumps(b.to_json()) + "\n")


def check_duplicates(corpus: str, dups: list[DuplicateId], policy: str) -> None:
    """Sample ids several corpus rows carry (``duplicate_ids``; the ledger counts samples by
    id): with ``data.duplicate_ids: error`` the run stops naming the shards and rows."""
    if dups and policy == "error":
        first = dups[0]
        raise BadCorpus(
            f"corpus {corpus!r}: sample_id {first.sample_id} is carried by {len(first.rows)} rows "
            f"({first.where()}){f' and {len(dups) - 1} more id(s) are duplicated' if len(dups) > 1 else ''}; "
            "sample ids must be unique (the ledger counts samples by id): fix the corpus, or set "
            "data.duplicate_ids=quarantine to leave every row of a duplicated id out")


def write_duplicate_quarantine(run_dir: str, dups: list[DuplicateId]) -> None:
    """``quarantine-duplicates.jsonl``: the ids every rank leaves out (``quarantined_duplicates``)."""
    path = os.path.join(run_dir, DUPLICATES_FILE)
    if not dups:
        if os.path.exists(path):
            os.remove(path)
        return
    with open_nofollow(path, "w") as f:
        for d in dups:
            f.write(json.dumps({"sample_id": d.sample_id, "reason": "duplicate_id",
                                "rows": [list(r) for r in d.rows]}) + "\n")


def quarantined_duplicates(run_dir: str) -> np.ndarray:
    """Sorted ids of ``quarantine-duplicates.jsonl``: what every rank leaves out of every epoch."""
    path = os.path.join(run_dir, DUPLICATES_FILE)
    if not os.path.exists(path):
        return np.zeros(0, np.int64)
    with open(path) as f:
        return np.unique(np.array([int(json.loads(line)["sample_id"]) for line in f if line.strip()], np.int64))
