"""GPU bags: which ranks run sequences together.

A spec such as ``g8n4`` means 4 bags of 8 GPUs; ``g1n16+g4n2+g8n1`` mixes sizes. Bags take
contiguous rank ranges in spec order. The ranks a spec covers form one *balance group*;
a world that is a multiple of that size replicates the spec into independent balance
groups (KnapFormer does the same), each planned on its own.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import numpy as np

_TERM = re.compile(r"^g(\d+)n(\d+)$")


@dataclass(frozen=True)
class Topology:
    """Bags of one balance group, replicated ``num_groups`` times over the world."""

    group_bags: tuple[int, ...]
    """Bag sizes of one balance group, in rank order."""
    num_groups: int = 1
    """Independent balance groups (replicas of ``group_bags``)."""

    def __post_init__(self) -> None:
        if not self.group_bags:
            raise ValueError("a topology needs at least one bag")
        bad = [g for g in self.group_bags if int(g) != g or g < 1]
        if bad:
            raise ValueError(f"bag sizes must be integers >= 1, got {bad}")
        if self.num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {self.num_groups}")

    # ---- construction -------------------------------------------------------------

    @classmethod
    def parse(
        cls, spec: str, world_size: int | None = None, gpus_per_node: int | None = None
    ) -> "Topology":
        """Parse ``"g8n4"`` or ``"g1n16+g4n2+g8n1"``.

        ``world_size``: if given it must be a multiple of the spec's size; the spec is
        then replicated into ``world_size / size`` balance groups.
        ``gpus_per_node``: if given, bags are laid out largest first so that no bag that
        fits in a node crosses a node boundary (and larger bags span whole nodes).
        """
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"empty topology spec {spec!r}: expected e.g. 'g8n4' or 'g1n16+g4n2+g8n1'")
        bags: list[int] = []
        for term in spec.replace(" ", "").split("+"):
            m = _TERM.match(term)
            if not m:
                raise ValueError(
                    f"bad topology term {term!r} in {spec!r}: expected gGnN "
                    "(N bags of G GPUs), terms joined by '+', e.g. 'g1n16+g4n2+g8n1'"
                )
            g, n = int(m.group(1)), int(m.group(2))
            if g < 1 or n < 1:
                raise ValueError(f"bad topology term {term!r} in {spec!r}: G and N must be >= 1")
            bags.extend([g] * n)
        if gpus_per_node is not None:
            bags = _node_aware_order(bags, gpus_per_node, spec)
        topo = cls(tuple(bags))
        if world_size is not None:
            topo = topo.replicate_to(world_size)
        if gpus_per_node is not None:
            topo.check_node_placement(gpus_per_node)
        return topo

    def replicate_to(self, world_size: int) -> "Topology":
        """This group's bags replicated into independent balance groups covering ``world_size``."""
        size = self.group_size
        if world_size < 1 or world_size % size:
            raise ValueError(
                f"topology {self.spec!r} covers {size} ranks per balance group; world size "
                f"{world_size} is not a positive multiple of {size}"
            )
        return Topology(self.group_bags, world_size // size)

    # ---- shape ----------------------------------------------------------------------

    @property
    def spec(self) -> str:
        """Canonical spec of one balance group (runs of equal sizes collapsed)."""
        terms: list[str] = []
        prev, count = None, 0
        for g in self.group_bags + (None,):
            if g == prev:
                count += 1
                continue
            if prev is not None:
                terms.append(f"g{prev}n{count}")
            prev, count = g, 1
        return "+".join(terms)

    @property
    def group_size(self) -> int:
        return int(sum(self.group_bags))

    @property
    def world_size(self) -> int:
        return self.group_size * self.num_groups

    @property
    def bags(self) -> list[int]:
        """Size of every bag in the world, in rank order."""
        return list(self.group_bags) * self.num_groups

    @property
    def num_bags(self) -> int:
        return len(self.group_bags) * self.num_groups

    @cached_property
    def bag_sizes(self) -> np.ndarray:
        return np.asarray(self.bags, dtype=np.int64)

    @cached_property
    def bag_starts(self) -> np.ndarray:
        """First rank of every bag."""
        return np.concatenate([[0], np.cumsum(self.bag_sizes)[:-1]]).astype(np.int64)

    @cached_property
    def bag_of_rank(self) -> np.ndarray:
        """Bag index of every rank."""
        return np.repeat(np.arange(self.num_bags, dtype=np.int64), self.bag_sizes)

    @cached_property
    def group_of_bag(self) -> np.ndarray:
        return np.repeat(np.arange(self.num_groups, dtype=np.int64), len(self.group_bags))

    def bag_ranks(self, bag: int) -> range:
        start = int(self.bag_starts[bag])
        return range(start, start + int(self.bag_sizes[bag]))

    def group_ranks(self, group: int) -> range:
        return range(group * self.group_size, (group + 1) * self.group_size)

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"topology {self.spec!r} x{self.num_groups} covers {self.world_size} ranks, "
                f"but the world has {world_size}; use Topology.parse(spec, world_size={world_size}) "
                f"if {world_size} is a multiple of {self.group_size}"
            )

    def check_node_placement(self, gpus_per_node: int) -> None:
        """Raise if a bag that fits in a node crosses a node boundary, or a larger bag does
        not span whole nodes."""
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        for b, (start, g) in enumerate(zip(self.bag_starts.tolist(), self.bags)):
            if g <= gpus_per_node:
                if start // gpus_per_node != (start + g - 1) // gpus_per_node:
                    raise ValueError(
                        f"bag {b} (g{g}, ranks {start}..{start + g - 1}) crosses a node boundary "
                        f"with {gpus_per_node} GPUs per node"
                    )
            elif start % gpus_per_node or g % gpus_per_node:
                raise ValueError(
                    f"bag {b} (g{g}) is larger than a node of {gpus_per_node} GPUs and must "
                    "span whole nodes (size a multiple of the node, starting on a node boundary)"
                )

    def __str__(self) -> str:
        return self.spec if self.num_groups == 1 else f"{self.spec} x{self.num_groups}"


def _node_aware_order(bags: list[int], gpus_per_node: int, spec: str) -> list[int]:
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    big = sorted((g for g in bags if g > gpus_per_node), reverse=True)
    nodes = pack_nodes([g for g in bags if g <= gpus_per_node], gpus_per_node)
    if nodes is None:
        raise ValueError(
            f"the bags of {spec!r} that fit in a node cannot be laid out in nodes of "
            f"{gpus_per_node} GPUs without one crossing a node boundary (every node but the "
            "last must be filled exactly)"
        )
    return big + [g for node in nodes for g in node]


def pack_nodes(bags: list[int], gpus_per_node: int) -> list[list[int]] | None:
    """Bags (each <= ``gpus_per_node``) grouped into nodes, every node filled exactly but
    the last; largest bags first. None if no such packing exists.

    First fit decreasing finds it for power-of-two sizes (there it is the same as sorting
    largest first) and most others; a depth-first search over node fillings covers the rest."""
    sizes = sorted(bags, reverse=True)
    nodes: list[list[int]] = []
    free: list[int] = []
    open_nodes: list[int] = []  # nodes with room left, in opening order
    for g in sizes:
        for k, i in enumerate(open_nodes):
            if free[i] >= g:
                nodes[i].append(g)
                free[i] -= g
                if not free[i]:
                    del open_nodes[k]
                break
        else:
            nodes.append([g])
            free.append(gpus_per_node - g)
            if free[-1]:
                open_nodes.append(len(nodes) - 1)
    if len(open_nodes) <= 1:
        return sorted(nodes, key=lambda node: sum(node) < gpus_per_node)  # the partial node last
    return _pack_exact(sizes, gpus_per_node)


def _pack_exact(sizes: list[int], gpus_per_node: int, budget: int = 20000) -> list[list[int]] | None:
    counts = Counter(sizes)
    kinds = sorted(counts, reverse=True)
    failed: set[tuple[int, ...]] = set()
    steps = 0

    def fillings(remaining: dict[int, int], room: int, start: int, used: tuple[int, ...] = ()):
        """Lists of remaining sizes (indices >= start, non-increasing) summing to ``room``."""
        if room == 0:
            yield list(used)
            return
        for i in range(start, len(kinds)):
            g = kinds[i]
            if g <= room and remaining[g] > used.count(g):
                yield from fillings(remaining, room - g, i, used + (g,))

    def solve(remaining: dict[int, int]) -> list[list[int]] | None:
        nonlocal steps
        total = sum(g * n for g, n in remaining.items())
        if total <= gpus_per_node:
            return [[g for g in kinds for _ in range(remaining[g])]] if total else []
        key = tuple(remaining[g] for g in kinds)
        if key in failed or steps > budget:
            return None
        steps += 1
        for node in fillings(remaining, gpus_per_node, 0):
            for g in node:
                remaining[g] -= 1
            rest = solve(remaining)
            for g in node:
                remaining[g] += 1
            if rest is not None:
                return [node] + rest
        failed.add(key)
        return None

    return solve(dict(counts))
