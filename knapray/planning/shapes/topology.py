"""GPU bags: which ranks run sequences together.

A spec such as ``g8n4`` means 4 bags of 8 GPUs; ``g1n16+g4n2+g8n1`` mixes sizes. Bags take
contiguous rank ranges in spec order. The ranks a spec covers form one *balance group*;
a world that is a multiple of that size replicates the spec into independent balance
groups (KnapFormer does the same), each planned on its own.

Besides its bags every rank is a *solo bag* of its own, numbered after the bags
(``solo_bag(r) = num_bags + r``): a plan may run a sequence whole on a rank that also
serves a bag of several (the two overlap on that rank; ``knapray.planning.search.overlap``).
``all_bag_sizes`` and ``all_bag_starts`` index both kinds.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from knapray.limits import MAX_WORLD_SIZE

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
            if len(m.group(1)) > 12 or len(m.group(2)) > 12:  # before int(): thousands of digits are refused
                raise ValueError(f"topology {spec!r}: at most {MAX_WORLD_SIZE} ranks")
            g, n = int(m.group(1)), int(m.group(2))
            if g < 1 or n < 1:
                raise ValueError(f"bad topology term {term!r} in {spec!r}: G and N must be >= 1")
            if len(bags) + n > MAX_WORLD_SIZE or sum(bags) + g * n > MAX_WORLD_SIZE:  # before the list grows
                raise ValueError(f"topology {spec!r}: {sum(bags) + g * n} ranks in one balance group or more; at most "
                                 f"{MAX_WORLD_SIZE}")
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
        if world_size > MAX_WORLD_SIZE:
            raise ValueError(f"world size {world_size}: at most {MAX_WORLD_SIZE} ranks")
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
        if bag >= self.num_bags:  # a solo bag
            return range(bag - self.num_bags, bag - self.num_bags + 1)
        start = int(self.bag_starts[bag])
        return range(start, start + int(self.bag_sizes[bag]))

    def solo_bag(self, rank: int) -> int:
        """The bag index of ``rank`` alone (overlapping the rank's bag of the topology)."""
        return self.num_bags + int(rank)

    @cached_property
    def all_bag_sizes(self) -> np.ndarray:
        """Size of every bag, then of every solo bag (1): indexed by a plan's ``bag``."""
        return np.concatenate([self.bag_sizes, np.ones(self.world_size, np.int64)])

    @cached_property
    def all_bag_starts(self) -> np.ndarray:
        """First rank of every bag, then of every solo bag (its rank)."""
        return np.concatenate([self.bag_starts, np.arange(self.world_size, dtype=np.int64)])

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

    def check_nodes(self, node_sizes: Sequence[int]) -> None:
        """Raise if a bag crosses a boundary of the real node layout ``node_sizes`` (ranks
        per node, in rank order; ``node_sizes_of``): a bag lies in one node, or, larger
        than a node, covers whole nodes of one size (as ``check_node_placement``)."""
        sizes = _check_node_sizes(node_sizes, self.world_size)
        ends = np.cumsum(sizes)
        starts = ends - np.asarray(sizes)
        for b, (start, g) in enumerate(zip(self.bag_starts.tolist(), self.bags)):
            first = int(np.searchsorted(ends, start, side="right"))  # node holding the bag's first rank
            last = int(np.searchsorted(ends, start + g - 1, side="right"))
            if first == last:
                continue
            spanned = set(sizes[first : last + 1])
            whole = start == starts[first] and start + g == ends[last]
            if not whole or len(spanned) > 1 or g <= max(spanned):
                raise ValueError(
                    f"bag {b} (g{g}, ranks {start}..{start + g - 1}) of topology {self} crosses a node boundary: "
                    f"the ranks are on nodes of {list(sizes)} ranks (in rank order)"
                )

    def __str__(self) -> str:
        return self.spec if self.num_groups == 1 else f"{self.spec} x{self.num_groups}"


# ---- real node layouts -----------------------------------------------------------------


def node_sizes_of(node_ids: Sequence[Hashable]) -> tuple[int, ...]:
    """Ranks per node, in rank order, from every rank's node id (in rank order): the
    lengths of the runs of consecutive ranks on one node. Ray Train and torchrun number
    the ranks of a node consecutively; if a node's ranks were not consecutive, each run
    counts as a node of its own (a bag is a range of ranks, so it may not span the gap)."""
    if not len(node_ids):
        raise ValueError("node_sizes_of needs at least one rank's node id")
    sizes = [1]
    for prev, cur in zip(node_ids[:-1], node_ids[1:]):
        if cur == prev:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return tuple(sizes)


def split_nodes(node_sizes: Sequence[int], gpus_per_node: int | None) -> tuple[int, ...]:
    """Every node cut into blocks of ``gpus_per_node`` consecutive ranks (the last block of
    a node smaller if the node is not a multiple): the units no bag may cross when the
    config also names a node size (``balance.gpus_per_node``)."""
    sizes = tuple(int(n) for n in node_sizes)
    if not gpus_per_node:
        return sizes
    out: list[int] = []
    for n in sizes:
        out += [gpus_per_node] * (n // gpus_per_node) + ([n % gpus_per_node] if n % gpus_per_node else [])
    return tuple(out)


def place_on_nodes(topology: Topology, node_sizes: Sequence[int]) -> Topology:
    """``topology``'s bags laid out so that none crosses a node of ``node_sizes``.

    Kept as it is if it already fits; else its bags are reordered, as replicated balance
    groups when every group covers the same sequence of node sizes, else as one balance
    group over the world. Raises ValueError, naming the layout, when its bags cannot be
    packed into the nodes (a bag larger than a node, or sizes that fill no node exactly)."""
    sizes = _check_node_sizes(node_sizes, topology.world_size)
    try:
        topology.check_nodes(sizes)
        return topology
    except ValueError:
        pass
    per_group = _cut(sizes, topology.group_size)
    if per_group is not None and len(set(per_group)) == 1:
        order = _pack_exactly(list(topology.group_bags), per_group[0])
        if order is not None:
            return Topology(tuple(order), topology.num_groups)
    order = _pack_exactly(topology.bags, sizes)
    if order is not None:
        return Topology(tuple(order), 1)
    raise ValueError(
        f"the bags of topology {topology} ({sorted(topology.bags, reverse=True)}) cannot be laid out on nodes of "
        f"{list(sizes)} ranks (in rank order) without a bag crossing a node: use topology 'bags_of:N' or 'auto', "
        "which re-plan bags for the nodes the workers are on"
    )


def _check_node_sizes(node_sizes: Sequence[int], world_size: int) -> tuple[int, ...]:
    sizes = tuple(int(n) for n in node_sizes)
    if not sizes or min(sizes) < 1 or sum(sizes) != world_size:
        raise ValueError(f"node sizes {list(sizes)} must be integers >= 1 summing to the world size {world_size}")
    return sizes


def _cut(sizes: tuple[int, ...], group_size: int) -> list[tuple[int, ...]] | None:
    """The node sizes of each run of ``group_size`` ranks, if no node crosses a run's end."""
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    for n in sizes:
        current.append(n)
        if sum(current) == group_size:
            groups.append(tuple(current))
            current = []
        elif sum(current) > group_size:
            return None
    return groups if not current else None


def _pack_exactly(bags: list[int], nodes: tuple[int, ...], budget: int = 20000) -> list[int] | None:
    """``bags`` in rank order such that each node of ``nodes`` is filled exactly by whole
    bags (largest first within a node); None if there is no such order (or the search
    budget runs out)."""
    order = sorted(bags, reverse=True)
    if not order or order[0] > max(nodes) or sum(order) != sum(nodes):
        return None
    return _search(order, nodes, budget)


def _search(order: list[int], nodes: tuple[int, ...], budget: int) -> list[int] | None:
    free = list(nodes)
    placed: list[list[int]] = [[] for _ in nodes]
    steps = 0

    def place(i: int) -> bool:
        nonlocal steps
        if i == len(order):
            return True
        steps += 1
        if steps > budget:
            return False
        tried: set[int] = set()
        for k, room in enumerate(free):
            if room >= order[i] and room not in tried:
                tried.add(room)  # nodes with the same room left are interchangeable
                free[k] -= order[i]
                placed[k].append(order[i])
                if place(i + 1):
                    return True
                free[k] += order[i]
                placed[k].pop()
        return False

    return [g for node in placed for g in node] if place(0) else None


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
