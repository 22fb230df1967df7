"""One balance group's planning problem: what a sequence costs on each bag, bag loads, and
the scores a plan is chosen by. The solver's steps (constructions, refinement, home
repair, memory budget) are functions of a ``GroupProblem`` in their own modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from .chunks import chunk_columns, make_chunks, sort_by_bag
from ..costs.cost import CostModel, StepTimes, rank_times
from ..shapes.topology import Topology
from ..costs.workload import WorkloadModel

Model = Union[WorkloadModel, CostModel]

Candidate = tuple[str, np.ndarray, int]
"""A plan the solver may choose: its name, the bag of every sequence, refinement steps."""


def longest_first(lens: np.ndarray) -> np.ndarray:
    """Indices by decreasing length, ties by index (a stable sort; by radix, in linear
    time, for lengths under 2**16)."""
    if lens.size and lens.max() < 2**16:
        return np.argsort((lens.max() - lens).astype(np.uint16), kind="stable")
    return np.argsort(-lens, kind="stable")


def _decreasing(work: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``argsort(-work, kind="stable")``. Work grows with length for every model here, so
    the (linear-time) order of lengths is taken where the work confirms it: equal for
    equal lengths, falling where the length falls."""
    order = longest_first(lens)
    w, same = work[order], lens[order][1:] == lens[order][:-1]
    step = w[1:] - w[:-1]
    if np.all(np.where(same, step == 0, step < 0)):
        return order
    return np.argsort(-work, kind="stable")


class NoFit(Exception):
    """No assignment within the token budget was found."""


@dataclass(frozen=True)
class GroupComm:
    """What a cost model adds for one balance group: per-bag Ulysses seconds per token and
    speed, and where the group's ranks sit (for routing times)."""

    bag_token_s: np.ndarray
    """(k,) Ulysses seconds per chunk token on each bag of the group."""
    bag_speed: np.ndarray
    """(k,) speed of each bag (its slowest rank)."""
    rank_offset: int
    """First rank of the group in the world (sets the ranks' nodes)."""


class GroupProblem:
    """Per-bag times of one balance group, shared by the solver steps.

    Bag ``b`` finishes when its per-GPU load ``Σ t(s, b)`` is done, with
    ``t(s, b) = cost[s, cls[b]] / speed[b]``: ``cost`` is the per-GPU time of a sequence on
    a bag of a class (size, communication), ``W(L)/g`` for the paper's workload model and
    ``CostModel.seq_cost`` for a cost model. A sequence may only go to a bag with
    ``g <= L`` (one shorter than every bag goes to a smallest bag, some chunks empty)."""

    def __init__(
        self,
        lens: np.ndarray,
        home: np.ndarray,
        bag_sizes: np.ndarray,
        model: Model,
        comm: GroupComm | None = None,
        repeats: np.ndarray | None = None,
    ):
        """``repeats``: (S,) how many times each sequence runs (a sampling job's steps times
        its passes): its work and times are that many of one run's; None: once each."""
        self.model = model
        self.comm = comm
        self.token_work = float(model.linear(1.0))
        self.true_lens = lens
        # For placement, a sequence shorter than every bag counts as long enough for the
        # smallest ones: it runs there with some empty chunks (nothing better exists).
        self.lens = np.maximum(lens, bag_sizes.min())
        self.home = home
        self.work = model(lens)
        reps = np.ones(lens.size) if repeats is None else np.asarray(repeats, dtype=np.float64)
        if reps.shape != lens.shape or not np.all(reps > 0):
            raise ValueError(f"repeats must be one positive count per sequence, got shape {reps.shape}")
        self.work = self.work * reps
        self.bag_sizes = bag_sizes
        self.g = bag_sizes.astype(np.float64)
        self.k = bag_sizes.size
        self.home_bag = np.repeat(np.arange(self.k), bag_sizes)[home]
        self.sizes = np.unique(bag_sizes)  # ascending
        self.bags_of_size = [np.flatnonzero(bag_sizes == s) for s in self.sizes]
        token_s = np.zeros(self.k) if comm is None else comm.bag_token_s
        speed = np.ones(self.k) if comm is None else comm.bag_speed
        self.inv_speed = 1.0 / speed
        # Classes: distinct (size, Ulysses cost); cost[s, c] is per GPU at speed 1.
        if comm is None:
            class_g, class_u = self.sizes.astype(np.float64), np.zeros(self.sizes.size)
            self.cls = np.searchsorted(self.sizes, bag_sizes)
        else:
            keys, self.cls = np.unique(np.column_stack([self.g, token_s]), axis=0, return_inverse=True)
            self.cls = self.cls.reshape(-1)
            class_g, class_u = keys[:, 0], keys[:, 1]
        # A cost model's per-sequence part is paid in full by every GPU of the bag.
        self.seq_fixed = model.per_sequence(lens) * reps if isinstance(model, CostModel) else np.zeros(lens.size)
        self.cost = (self.work - self.seq_fixed)[:, None] / class_g[None, :] + self.seq_fixed[:, None]
        if class_u.any():
            self.cost += (reps * lens)[:, None] / class_g[None, :] * class_u[None, :]
        # Exact per-rank time: (attention/g + per-token cost x tokens) / speed.
        self.bag_token_cost = self.token_work + token_s
        # Equal bags of equal speed, no communication term: the published greedy is LPT.
        self.uniform_equal = (
            self.cost.shape[1] == 1 and not class_u.any() and bool(np.all(self.inv_speed == self.inv_speed[0]))
        )
        # Lower bound on the makespan: every sequence on its cheapest class in GPU-seconds.
        gpu_s = (self.cost * class_g[None, :]).min(axis=1)
        self.ideal = float(gpu_s.sum()) / float((self.g * speed).sum())
        # Visit order of the constructions: decreasing work, ties by id (deterministic).
        self.order = _decreasing(self.work, lens)
        self.offset: np.ndarray | None = None
        """(k,) fixed seconds added to each bag's load (its ranks' routing), or None."""
        self._times: dict[int, tuple[np.ndarray, StepTimes]] = {}
        self._bag_types: tuple[np.ndarray, np.ndarray] | None = None

    def t(self, s, b):
        """Time of sequence(s) ``s`` on bag(s) ``b`` (broadcasting)."""
        return self.cost[s, self.cls[b]] * self.inv_speed[b]

    def bag_types(self) -> tuple[np.ndarray, np.ndarray]:
        """Bags on which every sequence takes the same time (one class and speed):
        ``(types, type_of_bag)``, ``types[i] = (class, 1/speed)``, in increasing order.
        Made once per problem (classes and speeds are fixed); callers only read them."""
        if self._bag_types is None:
            types, type_of_bag = np.unique(
                np.column_stack([self.cls, self.inv_speed]), axis=0, return_inverse=True
            )
            self._bag_types = (types, type_of_bag.reshape(-1))
        return self._bag_types

    def by_bag(self, assign: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(order, bounds)``: bag ``j`` holds ``order[bounds[j]:bounds[j + 1]]``, in
        increasing id (what ``flatnonzero(assign == j)`` gives, for all bags at once)."""
        order = sort_by_bag(assign, self.k)
        bounds = np.zeros(self.k + 1, dtype=np.int64)
        np.cumsum(np.bincount(assign, minlength=self.k), out=bounds[1:])
        return order, bounds

    def loads(self, assign: np.ndarray) -> np.ndarray:
        """Per-GPU time of every bag."""
        if self.cost.shape[1] == 1:
            per = self.cost[:, 0]
        else:
            per = np.take_along_axis(self.cost, self.cls[assign][:, None], axis=1)[:, 0]
        loads = np.bincount(assign, weights=per, minlength=self.k) * self.inv_speed
        return loads if self.offset is None else loads + self.offset

    def makespan(self, assign: np.ndarray) -> float:
        return float(self.loads(assign).max())

    def max_rank_load(self, assign: np.ndarray) -> float:
        """Exact time of the busiest rank once sequences are cut into chunks: a bag's
        remainder tokens go round-robin over its ranks (see ``make_chunks``), so its
        busiest rank has ``ceil`` of the leftover tokens."""
        g = self.bag_sizes[assign]
        base, rem = np.divmod(self.true_lens, g)
        attn = np.bincount(
            assign, weights=self.model.attention(self.true_lens) / g + self.seq_fixed, minlength=self.k
        )
        base_tok = np.bincount(assign, weights=base, minlength=self.k)
        rem_tok = np.bincount(assign, weights=rem, minlength=self.k)
        top_tok = base_tok + np.ceil(rem_tok / self.bag_sizes - 1e-9)
        return float(((attn + self.bag_token_cost * top_tok) * self.inv_speed).max())

    def times(self, assign: np.ndarray) -> StepTimes:
        """Predicted per-rank times of the group (cost model), routing included; kept per
        plan (an array the solver does not change once made), as several steps ask again."""
        hit = self._times.get(id(assign))
        if hit is not None and hit[0] is assign:
            return hit[1]
        topo = Topology(tuple(self.bag_sizes.tolist()))
        columns = chunk_columns(self.true_lens, assign, topo)
        if columns is not None:
            times = self._column_times(assign, topo, *columns)
        else:
            chunk_seq, chunk_rank, _, chunk_len = make_chunks(self.true_lens, self.home, assign, topo)
            times = rank_times(
                self.model, topo, self.true_lens, self.home, chunk_seq, chunk_rank, chunk_len,
                self.bag_sizes[assign], rank_offset=self.comm.rank_offset,
                bag_token_s=self.comm.bag_token_s, bag_speed=self.comm.bag_speed,
            )
        self._times[id(assign)] = (assign, times)
        return times

    def _column_times(
        self, assign: np.ndarray, topo: Topology, chunk_len: np.ndarray, base: np.ndarray, rem: np.ndarray,
        offset: np.ndarray,
    ) -> StepTimes:
        """``cost.rank_times`` for bags of one size from ``chunk_len[c]``, every sequence's
        chunk ``c`` (computed by its bag's ``c``-th rank): the same floating-point
        expressions, and each rank's sum over its chunks in the same order (by sequence),
        so the same bits, without per-chunk index arrays."""
        m, w, g = self.model, topo.world_size, float(self.bag_sizes[0])
        comp = m.linear(chunk_len)
        if m.seq_s:  # (0 + x is x: without a per-sequence term the sum is the same)
            comp = m.per_sequence(chunk_len) + comp
        comp += (m.attention(self.true_lens) / g)[None, :]
        uly = chunk_len * self.comm.bag_token_s[assign][None, :]
        speed = self.comm.bag_speed[topo.bag_of_rank]
        per_bag = np.empty((2, self.k, chunk_len.shape[0]))  # rank c of bag j: [j, c]
        for c in range(chunk_len.shape[0]):
            per_bag[0, :, c] = np.bincount(assign, weights=comp[c], minlength=self.k)
            per_bag[1, :, c] = np.bincount(assign, weights=uly[c], minlength=self.k)
        compute, ulysses = per_bag[0].ravel() / speed, per_bag[1].ravel() / speed
        gpn, off = m.gpus_per_node, self.comm.rank_offset
        starts = topo.bag_starts
        if np.all((starts + off) // gpn == (starts + self.bag_sizes - 1 + off) // gpn):
            sent, recv = self._routed_per_sequence(assign, topo, base, rem, offset)
        else:
            rank = topo.bag_starts[assign][:, None] + np.arange(chunk_len.shape[0])
            sent, recv = self._routed_per_chunk(w, np.ascontiguousarray(chunk_len.T), rank)
        parts = [np.maximum(sent[x], recv[x]) * m.route_token_s(bool(x)) for x in (0, 1)]
        return StepTimes(compute, ulysses, np.maximum(parts[0], parts[1]), m.fixed_s)

    # Routed tokens per rank, (intra-node, inter-node), sent and received: sums of whole
    # numbers, exact in any order, so they need not follow the chunks' order.

    def _routed_per_chunk(self, w: int, chunk_len: np.ndarray, chunk_rank: np.ndarray) -> tuple[list, list]:
        gpn, off = self.model.gpus_per_node, self.comm.rank_offset
        moved = self.home[:, None] != chunk_rank
        inter = ((self.home + off) // gpn)[:, None] != (chunk_rank + off) // gpn
        src = np.broadcast_to(self.home[:, None], chunk_rank.shape)
        tokens = chunk_len.astype(np.float64)
        sent, recv = [], []
        for mask in (moved & ~inter, moved & inter):
            sent.append(np.bincount(src[mask], weights=tokens[mask], minlength=w))
            recv.append(np.bincount(chunk_rank[mask], weights=tokens[mask], minlength=w))
        return sent, recv

    def _routed_per_sequence(
        self, assign: np.ndarray, topo: Topology, base: np.ndarray, rem: np.ndarray, offset: np.ndarray
    ) -> tuple[list, list]:
        """Every bag within one node: a sequence's chunks all cross a node boundary or none
        does. Home ranks send all but their own chunk; a bag's rank ``c`` receives, from a
        set of its sequences, their base lengths plus one for each whose extra chunks
        (``offset .. offset + rem - 1``, cyclic) cover ``c``: counted with a difference
        array per bag, so no per-chunk arrays are made."""
        w, k, gs = topo.world_size, self.k, int(self.bag_sizes[0])
        gpn, off = self.model.gpus_per_node, self.comm.rank_offset
        lens, home = self.true_lens, self.home
        first = topo.bag_starts[assign]
        inter = (home + off) // gpn != (first + off) // gpn
        c_home = home - first
        at_home = (c_home >= 0) & (c_home < gs)
        own = np.where(at_home, base + (((c_home - offset) % gs) < rem), 0)
        sent = [
            np.bincount(home, weights=np.where(inter, 0, lens - own).astype(np.float64), minlength=w),
            np.bincount(home, weights=np.where(inter, lens, 0).astype(np.float64), minlength=w),
        ]
        recv = []
        ends = offset + rem
        wrap = ends > gs
        for cls in (~inter, inter):
            bases = np.bincount(assign[cls], weights=base[cls], minlength=k)
            b, o, e, wr = assign[cls] * (gs + 1), offset[cls], ends[cls], wrap[cls]
            # +1 where a sequence's extra chunks start, -1 past their end; a run past the
            # last chunk wraps to chunk 0.
            at = np.concatenate((b + o, b + np.where(wr, gs, e), b[wr], b[wr] + e[wr] - gs))
            sign = np.concatenate((np.ones(b.size), -np.ones(b.size), np.ones(wr.sum()), -np.ones(wr.sum())))
            diff = np.bincount(at, weights=sign, minlength=k * (gs + 1))
            extra = np.cumsum(diff.reshape(k, gs + 1), axis=1)[:, :gs]
            recv.append((bases[:, None] + extra).ravel())
        # A home rank does not receive its own chunk.
        recv[0] = recv[0] - np.bincount(home[at_home], weights=own[at_home].astype(np.float64), minlength=w)
        return sent, recv

    def step_time(self, assign: np.ndarray) -> float:
        return self.times(assign).step_time

    def route_offsets(self, assign: np.ndarray) -> np.ndarray:
        """(k,) routing seconds of each bag's busiest-routing rank under ``assign``."""
        route = self.times(assign).route
        return np.maximum.reduceat(route, np.concatenate([[0], np.cumsum(self.bag_sizes)[:-1]]))

    def moved_tokens(self, assign: np.ndarray) -> float:
        """Tokens leaving their home rank (a home-bag sequence keeps ~1/g of its tokens)."""
        lens = self.true_lens
        at_home = assign == self.home_bag
        return float(lens.sum() - (lens[at_home] / self.bag_sizes[assign[at_home]]).sum())

    def choose(self, candidates: list[Candidate]) -> tuple[str, np.ndarray, int, float]:
        """The best candidate by exact peak (workload model) or predicted step time (cost
        model); among those within half a token's work of it (the chunking's own
        resolution) and no worse than the first (greedy), the one that moves fewest tokens.
        A plan listed twice (a step that changed nothing returns its input) is scored once."""
        score = self.max_rank_load if self.comm is None else self.step_time
        scores: dict[int, float] = {}
        moved: dict[int, float] = {}

        def once(cache: dict[int, float], f, a: np.ndarray) -> float:
            if id(a) not in cache:
                cache[id(a)] = f(a)
            return cache[id(a)]

        peak = [once(scores, score, a) for _, a, _ in candidates]
        greedy_peak = peak[0]
        best = min(peak)
        tol = 0.5 * self.token_work
        ok = [i for i, p in enumerate(peak) if p <= best + tol and p <= greedy_peak]
        i = min(ok, key=lambda i: (once(moved, self.moved_tokens, candidates[i][1]), peak[i]))
        return (*candidates[i], peak[i])

    # -- memory budget ---------------------------------------------------------------------

    def bag_tokens(self, assign: np.ndarray) -> np.ndarray:
        """(k,) tokens on every bag."""
        return np.bincount(assign, weights=self.true_lens, minlength=self.k)

    def fits(self, assign: np.ndarray, cap: np.ndarray) -> bool:
        return bool(np.all(self.bag_tokens(assign) <= cap))

    def allowed(self, seqs: np.ndarray) -> np.ndarray:
        """(len(seqs), k): may the sequence go to the bag (``g <= L``)?"""
        return self.bag_sizes[None, :] <= self.lens[seqs][:, None]
