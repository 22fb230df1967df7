"""``topology: auto``: the bag layout with the lowest predicted step time.

Candidates are multisets of bag sizes (``g1n16+g4n2+g8n1``, homogeneous ones included)
whose sizes divide the number of attention heads (Ulysses splits heads) and fit in a node;
bags are packed into nodes so none crosses a node boundary. A candidate's score is the
mean predicted step time (``CostModel``) of the ``knapray`` solver's plans for recent
steps' lengths, so the search rewards exactly what the solver can reach with it.

The search runs on a *sample world* of at most ``search_ranks`` ranks (contiguous blocks
of ranks of the recent steps, a different block per step), then scales the winning
composition to the real world (one balance group, or the sample composition replicated
into balance groups, whichever predicts faster):

1. seeds: every homogeneous topology, and *demand* seeds: for a target step time ``T``
   (the ideal one plus a margin), every sequence wants the smallest bag on which it
   takes at most ``T``; packing those sequences into bags of their size says how many
   bags of each size the step needs, the rest of the ranks become bags of one;
2. hill climbing from the best seed: split a bag in two, merge two into one, or trade
   two bags for two others of the same total, while the score improves.

With per-rank speeds (``CostModel.rank_speed``), nodes with slow ranks get the node
patterns with the smallest bags, and inside a node bags are ordered so slow ranks sit in
small bags (a bag runs at its slowest member's speed).
"""

from __future__ import annotations

from collections.abc import Callable

import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..costs.cost import CostModel
from ..balance.solver import plan_balance
from ..shapes.topology import Topology, pack_nodes

_IMPROVE_REL = 2e-4  # a move must lower the score by this fraction to count
_CLIMB_STARTS = 3  # hill climbs start from up to this many of the best seeds,
_CLIMB_WITHIN = 0.015  # those within this fraction of the best seed's score


@dataclass(frozen=True)
class TopologyChoice:
    """The chosen topology and how the search got there."""

    topology: Topology
    predicted_step_s: float
    """Mean predicted step time of the chosen topology on the sample steps (full world)."""
    ideal_step_s: float
    """Mean ideal step time of those steps (perfect balance, no communication)."""
    search_ranks: int
    """Ranks of the sample world the composition was searched on."""
    scores: dict[str, float] = field(default_factory=dict)
    """Mean predicted step time of every composition tried on the sample world."""
    search_s: float = 0.0
    """Wall time of the search."""

    @property
    def efficiency(self) -> float:
        return self.ideal_step_s / self.predicted_step_s if self.predicted_step_s > 0 else 1.0

    def summary(self) -> dict:
        return {
            "topology": composition_spec(self.topology),
            "layout": self.topology.spec,
            "num_groups": self.topology.num_groups,
            "predicted_step_s": self.predicted_step_s,
            "ideal_step_s": self.ideal_step_s,
            "efficiency": self.efficiency,
            "search_ranks": self.search_ranks,
            "candidates": len(self.scores),
            "search_s": self.search_s,
        }


def candidate_sizes(cost: CostModel, gpus_per_node: int | None = None, max_bag: int | None = None) -> list[int]:
    """Bag sizes ``auto`` considers: divisors of ``num_heads`` that fit in a node."""
    gpn = gpus_per_node or cost.gpus_per_node
    cap = gpn if max_bag is None else min(gpn, max_bag)
    return [g for g in range(1, cap + 1) if cost.num_heads % g == 0]


def composition_spec(topology: Topology) -> str:
    """``g8n2+g3n4+g1n4``: bag counts of one balance group, largest first (the layout may
    interleave them; ``Topology.parse(spec, gpus_per_node=...)`` rebuilds a packed one)."""
    counts = np.bincount(np.asarray(topology.group_bags))
    return "+".join(f"g{g}n{int(counts[g])}" for g in range(counts.size - 1, 0, -1) if counts[g])


def choose_topology(
    length_history: Sequence[Sequence[Sequence[int]]],
    world_size: int,
    cost_model: CostModel | None = None,
    gpus_per_node: int | None = None,
    **kwargs,
) -> Topology:
    """The topology with the lowest predicted step time for recent steps' lengths.

    ``length_history``: recent steps, each a list of per-rank lists of sequence lengths;
    steps with another number of ranks are re-dealt, batch by batch in order, onto
    ``world_size`` ranks. ``gpus_per_node`` defaults to the cost model's. Keyword
    arguments go to ``search_topology``."""
    return search_topology(length_history, world_size, cost_model, gpus_per_node, **kwargs).topology


def search_topology(
    length_history: Sequence[Sequence[Sequence[int]]],
    world_size: int,
    cost_model: CostModel | None = None,
    gpus_per_node: int | None = None,
    *,
    sizes: Sequence[int] | None = None,
    max_steps: int = 2,
    search_ranks: int = 64,
    max_evals: int = 120,
    max_group_ranks: int = 1024,
) -> TopologyChoice:
    """``choose_topology`` with the details (scores, predicted and ideal step time).

    ``sizes``: bag sizes to consider (default ``candidate_sizes``); ``max_steps``: recent
    steps scored per candidate; ``search_ranks``: size of the sample world;
    ``max_evals``: candidates scored at most; ``max_group_ranks``: largest balance group
    of the final topology."""
    t0 = time.perf_counter()
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    world_size = int(world_size)
    cost = cost_model if cost_model is not None else CostModel()
    gpn = int(gpus_per_node or cost.gpus_per_node)
    if gpn != cost.gpus_per_node:
        cost = cost.replace(gpus_per_node=gpn)
    speeds = cost.speeds(world_size)
    sizes = sorted(set(sizes)) if sizes is not None else candidate_sizes(cost, gpn)
    bad = [g for g in sizes if g < 1 or g > gpn or cost.num_heads % g]
    if bad or not sizes:
        raise ValueError(
            f"bag sizes {bad or sizes} are not usable: each must divide num_heads={cost.num_heads} "
            f"and be at most gpus_per_node={gpn}"
        )
    if 1 not in sizes:
        raise ValueError(f"bag sizes {sizes} must include 1 (it fills the ranks other bags leave)")
    steps = _recent_steps(length_history, world_size, max_steps)
    if not steps:
        # Nothing to score: the largest equal bags that tile the world (safe for long sequences).
        for g in sorted(sizes, reverse=True):
            layout = _layout({g: world_size // g}, gpn, speeds) if world_size % g == 0 else None
            if layout is not None:
                return TopologyChoice(Topology(tuple(layout)), float("nan"), float("nan"), 0, {},
                                      time.perf_counter() - t0)

    # ---- sample world -----------------------------------------------------------------
    n = _search_size(world_size, gpn, search_ranks)
    blocks = world_size // n
    samples = []
    for i, step in enumerate(steps):
        j = i % blocks
        samples.append((step[j * n : (j + 1) * n], cost.with_rank_speed(speeds[j * n : (j + 1) * n])))
    # One layout serves every sample only if the sample world is the whole world.
    search_speeds = speeds if blocks == 1 else None
    scores: dict[tuple[tuple[int, int], ...], float] = {}

    def score(counts: dict[int, int]) -> float:
        key = _key(counts)
        if key not in scores:
            layout = _layout(counts, gpn, search_speeds)
            topo = Topology(tuple(layout))
            scores[key] = float(np.mean([plan_balance(st, topo, c).predicted_step_time for st, c in samples]))
        return scores[key]

    seeds: list[dict[int, int]] = []
    for g in sizes:
        if n % g == 0:
            seeds.append({g: n // g})
    for margin in (1.02, 1.05, 1.1):
        for floor in sizes:
            seeds.extend(_demand_seeds(samples, sizes, n, gpn, margin, floor))
    scored = []
    for counts in seeds:
        if _key(counts) in scores or _layout(counts, gpn, None) is None:
            continue
        scored.append((score(counts), len(scored), counts))
    if not scored:
        raise ValueError(f"no bag layout of sizes {sizes} fills {n} ranks in nodes of {gpn}")
    scored.sort(key=lambda x: x[:2])
    # ---- hill climbing from the best few seeds --------------------------------------------
    best_score, _, best = scored[0]
    starts = [x for x in scored[:_CLIMB_STARTS] if x[0] <= best_score * (1 + _CLIMB_WITHIN)]
    for start_score, _, start in starts:
        counts, counts_score = climb(
            start, start_score, sizes,
            lambda cand: None if _key(cand) in scores or _layout(cand, gpn, None) is None else score(cand),
            lambda: len(scores) >= max_evals)
        if counts_score < best_score:
            best, best_score = counts, counts_score
    # ---- full world -------------------------------------------------------------------------
    full_steps = [(step, cost) for step in steps]
    options = []
    if blocks == 1:
        options.append(Topology(tuple(_layout(best, gpn, speeds))))
    else:
        group = _group_size(world_size, gpn, max_group_ranks)
        scaled = {g: c * (group // n) for g, c in best.items()}
        layout = _layout(scaled, gpn, speeds if group == world_size else None)
        if layout is not None:
            options.append(Topology(tuple(layout), world_size // group))
        if group != n:
            options.append(Topology(tuple(_layout(best, gpn, None)), blocks))
    results = []
    for topo in options:
        times, ideals = [], []
        for step, c in full_steps:
            plan = plan_balance(step, topo, c)
            times.append(plan.predicted_step_time)
            ideals.append(c.ideal_step_time(plan.seq_lens, world_size))
        results.append((float(np.mean(times)), float(np.mean(ideals)), topo))
    predicted, ideal, topo = min(results, key=lambda r: r[0])
    return TopologyChoice(
        topo, predicted, ideal, n,
        {"+".join(f"g{g}n{c}" for g, c in key): v for key, v in scores.items()},
        time.perf_counter() - t0,
    )


# ---- helpers -------------------------------------------------------------------------------


def _key(counts: dict[int, int]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted(((g, c) for g, c in counts.items() if c), reverse=True))


def _recent_steps(history, world_size: int, max_steps: int) -> list[list[list[int]]]:
    """The last ``max_steps`` non-empty steps, re-dealt onto ``world_size`` ranks if needed."""
    steps = [s for s in history if any(len(r) for r in s)]
    if not steps:
        return []
    if all(len(s) == world_size for s in steps):
        return [[list(r) for r in s] for s in steps[-max_steps:]]
    batches = [list(r) for s in steps for r in s]
    if len(batches) < world_size:
        return [[batches[i % len(batches)] for i in range(world_size)]]
    k = len(batches) // world_size
    dealt = [batches[i * world_size : (i + 1) * world_size] for i in range(k)]
    return dealt[-max_steps:]


def _search_size(world_size: int, gpn: int, search_ranks: int) -> int:
    """Largest divisor of the world that is a multiple of the node size and at most
    ``search_ranks`` (the whole world if that is small or not node-aligned)."""
    if world_size <= max(search_ranks, gpn) or world_size % gpn:
        return world_size
    best = gpn
    for n in range(gpn, search_ranks + 1, gpn):
        if world_size % n == 0:
            best = n
    return best


def _group_size(world_size: int, gpn: int, max_group_ranks: int) -> int:
    if world_size <= max_group_ranks:
        return world_size
    best = gpn
    for n in range(gpn, max_group_ranks + 1, gpn):
        if world_size % n == 0:
            best = n
    return best


def climb(counts: dict[int, int], counts_score: float, sizes: list[int],
          evaluate: Callable[[dict[int, int]], float | None], spent: Callable[[], bool],
          improve_rel: float = _IMPROVE_REL) -> tuple[dict[int, int], float]:
    """First-improvement hill climbing over ``_neighbours`` (split a bag, merge two, trade
    two for two) until no move lowers the score by ``improve_rel``: the one climber of the
    run-level search here and the per-step one (``pertopo``). ``evaluate(candidate)``
    scores a composition, None to pass it by (scored before, or no layout); ``spent()``:
    the evaluation budget is used up."""
    improved = True
    while improved and not spent():
        improved = False
        for cand in _neighbours(counts, sizes):
            if spent():
                break
            s = evaluate(cand)
            if s is None:
                continue
            if s < counts_score * (1 - improve_rel):
                counts, counts_score, improved = cand, s, True
                break
    return counts, counts_score


def _demand_seeds(
    samples, sizes: list[int], n: int, gpn: int, margin: float, floor: int = 1
) -> list[dict[int, int]]:
    """Bags each size needs so that every sequence runs on the smallest bag that finishes
    it within ``margin`` x the ideal step time, but a sequence that needs more than one
    GPU on a bag of at least ``floor`` (first fit decreasing per size)."""
    per_step = []
    for step, cost in samples:
        lens = np.asarray([x for r in step for x in r], dtype=np.int64)
        if lens.size == 0:
            continue
        target = cost.ideal_step_time(lens, n) * margin - cost.fixed_s
        times = np.stack([cost.seq_cost(lens, g) for g in sizes])  # (sizes, S)
        fits = times <= target
        # The smallest size that fits; the largest if none does.
        want = np.where(fits.any(axis=0), np.argmax(fits, axis=0), len(sizes) - 1)
        want = np.where(want > 0, np.maximum(want, sizes.index(floor)), want)
        bags = {}
        for i, g in enumerate(sizes):
            if g == 1:
                continue
            t = np.sort(times[i, want == i])[::-1]
            free: list[float] = []
            for x in t.tolist():
                for j, f in enumerate(free):
                    if f >= x:
                        free[j] -= x
                        break
                else:
                    free.append(target - x)
            bags[g] = len(free)
        per_step.append(bags)
    if not per_step:
        return []
    counts = {g: int(np.ceil(np.mean([b.get(g, 0) for b in per_step]))) for g in sizes if g > 1}
    # Too many ranks: drop bags of the size with the most, one at a time.
    while sum(g * c for g, c in counts.items()) > n:
        g = max((g for g in counts if counts[g]), key=lambda g: g * counts[g])
        counts[g] -= 1
    counts[1] = n - sum(g * c for g, c in counts.items())
    seeds = [counts]
    # If the layout does not pack into nodes, trade bags for ones until it does.
    fixed = dict(counts)
    while _layout(fixed, gpn, None) is None:
        g = max((g for g in fixed if g > 1 and fixed[g]), key=lambda g: fixed[g], default=None)
        if g is None:
            break
        fixed[g] -= 1
        fixed[1] = fixed.get(1, 0) + g
    if fixed != counts:
        seeds.append(fixed)
    return seeds


def _neighbours(counts: dict[int, int], sizes: list[int]):
    """Compositions one split, merge or two-for-two trade away."""
    present = [g for g in sorted(counts, reverse=True) if counts[g]]
    seen = set()

    def emit(remove: tuple[int, ...], add: tuple[int, ...]):
        new = dict(counts)
        for g in remove:
            new[g] = new.get(g, 0) - 1
        if any(v < 0 for v in new.values()):
            return None
        for g in add:
            new[g] = new.get(g, 0) + 1
        key = _key(new)
        if key in seen:
            return None
        seen.add(key)
        return {g: c for g, c in new.items() if c}

    size_set = set(sizes)
    moves = []
    for g in present:  # split
        for a in sizes:
            b = g - a
            if 1 <= b <= a and b in size_set:
                moves.append(((g,), (a, b)))
    for a, b in itertools.combinations_with_replacement(present, 2):  # merge and trade
        if a == b and counts[a] < 2:
            continue
        total = a + b
        if total in size_set:
            moves.append(((a, b), (total,)))
        for c in sizes:
            d = total - c
            if 1 <= d <= c and d in size_set and sorted((c, d)) != sorted((a, b)):
                moves.append(((a, b), (c, d)))
    for remove, add in moves:
        new = emit(remove, add)
        if new is not None:
            yield new


def _layout(counts: dict[int, int], gpn: int, speeds: np.ndarray | None) -> list[int] | None:
    """Bags in rank order, packed into nodes; None if they do not pack. With ``speeds``
    (one per rank), slow ranks go to small bags."""
    bags = [g for g in sorted(counts, reverse=True) for _ in range(counts[g])]
    nodes = pack_nodes(bags, gpn)
    if nodes is None:
        return None
    if speeds is None or len(speeds) != sum(bags) or np.all(speeds == speeds[0]):
        return [g for node in nodes for g in node]
    n_nodes = len(nodes)
    node_speed = [float(speeds[i * gpn : (i + 1) * gpn].min()) for i in range(n_nodes)]
    slots = sorted(range(n_nodes), key=lambda i: (node_speed[i], i))
    # Patterns with the smallest bags first (the partial last node keeps its place).
    full = [p for p in nodes if sum(p) == gpn]
    tail = [p for p in nodes if sum(p) != gpn]
    order = sorted(full, key=lambda p: (max(p), -p.count(1)))
    placed: list[list[int] | None] = [None] * n_nodes
    for slot, pattern in zip([s for s in slots if s < len(full)], order):
        placed[slot] = pattern
    if tail:
        placed[n_nodes - 1] = tail[0]
    out: list[int] = []
    for i, pattern in enumerate(placed):
        out.extend(_order_in_node(pattern, speeds[i * gpn : i * gpn + sum(pattern)]))
    return out


def _order_in_node(pattern: list[int], speeds: np.ndarray) -> list[int]:
    """The order of a node's bags that keeps the most capacity (sum of size x slowest speed)."""
    if np.all(speeds == speeds[0]) or len(set(pattern)) == 1:
        return list(pattern)
    best, best_cap = list(pattern), -1.0
    for perm in set(itertools.permutations(pattern)):
        cap, start = 0.0, 0
        for g in perm:
            cap += g * float(speeds[start : start + g].min())
            start += g
        if cap > best_cap + 1e-12 or (abs(cap - best_cap) <= 1e-12 and list(perm) > best):
            best, best_cap = list(perm), cap
    return best
