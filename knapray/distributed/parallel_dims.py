"""The run's device layout and its process groups, created in one fixed order.

``dist.new_group`` (and ``init_device_mesh``, which calls it) is collective: every rank
must create the same groups in the same order, or the run hangs at the first group a rank
created out of turn. A knapray run creates four kinds, always in this order:

1. ``step_sync``: the gloo group that carries the step's small host messages (node ids,
   plans, checkpoint coordination) beside the device collectives (``StepSync``);
2. ``fsdp_mesh``: FSDP2's device mesh (``full``: one axis over the world; ``hybrid``:
   replicate over nodes x shard within a node), when the model is sharded;
3. ``step_groups``: the bags of the run's topology and, for a per-step topology, a group
   for every aligned block of each node (``BagGroups``, ``BlockGroups``).

``ParallelDims`` is checked when it is made, without a process group (sizes, the node
layout a hybrid mesh needs), and then hands out the groups; asking for one out of this
order (a mesh after the bags) is a RuntimeError on every rank instead of a hang. A
stage may be skipped (a run without FSDP has no mesh; the parity tools make no step-sync
group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

STAGES = ("step_sync", "fsdp_mesh", "step_groups")


@dataclass(kw_only=True)
class ParallelDims:
    world_size: int = 1
    device_type: str = "cpu"
    """``cuda`` or ``cpu`` (the FSDP mesh's device type)."""
    gpus_per_node: int | None = None
    """Ranks per node (``balance.gpus_per_node``); a hybrid mesh shards over this many."""
    _stage: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if self.device_type not in ("cuda", "cpu", "meta"):
            raise ValueError(f"device_type must be cuda or cpu, got {self.device_type!r}")
        gpn = self.gpus_per_node
        if gpn is not None and (not isinstance(gpn, int) or isinstance(gpn, bool) or gpn < 1):
            raise ValueError(f"gpus_per_node must be an int >= 1, got {gpn!r}")

    @classmethod
    def local(cls, device_type: str = "cpu") -> "ParallelDims":
        """One process, no process group (calibration, memory measurement, the sampler)."""
        return cls(world_size=1, device_type=device_type)

    # ---- the FSDP mesh's shape (pure) ---------------------------------------------------

    def mesh_shape(self, fsdp: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(shape, axis names) of the FSDP mesh for ``fsdp`` (``full`` or ``hybrid``):
        ``full``: (world,) ("shard",); ``hybrid``: (nodes, gpus_per_node) ("replicate",
        "shard"): ranks n*g .. n*g+g-1 form node n's shard group."""
        if fsdp == "full":
            return (self.world_size,), ("shard",)
        if fsdp != "hybrid":
            raise ValueError(f"fsdp {fsdp!r} has no device mesh (full or hybrid have one)")
        gpn = self.gpus_per_node
        if gpn is None:
            raise ValueError("fsdp hybrid shards within a node: it needs gpus_per_node (--gpus-per-node; in a run "
                             "config balance.gpus_per_node)")
        if self.world_size % gpn:
            raise ValueError(f"fsdp hybrid: world size {self.world_size} is not a multiple of gpus_per_node={gpn}")
        return (self.world_size // gpn, gpn), ("replicate", "shard")

    # ---- the groups, in order (collective) ----------------------------------------------

    def _enter(self, stage: str) -> None:
        i = STAGES.index(stage)
        if i <= self._stage:
            raise RuntimeError(f"process groups out of order: {stage} after {STAGES[self._stage]} (every rank must "
                               f"create them in the order {' -> '.join(STAGES)}; knapray.distributed.parallel_dims)")
        self._stage = i

    def step_sync(self, device, *, gloo_socket_ifname: str = ""):
        """1. The step's host-message group (``StepSync.build``)."""
        from .step_sync import StepSync

        self._enter("step_sync")
        return StepSync.build(device, gloo_socket_ifname=gloo_socket_ifname)

    def fsdp_mesh(self, fsdp: str):
        """2. FSDP2's DeviceMesh over the default process group for ``fsdp`` (full/hybrid)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_shape(fsdp)
        self._enter("fsdp_mesh")
        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            actual = dist.get_world_size() if dist.is_initialized() else "no process group"
            raise ValueError(f"FSDP mesh for world_size={self.world_size}, but the default process group has {actual}")
        return init_device_mesh(self.device_type, shape, mesh_dim_names=names)

    def step_groups(self, topology, num_heads: int, per_step_node: int | None = None, divisors: bool = False):
        """3. The topology's bag groups and, for a per-step topology on nodes of
        ``per_step_node`` ranks, every aligned block's group (``StepGroups``; ``divisors``:
        blocks of every size dividing the heads, for overlapping plans)."""
        from . import BagGroups
        from .block_groups import BlockGroups, StepGroups

        self._enter("step_groups")
        base = BagGroups.build(topology, num_heads)
        blocks = BlockGroups.build(per_step_node, num_heads, divisors) if per_step_node is not None else None
        return StepGroups(base, blocks)
