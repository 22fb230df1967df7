# Frozen copy of knapray/planning/balance/solver.py at commit 1bf50b6 (before the linear-time
# rewrite of issue 23): a test oracle only. The rewritten solver must make the same plans
# (tests/unit/test_planner_oracle.py). Never import it from the package; never edit it except to
# follow a rename of what it imports, and one change of behaviour made to both: the least
# loaded bags are picked by ``lightest`` (ties to the lower index) instead of
# ``np.argpartition``, whose order on ties depends on the CPU (a locally planned step must
# be the same plan on every rank).
"""plan_balance(): assign every sequence to a bag so that the busiest GPU finishes first.

With the paper's ``WorkloadModel`` this is makespan scheduling on "uniform machines": bag
``j`` of ``g_j`` GPUs finishes when its per-GPU load ``P_j = Σ W(L)/g_j`` is done. With a
``CostModel`` a sequence on bag ``j`` costs each of its GPUs ``CostModel.seq_cost`` seconds
(``compute(L)/g_j + ulysses(L, g_j)``, the per-sequence part unsplit), divided by the bag's speed (its slowest rank's), which is not
proportional across bag sizes ("unrelated machines"); the plan minimizes the predicted
step time (routing included). Either way a sequence may only go to a bag with
``g_j <= L`` (one shorter than every bag goes to a smallest bag, some chunks empty).
Two solvers:

``greedy``  KnapFormer's published baseline (kept exact for comparison); it balances the
            model's work estimate (``W(L)``, or the cost model's compute seconds) and
            ignores communication and speeds.
``knapray`` (default) starts from greedy and from LPT (earliest finish), improves both by
            moves and swaps out of the most loaded bag until no step helps, then, without
            raising the makespan, moves sequences back to a bag that contains their home
            rank so fewer tokens travel; of these candidates and greedy itself it keeps the
            best by exact peak (cost model: predicted step time), so it is never worse
            than greedy.

A memory budget (``max_tokens_per_gpu=T``) caps every rank's routed tokens: bag ``j``
holds at most ``T * g_j`` tokens (its ranks' chunks differ by at most one token, so its
busiest rank holds ``ceil(tokens_j / g_j)``). The plan above is kept when it fits; else
its candidates are repaired (sequences moved or swapped out of bags over their capacity
into bags with room), a capacity-aware LPT joins them, all are refined by moves and swaps
that keep every bag within its capacity, and the best is chosen the same way. If none
fits, a first-fit-decreasing packing by tokens is the last resort before an error.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from knapray.planning.costs.cost import CostModel, StepTimes, rank_times
from knapray.planning.balance.plan import BalancePlan
from knapray.planning.balance.refine import lightest
from knapray.planning.shapes.topology import Topology
from knapray.planning.costs.workload import WorkloadModel

Model = Union[WorkloadModel, CostModel]

SOLVERS = ("knapray", "greedy")
_STOP_REL = 1e-7  # stop refining once the makespan is this close to the ideal


def plan_balance(
    seq_lens_per_rank: Sequence[Sequence[int]],
    topology: Topology,
    model: WorkloadModel | CostModel | None = None,
    solver: str = "knapray",
    max_tokens_per_gpu: int | None = None,
) -> BalancePlan:
    """Plan one step: ``seq_lens_per_rank[r]`` lists the lengths of rank ``r``'s sequences.

    ``model``: the paper's ``WorkloadModel`` (default) balances estimated work; a
    ``CostModel`` minimizes predicted step time (communication, per-rank speeds).

    ``max_tokens_per_gpu``: optional memory budget (see ``knapray memory``): no rank gets
    more routed tokens than this. A sequence whose chunk would exceed it even on the
    largest bag, or a step that fits no assignment, is rejected with an error naming the
    step's tokens, the budget and the capacity.
    """
    t0 = time.perf_counter()
    model = model or WorkloadModel()
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; valid: {', '.join(SOLVERS)}")
    lens, home, local = _flatten(seq_lens_per_rank, topology)
    budget = _check_budget(max_tokens_per_gpu, lens, topology)
    bag = np.empty(lens.size, dtype=np.int64)
    stats: dict = {"groups": []}
    is_cost = isinstance(model, CostModel)
    if is_cost:
        token_s, speed = model.bag_ulysses_token_s(topology), model.bag_speed(topology)
    nb = len(topology.group_bags)
    for grp in range(topology.num_groups):
        ranks = topology.group_ranks(grp)
        lo = np.searchsorted(home, ranks.start)
        hi = np.searchsorted(home, ranks.stop)
        bag_offset = grp * nb
        comm = None
        if is_cost:
            sl = slice(bag_offset, bag_offset + nb)
            comm = _GroupComm(token_s[sl], speed[sl], ranks.start)
        group_tokens = int(lens[lo:hi].sum())
        if budget is not None and group_tokens > budget * len(ranks):
            raise ValueError(
                f"balance group {grp} (ranks {ranks.start}-{ranks.stop - 1}) holds {group_tokens} of the "
                f"step's {int(lens.sum())} tokens, over its capacity of {budget * len(ranks)} "
                f"({len(ranks)} GPUs x {budget} tokens per GPU); the world's capacity is "
                f"{budget * topology.world_size}"
            )
        try:
            sub_bag, sub_stats = _solve_group(
                lens[lo:hi],
                home[lo:hi] - ranks.start,
                np.asarray(topology.group_bags, dtype=np.int64),
                model,
                solver,
                budget,
                comm,
            )
        except _NoFit:
            raise ValueError(
                f"found no assignment of the step's {int(lens.sum())} tokens that keeps every GPU within "
                f"the budget of {budget} tokens per GPU (world capacity {budget * topology.world_size}; "
                f"balance group {grp}: {group_tokens} tokens, capacity {budget * len(ranks)}): its long "
                f"sequences do not pack into bags of {sorted(set(topology.group_bags))} GPUs"
            ) from None
        bag[lo:hi] = sub_bag + bag_offset
        stats["groups"].append(sub_stats)
    chunk_seq, chunk_rank, chunk_start, chunk_len = _make_chunks(lens, home, bag, topology)
    return BalancePlan(
        topology=topology,
        model=model,
        seq_lens=lens,
        home_rank=home,
        local_index=local,
        bag=bag,
        chunk_seq=chunk_seq,
        chunk_rank=chunk_rank,
        chunk_start=chunk_start,
        chunk_len=chunk_len,
        solver=solver,
        plan_time_ms=(time.perf_counter() - t0) * 1e3,
        stats=stats,
    )


def identity_plan(
    seq_lens_per_rank: Sequence[Sequence[int]], model: WorkloadModel | CostModel | None = None
) -> BalancePlan:
    """No balancing: every rank computes its own sequences (topology ``g1nW``)."""
    topology = Topology((1,), len(seq_lens_per_rank)) if seq_lens_per_rank else None
    if topology is None:
        raise ValueError("seq_lens_per_rank is empty: need one list per rank")
    lens, home, local = _flatten(seq_lens_per_rank, topology)
    chunk_seq, chunk_rank, chunk_start, chunk_len = _make_chunks(lens, home, home, topology)
    return BalancePlan(
        topology, model or WorkloadModel(), lens, home, local, home.copy(),
        chunk_seq, chunk_rank, chunk_start, chunk_len, solver="identity",
    )


# ---- input ------------------------------------------------------------------------------


class _NoFit(Exception):
    """No assignment within the token budget was found."""


def _check_budget(max_tokens_per_gpu: int | None, lens: np.ndarray, topology: Topology) -> int | None:
    """The budget as an int, after the checks every balance group shares."""
    if max_tokens_per_gpu is None:
        return None
    if isinstance(max_tokens_per_gpu, bool) or int(max_tokens_per_gpu) != max_tokens_per_gpu or max_tokens_per_gpu < 1:
        raise ValueError(f"max_tokens_per_gpu must be a positive integer, got {max_tokens_per_gpu!r}")
    budget = int(max_tokens_per_gpu)
    gmax = max(topology.group_bags)
    too_long = np.flatnonzero(-(-lens // gmax) > budget)
    if too_long.size:
        s = int(too_long[0])
        raise ValueError(
            f"sequence of length {int(lens[s])} needs {-(-int(lens[s]) // gmax)} tokens per GPU "
            f"even on the largest bag (g{gmax}), over the budget of {budget}"
        )
    total, world = int(lens.sum()), topology.world_size
    if total > budget * world:
        raise ValueError(
            f"the step's {total} tokens exceed the budget of {budget} tokens per GPU: the world's "
            f"capacity is {budget * world} ({world} GPUs x {budget})"
        )
    return budget


def _flatten(
    seq_lens_per_rank: Sequence[Sequence[int]], topology: Topology
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if isinstance(seq_lens_per_rank, (str, bytes)) or not hasattr(seq_lens_per_rank, "__len__"):
        raise TypeError("seq_lens_per_rank must be a list with one list of lengths per rank")
    topology.check_world_size(len(seq_lens_per_rank))
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
    home = np.repeat(np.arange(len(arrays), dtype=np.int64), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    local = np.arange(lens.size, dtype=np.int64) - np.repeat(starts, counts)
    return lens, home, local


# ---- one balance group -----------------------------------------------------------------


def _solve_group(
    lens: np.ndarray,
    home: np.ndarray,
    bag_sizes: np.ndarray,
    model: Model,
    solver: str,
    max_tokens_per_gpu: int | None,
    comm: _GroupComm | None = None,
) -> tuple[np.ndarray, dict]:
    """Bag (index within the group) of each sequence of one balance group."""
    n = lens.size
    if n == 0:
        return np.zeros(0, np.int64), {"start": "empty"}
    problem = _Problem(lens, home, bag_sizes, model, comm)
    # Token capacity of every bag (its ranks' chunks differ by at most one token).
    bag_cap = None if max_tokens_per_gpu is None else max_tokens_per_gpu * bag_sizes
    greedy = problem.greedy()
    if solver == "greedy":
        if bag_cap is None or problem.fits(greedy, bag_cap):
            return greedy, {"start": "greedy"}
        name, assign, _, _ = problem.within_budget([("greedy", greedy, 0)], bag_cap, refine=False)
        return assign, {"start": name}
    # For equal bags of equal speed and no communication term the published greedy *is*
    # LPT, so it is the LPT start too. The home start (every sequence on the bag holding
    # its home rank) usually needs few moves.
    starts = [("greedy", greedy)]
    if not problem.uniform_equal:
        starts.append(("lpt", problem.lpt()))
    candidates = [("greedy", greedy, 0)]
    for name, start in starts:
        refined, iters = problem.refine(start)
        candidates.append((name + "+refine", refined, iters))
        candidates.append((name + "+refine+local", problem.localize(refined), iters))
    # The home start, cut down to the best makespan so far and refined.
    cap = min(problem.makespan(a) for _, a, _ in candidates)
    # This start only has to come within the choice's tolerance of the best so far (then it
    # wins on locality), not beat it: stop there, and after few iterations in any case.
    home, iters = problem.refine(
        problem.repair(problem.home_start(), cap), 2 * problem.k + 16, stop_at=cap + 0.25 * problem.token_work
    )
    candidates.append(("home+repair+refine", home, iters))
    name, assign, iters, score = problem.choose(candidates)
    if comm is not None:
        # Routing time is not in the bag loads: charge each bag the routing of its busiest
        # rank under the chosen plan, refine again, and keep the result if it is better.
        for _ in range(2):
            problem.offset = problem.route_offsets(assign)
            again, more = problem.refine(assign, 2 * problem.k + 16)
            problem.offset = None
            if np.array_equal(again, assign):
                break
            alt = [(name, assign, iters), (name + "+route", again, iters + more)]
            name, assign, iters, score = problem.choose(alt)
    if bag_cap is not None and not problem.fits(assign, bag_cap):
        # Only when the budget binds: the plan without it stays as it is otherwise. The
        # chosen plan and greedy are repaired (the other candidates are mostly their
        # refinements), and a capacity-aware LPT joins them.
        name, assign, iters, score = problem.within_budget([(name, assign, iters), candidates[0]], bag_cap)
    stats = {
        "start": name,
        "refine_iters": iters,
        "makespan_over_ideal": problem.makespan(assign) / problem.ideal if problem.ideal > 0 else 1.0,
    }
    if comm is not None:
        stats["predicted_step_s"] = score
    return assign, stats


@dataclass(frozen=True)
class _GroupComm:
    """What a cost model adds for one balance group: per-bag Ulysses seconds per token and
    speed, and where the group's ranks sit (for routing times)."""

    bag_token_s: np.ndarray
    """(k,) Ulysses seconds per chunk token on each bag of the group."""
    bag_speed: np.ndarray
    """(k,) speed of each bag (its slowest rank)."""
    rank_offset: int
    """First rank of the group in the world (sets the ranks' nodes)."""


class _Problem:
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
        comm: _GroupComm | None = None,
    ):
        self.model = model
        self.comm = comm
        self.token_work = float(model.linear(1.0))
        self.true_lens = lens
        # For placement, a sequence shorter than every bag counts as long enough for the
        # smallest ones: it runs there with some empty chunks (nothing better exists).
        self.lens = np.maximum(lens, bag_sizes.min())
        self.home = home
        self.work = model(lens)
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
        self.seq_fixed = model.per_sequence(lens) if isinstance(model, CostModel) else np.zeros(lens.size)
        self.cost = (self.work - self.seq_fixed)[:, None] / class_g[None, :] + self.seq_fixed[:, None]
        if class_u.any():
            self.cost += (lens[:, None] / class_g[None, :]) * class_u[None, :]
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
        self.order = np.argsort(-self.work, kind="stable")
        self.offset: np.ndarray | None = None
        """(k,) fixed seconds added to each bag's load (its ranks' routing), or None."""

    def t(self, s, b):
        """Time of sequence(s) ``s`` on bag(s) ``b`` (broadcasting)."""
        return self.cost[s, self.cls[b]] * self.inv_speed[b]

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
        remainder tokens go round-robin over its ranks (see ``_make_chunks``), so its
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
        """Predicted per-rank times of the group (cost model), routing included."""
        topo = Topology(tuple(self.bag_sizes.tolist()))
        chunk_seq, chunk_rank, _, chunk_len = _make_chunks(self.true_lens, self.home, assign, topo)
        return rank_times(
            self.model, topo, self.true_lens, self.home, chunk_seq, chunk_rank, chunk_len,
            self.bag_sizes[assign], rank_offset=self.comm.rank_offset,
            bag_token_s=self.comm.bag_token_s, bag_speed=self.comm.bag_speed,
        )

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

    def choose(self, candidates: list[tuple[str, np.ndarray, int]]) -> tuple[str, np.ndarray, int, float]:
        """The best candidate by exact peak (workload model) or predicted step time (cost
        model); among those within half a token's work of it (the chunking's own
        resolution) and no worse than the first (greedy), the one that moves fewest tokens."""
        score = self.max_rank_load if self.comm is None else self.step_time
        peak = [score(a) for _, a, _ in candidates]
        greedy_peak = peak[0]
        best = min(peak)
        tol = 0.5 * self.token_work
        ok = [i for i, p in enumerate(peak) if p <= best + tol and p <= greedy_peak]
        i = min(ok, key=lambda i: (self.moved_tokens(candidates[i][1]), peak[i]))
        return (*candidates[i], peak[i])

    def home_start(self) -> np.ndarray:
        """Every sequence on the bag holding its home rank (if it is long enough, else on
        the bag it fits that would finish it earliest)."""
        assign = self.home_bag.copy()
        misfit = np.flatnonzero(self.lens < self.bag_sizes[assign])
        if misfit.size:
            loads = self.loads(assign)
            for s in misfit[np.argsort(-self.work[misfit], kind="stable")].tolist():
                fits = np.flatnonzero(self.bag_sizes <= self.lens[s])
                j = int(fits[np.argmin(loads[fits] + self.t(s, fits))])
                loads[assign[s]] -= self.t(s, assign[s])
                loads[j] += self.t(s, j)
                assign[s] = j
        return assign

    # -- constructions -------------------------------------------------------------------

    def greedy(self) -> np.ndarray:
        """KnapFormer's greedy: by decreasing work, candidate bags are those whose capacity
        (mean per-GPU work x size) covers the sequence and whose size is <= L (else all
        bags of the largest size that fits), and the least occupied candidate wins. It
        balances the work estimate alone (no communication, no speeds), as published."""
        mean = float(self.work.sum()) / float(self.bag_sizes.sum())
        cap = [mean * float(s) for s in self.sizes]
        heaps = [[(0.0, int(b)) for b in bags] for bags in self.bags_of_size]
        assign = np.empty(self.lens.size, dtype=np.int64)
        lens, work = self.lens.tolist(), self.work.tolist()
        sizes = self.sizes.tolist()
        nsz = len(sizes)
        for s in self.order.tolist():
            L, w = lens[s], work[s]
            best_c, best_occ, best_bag = -1, 0.0, 0
            fallback = -1
            for c in range(nsz):
                if sizes[c] > L:
                    break
                fallback = c
                if cap[c] < w:
                    continue
                occ, b = heaps[c][0]
                occ /= cap[c]
                if best_c < 0 or occ < best_occ or (occ == best_occ and b < best_bag):
                    best_c, best_occ, best_bag = c, occ, b
            if best_c < 0:
                best_c = fallback
            load, b = heaps[best_c][0]
            heapq.heapreplace(heaps[best_c], (load + w, b))
            assign[s] = b
        return assign

    def lpt(self) -> np.ndarray:
        """LPT: by decreasing work, the bag that would finish the sequence earliest (lowest
        load after adding it), among bags with g <= L. Bags of one class and speed share a
        heap; with many distinct speeds every bag is looked at."""
        types, type_of_bag = np.unique(
            np.column_stack([self.cls, self.inv_speed]), axis=0, return_inverse=True
        )
        type_of_bag = type_of_bag.reshape(-1)
        assign = np.empty(self.lens.size, dtype=np.int64)
        lens = self.lens.tolist()
        if len(types) > 16:
            loads = np.zeros(self.k)
            every = np.arange(self.k)
            for s in self.order.tolist():
                fin = loads + self.t(s, every)
                fin[self.bag_sizes > lens[s]] = np.inf
                j = int(np.argmin(fin))
                loads[j] = fin[j]
                assign[s] = j
            return assign
        heaps = [[(0.0, int(b)) for b in np.flatnonzero(type_of_bag == ti)] for ti in range(len(types))]
        type_g = [int(self.bag_sizes[h[0][1]]) for h in heaps]
        # (S, types) time of every sequence on a bag of every type.
        t_rows = (self.cost[:, types[:, 0].astype(np.int64)] * types[None, :, 1]).tolist()
        n_types = len(types)
        for s in self.order.tolist():
            L = lens[s]
            row = t_rows[s]
            best_t, best_fin, best_bag = -1, 0.0, 0
            for ti in range(n_types):
                if type_g[ti] > L:
                    continue
                load, b = heaps[ti][0]
                fin = load + row[ti]
                if best_t < 0 or fin < best_fin or (fin == best_fin and b < best_bag):
                    best_t, best_fin, best_bag = ti, fin, b
            heapq.heapreplace(heaps[best_t], (best_fin, best_bag))
            assign[s] = best_bag
        return assign

    # -- refinement ------------------------------------------------------------------------

    def refine(
        self, assign: np.ndarray, max_iters: int | None = None, stop_at: float | None = None
    ) -> tuple[np.ndarray, int]:
        """Moves and swaps out of the most loaded bag while they lower it (or until the
        makespan is at most ``stop_at``).

        Each accepted step replaces the top bag's load by two strictly smaller loads, so
        the sorted load vector decreases lexicographically and the loop terminates."""
        assign = assign.copy()
        g = self.g
        loads = self.loads(assign)
        # Members of every bag in increasing id (a stable sort groups them in one pass).
        order = np.argsort(assign, kind="stable")
        members = [list(m) for m in np.split(order, np.cumsum(np.bincount(assign, minlength=self.k))[:-1])]
        max_iters = max_iters if max_iters is not None else 20 * self.k + 200
        # Below a fraction of one token's work, chunk rounding decides the peak anyway.
        stop = self.ideal + max(self.ideal * _STOP_REL, 0.5 * self.token_work)
        if stop_at is not None:
            stop = max(stop, stop_at)
        lens, cost, cls, inv = self.lens, self.cost, self.cls, self.inv_speed
        n_partners = min(self.k - 1, 4)
        # Each bag's members as an array with their cost rows; only the two bags an
        # accepted step touches are rebuilt (the loop is bound by numpy call overhead).
        cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def arrays(j: int) -> tuple[np.ndarray, np.ndarray]:
            got = cache.get(j)
            if got is None:
                idx = np.asarray(members[j], dtype=np.int64)
                got = cache[j] = (idx, cost[idx])
            return got

        iters = 0
        if self.uniform_equal and self.offset is None:
            return self._refine_uniform(assign, loads, members, max_iters, stop)
        while iters < max_iters and n_partners > 0:
            b = int(np.argmax(loads))
            top = loads[b]
            if top <= stop or not members[b]:
                break
            items, c_items = arrays(b)  # (n_b,), (n_b, classes)
            t_b = c_items[:, cls[b]] * inv[b]
            l_b = lens[items]
            # Partners: the least loaded bags, where a move or swap helps most.
            part = lightest(loads, n_partners + 1)  # was argpartition: see knapray.planning.balance.refine.lightest
            part = part[part != b][:n_partners]
            # Moves, all items x all partners at once: (n_b, p).
            g_p = g[part]
            new = np.maximum(top - t_b[:, None], loads[part][None, :] + c_items[:, cls[part]] * inv[part])
            new[l_b[:, None] < g_p[None, :]] = np.inf
            flat = int(np.argmin(new))
            best_val = float(new.flat[flat])
            action = ("move", int(items[flat // part.size]), int(part[flat % part.size]))
            # Swaps: item s of b with a lighter item t of a partner.
            # Swaps look at the two least loaded partners only: they are where the best
            # swaps land, and the candidate set stays small on every iteration.
            part = part[np.argsort(loads[part], kind="stable")][:2]
            cand = [arrays(j) for j in part.tolist()]
            cand_t = [c[0] for c in cand]
            sizes = [c.size for c in cand_t]
            if sum(sizes) * items.size <= 4096:
                t_all = np.concatenate(cand_t)
                c_all = np.concatenate([c[1] for c in cand])
                j_all = np.repeat(part, sizes)
                t_tb = c_all[:, cls[b]] * inv[b]  # (n_t,) t on b
                t_tj = c_all[np.arange(t_all.size), cls[j_all]] * inv[j_all]  # (n_t,) t on its own bag
                t_sj = c_items[:, cls[j_all]] * inv[j_all]  # (n_b, n_t) s on t's bag
                d_b = t_b[:, None] - t_tb[None, :]  # what b sheds
                new = np.maximum(top - d_b, loads[j_all][None, :] + t_sj - t_tj[None, :])
                g_j = g[j_all][None, :]
                bad = (d_b <= 0) | (l_b[:, None] < g_j) | (lens[t_all][None, :] < g[b])
                new[bad] = np.inf
                if new.size:
                    flat = int(np.argmin(new))
                    if new.flat[flat] < best_val:
                        i, t = divmod(flat, t_all.size)
                        best_val = float(new.flat[flat])
                        action = ("swap", int(items[i]), int(t_all[t]), int(j_all[t]))
            else:
                for j, oth in zip(part.tolist(), cand_t):
                    if not oth.size:
                        continue
                    t_ob = cost[oth, cls[b]] * inv[b]
                    srt = np.argsort(t_ob, kind="stable")
                    t_sorted = t_ob[srt]
                    t_sj = c_items[:, cls[j]] * inv[j]
                    # The swap that leaves both bags equal, if costs on j scale like on b.
                    rho = t_sj / np.maximum(t_b, 1e-300)
                    target = (loads[j] + t_sj - top + t_b) / (1.0 + rho)
                    pos = np.searchsorted(t_sorted, target)
                    for cand in (np.clip(pos - 1, 0, oth.size - 1), np.clip(pos, 0, oth.size - 1)):
                        t_items = oth[srt[cand]]
                        d_b = t_b - cost[t_items, cls[b]] * inv[b]
                        new = np.maximum(top - d_b, loads[j] + t_sj - cost[t_items, cls[j]] * inv[j])
                        valid = (d_b > 0) & (l_b >= g[j]) & (lens[t_items] >= g[b])
                        new = np.where(valid, new, np.inf)
                        i = int(np.argmin(new))
                        if new[i] < best_val:
                            best_val = float(new[i])
                            action = ("swap", int(items[i]), int(t_items[i]), j)
            if not best_val < top * (1 - 1e-12):
                break
            cache.pop(b, None)
            cache.pop(action[-1], None)
            _apply(action, b, members, assign, loads, self.t)
            iters += 1
        return assign, iters

    def _refine_uniform(
        self, assign: np.ndarray, loads: np.ndarray, members: list[list[int]], max_iters: int, stop: float
    ) -> tuple[np.ndarray, int]:
        """``refine`` for equal bags of equal speed without communication terms (every
        homogeneous topology under the workload model): a sequence costs the same on every
        bag, so the best move goes to the least loaded bag and swaps need one weight per
        sequence. Same steps as the general loop, a third of the array operations."""
        w = self.cost[:, 0] * self.inv_speed[0]
        arr: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def weights(j: int) -> tuple[np.ndarray, np.ndarray]:
            """Members of bag j sorted by weight, and their weights."""
            got = arr.get(j)
            if got is None:
                idx = np.asarray(members[j], dtype=np.int64)
                idx = idx[np.argsort(w[idx], kind="stable")]
                got = arr[j] = (idx, w[idx])
            return got

        iters = 0
        while iters < max_iters and self.k > 1:
            b = int(np.argmax(loads))
            top = loads[b]
            if top <= stop or not members[b]:
                break
            items, w_b = weights(b)
            if self.k > 2:
                low = [int(x) for x in lightest(loads, 3) if x != b]  # was argpartition, as above
                j1, j2 = low[0], low[1]
            else:
                j1 = j2 = 1 - b
            # Move to the least loaded bag.
            new = np.maximum(top - w_b, loads[j1] + w_b)
            i = int(np.argmin(new))
            best_val, action = float(new[i]), ("move", int(items[i]), j1)
            # Swap with either of the two least loaded bags.
            for j in {j1, j2}:
                t_items, w_t = weights(j)
                if not t_items.size:
                    continue
                if items.size * t_items.size <= 4096:
                    d = w_b[:, None] - w_t[None, :]  # (n_b, n_t): what b sheds
                else:
                    # Large bags: for each s only the t nearest the ideal exchange
                    # (leaving both bags equal: d* = (top - load_j) / 2) can be best.
                    pos = np.searchsorted(w_t, w_b - (top - loads[j]) / 2)
                    near = np.stack((np.clip(pos - 1, 0, t_items.size - 1), np.clip(pos, 0, t_items.size - 1)), 1)
                    d = w_b[:, None] - w_t[near]  # (n_b, 2)
                new = np.maximum(top - d, loads[j] + d)
                new[d <= 0] = np.inf
                flat = int(np.argmin(new))
                if new.flat[flat] < best_val:
                    i, c = divmod(flat, d.shape[1])
                    t = c if d.shape[1] == t_items.size and items.size * t_items.size <= 4096 else int(near[i, c])
                    best_val, action = float(new.flat[flat]), ("swap", int(items[i]), int(t_items[t]), j)
            if not best_val < top * (1 - 1e-12):
                break
            arr.pop(b, None)
            arr.pop(action[-1], None)
            _apply(action, b, members, assign, loads, lambda x, _: w[x])
            iters += 1
        return assign, iters

    def repair(self, assign: np.ndarray, cap: float) -> np.ndarray:
        """Bring every bag to at most ``cap`` by taking its lightest sequences out, then
        place them best-fit. From the home assignment this moves few tokens."""
        assign = assign.copy()
        loads = self.loads(assign)
        pool: list[int] = []
        for b in np.flatnonzero(loads > cap).tolist():
            items = np.flatnonzero(assign == b)
            t_items = self.t(items, b)
            srt = np.argsort(t_items, kind="stable")
            items, t_items = items[srt], t_items[srt]
            excess = loads[b] - cap
            take = int(np.searchsorted(np.cumsum(t_items), excess)) + 1
            take = min(take, items.size)
            pool.extend(items[:take].tolist())
            loads[b] -= t_items[:take].sum()
        if not pool:
            return assign
        pool_arr = np.asarray(pool, dtype=np.int64)
        pool_arr = pool_arr[np.argsort(-self.work[pool_arr], kind="stable")]
        # Best fit decreasing: each sequence goes where it leaves the least room under the
        # cap; one that fits nowhere goes where it finishes earliest.
        for s in pool_arr.tolist():
            fits = np.flatnonzero(self.bag_sizes <= self.lens[s])
            fin = loads[fits] + self.t(s, fits)
            room = np.where(fin <= cap, cap - fin, np.inf)
            i = int(np.argmin(room)) if np.isfinite(room).any() else int(np.argmin(fin))
            j = int(fits[i])
            loads[j] = fin[i]
            assign[s] = j
        return assign

    def localize(self, assign: np.ndarray) -> np.ndarray:
        """Move sequences to a bag holding their home rank wherever that keeps every bag
        at or under the current makespan, longest sequences first (most tokens saved)."""
        assign = assign.copy()
        loads = self.loads(assign)
        cap = float(loads.max())
        away = np.flatnonzero(
            (assign != self.home_bag) & (self.lens >= self.bag_sizes[self.home_bag])
        )
        if away.size == 0:
            return assign
        away = away[np.argsort(-self.lens[away], kind="stable")]
        loads_l = loads.tolist()
        t_home = self.t(away, self.home_bag[away]).tolist()
        t_cur = self.t(away, assign[away]).tolist()
        for s, h, cur, th, tc in zip(
            away.tolist(), self.home_bag[away].tolist(), assign[away].tolist(), t_home, t_cur
        ):
            new = loads_l[h] + th
            if new <= cap:
                loads_l[h] = new
                loads_l[cur] -= tc
                assign[s] = h
        return assign

    # -- memory budget ---------------------------------------------------------------------

    def bag_tokens(self, assign: np.ndarray) -> np.ndarray:
        """(k,) tokens on every bag."""
        return np.bincount(assign, weights=self.true_lens, minlength=self.k)

    def fits(self, assign: np.ndarray, cap: np.ndarray) -> bool:
        return bool(np.all(self.bag_tokens(assign) <= cap))

    def _allowed(self, seqs: np.ndarray) -> np.ndarray:
        """(len(seqs), k): may the sequence go to the bag (``g <= L``)?"""
        return self.bag_sizes[None, :] <= self.lens[seqs][:, None]

    def within_budget(
        self, candidates: list[tuple[str, np.ndarray, int]], cap: np.ndarray, refine: bool = True
    ) -> tuple[str, np.ndarray, int, float]:
        """The best assignment with every bag within its token capacity ``cap``, from the
        candidates (repaired), a capacity-aware LPT (with ``refine``) and, if neither
        gives one, a packing by tokens; each refined within the capacities if ``refine``.
        Raises ``_NoFit`` when none is found."""
        starts = []
        for name, assign, iters in candidates:
            fixed = assign if self.fits(assign, cap) else self.shed_tokens(assign, cap)
            if fixed is not None and not any(np.array_equal(fixed, a) for _, a, _ in starts):
                starts.append((name + "+budget", fixed, iters))
        builders = [("lpt+budget", self.lpt_within)] if refine or not starts else []
        for name, build in builders + [("pack+budget", self.pack_tokens)]:
            if starts and name == "pack+budget":
                break
            assign = build(cap)
            if assign is not None:
                starts.append((name, assign, 0))
        if not starts:
            raise _NoFit
        if refine:
            starts = [(name + "+refine", self.refine_within(a, cap), it) for name, a, it in starts]
        score = self.max_rank_load if self.comm is None else self.step_time
        scored = [(score(a), self.moved_tokens(a), i) for i, (_, a, _) in enumerate(starts)]
        peak, _, i = min(scored)
        return (*starts[i], peak)

    def shed_tokens(self, assign: np.ndarray, cap: np.ndarray) -> np.ndarray | None:
        """Bring every bag within its capacity: move sequences out of the most overfull bag
        into bags with room (one that clears the excess if possible, then the move that
        finishes earliest), or swap one for a shorter sequence of a bag with room. Each
        step lowers the total excess, so it ends; None if no step is possible."""
        assign = assign.copy()
        loads, tok, lens = self.loads(assign), self.bag_tokens(assign), self.true_lens
        every = np.arange(self.k)
        while True:
            excess = tok - cap
            b = int(np.argmax(excess))
            if excess[b] <= 0:
                return assign
            items = np.flatnonzero(assign == b)
            l_s = lens[items]
            ok = self._allowed(items) & (tok[None, :] + l_s[:, None] <= cap[None, :])
            ok[:, b] = False
            if ok.any():
                fin = np.where(ok, loads[None, :] + self.t(items[:, None], every[None, :]), np.inf)
                clears = ok & (l_s >= excess[b])[:, None]
                if clears.any():
                    fin = np.where(clears, fin, np.inf)
                i, j = np.unravel_index(int(np.argmin(fin)), fin.shape)
                s = int(items[i])
                loads[b] -= self.t(s, b)
                loads[j] += self.t(s, j)
                tok[b] -= lens[s]
                tok[j] += lens[s]
                assign[s] = j
                continue
            others = np.flatnonzero(assign != b)
            l_o, j_o = lens[others], assign[others]
            ok = (
                (l_s[:, None] > l_o[None, :])
                & (tok[j_o][None, :] - l_o[None, :] + l_s[:, None] <= cap[j_o][None, :])
                & self._allowed(items)[:, j_o]
                & (self.bag_sizes[b] <= self.lens[others])[None, :]
            )
            if not ok.any():
                return None
            new_j = loads[j_o][None, :] - self.t(others, j_o)[None, :] + self.t(items[:, None], j_o[None, :])
            new_b = loads[b] - self.t(items, b)[:, None] + self.t(others, b)[None, :]
            i, u = np.unravel_index(int(np.argmin(np.where(ok, np.maximum(new_j, new_b), np.inf))), ok.shape)
            s, o, j = int(items[i]), int(others[u]), int(j_o[u])
            loads[b], loads[j] = new_b[i, u], new_j[i, u]
            tok[b] += lens[o] - lens[s]
            tok[j] += lens[s] - lens[o]
            assign[s], assign[o] = j, b

    def lpt_within(self, cap: np.ndarray) -> np.ndarray | None:
        """LPT restricted to bags with room: by decreasing work, the bag that would finish
        the sequence earliest among those it fits; None if one fits nowhere."""
        assign = np.empty(self.lens.size, dtype=np.int64)
        loads, tok = np.zeros(self.k), np.zeros(self.k)
        every = np.arange(self.k)
        for s in self.order.tolist():
            length = self.true_lens[s]
            fin = loads + self.t(s, every)
            fin[(self.bag_sizes > self.lens[s]) | (tok + length > cap)] = np.inf
            j = int(np.argmin(fin))
            if not np.isfinite(fin[j]):
                return None
            loads[j], tok[j], assign[s] = fin[j], tok[j] + length, j
        return assign

    def pack_tokens(self, cap: np.ndarray) -> np.ndarray | None:
        """Best-fit decreasing by tokens, work ignored: the last resort for a tight budget."""
        assign = np.empty(self.lens.size, dtype=np.int64)
        room = cap.astype(np.float64)
        for s in np.argsort(-self.true_lens, kind="stable").tolist():
            length = self.true_lens[s]
            left = np.where((self.bag_sizes <= self.lens[s]) & (room >= length), room - length, np.inf)
            j = int(np.argmin(left))
            if not np.isfinite(left[j]):
                return None
            room[j], assign[s] = left[j], j
        return assign

    def refine_within(self, assign: np.ndarray, cap: np.ndarray, max_iters: int | None = None) -> np.ndarray:
        """``refine`` restricted to moves and swaps that keep every bag within ``cap``:
        out of the most loaded bag, a move to any bag with room or a swap with a sequence
        of one of the two least loaded bags, while that lowers it."""
        assign = assign.copy()
        loads, tok, lens = self.loads(assign), self.bag_tokens(assign), self.true_lens
        every = np.arange(self.k)
        max_iters = max_iters if max_iters is not None else 2 * self.k + 16
        for _ in range(max_iters):
            b = int(np.argmax(loads))
            top = loads[b]
            items = np.flatnonzero(assign == b)
            if items.size == 0 or self.k < 2:
                break
            t_b, l_s = self.t(items, b), lens[items]
            allowed = self._allowed(items)
            ok = allowed & (tok[None, :] + l_s[:, None] <= cap[None, :])
            ok[:, b] = False
            fin = loads[None, :] + self.t(items[:, None], every[None, :])  # (n_b, k)
            new = np.where(ok, np.maximum(top - t_b[:, None], fin), np.inf)
            flat = int(np.argmin(new))
            best, action = float(new.flat[flat]), ("move", int(items[flat // self.k]), flat % self.k)
            for j in [int(x) for x in np.argsort(loads, kind="stable") if x != b][:2]:
                others = np.flatnonzero(assign == j)
                if not others.size:
                    continue
                l_o = lens[others]
                d_b = t_b[:, None] - self.t(others, b)[None, :]  # what b sheds
                new_j = loads[j] + self.t(items, j)[:, None] - self.t(others, j)[None, :]
                ok = (
                    (d_b > 0) & allowed[:, j][:, None] & (self.bag_sizes[b] <= self.lens[others])[None, :]
                    & (tok[j] - l_o[None, :] + l_s[:, None] <= cap[j])
                    & (tok[b] - l_s[:, None] + l_o[None, :] <= cap[b])
                )
                new = np.where(ok, np.maximum(top - d_b, new_j), np.inf)
                flat = int(np.argmin(new))
                if new.flat[flat] < best:
                    i, u = divmod(flat, others.size)
                    best, action = float(new.flat[flat]), ("swap", int(items[i]), int(others[u]), j)
            if not best < top * (1 - 1e-12):
                break
            s, j = action[1], action[-1]
            if action[0] == "swap":
                o = action[2]
                tok[b] += lens[o] - lens[s]
                tok[j] += lens[s] - lens[o]
                loads[b] += self.t(o, b) - self.t(s, b)
                loads[j] += self.t(s, j) - self.t(o, j)
                assign[s], assign[o] = j, b
            else:
                tok[b] -= lens[s]
                tok[j] += lens[s]
                loads[b] -= self.t(s, b)
                loads[j] += self.t(s, j)
                assign[s] = j
        return assign


def _apply(action: tuple, b: int, members: list[list[int]], assign: np.ndarray, loads: np.ndarray, t) -> None:
    """Carry out a refinement step out of bag ``b``: ``("move", s, j)`` or ``("swap", s,
    t, j)``; ``t(x, j)`` is the time of sequence ``x`` on bag ``j``."""
    if action[0] == "move":
        _, s, j = action
        members[b].remove(s)
        members[j].append(s)
        assign[s] = j
        loads[b] -= t(s, b)
        loads[j] += t(s, j)
    else:
        _, s, u, j = action
        members[b].remove(s)
        members[j].remove(u)
        members[b].append(u)
        members[j].append(s)
        assign[s], assign[u] = j, b
        loads[b] += t(u, b) - t(s, b)
        loads[j] += t(s, j) - t(u, j)


# ---- chunks -----------------------------------------------------------------------------


def _make_chunks(
    lens: np.ndarray, home: np.ndarray, bag: np.ndarray, topology: Topology
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut each sequence into ``g`` contiguous chunks differing by at most one token.

    Which chunks get the extra token rotates within a bag (``offset`` = running sum of
    remainders), so a bag's ranks end up with token totals within one of each other."""
    g = topology.bag_sizes[bag]
    n = lens.size
    if n == 0:
        z = np.zeros(0, np.int64)
        return z, z, z.copy(), z.copy()
    base, rem = np.divmod(lens, g)
    # Running remainder offset per bag, in global sequence order.
    order = np.argsort(bag, kind="stable")
    rem_sorted = rem[order]
    csum = np.cumsum(rem_sorted) - rem_sorted
    bag_sorted = bag[order]
    first = np.concatenate([[True], bag_sorted[1:] != bag_sorted[:-1]])
    group_base = np.maximum.accumulate(np.where(first, csum, 0))
    offset = np.empty(n, np.int64)
    offset[order] = (csum - group_base) % g[order]
    chunk_seq = np.repeat(np.arange(n, dtype=np.int64), g)
    seq_first = np.concatenate([[0], np.cumsum(g)[:-1]])
    c = np.arange(chunk_seq.size, dtype=np.int64) - np.repeat(seq_first, g)
    gs = g[chunk_seq]
    extra = ((c - offset[chunk_seq]) % gs) < rem[chunk_seq]
    chunk_len = base[chunk_seq] + extra
    # Global token offset of each chunk, minus its sequence's global offset.
    ends = np.cumsum(chunk_len)
    seq_begin = np.concatenate([[0], np.cumsum(lens)[:-1]])
    chunk_start = ends - chunk_len - np.repeat(seq_begin, g)
    chunk_rank = topology.bag_starts[bag][chunk_seq] + c
    return chunk_seq, chunk_rank, chunk_start, chunk_len
