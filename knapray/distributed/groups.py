"""Process groups for a Topology: one per multi-rank bag, one per balance group.

``TopologyDims`` holds every check that needs no process group (world size against the
topology, head count against the bag sizes) and the pure per-rank layout, so it is tested
without torch.distributed. ``BagGroups.build`` then creates the groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from knapray.planning import Topology


def valid_bag_sizes(num_heads: int) -> list[int]:
    """Bag sizes that split ``num_heads`` evenly (the divisors of the head count)."""
    return [g for g in range(1, num_heads + 1) if num_heads % g == 0]


def check_heads(num_heads: int, topology: Topology) -> None:
    """Raise ValueError unless every bag size divides ``num_heads``.

    Ulysses gives each rank of a bag of ``g`` ranks ``num_heads / g`` whole heads."""
    if int(num_heads) != num_heads or num_heads < 1:
        raise ValueError(f"num_heads must be an integer >= 1, got {num_heads!r}")
    bad = sorted({g for g in topology.group_bags if num_heads % g})
    if bad:
        raise ValueError(
            f"{num_heads} attention heads cannot be split over a bag of {max(bad)} ranks "
            f"(topology {topology.spec!r}): Ulysses gives each rank of a bag of g ranks "
            f"num_heads/g heads, so every bag size must divide {num_heads}; "
            f"valid bag sizes for {num_heads} heads: {valid_bag_sizes(num_heads)}"
        )


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits in a topology (pure; no process group)."""

    rank: int
    bag: int
    """Index of the rank's bag."""
    bag_ranks: tuple[int, ...]
    """Global ranks of the bag, in bag order."""
    rank_in_bag: int
    balance_group: int
    """Index of the rank's balance group."""
    balance_ranks: tuple[int, ...]
    """Global ranks of the balance group (its plan routes tokens only among them)."""

    @property
    def bag_size(self) -> int:
        return len(self.bag_ranks)


@dataclass(frozen=True)
class TopologyDims:
    """Validated topology for a world: checks in ``__post_init__``, no process group."""

    topology: Topology
    world_size: int
    num_heads: int | None = None
    """If given, every bag size must divide it (see ``check_heads``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.topology, Topology):
            raise TypeError(
                f"topology must be a knapray.planning.Topology (e.g. Topology.parse('g2n2')), "
                f"got {type(self.topology).__name__}"
            )
        if int(self.world_size) != self.world_size or self.world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        self.topology.check_world_size(self.world_size)
        if self.num_heads is not None:
            check_heads(self.num_heads, self.topology)

    def layout(self, rank: int) -> RankLayout:
        if int(rank) != rank or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        topo = self.topology
        bag = int(topo.bag_of_rank[rank])
        bag_ranks = tuple(topo.bag_ranks(bag))
        grp = int(topo.group_of_bag[bag])
        return RankLayout(
            rank=int(rank),
            bag=bag,
            bag_ranks=bag_ranks,
            rank_in_bag=int(rank) - bag_ranks[0],
            balance_group=grp,
            balance_ranks=tuple(topo.group_ranks(grp)),
        )


@dataclass(frozen=True, eq=False)
class BagGroups:
    """This rank's process groups for a topology. Build with ``BagGroups.build``."""

    dims: TopologyDims
    layout: RankLayout
    bag_group: dist.ProcessGroup | None
    """Group of the rank's bag (for Ulysses); None for a bag of one rank."""
    balance_group: dist.ProcessGroup | None
    """Group of the rank's balance group (for routing); the world group if there is one;
    None in a single process without a process group."""

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def bag_size(self) -> int:
        return self.layout.bag_size

    @property
    def rank_in_bag(self) -> int:
        return self.layout.rank_in_bag

    @classmethod
    def build(cls, topology: Topology, num_heads: int | None = None) -> "BagGroups":
        """Create the groups. Collective: every rank of the world must call it, with the
        same topology, because every rank creates every group in the same order (also
        those it is not in), as ``dist.new_group`` requires. Without a process group the
        topology must be a world of one."""
        if not dist.is_initialized():
            # A single process: a world of one needs no group (every exchange is local).
            dims = TopologyDims(topology, 1, num_heads)
            return cls(dims=dims, layout=dims.layout(0), bag_group=None, balance_group=None)
        dims = TopologyDims(topology, dist.get_world_size(), num_heads)
        layout = dims.layout(dist.get_rank())
        bag_group = None
        for bag in range(topology.num_bags):
            ranks = list(topology.bag_ranks(bag))
            if len(ranks) > 1:
                group = dist.new_group(ranks)
                if bag == layout.bag:
                    bag_group = group
        balance_group = dist.group.WORLD
        if topology.num_groups > 1:
            for grp in range(topology.num_groups):
                group = dist.new_group(list(topology.group_ranks(grp)))
                if grp == layout.balance_group:
                    balance_group = group
        return cls(dims=dims, layout=layout, bag_group=bag_group, balance_group=balance_group)
