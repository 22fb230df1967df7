"""The models a run trains: one, or two experts split at a timestep boundary (Wan 2.2
A14B's high- and low-noise transformers, ``flow.expert_boundary``).

Each expert is a whole model with its own parallelized wrapper, optimizer, EMA, LR schedule
and timestep distribution (its side of the boundary); the trainer points its step at one of
them per optimizer step (``Trainer._use``). Both stay resident, sharded as the run shards
(FSDP keeps an idle expert's parameters, gradients' absence and optimizer state as shards).
In a checkpoint the first expert's parts keep their names (``model``, ``optimizer``,
``ema``: a one-model run's checkpoint is unchanged) and the second's carry diffusers'
suffix (``model_2``, ``optimizer_2``, ``ema_2``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from knapray.models.timesteps import TimestepDistribution
from knapray.worker.checkpoint import training_parts


def part_suffix(index: int) -> str:
    """Expert ``index``'s checkpoint part suffix: '' for the first, '_2' for the second."""
    return "" if index == 0 else f"_{index + 1}"


@dataclass(eq=False)
class Expert:
    """One model the run trains and what trains it."""

    name: str
    """``transformer`` or ``transformer_2`` (a Wan 2.2 pipeline's folder for it)."""
    model: torch.nn.Module
    parallel: Any
    """Its ``knapray.worker.parallelize.ParallelModel``."""
    optimizer: torch.optim.Optimizer
    ema: Any
    """Its ``knapray.worker.ema.EMA``, or None."""
    timesteps: TimestepDistribution
    """What its steps draw timesteps from (its side of the boundary)."""
    lora_base: dict | None = None
    """A LoRA run's base for it: {path, fingerprint} (``weights.checks.base_record``)."""
    schedule: Any = None
    """Its ``knapray.worker.optim.LRSchedule`` (set once the step to resume at is known)."""


def expert_parts(experts: list[Expert]) -> dict[str, Stateful]:
    """The checkpoint parts of every expert: the first's as a one-model run names them, the
    second's with ``part_suffix``."""
    parts: dict[str, Stateful] = {}
    for i, e in enumerate(experts):
        sfx = part_suffix(i)
        parts.update({name + sfx: part for name, part in training_parts(e.model, e.optimizer, ema=e.ema).items()})
    return parts
