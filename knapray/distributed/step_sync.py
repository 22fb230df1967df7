"""The training step's own small collectives: agreeing on counts, gathering per-rank
timings, exchanging Python metadata.

Two kinds of traffic, on two explicitly chosen groups:

- numbers (token counts, the loss, per-rank seconds) travel as ONE float64 tensor on the
  training device through ``group`` (the default group unless told otherwise), so a
  NCCL-only process group (what Ray Train gives GPU workers) works; numbers the host has
  (a step's token counts, whether its plan arrived) travel the same way on ``meta_group``
  (``host=True``), so agreeing on them never waits for the device;
- Python objects (lengths for a local plan, the topology rank 0 chose) travel through
  ``meta_group``, a gloo group created for it by ``StepSync.build``: object collectives
  pickle on the CPU, and a NCCL group would need a device round trip for each.

Values are passed by name, never by position in a tensor: ``sum_over_ranks(summed={...},
per_rank={...})`` packs them, reduces once and unpacks them under the same names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

Number = float | int | torch.Tensor


@dataclass(frozen=True, eq=False)
class StepSync:
    """This rank's handle for step-level collectives. Build with ``StepSync.build``."""

    device: torch.device
    """Where numeric collectives' tensors live (the training device)."""
    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    """Group of the numeric collectives (None: a world of one, no collective at all)."""
    meta_group: dist.ProcessGroup | None
    """A gloo group over the same ranks for Python objects (None: a world of one)."""

    @classmethod
    def build(cls, device: torch.device | str, *, gloo_socket_ifname: str = "") -> "StepSync":
        """Collective over the world when torch.distributed is initialized (every rank
        creates the gloo group); a single process without a process group gets a world of
        one in which every method is local.

        ``gloo_socket_ifname`` (``distributed.gloo_socket_ifname``): the network interface(s) gloo
        binds, set as GLOO_SOCKET_IFNAME for this and every later gloo group of the process
        (gloo reads it when a group is created); "" keeps the environment's."""
        device = torch.device(device)
        if gloo_socket_ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = gloo_socket_ifname
        if not dist.is_initialized():
            return cls(device=device, rank=0, world_size=1, group=None, meta_group=None)
        world = dist.get_world_size()
        # A new gloo group even when the default one is gloo: the object exchange is then
        # always on a group this class created, never on whatever the default happens to be.
        meta = dist.new_group(backend="gloo")
        return cls(device=device, rank=dist.get_rank(), world_size=world, group=dist.group.WORLD, meta_group=meta)

    # ---- numbers, on the device -------------------------------------------------------

    def sum_over_ranks(
        self,
        summed: Mapping[str, Number] | None = None,
        per_rank: Mapping[str, Number] | None = None,
        *,
        host: bool = False,
    ) -> tuple[dict[str, float], dict[str, list[float]]]:
        """One all-reduce: ``summed`` values added over ranks, ``per_rank`` values gathered
        (one entry per rank, in rank order). Scalars may be device tensors (no host sync
        before the collective); results come back as Python floats (one host sync).
        ``host``: every value is host data (Python numbers), reduced on the gloo
        ``meta_group`` with no device work at all.

        Every rank must pass the same names in the same order.
        """
        summed, per_rank = dict(summed or {}), dict(per_rank or {})
        n_sum, w = len(summed), self.world_size
        device, group = (torch.device("cpu"), self.meta_group) if host else (self.device, self.group)
        if host and any(isinstance(v, torch.Tensor) for v in (*summed.values(), *per_rank.values())):
            raise TypeError("sum_over_ranks(host=True) takes host numbers, not tensors")
        parts: list[torch.Tensor] = [self._scalar(v, device) for v in summed.values()]
        for value in per_rank.values():
            # (W,) zeros with this rank's value in its slot: the sum is the gather
            slot = torch.zeros(w, dtype=torch.float64, device=device)
            slot[self.rank] = self._scalar(value, device)
            parts.append(slot)
        if not parts:
            return {}, {}
        flat = torch.cat([p.reshape(-1) for p in parts])  # (n_sum + W * n_per_rank,)
        if group is not None:  # also a world of one: the path a GPU check exercises
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        values = flat.tolist() if host else flat.cpu().tolist()
        sums = dict(zip(summed, values[:n_sum]))
        gathered = {name: values[n_sum + i * w : n_sum + (i + 1) * w] for i, name in enumerate(per_rank)}
        return sums, gathered

    def sum_on_device(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a device tensor) summed over ranks in place, left on the device: no
        host sync (what gates the optimizer step reads it there)."""
        if self.group is not None:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group)
        return value

    def _scalar(self, value: Number, device: torch.device) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"sum_over_ranks takes scalars, got a tensor of shape {tuple(value.shape)}")
            return value.detach().reshape(1).to(device=device, dtype=torch.float64)
        return torch.tensor([float(value)], dtype=torch.float64, device=device)

    # ---- Python objects, on the gloo group ------------------------------------------

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (picklable values)."""
        if self.meta_group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.meta_group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.meta_group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.meta_group)
        return box[0]

    def barrier(self) -> None:
        if self.meta_group is not None:
            dist.barrier(group=self.meta_group)

