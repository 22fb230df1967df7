"""Process groups for every aligned power-of-two block of every node, created once.

A topology chosen every step (``knapray.planning.search.pertopo``) partitions each node into
aligned blocks (``knapray.planning.shapes.blocks``). Creating groups per step would be a
collective on every rank every step; instead ``BlockGroups.build`` creates one group per
block of more than one rank at start-up (with 8 GPUs per node: 7 per node), and each step
looks its bag's group up. Bags of one step never overlap, so the step's Ulysses
collectives run on disjoint groups. ``StepGroups`` picks a step's groups: the run's static
topology's (``BagGroups``) when the step runs on it, the blocks' otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from knapray.planning import Topology
from knapray.planning.shapes.blocks import aligned_blocks, check_aligned

from .groups import BagGroups


@dataclass(frozen=True, eq=False)
class BlockGroups:
    """This rank's groups of every aligned block it belongs to. Build with ``build``."""

    rank: int
    world_size: int
    gpus_per_node: int
    groups: dict[tuple[int, int], dist.ProcessGroup]
    """``(first rank, size)`` of every block of more than one rank holding this rank -> its group."""
    divisors: bool = False
    """Blocks of every size dividing the heads (overlapping groups), not only powers of two."""

    @classmethod
    def build(cls, gpus_per_node: int, num_heads: int | None = None, divisors: bool = False) -> "BlockGroups":
        """Create a group for every aligned block of more than one rank (sizes dividing
        ``num_heads``, if given; ``divisors``: every such size, not only powers of two).
        Collective: every rank calls it, and every rank creates every group in the order of
        ``aligned_blocks``, as ``dist.new_group`` requires."""
        if not dist.is_initialized():
            raise RuntimeError("BlockGroups.build needs an initialized process group")
        world, rank = dist.get_world_size(), dist.get_rank()
        groups = {}
        for start, size in aligned_blocks(world, gpus_per_node, num_heads, divisors):
            if size == 1:
                continue
            group = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                groups[(start, size)] = group
        return cls(rank, world, gpus_per_node, groups, divisors)

    def bag_group(self, topology: Topology) -> dist.ProcessGroup | None:
        """The group of this rank's bag in a step's topology (None for a bag of one).
        Raises ValueError if the topology's bags are not aligned blocks of this world."""
        topology.check_world_size(self.world_size)
        check_aligned(topology, self.gpus_per_node, any_size=self.divisors)
        bag = int(topology.bag_of_rank[self.rank])
        start, size = int(topology.bag_starts[bag]), int(topology.bag_sizes[bag])
        if size == 1:
            return None
        if (start, size) not in self.groups:
            raise ValueError(
                f"no group for block (ranks {start}..{start + size - 1}): it was not created by "
                "BlockGroups.build (its size does not divide the heads given there)"
            )
        return self.groups[(start, size)]


@dataclass(frozen=True, eq=False)
class StepGroups:
    """The groups a step's plan runs on, looked up from the plan's topology.

    ``base``: the groups of the run's static topology (a per-step run may plan a step on
    it: it need not be made of aligned blocks, and its balance groups route apart);
    ``blocks``: the aligned blocks' groups of a run whose steps choose their own bags
    (None for a static run). Every topology ``plan_step`` chooses is one balance group
    over the world, so its tokens route over the world."""

    base: BagGroups
    blocks: BlockGroups | None = None

    def for_topology(self, topology: Topology) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
        """``(bag_group, route_group)`` of this rank for a step planned on ``topology``
        (``balanced_forward``'s arguments; None: a bag of one / the world)."""
        base = self.base.dims.topology
        if topology.bags == base.bags and topology.group_size == base.group_size:
            return self.base.bag_group, self.base.balance_group
        if self.blocks is None:
            raise ValueError(f"the step is planned on {topology}, not on the run's topology {base}, and no "
                             "block groups were built (balance.topology 'per-step' builds them)")
        if topology.num_groups != 1:
            raise ValueError(f"a topology chosen for a step is one balance group over the world, got {topology} "
                             f"({topology.num_groups} groups)")
        return self.blocks.bag_group(topology), None
