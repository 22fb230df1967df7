"""Local search on a plan: moves and swaps out of the most loaded bag while they lower it.

Each accepted step replaces the top bag's load by two strictly smaller loads, so the
sorted load vector decreases lexicographically and the loop terminates. A step looks only
at the top bag and a few of the least loaded ones, so its cost is independent of the
number of sequences: each bag's members are kept as an array and only the two bags a step
touches change (nothing is rebuilt from all sequences per step).
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from .problem import GroupProblem

_STOP_REL = 1e-7  # stop refining once the makespan is this close to the ideal
_SORT_ALL_BAGS = 512  # ``lightest`` sorts every load up to this many bags


def lightest(loads: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` least loaded bags in (load, index) order. Every rank planning
    locally must pick the same ones: ``np.argpartition`` leaves the order of its first k,
    and which of several tied values it keeps, to the implementation (NumPy picks a SIMD
    kernel by CPU at run time), so it is only used for the k-th value here."""
    k = min(k, loads.size)
    if k <= 0:
        return np.zeros(0, np.int64)
    if loads.size <= _SORT_ALL_BAGS:
        # The same k: a stable sort is (load, index) order, and the bags at most as loaded
        # as the k-th are its first ones. A whole sort of a few hundred loads costs less
        # than the selection's several calls.
        return loads.argsort(kind="stable")[:k]
    kth = np.partition(loads, k - 1)[k - 1]
    cand = np.flatnonzero(loads <= kth)
    return cand[np.argsort(loads[cand], kind="stable")][:k]


def refine(
    p: GroupProblem, assign: np.ndarray, max_iters: int | None = None, stop_at: float | None = None
) -> tuple[np.ndarray, int]:
    """Moves and swaps out of the most loaded bag while they lower it (or until the
    makespan is at most ``stop_at``). Returns the plan and the steps taken; the plan is
    ``assign`` itself when no step was taken."""
    loads = p.loads(assign)
    members = _Members(p, assign)
    max_iters = max_iters if max_iters is not None else 20 * p.k + 200
    # Below a fraction of one token's work, chunk rounding decides the peak anyway.
    stop = p.ideal + max(p.ideal * _STOP_REL, 0.5 * p.token_work)
    if stop_at is not None:
        stop = max(stop, stop_at)
    if p.uniform_equal and p.offset is None:
        iters = _refine_uniform(p, loads, members, max_iters, stop)
    elif p.cost.shape[1] == 1 and np.all(p.inv_speed == p.inv_speed[0]):
        iters = _refine_one_kind(p, loads, members, max_iters, stop)
    else:
        iters = _refine_general(p, loads, members, max_iters, stop)
    return (members.assign if iters else assign), iters


class _Members:
    """The sequences of every bag, in the order the bag acquired them (increasing id at
    first; a sequence moved in goes last): slices of one sort until a step changes the
    bag, then a Python list (a removal and an append per step), as an array on demand."""

    def __init__(self, p: GroupProblem, assign: np.ndarray):
        self.order, self.bounds = p.by_bag(assign)
        self.start = assign
        self.assign = assign.copy()
        self.lists: dict[int, list[int]] = {}
        self.arrays: dict[int, np.ndarray] = {}

    def __getitem__(self, j: int) -> np.ndarray:
        got = self.arrays.get(j)
        if got is None:
            listed = self.lists.get(j)
            if listed is None:
                return self.order[self.bounds[j] : self.bounds[j + 1]]
            got = self.arrays[j] = np.array(listed, dtype=np.int64)
        return got

    def _list(self, j: int) -> list[int]:
        self.arrays.pop(j, None)
        listed = self.lists.get(j)
        if listed is None:
            listed = self.lists[j] = self.order[self.bounds[j] : self.bounds[j + 1]].tolist()
        return listed

    def move(self, s: int, b: int, j: int) -> None:
        self._list(b).remove(s)
        self._list(j).append(s)
        self.assign[s] = j

    def swap(self, s: int, b: int, u: int, j: int) -> None:
        self._list(b).remove(s)
        self._list(j).remove(u)
        self._list(b).append(u)
        self._list(j).append(s)
        self.assign[s], self.assign[u] = j, b


def _refine_general(p: GroupProblem, loads: np.ndarray, members: _Members, max_iters: int, stop: float) -> int:
    g = p.g
    lens, cost, cls, inv = p.lens, p.cost, p.cls, p.inv_speed
    n_partners = min(p.k - 1, 4)
    # Where every sequence is at least as long as the largest bag (the common case) the
    # size tests pass everywhere: they are left out, which masks nothing more.
    fits_all = bool(lens.size) and bool(lens.min() >= g.max())
    # Each bag's members with their cost rows, their times on the bag itself and their
    # lengths; only the two bags a step touches are rebuilt.
    cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def arrays(j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        got = cache.get(j)
        if got is None:
            idx = members[j]
            rows = cost[idx]
            got = cache[j] = (idx, rows, rows[:, cls[j]] * inv[j], lens[idx])
        return got

    iters = 0
    while iters < max_iters and n_partners > 0:
        b = int(loads.argmax())
        top = loads[b]
        if top <= stop or not members[b].size:
            break
        items, c_items, t_b, l_b = arrays(b)  # (n_b,), (n_b, classes), (n_b,), (n_b,)
        # Partners: the least loaded bags, where a move or swap helps most.
        part = lightest(loads, n_partners + 1)
        part = part[part != b][:n_partners]
        # Moves, all items x all partners at once: (n_b, p).
        t_p = c_items[:, cls[part]] * inv[part]  # (n_b, p) s on each partner
        new = np.maximum(top - t_b[:, None], loads[part][None, :] + t_p)
        if not fits_all:
            too_short = l_b[:, None] < g[part][None, :]
            new[too_short] = np.inf
        flat = int(new.argmin())
        best_val = float(new.flat[flat])
        action = ("move", int(items[flat // part.size]), int(part[flat % part.size]))
        # Swaps: item s of b with a lighter item t of a partner. Swaps look at the two least
        # loaded partners only: they are where the best swaps land, and the candidate set
        # stays small on every iteration (``lightest`` lists them by load already).
        part = part[:2]
        cand = [arrays(j) for j in part.tolist()]
        cand_t = [c[0] for c in cand]
        sizes = [c.size for c in cand_t]
        if sum(sizes) * items.size <= 4096:
            # Per partner, the move's columns repeated for its members: the same products.
            t_all = np.concatenate(cand_t)
            c_all = np.concatenate([c[1] for c in cand])
            j_all = part.repeat(sizes)
            t_tb = c_all[:, cls[b]] * inv[b]  # (n_t,) t on b
            t_tj = np.concatenate([c[2] for c in cand])  # (n_t,) t on its own bag
            t_sj = t_p[:, : part.size].repeat(sizes, axis=1)  # (n_b, n_t) s on t's bag
            d_b = t_b[:, None] - t_tb[None, :]  # what b sheds
            new = np.maximum(top - d_b, loads[j_all][None, :] + t_sj - t_tj[None, :])
            bad = d_b <= 0
            if not fits_all:
                bad |= too_short[:, : part.size].repeat(sizes, axis=1)
                bad |= np.concatenate([c[3] for c in cand])[None, :] < g[b]
            new[bad] = np.inf
            if new.size:
                flat = int(new.argmin())
                if new.flat[flat] < best_val:
                    i, t = divmod(flat, t_all.size)
                    best_val = float(new.flat[flat])
                    action = ("swap", int(items[i]), int(t_all[t]), int(j_all[t]))
        else:
            for j, oth in zip(part.tolist(), cand_t):
                if not oth.size:
                    continue
                t_ob = cost[oth, cls[b]] * inv[b]
                srt = t_ob.argsort(kind="stable")
                t_sorted = t_ob[srt]
                t_sj = c_items[:, cls[j]] * inv[j]
                # The swap that leaves both bags equal, if costs on j scale like on b.
                rho = t_sj / np.maximum(t_b, 1e-300)
                target = (loads[j] + t_sj - top + t_b) / (1.0 + rho)
                pos = np.searchsorted(t_sorted, target)
                for near in (np.clip(pos - 1, 0, oth.size - 1), np.clip(pos, 0, oth.size - 1)):
                    t_items = oth[srt[near]]
                    d_b = t_b - cost[t_items, cls[b]] * inv[b]
                    new = np.maximum(top - d_b, loads[j] + t_sj - cost[t_items, cls[j]] * inv[j])
                    valid = (d_b > 0) & (l_b >= g[j]) & (lens[t_items] >= g[b])
                    new = np.where(valid, new, np.inf)
                    i = int(new.argmin())
                    if new[i] < best_val:
                        best_val = float(new[i])
                        action = ("swap", int(items[i]), int(t_items[i]), j)
        if not best_val < top * (1 - 1e-12):
            break
        j = action[-1]
        cache.pop(b, None)
        cache.pop(j, None)
        s = action[1]
        if action[0] == "move":
            members.move(s, b, j)
            loads[b] -= p.t(s, b)
            loads[j] += p.t(s, j)
        else:
            u = action[2]
            members.swap(s, b, u, j)
            loads[b] += p.t(u, b) - p.t(s, b)
            loads[j] += p.t(s, j) - p.t(u, j)
        iters += 1
    return iters


def _refine_one_kind(p: GroupProblem, loads: np.ndarray, members: _Members, max_iters: int, stop: float) -> int:
    """``_refine_general`` where every bag is of one kind (one class, one speed: equal bags
    under a cost model, whose routing offsets keep the uniform loop out): a sequence takes
    the same time ``tw`` on every bag and fits every bag, so the cost rows, classes, speeds
    and size tests of the general loop drop out. Same expressions, same steps."""
    tw = p.cost[:, 0] * p.inv_speed[0]
    n_partners = min(p.k - 1, 4)
    cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def arrays(j: int) -> tuple[np.ndarray, np.ndarray]:
        got = cache.get(j)
        if got is None:
            idx = members[j]
            got = cache[j] = (idx, tw[idx])
        return got

    iters = 0
    while iters < max_iters and n_partners > 0:
        b = int(loads.argmax())
        top = loads[b]
        if top <= stop or not members[b].size:
            break
        items, t_b = arrays(b)
        part = lightest(loads, n_partners + 1)
        part = part[part != b][:n_partners]
        new = np.maximum(top - t_b[:, None], loads[part][None, :] + t_b[:, None])  # (n_b, p) moves
        flat = int(new.argmin())
        best_val = float(new.flat[flat])
        action = ("move", int(items[flat // part.size]), int(part[flat % part.size]))
        part = part[:2]  # the two least loaded (``lightest``'s order)
        cand = [arrays(j) for j in part.tolist()]
        sizes = [c[0].size for c in cand]
        # Exchanges with d <= 0 are not masked out: their value is at least top, so they
        # can win only where no step is taken (the general loop's size tests always pass).
        if sum(sizes) * items.size <= 4096:
            t_all = np.concatenate([c[0] for c in cand])
            w_t = np.concatenate([c[1] for c in cand])
            j_all = part.repeat(sizes)
            d_b = t_b[:, None] - w_t[None, :]
            new = np.maximum(top - d_b, loads[j_all][None, :] + t_b[:, None] - w_t[None, :])
            if new.size:
                flat = int(new.argmin())
                if new.flat[flat] < best_val:
                    i, t = divmod(flat, t_all.size)
                    best_val = float(new.flat[flat])
                    action = ("swap", int(items[i]), int(t_all[t]), int(j_all[t]))
        else:
            for j, (oth, t_ob) in zip(part.tolist(), cand):
                if not oth.size:
                    continue
                srt = t_ob.argsort(kind="stable")
                t_sorted = t_ob[srt]
                # The swap that leaves both bags equal (t_b / t_b = 1 on equal bags).
                target = (loads[j] + t_b - top + t_b) / (1.0 + t_b / np.maximum(t_b, 1e-300))
                pos = np.searchsorted(t_sorted, target)
                for near in (np.clip(pos - 1, 0, oth.size - 1), np.clip(pos, 0, oth.size - 1)):
                    pick = srt[near]
                    d_b = t_b - t_ob[pick]
                    new = np.maximum(top - d_b, loads[j] + t_b - t_ob[pick])
                    i = int(new.argmin())
                    if new[i] < best_val:
                        best_val = float(new[i])
                        action = ("swap", int(items[i]), int(oth[pick[i]]), j)
        if not best_val < top * (1 - 1e-12):
            break
        j = action[-1]
        cache.pop(b, None)
        cache.pop(j, None)
        s = action[1]
        if action[0] == "move":
            members.move(s, b, j)
            loads[b] -= tw[s]
            loads[j] += tw[s]
        else:
            u = action[2]
            members.swap(s, b, u, j)
            loads[b] += tw[u] - tw[s]
            loads[j] += tw[s] - tw[u]
        iters += 1
    return iters


def _refine_uniform(p: GroupProblem, loads: np.ndarray, members: _Members, max_iters: int, stop: float) -> int:
    """Refinement for equal bags of equal speed without communication terms (every
    homogeneous topology under the workload model): a sequence costs the same on every
    bag, so the best move goes to the least loaded bag and swaps need one weight per
    sequence. Same steps as the general loop, in fewer array operations: the bags are
    kept sorted by load (the top and the least loaded bags without a scan), each touched
    bag's members sorted by weight (a step inserts one or two), and the move and the
    exchanges with both partners are one array expression over the top bag's members."""
    w = p.cost[:, 0] * p.inv_speed[0]
    k = p.k
    if k < 2:
        return 0
    ranked = _RankedLoads(loads)
    by_weight = _SortedMembers(members, w, p.true_lens)
    iters = 0
    while iters < max_iters:
        b = ranked.top()
        top = loads[b]
        items, w_b = by_weight.arrays(b)
        if top <= stop or not items.size:
            break
        j1, j2 = ranked.two_least(b) if k > 2 else (1 - b, 1 - b)
        best_val, action = _best_step(top, w_b, j1, list({j1, j2}), loads, by_weight)
        if not best_val < top * (1 - 1e-12):
            break
        kind, i, t, j = action
        old = {b: float(top), j: float(loads[j])}
        s = int(items[i])
        if kind == "move":
            members.move(s, b, j)
            loads[b] -= w[s]
            loads[j] += w[s]
        else:
            u = int(by_weight.arrays(j)[0][t])
            members.swap(s, b, u, j)
            loads[b] += w[u] - w[s]
            loads[j] += w[s] - w[u]
        by_weight.changed(b, j)
        ranked.update(old)
        iters += 1
    return iters


def _best_step(
    top: float, w_b: np.ndarray, j1: int, partners: list[int], loads: np.ndarray, by_weight: _SortedMembers
) -> tuple[float, tuple[str, int, int, int]]:
    """The best move (to ``j1``) or exchange (with a partner) for the top bag, whose members
    weigh ``w_b`` (sorted): value ``max(top - d, load_j + d)`` for shedding ``d``, and
    ``("move" | "swap", row in b, row in j, j)``. Ties go to the move, then to the
    partners in the given order, then to the first pair in row-major order. Where the
    value is not below ``top`` no step is taken, and the action is meaningless.

    Column 0 is the move (an exchange with nothing: ``d = w_s``); then each small partner
    contributes its members (every pair); a large one (over 4096 pairs) only the two
    members whose weights bracket the exchange that leaves both bags equal,
    ``d* = (top - load_j) / 2``."""
    cols, blocks = [np.zeros(1)], []
    for j in partners:
        t_items, w_t = by_weight.arrays(j)
        if t_items.size and w_b.size * t_items.size <= 4096:
            blocks.append((j, t_items.size))
            cols.append(w_t)
    if blocks:
        d = w_b[:, None] - np.concatenate(cols)[None, :]  # (n_b, 1 + Σ n_j): what b sheds
        col_l = np.empty(d.shape[1])
        col_l[0], at = loads[j1], 1
        for j, c in blocks:
            col_l[at : at + c] = loads[j]
            at += c
    else:
        d = w_b[:, None]
        col_l = loads[j1]
    # An exchange must take weight off b (d > 0); the others are not masked out: their
    # value max(top - d, ...) is at least top, so they can win only where no step is taken.
    new = np.maximum(top - d, col_l + d)
    i = int(new[:, 0].argmin())
    best_val, action = float(new[i, 0]), ("move", i, -1, j1)
    found, at = {}, 1
    for j, c in blocks:
        block = new[:, at : at + c]
        flat = int(block.argmin())
        found[j] = (block.flat[flat], *divmod(flat, c))
        at += c
    for j in partners:
        if j in found:
            val, i, t = found[j]
        else:
            t_items, w_t = by_weight.arrays(j)
            if not t_items.size:
                continue
            # For each s, the members just below and at the exchange target: the first
            # minimum over the (s, below/at) pairs in row-major order.
            pos = w_t.searchsorted(w_b - (top - loads[j]) / 2)
            below, at_ = np.maximum(pos - 1, 0), np.minimum(pos, t_items.size - 1)
            d0, d1 = w_b - w_t[below], w_b - w_t[at_]
            v0, v1 = np.maximum(top - d0, loads[j] + d0), np.maximum(top - d1, loads[j] + d1)
            low = np.minimum(v0, v1)
            i = int(low.argmin())
            val = low[i]
            t = int(below[i]) if v0[i] == val else int(at_[i])
        if val < best_val:
            best_val, action = float(val), ("swap", i, t, j)
    return best_val, action


class _RankedLoads:
    """Bags sorted by ``(load, id)`` (as parallel lists: bisection compares floats), kept
    in step with the ``loads`` array they mirror."""

    def __init__(self, loads: np.ndarray):
        self.loads = loads
        order = np.lexsort((np.arange(loads.size), loads))
        self.lv, self.ids = loads[order].tolist(), order.tolist()

    def top(self) -> int:
        """``argmax(loads)``: the most loaded bag, the first such one on ties."""
        lv = self.lv
        q = len(lv) - 1
        while q and lv[q - 1] == lv[q]:
            q -= 1
        return self.ids[q]

    def two_least(self, b: int) -> tuple[int, int]:
        """The two least loaded bags other than the top one ``b``, lighter first: what
        ``lightest(loads, 3)`` without ``b`` gives. When loads tie there (or ``b`` is among
        the three least loaded) that function itself decides: ties go to the lower index."""
        lv = self.lv
        if lv[0] < lv[1] < lv[2] < self.loads[b]:
            return self.ids[0], self.ids[1]
        low = [int(x) for x in lightest(self.loads, 3) if x != b]
        return low[0], low[1]

    def update(self, old: dict[int, float]) -> None:
        """Bags whose loads changed from ``old[b]`` to ``loads[b]``."""
        lv, ids = self.lv, self.ids
        for b, was in old.items():
            q = bisect_left(lv, was)
            while ids[q] != b:
                q += 1
            del lv[q], ids[q]
            now = float(self.loads[b])
            q = bisect_left(lv, now)
            while q < len(lv) and lv[q] == now and ids[q] < b:
                q += 1
            lv.insert(q, now)
            ids.insert(q, b)


class _SortedMembers:
    """Members of each bag sorted by weight, ties in the order the bag acquired them (a
    stable sort of the bag's member list), made when a bag is looked at and dropped when
    a step changes it. Where bags are small (a sort call per bag is then mostly call
    overhead) and many have been looked at, the bags no step has changed yet are taken
    from one sort of all sequences (by bag, then length: linear-time radix passes),
    where weights are seen to follow lengths."""

    SORT_ALL_AFTER = 64  # bags sorted one by one before all are sorted at once ...
    SMALL_BAGS = 64  # ... if they hold at most this many sequences on average

    def __init__(self, members: _Members, w: np.ndarray, lens: np.ndarray):
        self.members, self.w, self.lens = members, w, lens
        self.sorted: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.sorted_one_by_one = 0
        self.all: tuple[np.ndarray, np.ndarray] | None = None

    def arrays(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, weights)`` of bag ``j``'s members by increasing weight."""
        got = self.sorted.get(j)
        if got is None:
            unchanged = j not in self.members.lists
            if (
                unchanged and self.all is None and self.sorted_one_by_one == self.SORT_ALL_AFTER
                and self.w.size <= self.SMALL_BAGS * (self.members.bounds.size - 1)
            ):
                self.all = self._sort_all()
            if unchanged and self.all is not None and self.all[0].size:
                lo, hi = self.members.bounds[j], self.members.bounds[j + 1]
                got = (self.all[0][lo:hi], self.all[1][lo:hi])
            else:
                idx = self.members[j]
                idx = idx[np.argsort(self.w[idx], kind="stable")]
                got = (idx, self.w[idx])
                self.sorted_one_by_one += 1
            self.sorted[j] = got
        return got

    def _sort_all(self) -> tuple[np.ndarray, np.ndarray]:
        """Every sequence by (starting bag, length, id), with its weight; empty arrays if
        weights do not follow lengths (equal exactly for equal lengths, rising with them)."""
        lens = self.lens
        by_len = np.argsort(lens.astype(np.uint16) if lens.max() < 2**16 else lens, kind="stable")
        bag = self.members.start[by_len]
        order = by_len[np.argsort(bag.astype(np.uint16) if bag.size and bag.max() < 2**16 else bag, kind="stable")]
        w, length, bag = self.w[order], lens[order], self.members.start[order]
        same_bag = bag[1:] == bag[:-1]
        same_len = length[1:] == length[:-1]
        rises = w[1:] > w[:-1]
        if not np.all(~same_bag | np.where(same_len, w[1:] == w[:-1], rises)):
            return np.zeros(0, np.int64), np.zeros(0)
        return order, w

    def changed(self, *bags: int) -> None:
        for j in bags:
            self.sorted.pop(j, None)
