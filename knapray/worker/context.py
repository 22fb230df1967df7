"""What the trainer needs from its launcher, so it never imports ray.train.

``RayTrainContext`` (Ray Train workers) lives in ``launch.py``; ``TorchrunContext`` serves a
torchrun world (``knapray/commands/torchrun.py``); ``LocalContext`` runs the trainer over
given rows (tests, debugging).
Checkpoints are not the launcher's business: the trainer keeps them in the run
directory, the same way under every launcher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
import socket
from typing import TYPE_CHECKING, Any, Protocol

import torch

from knapray.data import BadShard, local_rows

if TYPE_CHECKING:
    from knapray.config.run import TrainConfig


class TrainContext(Protocol):
    rank: int
    world_size: int
    local_rank: int

    def device(self, use_gpu: bool) -> torch.device: ...

    def node_id(self) -> str:
        """Where this rank really runs (Ray: the worker's node id; torchrun: the host):
        the trainer gathers every rank's and keeps bags within nodes."""

    def rows(self, epoch: int, on_bad_shard: Callable[[BadShard], None]) -> Iterable[Any]:
        """This rank's rows (row dicts, column batches or pyarrow batches) for one epoch,
        in an order that depends on the epoch. A shard that fails to read part-way goes
        to ``on_bad_shard`` (launchers whose driver checked the shards may never call it)."""

    def report(self, metrics: dict) -> None:
        """Report a step's metrics (every rank calls it; a barrier under Ray Train)."""


@dataclass
class LocalContext:
    """A context over given rows; ``reports`` keeps what was reported."""

    shards: list[Iterable[Any]]
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    reports: list[dict] = field(default_factory=list)

    def device(self, use_gpu: bool) -> torch.device:
        if use_gpu and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def node_id(self) -> str:
        return "local"  # every rank of a LocalContext runs on this machine

    def rows(self, epoch: int, on_bad_shard: Callable[[BadShard], None]) -> Iterable[Any]:
        return self.shards[self.rank]

    def report(self, metrics: dict) -> None:
        self.reports.append(dict(metrics))


class TorchrunContext:
    """``TrainContext`` for a torchrun world (the process group is already initialized)."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, local_rank: int) -> None:
        self.cfg = cfg
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank

    def device(self, use_gpu: bool) -> torch.device:
        return torch.device("cuda", self.local_rank) if use_gpu else torch.device("cpu")

    def node_id(self) -> str:
        """The host: torchrun numbers the ranks of one host consecutively."""
        return socket.gethostname()

    def rows(self, epoch: int, on_bad_shard):
        """Every world_size-th row of the readable shards, shards in an order drawn
        from (seed, epoch); a shard that fails part-way goes to ``on_bad_shard``."""
        return local_rows(self.cfg.data.corpus, self.rank, self.world_size,
                          shuffle_seed=self.cfg.data.seed, epoch=epoch, on_bad_shard=on_bad_shard)

    def report(self, metrics: dict) -> None:
        pass  # rank 0 writes metrics.jsonl and logs every log_every steps
