"""Cut every sequence into the chunks its bag's ranks compute."""

from __future__ import annotations

import numpy as np

from ..shapes.topology import Topology


def make_chunks(
    lens: np.ndarray, home: np.ndarray, bag: np.ndarray, topology: Topology
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(chunk_seq, chunk_rank, chunk_start, chunk_len)``: each sequence cut into ``g``
    contiguous chunks differing by at most one token, chunk ``c`` on its bag's ``c``-th rank.

    Which chunks get the extra token rotates within a bag (``offset`` = running sum of the
    remainders of the bag's earlier sequences), so a bag's ranks end up with token totals
    within one of each other. ``home`` is not needed to cut; it is taken so that callers
    pass a plan's arrays as they are."""
    n = lens.size
    if n == 0:
        z = np.zeros(0, np.int64)
        return z, z, z.copy(), z.copy()
    solo = int(bag.max()) >= topology.num_bags  # some sequences whole on a rank of a larger bag
    sizes = topology.all_bag_sizes if solo else topology.bag_sizes
    g = sizes[bag]
    base, rem = np.divmod(lens, g)
    offset = _rotation_offsets(rem, bag, g, sizes.size)
    first_rank = (topology.all_bag_starts if solo else topology.bag_starts)[bag]
    g0 = int(g[0])
    if (g0 < 2**15 and sizes.min() == sizes.max()) or (solo and g0 < 2**15 and bool((g == g0).all())):
        chunk_len, chunk_start, chunk_rank = _grid(base, rem, offset, first_rank, g0)
        chunk_seq = np.repeat(np.arange(n, dtype=np.int64), g0)
        return chunk_seq, chunk_rank.ravel(), chunk_start.ravel(), chunk_len.ravel()
    chunk_seq = np.repeat(np.arange(n, dtype=np.int64), g)
    seq_first = np.cumsum(g) - g
    c = np.arange(chunk_seq.size, dtype=np.int64) - np.repeat(seq_first, g)
    gs = g[chunk_seq]
    extra = ((c - offset[chunk_seq]) % gs) < rem[chunk_seq]
    chunk_len = base[chunk_seq] + extra
    # Token offset of each chunk in its sequence: running total minus the sequence's start.
    ends = np.cumsum(chunk_len)
    chunk_start = ends - chunk_len - np.repeat(np.cumsum(lens) - lens, g)
    chunk_rank = first_rank[chunk_seq] + c
    return chunk_seq, chunk_rank, chunk_start, chunk_len


def chunk_columns(lens: np.ndarray, bag: np.ndarray, topology: Topology) -> tuple[np.ndarray, ...] | None:
    """When every bag has the same size ``g``: ``chunk_len`` as a ``(g, n)`` array (row ``c``:
    the length of every sequence's chunk ``c``, the one its bag's ``c``-th rank computes),
    and per sequence its chunks' ``base`` length, the ``rem`` chunks one longer and where
    they start (``offset``: chunks ``offset .. offset + rem - 1``, modulo ``g``). None for
    bags of several sizes."""
    sizes = topology.bag_sizes
    if not lens.size or sizes.min() != sizes.max() or sizes[0] >= 2**15:
        return None
    gs = int(sizes[0])
    base, rem = np.divmod(lens, gs)
    offset = _rotation_offsets(rem, bag, np.full(lens.size, gs), topology.num_bags)
    c = np.arange(gs, dtype=np.int16)
    extra = ((c[:, None] - offset.astype(np.int16)[None, :]) % gs) < rem.astype(np.int16)[None, :]  # (g, n)
    return base[None, :] + extra, base, rem, offset


def _grid(base, rem, offset, first_rank, gs: int):
    """Chunk lengths, starts and ranks of sequences on bags of one size ``gs``, as dense
    ``(n, g)`` grids; the extra-token pattern is computed in 16 bits (it is below g)."""
    c = np.arange(gs, dtype=np.int16)
    extra = ((c[None, :] - offset.astype(np.int16)[:, None]) % gs) < rem.astype(np.int16)[:, None]  # (n, g)
    chunk_len = base[:, None] + extra
    # Chunk c starts after c whole bases and the extra tokens of the chunks before it.
    chunk_start = base[:, None] * np.arange(gs) + (np.cumsum(extra, axis=1, dtype=np.int16) - extra)
    chunk_rank = first_rank[:, None] + np.arange(gs)
    return chunk_len, chunk_start, chunk_rank


def sort_by_bag(bag: np.ndarray, num_bags: int) -> np.ndarray:
    """Sequence ids grouped by bag, each bag's in increasing id (a stable sort)."""
    # numpy sorts 16-bit keys stably by radix, in linear time (6x faster than int64 here).
    keys = bag.astype(np.uint16) if num_bags <= 2**16 else bag
    return np.argsort(keys, kind="stable")


def _rotation_offsets(rem: np.ndarray, bag: np.ndarray, g: np.ndarray, num_bags: int) -> np.ndarray:
    """(n,) remainder tokens of the bag's earlier sequences (global order), modulo ``g``."""
    order = sort_by_bag(bag, num_bags)
    rem_sorted = rem[order]
    csum = np.cumsum(rem_sorted) - rem_sorted
    bag_sorted = bag[order]
    first = np.ones(bag_sorted.size, dtype=bool)
    first[1:] = bag_sorted[1:] != bag_sorted[:-1]
    group_base = np.maximum.accumulate(np.where(first, csum, 0))
    offset = np.empty(rem.size, np.int64)
    offset[order] = (csum - group_base) % g[order]
    return offset
