"""One step's sequence lengths, one list per rank, as flat arrays in global order.

Sequences are numbered by ``(home rank, local index)``. The common input (lists or arrays
of positive integers) is converted in a few numpy calls; anything else goes through the
per-rank check, which names the bad rank and sequence (and accepts exactly what the fast
path accepts, so both give the same arrays).
"""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import numpy as np

from .topology import Topology


def flatten_lengths(
    seq_lens_per_rank: Sequence[Sequence[int]], topology: Topology
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lens, home, local)``: every sequence's length, home rank and index on its rank."""
    if isinstance(seq_lens_per_rank, (str, bytes)) or not hasattr(seq_lens_per_rank, "__len__"):
        raise TypeError("seq_lens_per_rank must be a list with one list of lengths per rank")
    topology.check_world_size(len(seq_lens_per_rank))
    fast = _flat_array(seq_lens_per_rank)
    if fast is None:
        lens, counts = _checked_per_rank(seq_lens_per_rank)
    else:
        lens, counts = fast
    home = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    local = np.arange(lens.size, dtype=np.int64) - np.repeat(starts, counts)
    return lens, home, local


def _flat_array(seq_lens_per_rank: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray] | None:
    """Lengths and per-rank counts in one conversion, or None where the per-rank check must
    decide (it then accepts or names the bad value)."""
    try:
        counts = np.fromiter(map(len, seq_lens_per_rank), dtype=np.int64, count=len(seq_lens_per_rank))
        if all(isinstance(r, np.ndarray) for r in seq_lens_per_rank):
            flat = list(seq_lens_per_rank)
            arr = np.concatenate(flat) if flat else np.zeros(0, np.int64)
            items = None
        else:
            items = list(chain.from_iterable(seq_lens_per_rank))
            arr = np.asarray(items)
    except (TypeError, ValueError):
        return None
    if arr.ndim != 1 or arr.size != int(counts.sum()):
        return None
    if not arr.size:
        return np.zeros(0, np.int64), counts
    if arr.dtype.kind == "f":
        # A float length is accepted if it is a whole number (the per-rank rule); past 2**53
        # a float no longer holds every integer another rank's ints were read from.
        if not np.all(arr == np.round(arr)) or np.abs(arr).max() > 2.0**53:
            return None
    elif arr.dtype.kind not in "iu":
        return None  # bools, strings, objects
    arr = arr.astype(np.int64)
    if arr.min() <= 0:
        return None
    if items is not None:
        # A rank listing only booleans is refused by the per-rank rule, while numpy would
        # read True as 1 beside integers of other ranks: let that rule decide.
        ones = np.flatnonzero(arr == 1)
        if ones.size and any(isinstance(items[i], (bool, np.bool_)) for i in ones.tolist()):
            return None
    elif any(r.dtype.kind not in "iuf" for r in seq_lens_per_rank if r.size):
        return None
    return arr, counts


def _checked_per_rank(seq_lens_per_rank: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    arrays = []
    for r, lens in enumerate(seq_lens_per_rank):
        arr = np.asarray(lens)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            if arr.size and np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)):
                arr = arr.astype(np.int64)
            else:
                raise ValueError(
                    f"rank {r}: sequence lengths must be a flat list of integers, got {lens!r:.80}"
                )
        bad = np.flatnonzero(arr <= 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"rank {r}, sequence {i}: length {int(arr[i])} is not positive "
                "(every sequence needs at least one token)"
            )
        arrays.append(arr.astype(np.int64))
    counts = np.array([a.size for a in arrays], dtype=np.int64)
    lens = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    return lens, counts
