"""Aligned power-of-two blocks of a node: the bags a topology chosen every step may use.

A block of ``g`` GPUs (``g`` a power of two) is *aligned* if it starts at a multiple of
``g`` within its node. With 8 GPUs per node the blocks are the node itself, its two
halves, four quarters and eight single GPUs: 15 blocks per node, at most one process
group each, created once for the whole run (``aligned_blocks`` lists them in one order on
every rank). Any partition of every node into such blocks is a valid set of bags for a
step: bags of one step never overlap, so no two collectives of a step share a rank out of
order, and the groups exist before the first step.

``knapray serve``'s gang forms its blocks the same way (``blocks_of``), and may also form
blocks of whole nodes (2, 4, ... nodes, aligned at their size): a sampling request's bag
holds for its whole loop, so a lone clip may take the gang while nothing else waits.

A run with overlapping groups (``balance.overlap``) also has blocks of every other size
that divides the head count, up to a node (``divisors=True``; 24 heads on nodes of 8: 3 and
6 besides 1, 2, 4, 8), each aligned the same way (a block of ``g`` starts at a multiple of
``g`` in its node: blocks of 3 at 0 and 3), so a step's demand may ask for groups of 3.
"""

from __future__ import annotations

from functools import lru_cache

from .topology import Topology


def block_sizes(gpus_per_node: int, num_heads: int | None = None, divisors: bool = False) -> list[int]:
    """Powers of two up to the node size (that divide ``num_heads``, if given: Ulysses
    gives each rank of a bag of ``g`` ranks ``num_heads / g`` heads); ``divisors``: every
    size up to the node that divides ``num_heads``."""
    _check_positive("gpus_per_node", gpus_per_node)
    if num_heads is not None:
        _check_positive("num_heads", num_heads)
    if divisors:
        if num_heads is None:
            raise ValueError("block sizes of every divisor need the head count")
        return [g for g in range(1, gpus_per_node + 1) if num_heads % g == 0]
    sizes, g = [], 1
    while g <= gpus_per_node:
        if num_heads is None or num_heads % g == 0:
            sizes.append(g)
        g *= 2
    return sizes


def aligned_blocks(world_size: int, gpus_per_node: int, num_heads: int | None = None,
                   divisors: bool = False) -> list[tuple[int, int]]:
    """``(first rank, size)`` of every aligned block of every node, sizes from
    ``block_sizes``: node by node, largest blocks first, then by offset. A world smaller
    than a node is one node."""
    _check_positive("world_size", world_size)
    node = _node_size(world_size, gpus_per_node)
    return list(blocks_of(world_size, tuple(block_sizes(node, num_heads, divisors)), node, any_size=divisors))


def blocks_of(ranks: int, sizes: tuple[int, ...], node: int | None = None,
              any_size: bool = False) -> tuple[tuple[int, int], ...]:
    """``(first rank, size)`` of every aligned block of the given ``sizes`` (powers of two;
    ``any_size``: any size up to a node, aligned at a multiple of it) over ``ranks`` ranks
    in nodes of ``node`` (default: all in one; the last node may be short). A size up to a node gives blocks inside every node; a larger one, a power-of-two
    number of whole nodes, gives blocks of whole nodes aligned at their size. Blocks of
    whole nodes first (largest first), then node by node, largest first, then by offset."""
    _check_positive("ranks", ranks)
    node = node or ranks
    _check_positive("node", node)
    out = []
    for g in sorted(set(sizes), reverse=True):
        if g < 1 or (g & (g - 1) and not (any_size and g <= node)) or (g > node and (g % node or g > ranks)):
            raise ValueError(f"block size {g}: a power of two of at most {node} ranks (a node), or a power-of-two "
                             f"number of whole nodes of {node} within {ranks} ranks")
        if g > node:
            out += [(first, g) for first in range(0, ranks - g + 1, g)]
    for start in range(0, ranks, node):
        for g in sorted({g for g in sizes if g <= node}, reverse=True):
            out += [(start + o, g) for o in range(0, min(node, ranks - start) - g + 1, g)]
    return tuple(out)


@lru_cache(maxsize=64)
def node_partitions(gpus_per_node: int, sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Every partition of a node into aligned blocks of the given sizes (powers of two),
    each as its block sizes in rank order; largest blocks first."""
    _check_positive("gpus_per_node", gpus_per_node)
    bad = [g for g in sizes if g < 1 or g & (g - 1)]
    if bad:
        raise ValueError(f"block sizes must be powers of two, got {bad}")
    order = sorted(set(sizes), reverse=True)

    def fill(pos: int) -> list[tuple[int, ...]]:
        if pos == gpus_per_node:
            return [()]
        out = []
        for g in order:
            if pos % g == 0 and pos + g <= gpus_per_node:
                out.extend((g,) + rest for rest in fill(pos + g))
        return out

    return tuple(fill(0))


def is_aligned_layout(bags: tuple[int, ...] | list[int], gpus_per_node: int, any_size: bool = False) -> bool:
    """True if ``bags`` (sizes in rank order) are aligned power-of-two blocks (``any_size``:
    aligned blocks of any size), each inside one node (a world smaller than a node is one node)."""
    return _first_unaligned(list(bags), gpus_per_node, any_size) is None


def check_aligned(topology: Topology, gpus_per_node: int, any_size: bool = False) -> None:
    """Raise ValueError naming the first bag of ``topology`` that is not an aligned
    power-of-two block inside a node (``any_size``: an aligned block of any size)."""
    bad = _first_unaligned(topology.bags, gpus_per_node, any_size)
    if bad is not None:
        b, start, g = bad
        kind = "aligned" if any_size else "aligned power-of-two"
        raise ValueError(
            f"bag {b} (g{g}, ranks {start}..{start + g - 1}) of {topology} is not an {kind} "
            f"block of a node of {gpus_per_node} GPUs (a block of g starts at a multiple of g in its node)"
        )


def _first_unaligned(bags: list[int], gpus_per_node: int, any_size: bool = False) -> tuple[int, int, int] | None:
    """(bag, first rank, size) of the first bag that is not an aligned block, or None."""
    node = _node_size(sum(bags), gpus_per_node)
    start = 0
    for b, g in enumerate(bags):
        off = start % node
        if g < 1 or (g & (g - 1) and not any_size) or off % g or off + g > node:
            return b, start, g
        start += g
    return None


def _node_size(world_size: int, gpus_per_node: int) -> int:
    _check_positive("gpus_per_node", gpus_per_node)
    if world_size <= gpus_per_node:
        return world_size
    if world_size % gpus_per_node:
        raise ValueError(
            f"world size {world_size} is not a multiple of {gpus_per_node} GPUs per node: "
            "nodes must be whole to partition them into blocks"
        )
    return gpus_per_node


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
