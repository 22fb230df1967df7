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
    t_rows = p.cost[np.ix_(pool, types[:, 0].astype(np.int64))] * types[None, :, 1]
    if len(types) == 1:
        # One kind of bag (it fits every sequence: the lengths are at least its size).
        _, lv, ids = kinds[0]
        assign[pool] = _best_fit_one_kind(t_rows[:, 0].tolist(), lv, ids, cap)
        for x, j in zip(lv, ids):
            loads[j] = x
        return
    t_rows = t_rows.tolist()
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


def _best_fit_one_kind(times: list[float], lv: list[float], ids: list[int], cap: float) -> list[int]:
    """``_best_fit`` over bags of one kind: ``lv`` their loads ascending, ``ids`` the bags
    (both updated in place). A bag's load only grows, so it moves up the order: shifted
    there, not removed and inserted. A bag with less room than the smallest sequence can
    never be the best fit again: it leaves for a second sorted list, which only the
    earliest-finish rule (no bag fits) still reads, so the shifts stay short."""
    smallest = min(times, default=0.0)
    # Closed from the start: bags too full for the smallest sequence (the open loads then
    # stay below the closed ones, and the two lists read as one sorted list).
    first_closed = bisect_right(lv, cap - smallest)
    while first_closed and lv[first_closed - 1] + smallest > cap:
        first_closed -= 1
    while first_closed < len(lv) and lv[first_closed] + smallest <= cap:
        first_closed += 1
    closed_lv, closed_ids = lv[first_closed:], ids[first_closed:]
    del lv[first_closed:], ids[first_closed:]
    chosen = []
    for t in times:
        n = len(lv)
        q = bisect_right(lv, cap - t)
        while q and lv[q - 1] + t > cap:
            q -= 1
        while q < n and lv[q] + t <= cap:
            q += 1
        if q:  # the fullest bag that fits; equal room to the lowest bag
            q -= 1
            room = cap - (lv[q] + t)
            at = q
            while q and cap - (lv[q - 1] + t) == room:
                q -= 1
                if ids[q] < ids[at]:
                    at = q
        else:  # fits nowhere: where it finishes earliest (the lowest loads of both lists)
            chosen.append(_earliest(t, lv, ids, closed_lv, closed_ids, smallest, cap))
            continue
        j = ids[at]
        new = lv[at] + t
        if new + smallest > cap:  # no sequence fits it any more
            del lv[at], ids[at]
            q = bisect_left(closed_lv, new)
            closed_lv.insert(q, new)
            closed_ids.insert(q, j)
        else:
            to = bisect_left(lv, new, at + 1) - 1  # its place once it has left ``at``
            lv[at:to] = lv[at + 1 : to + 1]
            ids[at:to] = ids[at + 1 : to + 1]
            lv[to], ids[to] = new, j
        chosen.append(j)
    # Hand back every bag's load, in one list.
    lv += closed_lv
    ids += closed_ids
    return chosen


def _earliest(
    t: float, lv: list[float], ids: list[int], closed_lv: list[float], closed_ids: list[int], smallest: float,
    cap: float,
) -> int:
    """Put a sequence that fits no bag on the one where it finishes earliest (the lowest
    bag among equal finishes); both lists are sorted, ``lv``'s loads below the others'
    (a bag too full for the ``smallest`` sequence is closed)."""
    both_lv, both_ids = lv + closed_lv, ids + closed_ids
    fin = both_lv[0] + t
    at = q = 0
    while q + 1 < len(both_lv) and both_lv[q + 1] + t == fin:
        q += 1
        if both_ids[q] < both_ids[at]:
            at = q
    j = both_ids[at]
    new = both_lv[at] + t
    if at < len(lv):
        del lv[at], ids[at]
    else:
        del closed_lv[at - len(lv)], closed_ids[at - len(lv)]
    dst_lv, dst_ids = (closed_lv, closed_ids) if new + smallest > cap else (lv, ids)
    q = bisect_left(dst_lv, new)
    dst_lv.insert(q, new)
    dst_ids.insert(q, j)
    return j


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
    t_home = p.t(away, p.home_bag[away])
    # The test on the loads as they are: no sequence passing it, none ever moves (and
    # the visiting order need not be made).
    if not np.any(loads[p.home_bag[away]] + t_home <= cap):
        return assign
    order = longest_first(p.lens[away])
    away, t_home = away[order], t_home[order]
    home, cur = p.home_bag[away], assign[away]
    t_cur = p.t(away, cur)
    if away.size <= _SCALAR_VISITS:
        return _localize_scalar(assign, loads.tolist(), cap, away, home, t_home, cur, t_cur)
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


_SCALAR_VISITS = 4096
"""``localize`` visits up to this many sequences one by one (a test and a move cost a few
Python operations, where each numpy call on a block costs a microsecond or more)."""


def _localize_scalar(
    assign: np.ndarray, load: list[float], cap: float, away: np.ndarray, home: np.ndarray, t_home: np.ndarray,
    cur: np.ndarray, t_cur: np.ndarray,
) -> np.ndarray:
    """``localize``'s visits in visiting order, on Python floats: the same test and the same
    two updates per move, in the same double arithmetic, so the same moves."""
    movers = []
    for i, (h, th) in enumerate(zip(home.tolist(), t_home.tolist())):
        if load[h] + th <= cap:
            load[h] = load[h] + th
            c = int(cur[i])
            load[c] -= float(t_cur[i])
            movers.append(i)
    if not movers:
        return assign
    out = assign.copy()
    out[away[movers]] = home[movers]
    return out
