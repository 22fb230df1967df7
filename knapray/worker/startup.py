"""When each attempt of a run got where: rank 0 appends one line per attempt (a start or a
restart of the worker group) to ``<run dir>/startup.jsonl`` once its first step is done.

Wall-clock seconds (``time.time()``, comparable across the machine's processes):

- ``process_started``: the worker process's start (``/proc``; None elsewhere);
- ``trainer_started``: the trainer's construction began (imports, Ray Train's setup and
  the process group are before it);
- ``model_ready``: the model built, parallelized and given its weights;
- ``restored``: the checkpoint loaded (= ``model_ready`` for a fresh run);
- ``first_step``: the attempt's first step done (the data iterator's first batch, compile).

``knapray.testing.elastic_check`` reads them to split a node loss's recovery into Ray's
part and the trainer's parts.
"""

from __future__ import annotations

import json
import os
import time

from knapray.nofollow import open_nofollow
from knapray.run_files import RunDir

MARKS = ("process_started", "trainer_started", "model_ready", "restored", "first_step")


def process_started_at(pid: int | None = None) -> float | None:
    """When process ``pid`` (default: this one) started, in wall-clock seconds; None where
    ``/proc`` does not say (not Linux)."""
    try:
        stat = open(f"/proc/{pid or os.getpid()}/stat").read()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class StartupClock:
    """The marks of one attempt (``mark`` keeps each name's first time)."""

    def __init__(self) -> None:
        self.marks: dict[str, float | None] = {"process_started": process_started_at(), "trainer_started": time.time()}
        self.written = False

    def mark(self, name: str) -> None:
        if name not in MARKS:
            raise ValueError(f"unknown startup mark {name!r}; valid: {list(MARKS)}")
        self.marks.setdefault(name, time.time())

    def write(self, run_dir: str, **attempt) -> None:
        """Rank 0, once per attempt: the marks and what the attempt is (step, world, nodes)."""
        if self.written:
            return
        self.written = True
        with open_nofollow(RunDir(run_dir).startup, "a") as f:
            f.write(json.dumps({**attempt, **self.marks}) + "\n")


def read_startups(run_dir: str) -> list[dict]:
    """Every attempt's line, oldest first (a torn last line left out)."""
    path = RunDir(run_dir).startup
    if not os.path.exists(path):
        return []
    out = []
    with open_nofollow(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
