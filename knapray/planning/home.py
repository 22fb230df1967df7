"""Keeping sequences on the bag that holds their home rank (fewer tokens travel).

``repair`` cuts the every-sequence-at-home start down to a makespan cap; ``localize``
moves sequences of a finished plan back home where that keeps the makespan. Both visit
sequences in a fixed order with a rule that depends on the loads so far; they reach the
same plans as a per-sequence loop, with work proportional to the sequences they touch
rather than a scan of all sequences (or all bags) per step.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

from .problem import GroupProblem, longest_first


def repair(p: GroupProblem, assign: np.ndarray, cap: float) -> np.ndarray:
    """Bring every bag to at most ``cap`` by taking its lightest sequences out, then
    place them best-fit. From the home assignment this moves few tokens."""
    assign = assign.copy()
    loads = p.loads(assign)
    over = np.flatnonzero(loads > cap)
    if not over.size:
        return assign
    order, bounds = p.by_bag(assign)
    pool: list[np.ndarray] = []
    for b in over.tolist():
        items = order[bounds[b] : bounds[b + 1]]
        t_items = p.t(items, b)
        srt = np.argsort(t_items, kind="stable")
        items, t_items = items[srt], t_items[srt]
        excess = loads[b] - cap
        take = int(np.searchsorted(np.cumsum(t_items), excess)) + 1
        take = min(take, items.size)
        pool.append(items[:take])
        loads[b] -= t_items[:take].sum()
    pool_arr = np.concatenate(pool)
    pool_arr = pool_arr[np.argsort(-p.work[pool_arr], kind="stable")]
    _best_fit(p, pool_arr, assign, loads, cap)
    return assign


def _best_fit(p: GroupProblem, pool: np.ndarray, assign: np.ndarray, loads: np.ndarray, cap: float) -> None:
    """Best fit decreasing: each sequence goes where it leaves the least room under the
    cap; one that fits nowhere goes where it finishes earliest; ties to the lowest bag.

    Bags on which every sequence takes the same time (one class and speed: a *type*) are
    kept sorted by load, so the best bag of a type is found by bisection: a load fits if
    ``load + t <= cap``, and the fitting loads are a prefix of the sorted ones (adding ``t``
    is monotone), the fullest of them leaving the least room. Loads are Python floats
    here (the same double arithmetic) and go back to ``loads`` at the end."""
    types, type_of_bag = p.bag_types()
    load = loads.tolist()
    kinds = []  # per type: (bag size, sorted loads, their bags)
    for ti in range(len(types)):
        bags = np.flatnonzero(type_of_bag == ti)
        order = np.argsort(loads[bags], kind="stable")
        kinds.append((int(p.bag_sizes[bags[0]]), loads[bags[order]].tolist(), bags[order].tolist()))
    # (pool, types) time of every pooled sequence on a bag of every type.
    t_rows = (p.cost[np.ix_(pool, types[:, 0].astype(np.int64))] * types[None, :, 1]).tolist()
    chosen = []
    for length, row in zip(p.lens[pool].tolist(), t_rows):
        best_fit, best_fin = None, None  # (room, bag), (finish, bag)
        for (size, lv, ids), t in zip(kinds, row):
            if size > length:
                continue
            # Fitting loads are a prefix: its end, near cap - t, settled by the exact test.
            q = bisect_right(lv, cap - t)
            while q and lv[q - 1] + t > cap:
                q -= 1
            while q < len(lv) and lv[q] + t <= cap:
                q += 1
            if q:
                q -= 1
                room = cap - (lv[q] + t)
                j = ids[q]
                while q and cap - (lv[q - 1] + t) == room:
                    q -= 1
                    j = min(j, ids[q])
                if best_fit is None or (room, j) < best_fit:
                    best_fit = (room, j)
            elif best_fit is None:
                fin = lv[0] + t
                j, q = ids[0], 0
                while q + 1 < len(lv) and lv[q + 1] + t == fin:
                    q += 1
                    j = min(j, ids[q])
                if best_fin is None or (fin, j) < best_fin:
                    best_fin = (fin, j)
        j = best_fit[1] if best_fit is not None else best_fin[1]
        ti = type_of_bag[j]
        _, lv, ids = kinds[ti]
        q = bisect_left(lv, load[j])
        while ids[q] != j:
            q += 1
        del lv[q], ids[q]
        load[j] += row[ti]
        q = bisect_left(lv, load[j])
        lv.insert(q, load[j])
        ids.insert(q, j)
        chosen.append(j)
    assign[pool] = chosen
    loads[:] = load


def localize(p: GroupProblem, assign: np.ndarray) -> np.ndarray:
    """Move sequences to a bag holding their home rank wherever that keeps every bag
    at or under the current makespan, longest sequences first (most tokens saved).
    Returns ``assign`` itself if none moves.

    A sequence moves iff its home bag's load plus its time is within the makespan. Until
    one moves no load changes, so the next mover is the first sequence in visiting order
    that passes this test on the current loads: the test runs on blocks of the order at a
    time, and only a move (two loads change) restarts it."""
    loads = p.loads(assign)
    cap = float(loads.max())
    away = np.flatnonzero((assign != p.home_bag) & (p.lens >= p.bag_sizes[p.home_bag]))
    if away.size == 0:
        return assign
    away = away[longest_first(p.lens[away])]
    home, cur = p.home_bag[away], assign[away]
    t_home, t_cur = p.t(away, home), p.t(away, cur)
    out = None
    pos, block, n = 0, 256, away.size
    while pos < n:
        end = min(n, pos + block)
        hit = np.flatnonzero(loads[home[pos:end]] + t_home[pos:end] <= cap)
        if not hit.size:
            pos, block = end, block * 2
            continue
        i = pos + int(hit[0])
        h, c = home[i], cur[i]
        loads[h] = loads[h] + t_home[i]
        loads[c] -= t_cur[i]
        if out is None:
            out = assign.copy()
        out[away[i]] = h
        pos, block = i + 1, 256
    return assign if out is None else out
