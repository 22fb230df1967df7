"""plan_balance(): assign every sequence to a bag so that per-GPU work is even.

This is makespan scheduling on "uniform machines": bag ``j`` of ``g_j`` GPUs finishes when
its per-GPU load ``P_j = Σ W(L)/g_j`` is done, and a sequence may only go to a bag with
``g_j <= L`` (one shorter than every bag goes to a smallest bag, some chunks empty). Two solvers:

``greedy``  KnapFormer's published baseline (kept exact for comparison).
``knapray`` (default) starts from the better of two constructions (LPT for uniform
            machines, and the greedy itself, so it is never worse than greedy), improves
            it by moves and swaps out of the most loaded bag until no step helps, then,
            without raising the makespan, moves sequences back to a bag that contains
            their home rank so fewer tokens travel.
"""

from __future__ import annotations

import heapq
import time
from typing import Sequence

import numpy as np

from .plan import BalancePlan
from .topology import Topology
from .workload import WorkloadModel

SOLVERS = ("knapray", "greedy")
_STOP_REL = 1e-7  # stop refining once the makespan is this close to the ideal


def plan_balance(
    seq_lens_per_rank: Sequence[Sequence[int]],
    topology: Topology,
    model: WorkloadModel | None = None,
    solver: str = "knapray",
    max_tokens_per_gpu: int | None = None,
) -> BalancePlan:
    """Plan one step: ``seq_lens_per_rank[r]`` lists the lengths of rank ``r``'s sequences.

    ``max_tokens_per_gpu``: optional memory budget; a sequence whose chunk would exceed it
    even on the largest bag is rejected with an error naming it.
    """
    t0 = time.perf_counter()
    model = model or WorkloadModel()
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; valid: {', '.join(SOLVERS)}")
    lens, home, local = _flatten(seq_lens_per_rank, topology)
    bag = np.empty(lens.size, dtype=np.int64)
    stats: dict = {"groups": []}
    for grp in range(topology.num_groups):
        ranks = topology.group_ranks(grp)
        lo = np.searchsorted(home, ranks.start)
        hi = np.searchsorted(home, ranks.stop)
        bag_offset = grp * len(topology.group_bags)
        sub_bag, sub_stats = _solve_group(
            lens[lo:hi],
            home[lo:hi] - ranks.start,
            np.asarray(topology.group_bags, dtype=np.int64),
            model,
            solver,
            max_tokens_per_gpu,
        )
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
    seq_lens_per_rank: Sequence[Sequence[int]], model: WorkloadModel | None = None
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
    model: WorkloadModel,
    solver: str,
    max_tokens_per_gpu: int | None,
) -> tuple[np.ndarray, dict]:
    """Bag (index within the group) of each sequence of one balance group."""
    n = lens.size
    if n == 0:
        return np.zeros(0, np.int64), {"start": "empty"}
    gmax = int(bag_sizes.max())
    if max_tokens_per_gpu is not None:
        too_long = np.flatnonzero(-(-lens // gmax) > max_tokens_per_gpu)
        if too_long.size:
            s = int(too_long[0])
            raise ValueError(
                f"sequence of length {int(lens[s])} needs {-(-int(lens[s]) // gmax)} tokens per GPU "
                f"even on the largest bag (g{gmax}), over the budget of {max_tokens_per_gpu}"
            )
    work = model(lens)
    problem = _Problem(lens, home, bag_sizes, work, model)
    greedy = problem.greedy()
    if solver == "greedy":
        return greedy, {"start": "greedy"}
    homogeneous = bool(np.all(bag_sizes == bag_sizes[0]))
    # For equal bags the published greedy *is* LPT, so it is the LPT start too. The home
    # start (every sequence on the bag holding its home rank) usually needs few moves.
    starts = [("greedy", greedy)]
    if not homogeneous:
        starts.append(("lpt", problem.lpt()))
    candidates = [("greedy", greedy, 0)]
    for name, start in starts:
        refined, iters = problem.refine(start)
        candidates.append((name + "+refine", refined, iters))
        candidates.append((name + "+refine+local", problem.localize(refined), iters))
    # The home start, cut down to the best makespan so far and refined.
    cap = min(problem.makespan(a) for _, a, _ in candidates)
    # Few iterations: this start only has to win where it is nearly as balanced already.
    home, iters = problem.refine(problem.repair(problem.home_start(), cap), 2 * problem.k + 16)
    candidates.append(("home+repair+refine", home, iters))
    name, assign, iters = problem.choose(candidates)
    stats = {
        "start": name,
        "refine_iters": iters,
        "makespan_over_ideal": problem.makespan(assign) / problem.ideal,
    }
    return assign, stats


class _Problem:
    """Loads, sizes and costs of one balance group, shared by the solver steps."""

    def __init__(
        self,
        lens: np.ndarray,
        home: np.ndarray,
        bag_sizes: np.ndarray,
        work: np.ndarray,
        model: WorkloadModel,
    ):
        self.model = model
        self.token_work = float(model.linear(1.0))
        self.true_lens = lens
        # For placement, a sequence shorter than every bag counts as long enough for the
        # smallest ones: it runs there with some empty chunks (nothing better exists).
        self.lens = np.maximum(lens, bag_sizes.min())
        self.home = home
        self.work = work
        self.bag_sizes = bag_sizes
        self.k = bag_sizes.size
        self.home_bag = np.repeat(np.arange(self.k), bag_sizes)[home]
        self.sizes = np.unique(bag_sizes)  # ascending
        self.bags_of_size = [np.flatnonzero(bag_sizes == s) for s in self.sizes]
        self.ideal = float(work.sum()) / float(bag_sizes.sum())
        # Visit order of the constructions: decreasing work, ties by id (deterministic).
        self.order = np.argsort(-work, kind="stable")

    def loads(self, assign: np.ndarray) -> np.ndarray:
        """Per-GPU load of every bag."""
        return np.bincount(assign, weights=self.work, minlength=self.k) / self.bag_sizes

    def makespan(self, assign: np.ndarray) -> float:
        return float(self.loads(assign).max())

    def max_rank_load(self, assign: np.ndarray) -> float:
        """Exact work of the busiest rank once sequences are cut into chunks: a bag's
        remainder tokens go round-robin over its ranks (see ``_make_chunks``), so its
        busiest rank has ``ceil`` of the leftover tokens."""
        g = self.bag_sizes[assign]
        base, rem = np.divmod(self.true_lens, g)
        attn = np.bincount(assign, weights=self.model.attention(self.true_lens) / g, minlength=self.k)
        base_tok = np.bincount(assign, weights=base, minlength=self.k)
        rem_tok = np.bincount(assign, weights=rem, minlength=self.k)
        top_tok = base_tok + np.ceil(rem_tok / self.bag_sizes - 1e-9)
        return float((attn + self.model.linear(top_tok)).max())

    def moved_tokens(self, assign: np.ndarray) -> float:
        """Tokens leaving their home rank (a home-bag sequence keeps ~1/g of its tokens)."""
        lens = self.true_lens
        at_home = assign == self.home_bag
        return float(lens.sum() - (lens[at_home] / self.bag_sizes[assign[at_home]]).sum())

    def choose(self, candidates: list[tuple[str, np.ndarray, int]]) -> tuple[str, np.ndarray, int]:
        """The best-balanced candidate; among those within half a token's work of it (the
        chunking's own resolution) and no worse than greedy, the one that moves fewest tokens."""
        peak = [self.max_rank_load(a) for _, a, _ in candidates]
        greedy_peak = peak[0]
        best = min(peak)
        tol = 0.5 * self.token_work
        ok = [i for i, p in enumerate(peak) if p <= best + tol and p <= greedy_peak]
        i = min(ok, key=lambda i: (self.moved_tokens(candidates[i][1]), peak[i]))
        return candidates[i]

    def home_start(self) -> np.ndarray:
        """Every sequence on the bag holding its home rank (if it is long enough, else on
        the least loaded bag it fits)."""
        assign = self.home_bag.copy()
        misfit = np.flatnonzero(self.lens < self.bag_sizes[assign])
        if misfit.size:
            loads = self.loads(np.where(self.lens >= self.bag_sizes[assign], assign, 0) * 0 + assign)
            for s in misfit[np.argsort(-self.work[misfit], kind="stable")].tolist():
                fits = np.flatnonzero(self.bag_sizes <= self.lens[s])
                j = int(fits[np.argmin(loads[fits] + self.work[s] / self.bag_sizes[fits])])
                loads[assign[s]] -= self.work[s] / self.bag_sizes[assign[s]]
                loads[j] += self.work[s] / self.bag_sizes[j]
                assign[s] = j
        return assign

    # -- constructions -------------------------------------------------------------------

    def greedy(self) -> np.ndarray:
        """KnapFormer's greedy: by decreasing work, candidate bags are those whose capacity
        (mean per-GPU work x size) covers the sequence and whose size is <= L (else all
        bags of the largest size that fits), and the least occupied candidate wins."""
        mean = self.ideal
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
        """LPT for uniform machines: by decreasing work, the bag that would finish the
        sequence earliest (lowest per-GPU load after adding it), among bags with g <= L."""
        heaps = [[(0.0, int(b)) for b in bags] for bags in self.bags_of_size]
        assign = np.empty(self.lens.size, dtype=np.int64)
        lens, work = self.lens.tolist(), self.work.tolist()
        sizes = [float(s) for s in self.sizes.tolist()]
        for s in self.order.tolist():
            L, w = lens[s], work[s]
            best_c, best_fin, best_bag = -1, 0.0, 0
            for c, g in enumerate(sizes):
                if g > L:
                    break
                load, b = heaps[c][0]
                fin = load + w / g
                if best_c < 0 or fin < best_fin or (fin == best_fin and b < best_bag):
                    best_c, best_fin, best_bag = c, fin, b
            load, b = heaps[best_c][0]
            heapq.heapreplace(heaps[best_c], (load + w / sizes[best_c], b))
            assign[s] = b
        return assign

    # -- refinement ------------------------------------------------------------------------

    def refine(self, assign: np.ndarray, max_iters: int | None = None) -> tuple[np.ndarray, int]:
        """Moves and swaps out of the most loaded bag while they lower it.

        Each accepted step replaces the top bag's load by two strictly smaller loads, so
        the sorted load vector decreases lexicographically and the loop terminates."""
        assign = assign.copy()
        g = self.bag_sizes.astype(np.float64)
        loads = self.loads(assign)
        members = [list(np.flatnonzero(assign == b)) for b in range(self.k)]
        max_iters = max_iters if max_iters is not None else 20 * self.k + 200
        # Below a fraction of one token's work, chunk rounding decides the peak anyway.
        stop = self.ideal + max(self.ideal * _STOP_REL, 0.5 * self.token_work)
        lens, work = self.lens, self.work
        n_partners = min(self.k - 1, 4)
        iters = 0
        while iters < max_iters and n_partners > 0:
            b = int(np.argmax(loads))
            top = loads[b]
            if top <= stop or not members[b]:
                break
            items = np.asarray(members[b], dtype=np.int64)
            w_b, l_b = work[items], lens[items]
            # Partners: the least loaded bags, where a move or swap helps most.
            part = np.argpartition(loads, n_partners)[: n_partners + 1]
            part = part[part != b][:n_partners]
            # Moves, all items x all partners at once: (n_b, p).
            g_p = g[part]
            new = np.maximum(top - w_b[:, None] / g[b], loads[part][None, :] + w_b[:, None] / g_p)
            new[l_b[:, None] < g_p[None, :]] = np.inf
            flat = int(np.argmin(new))
            best_val = float(new.flat[flat])
            action = ("move", int(items[flat // part.size]), int(part[flat % part.size]))
            # Swaps: item s of b with a lighter item t of a partner.
            # Swaps look at the two least loaded partners only: they are where the best
            # swaps land, and the candidate set stays small on every iteration.
            part = part[np.argsort(loads[part], kind="stable")][:2]
            cand_t = [np.asarray(members[j], dtype=np.int64) for j in part.tolist()]
            sizes = [c.size for c in cand_t]
            if sum(sizes) * items.size <= 4096:
                t_all = np.concatenate(cand_t)
                j_all = np.repeat(part, sizes)
                d = w_b[:, None] - work[t_all][None, :]  # (n_b, n_t)
                g_j = g[j_all][None, :]
                new = np.maximum(top - d / g[b], loads[j_all][None, :] + d / g_j)
                bad = (d <= 0) | (l_b[:, None] < g_j) | (lens[t_all][None, :] < g[b])
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
                    srt = np.argsort(work[oth], kind="stable")
                    w_sorted = work[oth][srt]
                    # The swap that leaves both bags equal moves d* of work.
                    d_star = (top - loads[j]) / (1.0 / g[b] + 1.0 / g[j])
                    pos = np.searchsorted(w_sorted, w_b - d_star)
                    for cand in (np.clip(pos - 1, 0, oth.size - 1), np.clip(pos, 0, oth.size - 1)):
                        t_items = oth[srt[cand]]
                        d = w_b - work[t_items]
                        new = np.maximum(top - d / g[b], loads[j] + d / g[j])
                        valid = (d > 0) & (l_b >= g[j]) & (lens[t_items] >= g[b])
                        new = np.where(valid, new, np.inf)
                        i = int(np.argmin(new))
                        if new[i] < best_val:
                            best_val = float(new[i])
                            action = ("swap", int(items[i]), int(t_items[i]), j)
            if not best_val < top * (1 - 1e-12):
                break
            if action[0] == "move":
                _, s, j = action
                members[b].remove(s)
                members[j].append(s)
                assign[s] = j
                loads[b] -= work[s] / g[b]
                loads[j] += work[s] / g[j]
            else:
                _, s, t, j = action
                members[b].remove(s)
                members[j].remove(t)
                members[b].append(t)
                members[j].append(s)
                assign[s], assign[t] = j, b
                loads[b] += (work[t] - work[s]) / g[b]
                loads[j] += (work[s] - work[t]) / g[j]
            iters += 1
        return assign, iters

    def repair(self, assign: np.ndarray, cap: float) -> np.ndarray:
        """Bring every bag to at most ``cap`` by taking its lightest sequences out, then
        place them by LPT. From the home assignment this moves few tokens."""
        assign = assign.copy()
        g = self.bag_sizes.astype(np.float64)
        loads = self.loads(assign)
        pool: list[int] = []
        for b in np.flatnonzero(loads > cap).tolist():
            items = np.flatnonzero(assign == b)
            items = items[np.argsort(self.work[items], kind="stable")]
            excess = (loads[b] - cap) * g[b]
            take = int(np.searchsorted(np.cumsum(self.work[items]), excess)) + 1
            take = min(take, items.size)
            pool.extend(items[:take].tolist())
            loads[b] -= self.work[items[:take]].sum() / g[b]
        if not pool:
            return assign
        pool_arr = np.asarray(pool, dtype=np.int64)
        pool_arr = pool_arr[np.argsort(-self.work[pool_arr], kind="stable")]
        # Best fit decreasing: each sequence goes where it leaves the least room under the
        # cap; one that fits nowhere goes where it finishes earliest.
        for s in pool_arr.tolist():
            fits = np.flatnonzero(self.bag_sizes <= self.lens[s])
            fin = loads[fits] + self.work[s] / g[fits]
            room = np.where(fin <= cap, cap - fin, np.inf)
            i = int(np.argmin(room)) if np.isfinite(room).any() else int(np.argmin(fin))
            j = int(fits[i])
            loads[j] += self.work[s] / g[j]
            assign[s] = j
        return assign

    def localize(self, assign: np.ndarray) -> np.ndarray:
        """Move sequences to a bag holding their home rank wherever that keeps every bag
        at or under the current makespan, longest sequences first (most tokens saved)."""
        assign = assign.copy()
        loads = self.loads(assign)
        cap = float(loads.max())
        g = self.bag_sizes.astype(np.float64)
        away = np.flatnonzero(
            (assign != self.home_bag) & (self.lens >= self.bag_sizes[self.home_bag])
        )
        if away.size == 0:
            return assign
        away = away[np.argsort(-self.lens[away], kind="stable")]
        loads_l = loads.tolist()
        g_l = g.tolist()
        work = self.work
        for s, h, cur, w in zip(
            away.tolist(), self.home_bag[away].tolist(), assign[away].tolist(), work[away].tolist()
        ):
            new = loads_l[h] + w / g_l[h]
            if new <= cap:
                loads_l[h] = new
                loads_l[cur] -= w / g_l[cur]
                assign[s] = h
        return assign


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
