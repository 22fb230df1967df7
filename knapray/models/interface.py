"""What every family's model offers, whoever runs it: the four stages the balanced executor
calls, and the modules ``knapray.worker.parallelize`` wraps (``fsdp_units``).

The model says which of its modules are the units; nothing outside it looks for attribute
names (a family without double-stream blocks or a pooled-vector MLP has none to declare).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class FsdpUnits:
    """A model's modules as ``parallelize`` wraps them: one FSDP unit each, and the root
    (the model) owning no parameter. Every parameter of the model is in exactly one."""

    embedders: tuple[nn.Module, ...]
    """The per-sequence conditioning MLPs, then the token embedders: their inputs need no
    grad, so FSDP reduces them in its end-of-backward callback."""
    blocks: tuple[nn.Module, ...]
    """The transformer blocks in execution order: also what compile and activation
    checkpointing wrap, and what ``ac: every_k`` counts."""
    final: nn.Module
    """The head: the last unit of forward, kept gathered into backward."""

    def __iter__(self):
        """Every unit: embedders, blocks, final."""
        return iter((*self.embedders, *self.blocks, self.final))


@runtime_checkable
class StageModel(Protocol):
    """A family's model (``knapray.models.families.Family.model_cls``)."""

    cfg: Any

    def fsdp_units(self) -> FsdpUnits: ...

    def condition(self, *args: torch.Tensor) -> torch.Tensor: ...

    def embed(self, x_txt: torch.Tensor, x_img: torch.Tensor, is_text: torch.Tensor, **kw: Any) -> torch.Tensor: ...

    def positions(self, pos: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor) -> torch.Tensor: ...

    def blocks(self, h: torch.Tensor, vec_seq: torch.Tensor, seq_index: torch.Tensor, pos: torch.Tensor,
               is_text: torch.Tensor, attn: Any, **kw: Any) -> torch.Tensor: ...

    def head(self, h: torch.Tensor, vec_seq: torch.Tensor, seq_index: torch.Tensor, is_text: torch.Tensor,
             **kw: Any) -> torch.Tensor: ...

    def initial_values(self, write: Any) -> None: ...

    def conditioning_mlps(self) -> list[nn.Module]: ...
