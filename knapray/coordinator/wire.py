"""A plan as the object store holds it: what the solver chose, not what follows from it.

A ``BalancePlan``'s chunk arrays (``C`` = sequences x bag size entries each) follow from
its lengths, its bags and its topology (``planning.balance.chunks.make_chunks``), and its
``home_rank`` / ``local_index`` from how many sequences each rank holds. ``pack`` keeps
only ``seq_lens``, ``bag`` and those counts (int32 where the values fit), about 1/40 of
the plan at 1024 ranks; ``unpack`` rebuilds the rest on the rank. ``pack`` rebuilds the
plan itself before it answers and compares every array (values and dtype): a plan that
does not rebuild exactly (a solver that cut its chunks another way) travels whole, so a
rank always runs exactly the coordinator's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knapray.planning import BalancePlan, Topology
from knapray.planning.balance.chunks import make_chunks

ARRAYS = ("seq_lens", "home_rank", "local_index", "bag", "chunk_seq", "chunk_rank", "chunk_start", "chunk_len")


@dataclass(frozen=True, eq=False)
class PackedPlan:
    topology: Topology
    model: object
    solver: str
    plan_time_ms: float
    stats: dict
    seq_lens: np.ndarray
    bag: np.ndarray
    rank_counts: np.ndarray
    """(W,) sequences each rank holds (they are numbered by home rank, then local index)."""
    whole: dict[str, np.ndarray] | None = None
    """Every array as it is, when the plan does not rebuild from the others."""


def _small(a: np.ndarray) -> np.ndarray:
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        return a
    return a.astype(np.int32)


def pack(plan: BalancePlan) -> PackedPlan:
    """``plan`` for the object store (see the module docstring)."""
    counts = np.bincount(plan.home_rank, minlength=plan.world_size)
    packed = PackedPlan(plan.topology, plan.model, plan.solver, plan.plan_time_ms, plan.stats,
                        _small(plan.seq_lens), _small(plan.bag), _small(counts))
    rebuilt = unpack(packed)
    if all(getattr(rebuilt, f).dtype == getattr(plan, f).dtype and np.array_equal(getattr(rebuilt, f), getattr(plan, f))
           for f in ARRAYS):
        return packed
    return PackedPlan(plan.topology, plan.model, plan.solver, plan.plan_time_ms, plan.stats, plan.seq_lens, plan.bag,
                      counts, whole={f: getattr(plan, f) for f in ARRAYS})


def unpack(packed: PackedPlan) -> BalancePlan:
    """The ``BalancePlan`` ``pack`` was given, array for array."""
    if packed.whole is not None:
        arrays = packed.whole
    else:
        lens = packed.seq_lens.astype(np.int64)
        bag = packed.bag.astype(np.int64)
        counts = packed.rank_counts.astype(np.int64)
        home = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
        local = np.arange(lens.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        chunk_seq, chunk_rank, chunk_start, chunk_len = make_chunks(lens, home, bag, packed.topology)
        arrays = dict(seq_lens=lens, home_rank=home, local_index=local, bag=bag, chunk_seq=chunk_seq,
                      chunk_rank=chunk_rank, chunk_start=chunk_start, chunk_len=chunk_len)
    return BalancePlan(topology=packed.topology, model=packed.model, solver=packed.solver,
                       plan_time_ms=packed.plan_time_ms, stats=packed.stats, **arrays)
