"""What the training loop needs from its launcher, so the loop never imports ray.train.

``RayTrainContext`` (Ray Train workers) lives in ``launch.py``; ``LocalContext`` runs the
loop in one process (tests, debugging) or under torchrun with an iterable of rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class TrainContext(Protocol):
    rank: int
    world_size: int
    local_rank: int

    def device(self, use_gpu: bool) -> torch.device: ...

    def rows(self, epoch: int) -> Iterable[Any]:
        """This rank's rows (row dicts or column batches) for one epoch."""

    def load_checkpoint(self, load: Callable[[str], Any]) -> Any:
        """``load(directory)`` of the checkpoint to resume from; None if there is none."""

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        """Report metrics (every rank calls it; a barrier under Ray Train); rank 0 may
        attach a checkpoint directory."""


@dataclass
class LocalContext:
    """A context over given rows; ``reports`` keeps what was reported."""

    shards: list[Iterable[Any]]
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    checkpoint: str | None = None
    reports: list[dict] = field(default_factory=list)

    def device(self, use_gpu: bool) -> torch.device:
        if use_gpu and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def rows(self, epoch: int) -> Iterable[Any]:
        return self.shards[self.rank]

    def load_checkpoint(self, load: Callable[[str], Any]) -> Any:
        return load(self.checkpoint) if self.checkpoint else None

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        self.reports.append(dict(metrics, checkpoint=checkpoint_dir))
        if checkpoint_dir:
            self.checkpoint = checkpoint_dir


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))
