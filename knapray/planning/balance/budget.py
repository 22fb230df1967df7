"""The memory budget: every bag within its token capacity (``max_tokens_per_gpu x g``).

Used only when the plan chosen without a budget breaks it: the chosen plan and greedy are
repaired (sequences moved or swapped out of bags over their capacity into bags with room),
a capacity-aware LPT joins them, all are refined by moves and swaps that keep every bag
within its capacity, and the best is kept; a packing by tokens is the last resort.
"""

from __future__ import annotations

import numpy as np

from .problem import Candidate, GroupProblem, NoFit


def within_budget(
    p: GroupProblem, candidates: list[Candidate], cap: np.ndarray, refine: bool = True
) -> tuple[str, np.ndarray, int, float]:
    """The best assignment with every bag within its token capacity ``cap``, from the
    candidates (repaired), a capacity-aware LPT (with ``refine``) and, if neither
    gives one, a packing by tokens; each refined within the capacities if ``refine``.
    Raises ``NoFit`` when none is found."""
    starts = []
    for name, assign, iters in candidates:
        fixed = assign if p.fits(assign, cap) else shed_tokens(p, assign, cap)
        if fixed is not None and not any(np.array_equal(fixed, a) for _, a, _ in starts):
            starts.append((name + "+budget", fixed, iters))
    builders = [("lpt+budget", lpt_within)] if refine or not starts else []
    for name, build in builders + [("pack+budget", pack_tokens)]:
        if starts and name == "pack+budget":
            break
        assign = build(p, cap)
        if assign is not None:
            starts.append((name, assign, 0))
    if not starts:
        raise NoFit
    if refine:
        starts = [(name + "+refine", refine_within(p, a, cap), it) for name, a, it in starts]
    score = p.max_rank_load if p.comm is None else p.step_time
    scored = [(score(a), p.moved_tokens(a), i) for i, (_, a, _) in enumerate(starts)]
    peak, _, i = min(scored)
    return (*starts[i], peak)


def shed_tokens(p: GroupProblem, assign: np.ndarray, cap: np.ndarray) -> np.ndarray | None:
    """Bring every bag within its capacity: move sequences out of the most overfull bag
    into bags with room (one that clears the excess if possible, then the move that
    finishes earliest), or swap one for a shorter sequence of a bag with room. Each
    step lowers the total excess, so it ends; None if no step is possible."""
    assign = assign.copy()
    loads, tok, lens = p.loads(assign), p.bag_tokens(assign), p.true_lens
    every = np.arange(p.k)
    while True:
        excess = tok - cap
        b = int(np.argmax(excess))
        if excess[b] <= 0:
            return assign
        items = np.flatnonzero(assign == b)
        l_s = lens[items]
        ok = p.allowed(items) & (tok[None, :] + l_s[:, None] <= cap[None, :])
        ok[:, b] = False
        if ok.any():
            fin = np.where(ok, loads[None, :] + p.t(items[:, None], every[None, :]), np.inf)
            clears = ok & (l_s >= excess[b])[:, None]
            if clears.any():
                fin = np.where(clears, fin, np.inf)
            i, j = np.unravel_index(int(np.argmin(fin)), fin.shape)
            s = int(items[i])
            loads[b] -= p.t(s, b)
            loads[j] += p.t(s, j)
            tok[b] -= lens[s]
            tok[j] += lens[s]
            assign[s] = j
            continue
        others = np.flatnonzero(assign != b)
        l_o, j_o = lens[others], assign[others]
        ok = (
            (l_s[:, None] > l_o[None, :])
            & (tok[j_o][None, :] - l_o[None, :] + l_s[:, None] <= cap[j_o][None, :])
            & p.allowed(items)[:, j_o]
            & (p.bag_sizes[b] <= p.lens[others])[None, :]
        )
        if not ok.any():
            return None
        new_j = loads[j_o][None, :] - p.t(others, j_o)[None, :] + p.t(items[:, None], j_o[None, :])
        new_b = loads[b] - p.t(items, b)[:, None] + p.t(others, b)[None, :]
        i, u = np.unravel_index(int(np.argmin(np.where(ok, np.maximum(new_j, new_b), np.inf))), ok.shape)
        s, o, j = int(items[i]), int(others[u]), int(j_o[u])
        loads[b], loads[j] = new_b[i, u], new_j[i, u]
        tok[b] += lens[o] - lens[s]
        tok[j] += lens[s] - lens[o]
        assign[s], assign[o] = j, b


def lpt_within(p: GroupProblem, cap: np.ndarray) -> np.ndarray | None:
    """LPT restricted to bags with room: by decreasing work, the bag that would finish
    the sequence earliest among those it fits; None if one fits nowhere."""
    assign = np.empty(p.lens.size, dtype=np.int64)
    loads, tok = np.zeros(p.k), np.zeros(p.k)
    every = np.arange(p.k)
    for s in p.order.tolist():
        length = p.true_lens[s]
        fin = loads + p.t(s, every)
        fin[(p.bag_sizes > p.lens[s]) | (tok + length > cap)] = np.inf
        j = int(np.argmin(fin))
        if not np.isfinite(fin[j]):
            return None
        loads[j], tok[j], assign[s] = fin[j], tok[j] + length, j
    return assign


def pack_tokens(p: GroupProblem, cap: np.ndarray) -> np.ndarray | None:
    """Best-fit decreasing by tokens, work ignored: the last resort for a tight budget."""
    assign = np.empty(p.lens.size, dtype=np.int64)
    room = cap.astype(np.float64)
    for s in np.argsort(-p.true_lens, kind="stable").tolist():
        length = p.true_lens[s]
        left = np.where((p.bag_sizes <= p.lens[s]) & (room >= length), room - length, np.inf)
        j = int(np.argmin(left))
        if not np.isfinite(left[j]):
            return None
        room[j], assign[s] = left[j], j
    return assign


def refine_within(p: GroupProblem, assign: np.ndarray, cap: np.ndarray, max_iters: int | None = None) -> np.ndarray:
    """``refine`` restricted to moves and swaps that keep every bag within ``cap``:
    out of the most loaded bag, a move to any bag with room or a swap with a sequence
    of one of the two least loaded bags, while that lowers it."""
    assign = assign.copy()
    loads, tok, lens = p.loads(assign), p.bag_tokens(assign), p.true_lens
    every = np.arange(p.k)
    max_iters = max_iters if max_iters is not None else 2 * p.k + 16
    for _ in range(max_iters):
        b = int(np.argmax(loads))
        top = loads[b]
        items = np.flatnonzero(assign == b)
        if items.size == 0 or p.k < 2:
            break
        t_b, l_s = p.t(items, b), lens[items]
        allowed = p.allowed(items)
        ok = allowed & (tok[None, :] + l_s[:, None] <= cap[None, :])
        ok[:, b] = False
        fin = loads[None, :] + p.t(items[:, None], every[None, :])  # (n_b, k)
        new = np.where(ok, np.maximum(top - t_b[:, None], fin), np.inf)
        flat = int(np.argmin(new))
        best, action = float(new.flat[flat]), ("move", int(items[flat // p.k]), flat % p.k)
        for j in [int(x) for x in np.argsort(loads, kind="stable") if x != b][:2]:
            others = np.flatnonzero(assign == j)
            if not others.size:
                continue
            l_o = lens[others]
            d_b = t_b[:, None] - p.t(others, b)[None, :]  # what b sheds
            new_j = loads[j] + p.t(items, j)[:, None] - p.t(others, j)[None, :]
            ok = (
                (d_b > 0) & allowed[:, j][:, None] & (p.bag_sizes[b] <= p.lens[others])[None, :]
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
            loads[b] += p.t(o, b) - p.t(s, b)
            loads[j] += p.t(s, j) - p.t(o, j)
            assign[s], assign[o] = j, b
        else:
            tok[b] -= lens[s]
            tok[j] += lens[s]
            loads[b] -= p.t(s, b)
            loads[j] += p.t(s, j)
            assign[s] = j
    return assign
