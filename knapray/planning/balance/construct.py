"""Starting plans of one balance group: KnapFormer's greedy, LPT, and every sequence at home.

Greedy and LPT visit sequences by decreasing work and put each on a least loaded bag. With
one kind of bag (the common case: all bags of one size and speed) that is a heap of
``(load, bag)``; ``least_loaded`` replays the heap's choices a round of bags at a time in
numpy, so the plans are the heap's exactly.
"""

from __future__ import annotations

import heapq

import numpy as np

from .problem import GroupProblem


def greedy(p: GroupProblem) -> np.ndarray:
    """KnapFormer's greedy: by decreasing work, candidate bags are those whose capacity
    (mean per-GPU work x size) covers the sequence and whose size is <= L (else all
    bags of the largest size that fits), and the least occupied candidate wins. It
    balances the work estimate alone (no communication, no speeds), as published."""
    assign = np.empty(p.lens.size, dtype=np.int64)
    if p.sizes.size == 1:
        # One size: every bag is a candidate (or, for a sequence over the capacity, the
        # fallback is all bags of that size), so the least loaded bag wins.
        assign[p.order] = least_loaded(p.work[p.order], p.bags_of_size[0], np.zeros(p.k))
        return assign
    mean = float(p.work.sum()) / float(p.bag_sizes.sum())
    cap = [mean * float(s) for s in p.sizes]
    heaps = [[(0.0, int(b)) for b in bags] for bags in p.bags_of_size]
    lens, work = p.lens.tolist(), p.work.tolist()
    sizes = p.sizes.tolist()
    nsz = len(sizes)
    for s in p.order.tolist():
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


def lpt(p: GroupProblem) -> np.ndarray:
    """LPT: by decreasing work, the bag that would finish the sequence earliest (lowest
    load after adding it), among bags with g <= L. Bags of one class and speed share a
    heap; with many distinct speeds every bag is looked at."""
    types, type_of_bag = p.bag_types()
    assign = np.empty(p.lens.size, dtype=np.int64)
    if len(types) == 1:
        # One kind of bag: the same heap for every sequence.
        c, inv = int(types[0, 0]), types[0, 1]
        assign[p.order] = least_loaded(p.cost[p.order, c] * inv, np.arange(p.k), np.zeros(p.k))
        return assign
    lens = p.lens.tolist()
    if len(types) > 16:
        loads = np.zeros(p.k)
        every = np.arange(p.k)
        for s in p.order.tolist():
            fin = loads + p.t(s, every)
            fin[p.bag_sizes > lens[s]] = np.inf
            j = int(np.argmin(fin))
            loads[j] = fin[j]
            assign[s] = j
        return assign
    heaps = [[(0.0, int(b)) for b in np.flatnonzero(type_of_bag == ti)] for ti in range(len(types))]
    type_g = [int(p.bag_sizes[h[0][1]]) for h in heaps]
    # (S, types) time of every sequence on a bag of every type.
    t_rows = (p.cost[:, types[:, 0].astype(np.int64)] * types[None, :, 1]).tolist()
    n_types = len(types)
    for s in p.order.tolist():
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


def home_start(p: GroupProblem) -> np.ndarray:
    """Every sequence on the bag holding its home rank (if it is long enough, else on
    the bag it fits that would finish it earliest)."""
    assign = p.home_bag.copy()
    misfit = np.flatnonzero(p.lens < p.bag_sizes[assign])
    if misfit.size:
        loads = p.loads(assign)
        for s in misfit[np.argsort(-p.work[misfit], kind="stable")].tolist():
            fits = np.flatnonzero(p.bag_sizes <= p.lens[s])
            j = int(fits[np.argmin(loads[fits] + p.t(s, fits))])
            loads[assign[s]] -= p.t(s, assign[s])
            loads[j] += p.t(s, j)
            assign[s] = j
    return assign


# A round shorter than this falls back to the heap for a while (see least_loaded); with
# fewer bags than _HEAP_ONLY the heap alone is faster than rounds in numpy.
_MIN_ROUND = 16
_HEAP_ONLY = 64


def least_loaded(weights: np.ndarray, bags: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """The bag each item goes to when, in turn, item ``i`` goes to the least loaded bag
    (``(load, bag id)`` smallest: a heap's choice) and adds ``weights[i]`` to its load.

    Exactly the heap's choices, a round at a time: with bags sorted by ``(load, id)``, item
    ``i`` of a round goes to the ``i``-th bag as long as no bag loaded earlier in the round
    has dropped below that bag (every bag the round already loaded is then still heavier).
    The longest such prefix is taken at once, and the bags merged back into order. When
    rounds come out short (a few light bags soak up many items), the heap itself runs for
    a while: it is the same rule, one item at a time."""
    m = weights.size
    out = np.empty(m, dtype=np.int64)
    if bags.size < _HEAP_ONLY:
        heap = list(zip(loads.astype(np.float64).tolist(), bags.tolist()))
        heapq.heapify(heap)
        for i, w in enumerate(weights.tolist()):
            load, b = heap[0]
            heapq.heapreplace(heap, (load + w, b))
            out[i] = b
        return out
    order = np.lexsort((bags, loads))
    lo, ids = loads[order].astype(np.float64), bags[order].astype(np.int64)
    kb, pos = ids.size, 0
    while pos < m:
        r = min(kb, m - pos)
        new = lo[:r] + weights[pos : pos + r]
        # Item i keeps the order's bag if every bag loaded before it in the round is now
        # heavier than that bag (equal loads would be settled by id: end the round there).
        ahead = np.flatnonzero(np.minimum.accumulate(new[:-1]) <= lo[1:r])
        v = r if not ahead.size else int(ahead[0]) + 1
        out[pos : pos + v] = ids[:v]
        pos += v
        if v < _MIN_ROUND and pos < m and kb > _MIN_ROUND:
            heap = list(zip(np.concatenate([new[:v], lo[v:]]).tolist(), ids.tolist()))
            heapq.heapify(heap)
            stop = min(m, pos + 4 * kb)
            for i, w in zip(range(pos, stop), weights[pos:stop].tolist()):
                load, b = heap[0]
                heapq.heapreplace(heap, (load + w, b))
                out[i] = b
            pos = stop
            heap.sort()
            lo = np.array([h[0] for h in heap])
            ids = np.array([h[1] for h in heap], dtype=np.int64)
            continue
        lo, ids = _merge(lo[v:], ids[v:], new[:v], ids[:v])
    return out


def _merge(lo_a: np.ndarray, ids_a: np.ndarray, lo_b: np.ndarray, ids_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bags of ``a`` (sorted by ``(load, id)``) and ``b`` (any order) in ``(load, id)`` order."""
    ob = np.lexsort((ids_b, lo_b))
    lo = np.concatenate([lo_a, lo_b[ob]])
    ids = np.concatenate([ids_a, ids_b[ob]])
    # Two sorted runs: a stable sort merges them in linear time; equal loads across the
    # runs need the id order, which only a two-key sort gives.
    o = np.argsort(lo, kind="stable")
    lo, ids = lo[o], ids[o]
    same = lo[1:] == lo[:-1]
    if same.any() and (ids[1:][same] < ids[:-1][same]).any():
        o = np.lexsort((ids, lo))
        lo, ids = lo[o], ids[o]
    return lo, ids
