"""Topology rules: which bags a world of ``W`` ranks gets, from a rule that holds for any ``W``.

An elastic run changes its world size, so the run config names a *rule*, not a fixed
topology; the coordinator resolves it again at every (re)start:

- a concrete spec (``"g8n4"``) is replicated into ``W / size`` balance groups;
- ``"bags_of:N"``: one balance group of ``g{p}`` bags, ``p`` the largest power of two
  ``<= N`` that divides ``W`` (and ``gpus_per_node``, if given);
- ``"auto"``: with the workload model, among ``g{2^k}`` (``2^k`` dividing ``W``, at most a
  node), the smallest bags whose mean imbalance, predicted by planning recent steps'
  lengths re-dealt onto ``W`` ranks, is within ``auto_tolerance`` of the best; with the
  cost model, mixed bag sizes by predicted step time (``choose_topology``); with no length
  history yet, the ``bags_of`` rule with one node's size;
- ``"per-step"`` (cost model only): every step chooses its own partition of each node into
  aligned power-of-two blocks (``knapray.planning.search.pertopo``); the rule's topology is the
  ``"auto"`` one, with nodes of ``gpus_per_node`` ranks (the world if not given), which
  every step also tries as is (``per_step_node`` says a run plans per step, and its node).

Where the ranks really are (``node_sizes``: ranks per node in rank order, gathered from
the workers, ``topology.node_sizes_of``) overrides the config's uniform
``gpus_per_node`` picture: ``node_layout`` combines them into the units no bag may cross;
with nodes of one size the rules above run with that size as the node; with uneven nodes
(3 workers on one node, 1 on another) every node is cut into the largest power-of-two
bags it holds, up to the rule's largest (``node_bags``: nodes of 2, 2 and 1 give
``g2n2+g1n1``), a concrete spec is re-laid out (``place_on_nodes``) and ``"per-step"`` is
refused. The result is always checked against the real nodes: a bag never crosses one
silently.

Pure: numpy and the planning package only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd

import numpy as np

from .autotopo import choose_topology
from ..costs.cost import CostModel
from ..balance.solver import plan_balance
from ..shapes.topology import Topology, place_on_nodes, split_nodes
from ..costs.workload import WorkloadModel

PER_STEP = "per-step"
"""The rule whose steps each choose their own bags (``knapray.planning.search.pertopo``)."""

AUTO_MAX_BAG = 8
"""Largest bag ``"auto"`` considers without ``gpus_per_node`` (one node)."""

LengthHistory = Sequence[Sequence[Sequence[int]]]
"""Recent steps, each a list of per-rank lists of sequence lengths."""


@dataclass(frozen=True, slots=True)
class RuleChoice:
    """A resolved rule: the topology and, for logs, why it was chosen."""

    topology: Topology
    reason: str


def parse_rule(rule: str) -> tuple[str, int | Topology | None]:
    """``("auto", None)``, ``("per_step", None)``, ``("bags_of", N)`` or ``("spec", Topology)``;
    a clear error otherwise."""
    if not isinstance(rule, str):
        raise ValueError(f"topology must be a string such as 'g8n4', 'bags_of:8', 'auto' or 'per-step', got {rule!r}")
    if rule == "auto":
        return "auto", None
    if rule == PER_STEP:
        return "per_step", None
    if rule.startswith("bags_of:"):
        arg = rule.split(":", 1)[1]
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"topology {rule!r}: expected 'bags_of:N' with an integer N >= 1, e.g. 'bags_of:8'")
        return "bags_of", int(arg)
    try:
        return "spec", Topology.parse(rule)
    except ValueError as e:
        raise ValueError(f"topology {rule!r} is neither 'auto', 'per-step', 'bags_of:N' nor a valid spec: {e}") from e


def per_step_node(rule: str, world_size: int, gpus_per_node: int | None) -> int | None:
    """Ranks per node of a run whose steps choose their own bags (rule ``"per-step"``):
    ``gpus_per_node``, or the whole world if not given (a world smaller than a node is one
    node); None for every other rule. Raises ValueError if the nodes are not whole."""
    if parse_rule(rule)[0] != "per_step":
        return None
    if not gpus_per_node or world_size <= gpus_per_node:
        return int(world_size)
    if world_size % gpus_per_node:
        raise ValueError(
            f"topology 'per-step' partitions whole nodes into blocks: world size {world_size} is not a "
            f"multiple of gpus_per_node={gpus_per_node}"
        )
    return int(gpus_per_node)


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """The units no bag may cross: the real nodes (each cut into blocks of the config's
    ``gpus_per_node``, if set), in rank order."""

    sizes: tuple[int, ...]
    configured: int | None
    """The config's ``gpus_per_node`` (None: not set)."""

    @property
    def uniform(self) -> int | None:
        """The node size the rules plan with: the size every unit has; None when there is
        one node and the config names none (a single machine: no node constraint), or when
        the units differ in size."""
        if len(set(self.sizes)) != 1 or (len(self.sizes) == 1 and not self.configured):
            return None
        return self.sizes[0]

    @property
    def unit(self) -> int:
        """The largest size dividing every unit: blocks of it never cross a node."""
        out = 0
        for n in self.sizes:
            out = gcd(out, n)
        return out


def node_layout(world_size: int, gpus_per_node: int | None, node_sizes: Sequence[int] | None) -> NodeLayout | None:
    """The real layout (``node_sizes``) cut by the config's ``gpus_per_node``; None without a
    real layout (the rules then trust ``gpus_per_node`` alone)."""
    if node_sizes is None:
        return None
    sizes = tuple(int(n) for n in node_sizes)
    if not sizes or min(sizes) < 1 or sum(sizes) != world_size:
        raise ValueError(f"node sizes {list(sizes)} must be integers >= 1 summing to the world size {world_size}")
    return NodeLayout(split_nodes(sizes, gpus_per_node), gpus_per_node or None)


def planning_node(world_size: int, gpus_per_node: int | None, node_sizes: Sequence[int] | None) -> int | None:
    """The node size the rules (and a per-step run's plans) use: the config's
    ``gpus_per_node`` without a real layout, else the layout's uniform unit (None: no
    single size, see ``NodeLayout.uniform``)."""
    layout = node_layout(world_size, gpus_per_node, node_sizes)
    if layout is None:
        return gpus_per_node or None
    return layout.uniform


def largest_pow2_bag(limit: int, world_size: int, gpus_per_node: int | None) -> int:
    """Largest power of two ``<= limit`` dividing the world (and the node, if given)."""
    p = 1
    while p * 2 <= limit and world_size % (p * 2) == 0 and (
        gpus_per_node is None or gpus_per_node % (p * 2) == 0
    ):
        p *= 2
    return p


def redeal(history: LengthHistory, world_size: int, max_steps: int) -> list[list[list[int]]]:
    """Recent per-rank batches dealt, in order, into steps of ``world_size`` ranks (a rank's
    batch size does not change with the world size, the number of ranks does)."""
    batches = [list(rank) for step in history for rank in step]
    if not batches:
        return []
    if len(batches) < world_size:
        return [[batches[i % len(batches)] for i in range(world_size)]]
    n = min(len(batches) // world_size, max_steps)
    return [batches[i * world_size : (i + 1) * world_size] for i in range(n)]


def resolve_rule(
    rule: str,
    world_size: int,
    *,
    gpus_per_node: int | None = None,
    node_sizes: Sequence[int] | None = None,
    history: LengthHistory = (),
    model: WorkloadModel | CostModel | None = None,
    solver: str = "knapray",
    auto_tolerance: float = 0.02,
    history_steps: int = 32,
) -> RuleChoice:
    """The topology ``rule`` gives a world of ``world_size`` ranks (see the module docstring).

    ``node_sizes``: ranks per node in rank order, where the workers really run (None:
    only ``gpus_per_node`` says where nodes are); no bag of the result crosses one, or
    ValueError says why none can. ``history``, ``model``, ``solver``, ``auto_tolerance``
    and ``history_steps`` matter only to ``"auto"`` and ``"per-step"``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    world_size = int(world_size)
    layout = node_layout(world_size, gpus_per_node, node_sizes)
    if layout is None:
        return _resolve(rule, world_size, gpus_per_node, history, model, solver, auto_tolerance, history_steps)
    kind, arg = parse_rule(rule)
    if layout.uniform is not None or kind == "per_step":
        if kind == "per_step" and layout.uniform is None and len(layout.sizes) > 1:
            raise ValueError(f"topology 'per-step' partitions whole nodes of one size into blocks, but the "
                             f"{world_size} workers are on nodes of {list(layout.sizes)} ranks (in rank order)")
        if kind == "spec" and not layout.configured:
            # The spec's own order, if it fits the nodes (the same topology as on one machine).
            topo = Topology.parse(rule, world_size=world_size)
            try:
                topo.check_nodes(layout.sizes)
                return RuleChoice(topo, f"spec {rule!r} replicated over {world_size} ranks, "
                                        f"fits nodes of {layout.uniform}")
            except ValueError:
                pass
        choice = _resolve(rule, world_size, layout.uniform, history, model, solver, auto_tolerance, history_steps)
    elif kind == "spec":
        topo = place_on_nodes(Topology.parse(rule, world_size=world_size), layout.sizes)
        choice = RuleChoice(topo, f"spec {rule!r} laid out on nodes of {list(layout.sizes)} ranks")
    else:
        # Uneven nodes: each node cut into the largest power-of-two bags it holds (3 ranks:
        # a bag of 2 and one of 1), up to the rule's largest bag, in rank order.
        choice = _uneven(kind, arg, layout.sizes, history, model, solver, auto_tolerance, history_steps)
    choice.topology.check_nodes(layout.sizes)
    return choice


def node_bags(node_sizes: Sequence[int], largest: int) -> Topology:
    """Every node (ranks in rank order) cut into power-of-two bags of at most ``largest``
    ranks, the largest first: nodes of 2, 2 and 1 at 2 give ``g2n2+g1n1``; of 4 and 2 at 8
    give ``g4n1+g2n1``; a node of 3 gives a bag of 2 and one of 1."""
    bags = []
    for n in node_sizes:
        while n:
            p = 1
            while p * 2 <= min(n, largest):
                p *= 2
            bags.append(p)
            n -= p
    return Topology(tuple(bags))


def _uneven(
    kind: str,
    arg: int | Topology | None,
    sizes: tuple[int, ...],
    history: LengthHistory,
    model: WorkloadModel | CostModel | None,
    solver: str,
    tolerance: float,
    history_steps: int,
) -> RuleChoice:
    """``bags_of``/``auto`` on nodes of different sizes: ``node_bags`` at the rule's largest
    bag (``auto``: the smallest largest bag whose predicted mean imbalance over recent steps
    is within ``tolerance`` of the best; no history yet: one node's)."""
    world = sum(sizes)
    where = f"nodes of {list(sizes)} ranks"
    if kind == "bags_of":
        return RuleChoice(node_bags(sizes, int(arg)), f"bags of up to {arg} inside each of the {where}")
    cap = 1
    while cap * 2 <= min(max(sizes), AUTO_MAX_BAG):
        cap *= 2
    steps = [s for s in redeal(history, world, history_steps) if any(s)]
    if not steps:
        return RuleChoice(node_bags(sizes, cap), f"auto: no length history yet, bags of up to {cap} inside each of the "
                                                 f"{where}")
    scores = {}
    p = 1
    while p <= cap:
        topo = node_bags(sizes, p)
        scores[p] = float(np.mean([plan_balance([np.asarray(r, np.int64) for r in s], topo, model or WorkloadModel(),
                                                solver=solver).imbalance for s in steps]))
        p *= 2
    best = min(scores.values())
    p = min(q for q, v in scores.items() if v <= best + tolerance)
    return RuleChoice(node_bags(sizes, p), f"auto: mean predicted imbalance by largest bag "
                                           f"{({q: round(v, 4) for q, v in scores.items()})}, inside each of the {where}")


def _resolve(
    rule: str,
    world_size: int,
    gpus_per_node: int | None,
    history: LengthHistory,
    model: WorkloadModel | CostModel | None,
    solver: str,
    auto_tolerance: float,
    history_steps: int,
) -> RuleChoice:
    """``resolve_rule`` with nodes of ``gpus_per_node`` ranks (None: no node constraint)."""
    kind, arg = parse_rule(rule)
    gpn = gpus_per_node
    if kind == "spec":
        try:
            topo = Topology.parse(rule, world_size=world_size, gpus_per_node=gpn)
        except ValueError as e:
            raise ValueError(
                f"world size {world_size} does not fit topology {rule!r} "
                f"({arg.group_size} ranks per balance group): {e}. Use a world size that is a "
                f"multiple of {arg.group_size}, or topology='bags_of:8' or 'auto' to re-plan "
                "bags for any world size"
            ) from e
        return RuleChoice(topo, f"spec {rule!r} replicated over {world_size} ranks")
    if kind == "bags_of":
        p = largest_pow2_bag(arg, world_size, gpn)
        return RuleChoice(Topology((p,) * (world_size // p)), f"largest power of two <= {arg} dividing the world")
    if kind == "per_step":
        if not isinstance(model, CostModel):
            raise ValueError("topology 'per-step' chooses bags by predicted step time: it needs the cost model "
                             "(balance.planner: cost)")
        node = per_step_node(rule, world_size, gpn)
        base = _auto(world_size, node, history, model, solver, auto_tolerance, history_steps)
        return RuleChoice(base.topology, f"per-step in nodes of {node} ranks; base (tried every step): {base.reason}")
    return _auto(world_size, gpn, history, model or WorkloadModel(), solver, auto_tolerance, history_steps)


def _auto(
    world_size: int,
    gpn: int | None,
    history: LengthHistory,
    model: WorkloadModel | CostModel,
    solver: str,
    tolerance: float,
    history_steps: int,
) -> RuleChoice:
    steps = redeal(history, world_size, history_steps)
    if isinstance(model, CostModel):
        # Mixed bag sizes by predicted step time (compute and communication).
        return RuleChoice(choose_topology(steps, world_size, model, gpn), "auto: cost model's predicted step time")
    cap = gpn or AUTO_MAX_BAG
    steps = [s for s in steps if any(s)]
    if not steps:
        p = largest_pow2_bag(cap, world_size, gpn)
        return RuleChoice(Topology((p,) * (world_size // p)), "auto: no length history yet, one node's bags")
    candidates = []
    p = 1
    while p <= cap and world_size % p == 0 and (gpn is None or gpn % p == 0):
        candidates.append(p)
        p *= 2
    scores = {}
    for p in candidates:
        topo = Topology((p,) * (world_size // p))
        scores[p] = float(np.mean([plan_balance([np.asarray(r, np.int64) for r in s], topo, model, solver=solver).imbalance
                                   for s in steps]))
    best = min(scores.values())
    p = min(q for q, v in scores.items() if v <= best + tolerance)
    return RuleChoice(
        Topology((p,) * (world_size // p)),
        f"auto: mean predicted imbalance by bag size {({q: round(v, 4) for q, v in scores.items()})}",
    )
