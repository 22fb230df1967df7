"""A run directory's layout: the names of the files a run writes, the ``RunDir`` that spells
their paths, and ``RunError`` (a run that cannot start or continue as configured). The
driver (pre-flight, launch, report) and the worker (trainer, checkpoints, ledger, metrics)
both read and write these files; this module is below both, so that neither imports the
other for a file name."""

from __future__ import annotations

import os
from dataclasses import dataclass

CONFIG_FILE = "config.json"
LOCK_FILE = "RUNNING.lock"
LEDGER_DIR = "ledger"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
LEDGER_FILE = "ledger.jsonl"
QUARANTINE_FILE = "quarantine.jsonl"
STARTUP_FILE = "startup.jsonl"
RANK_WORK_PLOT = "rank_work.png"
PIDS_DIR = "pids"
CHECKPOINTS_DIR = "checkpoints"
PROFILE_DIR = "profile"
COMPARISON_FILE = "comparison.json"
COMPARISON_PLOT = "comparison.png"
STALE_FILES = (METRICS_FILE, SUMMARY_FILE, LEDGER_FILE, QUARANTINE_FILE, RANK_WORK_PLOT, STARTUP_FILE)
"""What a previous run left that a fresh run (``run.resume: never``) clears."""
STALE_DIRS = (LEDGER_DIR, PIDS_DIR)


class RunError(ValueError):
    """A run cannot start as configured; the message names the value and what is valid."""


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory's files (nothing is created or read here)."""

    root: str

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def config(self) -> str:
        return self.path(CONFIG_FILE)

    @property
    def lock(self) -> str:
        return self.path(LOCK_FILE)

    @property
    def ledger_dir(self) -> str:
        return self.path(LEDGER_DIR)

    @property
    def metrics(self) -> str:
        return self.path(METRICS_FILE)

    @property
    def summary(self) -> str:
        return self.path(SUMMARY_FILE)

    @property
    def ledger(self) -> str:
        return self.path(LEDGER_FILE)

    @property
    def quarantine(self) -> str:
        return self.path(QUARANTINE_FILE)

    @property
    def startup(self) -> str:
        return self.path(STARTUP_FILE)

    @property
    def rank_work_plot(self) -> str:
        return self.path(RANK_WORK_PLOT)

    @property
    def pids(self) -> str:
        return self.path(PIDS_DIR)

    def pid_file(self, rank: int) -> str:
        return self.path(PIDS_DIR, f"rank{rank}.pid")

    @property
    def checkpoints(self) -> str:
        return self.path(CHECKPOINTS_DIR)

    @property
    def profile(self) -> str:
        return self.path(PROFILE_DIR)

    @property
    def comparison(self) -> str:
        return self.path(COMPARISON_FILE)

    @property
    def comparison_plot(self) -> str:
        return self.path(COMPARISON_PLOT)
