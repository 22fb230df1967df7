"""A topology chosen every step: a partition of every node into aligned blocks, planned
together with the assignment of sequences.

KnapFormer fixes its bags for the whole run, and ``autotopo`` picks them from recent
steps; data whose mix changes from step to step (image-only steps, then video-heavy ones)
wants other bags every step. Here every step picks its own bags among the aligned
power-of-two blocks of each node (``blocks``; their process groups exist from the start),
by predicted step time (``CostModel``) of the ``knapray`` solver's plan on them:

1. candidates: the homogeneous partitions (every node cut into blocks of one size), and
   *demand* compositions: for a target step time (the step's ideal times a margin) every
   sequence wants the smallest block on which it takes at most the target; packing those
   sequences into blocks of their size says how many blocks of each size the step needs
   (``autotopo``'s demand seeds, on this step alone);
2. hill climbing from the best: split a block into its halves, merge two into one, or
   trade two for two of the same total, while the prediction improves, up to
   ``max_evals`` plans in all;
3. optionally a ``base`` topology (the run's static one, whose groups exist too) is a
   candidate as well, so the step is never predicted slower than on it.

With a memory budget (``max_tokens_per_gpu``) a layout whose plan cannot keep it (a
sequence too long for the largest bag, or no assignment that fits) is left out; if no
layout keeps it, ``plan_step`` raises ValueError (``plan_from_gathered`` then plans the
step without the budget and warns, as on a static topology).

A composition becomes node partitions by placing blocks largest first, each on the node
whose own sequences want blocks of that size most (so long sequences are routed inside
their node), ties to the lowest node; inside a node blocks go largest first, which keeps
every power-of-two block aligned. Everything is deterministic in the lengths, so every
rank derives the same partition and plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .autotopo import _demand_seeds, _key, climb
from ..shapes.blocks import _node_size, block_sizes
from ..costs.cost import CostModel
from ..balance.plan import BalancePlan
from ..balance.solver import plan_balance
from ..shapes.topology import Topology

DEMAND_MARGINS = (1.0, 1.03, 1.1, 1.3)
"""Target step times (x the ideal) of the demand compositions."""
_IMPROVE_REL = 1e-4  # a climbing move must lower the prediction by this fraction


@dataclass(frozen=True)
class StepTopology:
    """This step's plan on its own partition, and how it was chosen."""

    plan: BalancePlan
    """The plan; ``plan.topology`` is the step's partition (or ``base``)."""
    predicted_step_s: float
    source: str
    """What produced the winner: ``base``, ``homogeneous``, ``demand`` or ``climb``."""
    base_step_s: float | None = None
    """Predicted step time on ``base`` (None without one)."""
    scores: dict[str, float] = field(default_factory=dict)
    """Predicted step time of every layout tried (spec -> seconds)."""
    search_s: float = 0.0

    @property
    def topology(self) -> Topology:
        return self.plan.topology


def plan_step(
    seq_lens_per_rank: Sequence[Sequence[int]],
    cost: CostModel | None = None,
    *,
    gpus_per_node: int | None = None,
    base: Topology | None = None,
    max_evals: int = 24,
    solver: str = "knapray",
    max_tokens_per_gpu: int | None = None,
) -> StepTopology:
    """Choose this step's partition of every node into aligned blocks and plan on it.

    ``base``: a topology of the run (the static one) also tried as is. ``max_evals``:
    plans computed at most (every candidate costs one ``plan_balance``, with ``solver``).
    ``max_tokens_per_gpu``: the memory budget every candidate's plan keeps (layouts that
    cannot are skipped; ValueError if none can)."""
    t0 = time.perf_counter()
    cost = cost if cost is not None else CostModel()
    gpn = int(gpus_per_node or cost.gpus_per_node)
    if gpn != cost.gpus_per_node:
        cost = cost.replace(gpus_per_node=gpn)
    if max_evals < 1:
        raise ValueError(f"max_evals must be >= 1, got {max_evals}")
    step = [list(r) for r in seq_lens_per_rank]
    world = len(step)
    if world < 1:
        raise ValueError("seq_lens_per_rank is empty: need one list per rank")
    node = _node_size(world, gpn)
    n_nodes = world // node
    sizes = block_sizes(node, cost.num_heads)
    if base is not None:
        base.check_world_size(world)
    lens = np.asarray([x for r in step for x in r], dtype=np.int64)
    home_node = np.repeat(np.arange(world) // node, [len(r) for r in step])

    scores: dict[str, float] = {}
    infeasible: dict[str, str] = {}
    best: list = [np.inf, None, "", None]  # score, plan, source, counts

    def evaluate(topo: Topology, source: str, counts: dict[int, int] | None) -> float:
        name = str(topo)
        if name in scores:
            return scores[name]
        try:
            plan = plan_balance(step, topo, cost, solver=solver, max_tokens_per_gpu=max_tokens_per_gpu)
        except ValueError as e:
            if max_tokens_per_gpu is None:
                raise
            infeasible[name] = str(e)  # this layout cannot keep the memory budget
            scores[name] = np.inf
            return np.inf
        s = plan.predicted_step_time
        scores[name] = s
        if s < best[0]:
            best[:] = [s, plan, source, counts]
        return s

    base_s = evaluate(base, "base", None) if base is not None else None
    if lens.size == 0:
        topo = Topology((1,), world) if base is None else base
        plan = plan_balance(step, topo, cost, solver=solver)
        return StepTopology(plan, plan.predicted_step_time, "empty", base_s, scores, time.perf_counter() - t0)
    want = _wanted_sizes(lens, cost, sizes, world)

    def layout(counts: dict[int, int]) -> Topology | None:
        bags = _place(counts, node, n_nodes, want, home_node, cost.compute(lens))
        return None if bags is None else Topology(tuple(bags))

    seeds: list[tuple[str, dict[int, int]]] = [("homogeneous", {g: world // g}) for g in sizes if world % g == 0]
    sample = [(step, cost)]
    for margin in DEMAND_MARGINS:
        for floor in sizes:
            seeds.extend(("demand", c) for c in _demand_seeds(sample, sizes, world, node, margin, floor))
    tried: dict[tuple, float] = {}
    for source, counts in seeds:
        key = _key(counts)
        if key in tried or len(scores) >= max_evals:
            continue
        topo = layout(counts)
        if topo is not None:
            tried[key] = evaluate(topo, source, counts)
    # Hill climbing from the best composition.
    if tried:
        start = min(tried, key=tried.get)

        def climb_to(cand: dict[int, int]) -> float | None:
            key = _key(cand)
            topo = None if key in tried else layout(cand)
            if topo is None:
                return None
            tried[key] = s = evaluate(topo, "climb", cand)
            return s

        climb({g: c for g, c in start}, tried[start], sizes, climb_to, lambda: len(scores) >= max_evals,
              improve_rel=_IMPROVE_REL)
    score, plan, source, _ = best
    if plan is None:
        first = next(iter(infeasible.items()))
        raise ValueError(
            f"no layout of {len(scores)} tried keeps the memory budget of {max_tokens_per_gpu} tokens per GPU "
            f"(e.g. {first[0]}: {first[1]})"
        )
    return StepTopology(plan, float(score), source, base_s, scores, time.perf_counter() - t0)


def _wanted_sizes(lens: np.ndarray, cost: CostModel, sizes: list[int], world: int) -> np.ndarray:
    """(S,) the smallest block size on which each sequence takes at most the step's ideal
    time (the largest size if none), for placing blocks near the sequences that want them."""
    target = cost.ideal_step_time(lens, world) - cost.fixed_s
    times = np.stack([cost.seq_cost(lens, g) for g in sizes])  # (sizes, S)
    fits = times <= target
    idx = np.where(fits.any(axis=0), np.argmax(fits, axis=0), len(sizes) - 1)
    return np.asarray(sizes)[idx]


def _place(
    counts: dict[int, int],
    node: int,
    n_nodes: int,
    want: np.ndarray,
    home_node: np.ndarray,
    work: np.ndarray,
) -> list[int] | None:
    """Bag sizes in rank order: blocks largest first, each on the node (with room) whose
    own sequences wanting at least that size hold the most work not yet served, ties to
    the lowest node; inside a node largest first (aligned). None if they do not fill the
    nodes exactly."""
    if sum(g * c for g, c in counts.items()) != node * n_nodes:
        return None
    free = np.full(n_nodes, node, dtype=np.int64)
    nodes: list[list[int]] = [[] for _ in range(n_nodes)]
    total = float(work.sum())
    per_gpu = total / (node * n_nodes) if total > 0 else 1.0
    for g in sorted((g for g in counts if counts[g]), reverse=True):
        pull = np.bincount(home_node[want >= g], weights=work[want >= g], minlength=n_nodes).astype(np.float64)
        # Work the blocks placed so far on a node already serve (their capacity).
        pull -= np.asarray([sum(b for b in bags if b >= g) for bags in nodes]) * per_gpu
        for _ in range(counts[g]):
            room = free >= g
            if not room.any():
                return None
            k = int(np.argmax(np.where(room, pull, -np.inf)))
            nodes[k].append(g)
            free[k] -= g
            pull[k] -= g * per_gpu
    if free.any():
        return None
    return [g for bags in nodes for g in sorted(bags, reverse=True)]
