"""Overlapping groups: long sequences sharded over bags, short ones whole on the least loaded GPUs.

A plan on disjoint bags leaves a bag's spare time unusable for a sequence too short to be
worth sharding over it: it either pays the bag's all-to-alls or waits for a bag of one.
Here every rank is also a *solo bag* of its own (``Topology.solo_bag``), which overlaps its
bag of the topology: a sequence may run whole on a rank that also holds chunks of the
bag's sequences, and that rank's work is the sum of both (the bag's ranks meet at every
attention layer, so the bag goes at its most loaded rank's pace; the cost model's
per-rank sum and its maximum say the same).

``overlap_plan`` builds such plans for one step, for each of some topologies and target
step times (the step's ideal times a margin):

1. the *long* sequences (one GPU would take more than the target for one) are planned by
   knapray's solver on the topology's bags, as a plan without overlap would be;
2. the *short* ones go, longest first, whole to the rank of their balance group that
   would finish them first under the cost model (its load so far, the sequence's
   compute, and its routing if the rank is not its home);
3. the most loaded rank then gives whole sequences away, one at a time, while that lowers
   the predicted step time.

Stages 2 and 3 look at every rank for every sequence: in a balance group of more than
``EXACT_RANKS`` ranks, stage 2 keeps each rank's short sequences at home, largest first,
up to the target, and deals the rest out longest first to the least loaded rank
(``construct.least_loaded``: numpy, a round of ranks at a time), and stage 3 is skipped.

Every candidate is scored by the cost model's step time over the whole plan (routing
included), and the best is returned. The plan is a ``BalancePlan`` like any other: the
router moves its chunks with one all-to-all each way, Ulysses runs inside each bag and a
rank's solo sequences run as a bag of one beside it (``knapray.distributed.ulysses``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ..balance.chunks import make_chunks
from ..costs.cost import CostModel
from ..shapes.lengths import flatten_lengths
from ..balance.plan import BalancePlan
from ..balance.solver import plan_balance
from ..shapes.topology import Topology

MARGINS = (0.0, 1.0, 1.05, 1.1, 1.2, 1.35)
"""Target step times (x the step's ideal) that split long sequences from short ones; at 0
every sequence is long: the topology's plan without overlap, a candidate too."""
MOVES_PER_RANK = 2
"""How many whole-sequence moves off the most loaded rank, per rank, the last stage tries."""
EXACT_RANKS = 256
"""Balance groups up to this many ranks get stages 2 and 3 as written; larger ones the
vectorized placement (see the module doc)."""


def step_candidates(step: Sequence[Sequence[int]], cost: CostModel, base: Topology, chosen: Topology,
                    per_step_node: int | None) -> list[Topology]:
    """The topologies a step's overlapping plan is sought on: the one its plan without
    overlap chose (``chosen``) and the run's (``base``); and where steps choose their own
    bags (``per_step_node``: ranks per node), every homogeneous partition into aligned
    power-of-two blocks and the step's demand layouts (the groups of every size dividing
    the heads that its sequences ask for at each of ``MARGINS``' targets, ``demand_layout``)
    that are aligned blocks: their groups exist (``BlockGroups.build(divisors=True)``)."""
    from ..shapes.blocks import block_sizes, is_aligned_layout

    out = [chosen, base]
    if per_step_node is None:
        return list(dict.fromkeys(out))
    world = len(step)
    node = min(per_step_node, world)
    out += [Topology((g,) * (world // g)) for g in block_sizes(node, cost.num_heads) if world % g == 0]
    lens = np.asarray([x for r in step for x in r], dtype=np.int64)
    home_node = np.repeat(np.arange(world) // node, [len(r) for r in step])
    sizes = divisor_sizes(node, cost.num_heads)
    ideal = cost.ideal_step_time(lens, world) - cost.fixed_s
    for margin in MARGINS[1:]:
        topo = demand_layout(lens, home_node, cost, world, sizes, ideal * margin, node)
        if topo is not None and is_aligned_layout(topo.bags, node, any_size=True):
            out.append(topo)
    return list(dict.fromkeys(out))


def divisor_sizes(gpus_per_node: int, num_heads: int) -> list[int]:
    """Group sizes up to a node that divide the head count (FlexSP's: any that Ulysses allows)."""
    return [g for g in range(1, gpus_per_node + 1) if num_heads % g == 0]


def demand_layout(lens: np.ndarray, home_node: np.ndarray, cost: CostModel, world: int, sizes: list[int],
                   target: float, node: int | None = None) -> Topology | None:
    """Groups of the sizes the step's sequences ask for at ``target`` seconds, placed on the
    nodes (of ``node`` ranks; default the cost model's, or the world) whose own sequences
    ask for them most (``pertopo``'s placement), every node's rest in groups of one; None
    if they cannot be placed."""
    from .pertopo import _place

    node = node or min(cost.gpus_per_node, world)
    n_nodes = world // node
    times = np.stack([cost.seq_cost(lens, g) for g in sizes])  # (sizes, S)
    fits = times <= target
    want = np.asarray(sizes)[np.where(fits.any(axis=0), np.argmax(fits, axis=0), len(sizes) - 1)]
    counts: dict[int, int] = {}
    for g in sizes[1:]:
        need = float(times[sizes.index(g)][want == g].sum())
        if need > 0:
            counts[g] = max(1, int(np.ceil(need / target)))
    # What does not fit the nodes is trimmed, largest groups first.
    while sum(g * c for g, c in counts.items()) > world and counts:
        g = max(counts)
        counts[g] -= 1
        if not counts[g]:
            del counts[g]
    counts[1] = world - sum(g * c for g, c in counts.items())
    for _ in range(64):  # groups that fit the total but not the nodes: trade the largest for ones
        bags = _place(counts, node, n_nodes, want, home_node, cost.compute(lens))
        if bags is not None:
            return Topology(tuple(bags))
        g = max(k for k in counts if k > 1) if any(k > 1 for k in counts) else None
        if g is None:
            return None
        counts[g] -= 1
        counts[1] += g
        if not counts[g]:
            del counts[g]
    return None



def overlap_plan(
    step: Sequence[Sequence[int]],
    cost: CostModel,
    topologies: Sequence[Topology],
    margins: Sequence[float] = MARGINS,
    max_tokens_per_gpu: int | None = None,
    plain: BalancePlan | None = None,
) -> BalancePlan | None:
    """The best overlapping plan of one step over ``topologies`` x ``margins`` (None when
    no candidate keeps the memory budget ``max_tokens_per_gpu``). Deterministic in the
    lengths: every rank that calls it derives the same plan. ``plain``: the step's plan
    without overlap on one of the topologies, if the caller has it (its margin-0 candidate,
    not planned again)."""
    t0 = time.perf_counter()
    best, best_s, best_info = None, np.inf, {}
    for topo in dict.fromkeys(topologies):  # each once, in the order given
        lens, home, _ = flatten_lengths(step, topo)
        ideal = cost.ideal_step_time(lens, topo.world_size) - cost.fixed_s
        tried: set[bytes] = set()
        for margin in margins:
            long = cost.compute(lens) > ideal * margin
            key = long.tobytes()
            if key in tried:  # the same split as a smaller margin: the same plan
                continue
            tried.add(key)
            if plain is not None and plain.topology == topo and long.all():
                plan = plain
            elif topo.group_size > EXACT_RANKS:
                plan = _plan(topo, cost, step, _place_fast(step, lens, home, long, topo, cost, ideal * margin))
            else:
                plan = _refined(_plan(topo, cost, step, _place(step, lens, home, long, topo, cost)), cost)
            if max_tokens_per_gpu is not None and int(plan.rank_tokens.max()) > max_tokens_per_gpu:
                continue
            s = plan.predicted_step_time
            if s < best_s - 1e-12:
                best, best_s, best_info = plan, s, {"topology": topo.spec, "margin": margin,
                                                    "long": int(long.sum()), "solo": int((plan.bag >= topo.num_bags).sum())}
    if best is None:
        return None
    best.stats.update({"overlap": best_info, "plan_ms": (time.perf_counter() - t0) * 1e3})
    return best


def whole_on(plan: BalancePlan, moves: dict[int, int]) -> BalancePlan:
    """``plan`` with sequence ``s`` run whole on rank ``r`` for each ``s: r`` of ``moves``
    (on the rank's solo bag, or on its own bag if that is a bag of one); ``r`` must be in
    the balance group of ``s``'s home rank (a plan routes only within a group)."""
    topo = plan.topology
    bag = plan.bag.copy()
    for s, r in moves.items():
        if not 0 <= s < plan.num_sequences or not 0 <= r < topo.world_size:
            raise ValueError(f"sequence {s} on rank {r}: the plan has {plan.num_sequences} sequences, "
                             f"{topo.world_size} ranks")
        if r // topo.group_size != int(plan.home_rank[s]) // topo.group_size:
            raise ValueError(f"sequence {s} (home rank {int(plan.home_rank[s])}) cannot run on rank {r}: "
                             f"another balance group of {topo}")
        bag[s] = _whole_on(topo, r)
    return _plan(topo, plan.model, _step_of(plan), bag)


def _plan(topo: Topology, cost, step: Sequence[Sequence[int]], bag: np.ndarray) -> BalancePlan:
    lens, home, local = flatten_lengths(step, topo)
    chunk_seq, chunk_rank, chunk_start, chunk_len = make_chunks(lens, home, bag, topo)
    return BalancePlan(topology=topo, model=cost, seq_lens=lens, home_rank=home, local_index=local, bag=bag,
                       chunk_seq=chunk_seq, chunk_rank=chunk_rank, chunk_start=chunk_start, chunk_len=chunk_len,
                       solver="knapray+overlap", stats={})


def _place(step, lens: np.ndarray, home: np.ndarray, long: np.ndarray, topo: Topology, cost: CostModel) -> np.ndarray:
    """Every sequence's bag: the long ones by the solver on ``topo``'s bags, the short ones
    whole on a rank (stage 2 of the module doc)."""
    world = topo.world_size
    bag = np.empty(lens.size, dtype=np.int64)
    loads = np.zeros(world)
    if long.any():
        bag[long], loads = _long_planned(step, lens, long, topo, cost)
    short = np.flatnonzero(~long)
    if not short.size:
        return bag
    speed = cost.bag_speed(topo)[topo.bag_of_rank]
    gpn = cost.gpus_per_node
    t_intra, t_inter = cost.route_token_s(False), cost.route_token_s(True)
    node = np.arange(world) // gpn
    size = topo.group_size
    whole = cost.compute(lens[short])
    # A group's ranks are the slice [lo, lo + size): its loads and speeds are views. A
    # sender's per-token routing seconds to each rank of its group (0 to itself) are made
    # once: 0 x tokens is the 0 a per-sequence expression would give.
    per_token: dict[int, np.ndarray] = {}
    whole_on: dict[int, int] = {}  # rank -> ``_whole_on``, for the ranks chosen
    whole_l, short_l, home_l, lens_l = whole.tolist(), short.tolist(), home.tolist(), lens.tolist()
    speed_l = speed.tolist()
    unit_speed = bool(np.all(speed == 1.0))
    for i in np.argsort(-whole, kind="stable").tolist():
        s = short_l[i]
        src = home_l[s]
        lo = src // size * size
        fac = per_token.get(src)
        if fac is None:
            ranks = np.arange(lo, lo + size)
            fac = per_token[src] = np.where(ranks == src, 0.0, np.where(node[ranks] == node[src], t_intra, t_inter))
        route = fac * float(lens_l[s])
        w = whole_l[i]
        # At speed 1 everywhere the division is exact (w / 1 is w): left out.
        finish = loads[lo : lo + size] + (w if unit_speed else w / speed[lo : lo + size]) + route
        q = int(finish.argmin())
        r = lo + q
        loads[r] += w / speed_l[r] + (0.0 if r == src else route[q])
        if r != src:
            loads[src] += route[q]  # the sender's side of the exchange
        b = whole_on.get(r)
        if b is None:
            b = whole_on[r] = _whole_on(topo, r)
        bag[s] = b
    return bag


def _long_planned(step, lens: np.ndarray, long: np.ndarray, topo: Topology, cost: CostModel
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(bags of the long sequences, every rank's seconds under their plan, fixed cost out)."""
    world = topo.world_size
    counts = [len(r) for r in step]
    starts = np.concatenate([[0], np.cumsum(counts)])
    sub = [[int(lens[i]) for i in range(starts[r], starts[r + 1]) if long[i]] for r in range(world)]
    plan = plan_balance(sub, topo, cost)
    return plan.bag, cost.step_times(plan).total - cost.fixed_s


def _place_fast(step, lens: np.ndarray, home: np.ndarray, long: np.ndarray, topo: Topology, cost: CostModel,
                target: float) -> np.ndarray:
    """Stage 2 for a large balance group (module doc): each rank keeps its short sequences,
    largest first, while its load stays within ``target``; the rest go, longest first, to
    the least loaded rank of their group."""
    from ..balance.construct import least_loaded

    world = topo.world_size
    bag = np.empty(lens.size, dtype=np.int64)
    loads = np.zeros(world)
    if long.any():
        bag[long], loads = _long_planned(step, lens, long, topo, cost)
    short = np.flatnonzero(~long)
    if not short.size:
        return bag
    speed = cost.bag_speed(topo)[topo.bag_of_rank]
    src = home[short]
    work = cost.compute(lens[short]) / speed[src]
    order = np.lexsort((-work, src))  # by home rank, each rank's largest first
    w, r = work[order], src[order]
    first = np.concatenate([[0], np.flatnonzero(r[1:] != r[:-1]) + 1])
    cs = np.cumsum(w)
    upto = cs - np.repeat(cs[first] - w[first], np.diff(np.append(first, w.size)))  # each rank's, inclusive
    stay = loads[r] + upto <= target  # a prefix of each rank's list (its cumulative load only grows)
    rank_of = np.empty(short.size, dtype=np.int64)
    rank_of[order[stay]] = r[stay]
    loads += np.bincount(r[stay], weights=w[stay], minlength=world)
    moved = order[~stay]
    for g in range(topo.num_groups):
        ranks = np.arange(g * topo.group_size, (g + 1) * topo.group_size)
        mine = moved[src[moved] // topo.group_size == g]
        if not mine.size:
            continue
        mine = mine[np.argsort(-work[mine], kind="stable")]
        rank_of[mine] = least_loaded(work[mine], ranks, loads[ranks])
    on_own = topo.bag_sizes[topo.bag_of_rank[rank_of]] == 1
    bag[short] = np.where(on_own, topo.bag_of_rank[rank_of], topo.num_bags + rank_of)
    return bag


def _whole_on(topo: Topology, rank: int) -> int:
    """The bag that runs a sequence whole on ``rank``: its own bag if that is a bag of one."""
    b = int(topo.bag_of_rank[rank])
    return b if int(topo.bag_sizes[b]) == 1 else topo.solo_bag(rank)


def _refined(plan: BalancePlan, cost: CostModel) -> BalancePlan:
    """Stage 3: move a whole sequence off the most loaded rank to the rank (of its balance
    group) that the move leaves least loaded, while the predicted step time drops."""
    topo = plan.topology
    best_s = plan.predicted_step_time
    for _ in range(MOVES_PER_RANK * topo.world_size):
        total = plan.rank_time
        worst = int(np.argmax(total))
        mine = np.flatnonzero((plan.bag_size_of_seq == 1) & (plan.chunk_rank[_first_chunk(plan)] == worst))
        if not mine.size:
            break
        group = topo.group_ranks(worst // topo.group_size)
        others = np.asarray([r for r in group if r != worst])
        if not others.size:
            break
        # Try the worst rank's whole sequences, largest first, on the least loaded ranks.
        improved = False
        order = mine[np.argsort(-plan.seq_lens[mine], kind="stable")]
        targets = others[np.argsort(total[others], kind="stable")[:4]]
        for s in order[:8].tolist():
            for r in targets.tolist():
                bag = plan.bag.copy()
                bag[s] = _whole_on(topo, r)
                moved = _plan(topo, cost, _step_of(plan), bag)
                t = moved.predicted_step_time
                if t < best_s * (1 - 1e-9):
                    plan, best_s, improved = moved, t, True
                    break
            if improved:
                break
        if not improved:
            break
    return plan


def _first_chunk(plan: BalancePlan) -> np.ndarray:
    """(S,) index of every sequence's first chunk (chunks are sorted by sequence)."""
    return np.cumsum(plan.bag_size_of_seq) - plan.bag_size_of_seq


def _step_of(plan: BalancePlan) -> list[list[int]]:
    off = plan.seq_offsets
    lens = plan.seq_lens.tolist()
    return [lens[off[r]:off[r + 1]] for r in range(plan.world_size)]
