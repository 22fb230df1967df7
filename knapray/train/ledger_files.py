"""PLACEHOLDER until the coordinator's ledger journal lands: the trainer-facing ledger API.

A JSON-lines journal in ``<run dir>/ledger/journal.jsonl``."""

from __future__ import annotations

import json
import os

import numpy as np


def _path(run_dir: str) -> str:
    return os.path.join(run_dir, "ledger", "journal.jsonl")


class LocalLedger:
    def __init__(self, run_dir: str, attempt: int) -> None:
        self.path = _path(run_dir)
        self.attempt = attempt
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    @classmethod
    def open(cls, run_dir: str, resume_step: int | None) -> "LocalLedger":
        rows = _read(run_dir)
        attempt = max((r.get("attempt", 0) for r in rows), default=-1) + 1 if resume_step is not None else 0
        led = cls(run_dir, attempt)
        if resume_step is None:
            open(led.path, "w").close()
        else:
            led._write({"truncate": resume_step, "attempt": attempt})
        return led

    def append(self, step: int, epoch: int, sample_ids, home_ranks) -> None:
        self._write({"step": step, "epoch": epoch, "attempt": self.attempt,
                     "sample_ids": list(map(int, sample_ids)), "home_ranks": list(map(int, home_ranks))})

    def position(self) -> dict:
        return {"attempt": self.attempt}

    def _write(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _read(run_dir: str) -> list[dict]:
    path = _path(run_dir)
    if not os.path.exists(path):
        return []
    out: list[dict] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if "truncate" in rec:
                out = [r for r in out if r["step"] <= rec["truncate"]]
            else:
                out.append(rec)
    return out


def committed_ids(run_dir: str, epoch: int, through_step: int | None) -> np.ndarray:
    ids = [i for r in _read(run_dir) if r["epoch"] == epoch and (through_step is None or r["step"] <= through_step)
           for i in r["sample_ids"]]
    return np.asarray(sorted(ids), dtype=np.int64)


def ledger_rows(run_dir: str) -> list[dict]:
    return [{"step": r["step"], "epoch": r["epoch"], "sample_id": i, "home_rank": h, "attempt": r["attempt"]}
            for r in _read(run_dir) for i, h in zip(r["sample_ids"], r["home_ranks"])]
