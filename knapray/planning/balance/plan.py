"""BalancePlan: where every sequence, and every chunk of it, runs.

Sequences are numbered globally in ``(home rank, local index)`` order. A sequence placed
on a bag of ``g`` ranks is cut into ``g`` contiguous chunks, chunk ``c`` running on the
bag's ``c``-th rank. A sequence on a solo bag (``Topology.solo_bag``: index
``num_bags + r``) runs whole on rank ``r``, beside that rank's share of its own bag. Chunk arrays are sorted by ``(sequence, chunk)``, so a sequence's
chunks are consecutive and in rank order, and a rank's chunks, taken in array order,
are in global sequence order; that is both the order in which an all-to-all delivers
them (by source rank, then local index) and the order every rank of a bag agrees on for
Ulysses attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..costs.cost import CostModel, StepTimes
from ..shapes.topology import Topology
from ..costs.workload import WorkloadModel


@dataclass(frozen=True, eq=False)
class BalancePlan:
    topology: Topology
    model: WorkloadModel | CostModel
    """What the plan balanced: work (``WorkloadModel``) or predicted seconds (``CostModel``)."""
    seq_lens: np.ndarray
    """(S,) length of every sequence, in global order."""
    home_rank: np.ndarray
    """(S,) rank that holds the sequence before routing (and gets its output back)."""
    local_index: np.ndarray
    """(S,) index of the sequence in its home rank's list."""
    bag: np.ndarray
    """(S,) bag the sequence runs on."""
    chunk_seq: np.ndarray
    """(C,) sequence of each chunk."""
    chunk_rank: np.ndarray
    """(C,) rank that computes the chunk."""
    chunk_start: np.ndarray
    """(C,) offset of the chunk's first token in its sequence."""
    chunk_len: np.ndarray
    """(C,) tokens in the chunk (the chunks of a sequence differ by at most one)."""
    solver: str = "knapray"
    plan_time_ms: float = 0.0
    stats: dict = field(default_factory=dict)
    """Solver diagnostics (iterations, which start won, ...)."""

    # ---- sizes ------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def num_sequences(self) -> int:
        return int(self.seq_lens.size)

    @cached_property
    def seq_offsets(self) -> np.ndarray:
        """(W+1,) global ids of each rank's sequences are ``seq_offsets[r]:seq_offsets[r+1]``."""
        counts = np.bincount(self.home_rank, minlength=self.world_size)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @cached_property
    def bag_size_of_seq(self) -> np.ndarray:
        return self.topology.all_bag_sizes[self.bag] if self.overlapping else self.topology.bag_sizes[self.bag]

    @cached_property
    def overlapping(self) -> bool:
        """Whether some sequence runs whole on a rank of a larger bag (a solo bag)."""
        return bool(self.bag.size) and int(self.bag.max()) >= self.topology.num_bags

    def solo_sequences(self, rank: int) -> np.ndarray:
        """Global ids of the sequences that run whole on ``rank`` beside its bag's."""
        return np.flatnonzero(self.bag == self.topology.solo_bag(rank))

    @cached_property
    def chunk_src(self) -> np.ndarray:
        """(C,) home rank of each chunk's sequence (the rank that sends it)."""
        return self.home_rank[self.chunk_seq]

    @cached_property
    def rank_tokens(self) -> np.ndarray:
        """(W,) tokens each rank computes under this plan (what a memory budget caps)."""
        return np.bincount(self.chunk_rank, weights=self.chunk_len, minlength=self.world_size).astype(np.int64)

    # ---- work -------------------------------------------------------------------------

    @cached_property
    def seq_work(self) -> np.ndarray:
        return self.model(self.seq_lens)

    @cached_property
    def baseline_rank_work(self) -> np.ndarray:
        """Work per rank if every rank computed its own sequences alone."""
        return np.bincount(self.home_rank, weights=self.seq_work, minlength=self.world_size)

    @cached_property
    def rank_work(self) -> np.ndarray:
        """Work per rank under this plan (for a ``CostModel``: compute seconds at speed 1,
        no communication; ``rank_time`` is the predicted time)."""
        work = self.model.chunk(
            self.chunk_len, self.seq_lens[self.chunk_seq], self.bag_size_of_seq[self.chunk_seq]
        )
        return np.bincount(self.chunk_rank, weights=work, minlength=self.world_size)

    @property
    def imbalance(self) -> float:
        """max / mean of ``rank_work`` (1.0 is perfect)."""
        return _imbalance(self.rank_work)

    @property
    def baseline_imbalance(self) -> float:
        return _imbalance(self.baseline_rank_work)

    def step_times(self, cost: CostModel | None = None) -> StepTimes:
        """Predicted seconds per rank (compute, Ulysses, routing) under ``cost``, by
        default the plan's own model if it is a ``CostModel``."""
        cost = cost if cost is not None else self.model
        if not isinstance(cost, CostModel):
            raise ValueError("step_times needs a CostModel (the plan was made with a WorkloadModel)")
        return cost.step_times(self)

    @cached_property
    def rank_time(self) -> np.ndarray:
        """(W,) predicted seconds per rank under the plan's ``CostModel``."""
        return self.step_times().total

    @property
    def predicted_step_time(self) -> float:
        """Predicted seconds of the step under the plan's ``CostModel``."""
        return self.step_times().step_time

    # ---- traffic ----------------------------------------------------------------------

    @cached_property
    def send_matrix(self) -> np.ndarray:
        """(W, W) tokens rank ``i`` sends to rank ``j`` in the forward route."""
        w = self.world_size
        flat = np.bincount(
            self.chunk_src * w + self.chunk_rank, weights=self.chunk_len, minlength=w * w
        )
        return flat.astype(np.int64).reshape(w, w)

    @property
    def recv_counts(self) -> np.ndarray:
        """(W,) tokens each rank receives (itself included) = tokens it computes."""
        return self.send_matrix.sum(axis=0)

    @property
    def moved_token_fraction(self) -> float:
        """Fraction of all tokens computed on a rank other than their home."""
        total = int(self.seq_lens.sum())
        if total == 0:
            return 0.0
        moved = int(self.chunk_len[self.chunk_rank != self.chunk_src].sum())
        return moved / total

    # ---- per-rank views for the router ---------------------------------------------

    def send_chunks(self, rank: int) -> np.ndarray:
        """Indices of the chunks ``rank`` sends, in send order (destination rank, then
        local index, then chunk)."""
        idx = np.flatnonzero(self.chunk_src == rank)
        order = np.lexsort((idx, self.chunk_rank[idx]))
        return idx[order]

    def recv_chunks(self, rank: int) -> np.ndarray:
        """Indices of the chunks ``rank`` computes, in receive order (= global sequence
        order, which is also the bag's agreed Ulysses order)."""
        return np.flatnonzero(self.chunk_rank == rank)

    def bag_sequences(self, bag: int) -> np.ndarray:
        """Global ids of the sequences a bag runs, in the order its ranks agree on."""
        return np.flatnonzero(self.bag == bag)

    def summary(self) -> dict:
        return {
            "solver": self.solver,
            "topology": str(self.topology),
            "world_size": self.world_size,
            "sequences": self.num_sequences,
            "baseline_imbalance": self.baseline_imbalance,
            "imbalance": self.imbalance,
            "moved_token_fraction": self.moved_token_fraction,
            "plan_ms": self.plan_time_ms,
        }

    def to_json(self) -> dict:
        """Everything needed to check the plan independently."""
        seqs = []
        bounds = np.concatenate([[0], np.cumsum(self.bag_size_of_seq)]).tolist()
        ranks, starts, lens = (
            self.chunk_rank.tolist(),
            self.chunk_start.tolist(),
            self.chunk_len.tolist(),
        )
        for s in range(self.num_sequences):
            lo, hi = bounds[s], bounds[s + 1]
            seqs.append(
                {
                    "home_rank": int(self.home_rank[s]),
                    "local_index": int(self.local_index[s]),
                    "length": int(self.seq_lens[s]),
                    "bag": int(self.bag[s]),
                    "chunks": [
                        {"rank": ranks[c], "start": starts[c], "length": lens[c]}
                        for c in range(lo, hi)
                    ],
                }
            )
        return {
            "topology": self.topology.spec,
            "num_groups": self.topology.num_groups,
            "bags": [list(self.topology.bag_ranks(b)) for b in range(self.topology.num_bags)],
            "sequences": seqs,
        }


def _imbalance(work: np.ndarray) -> float:
    mean = float(work.mean()) if work.size else 0.0
    return float(work.max()) / mean if mean > 0 else 1.0
