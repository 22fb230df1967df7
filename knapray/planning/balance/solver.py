"""plan_balance(): assign every sequence to a bag so that the busiest GPU finishes first.

With the paper's ``WorkloadModel`` this is makespan scheduling on "uniform machines": bag
``j`` of ``g_j`` GPUs finishes when its per-GPU load ``P_j = Σ W(L)/g_j`` is done. With a
``CostModel`` a sequence on bag ``j`` costs each of its GPUs ``CostModel.seq_cost`` seconds
(``compute(L)/g_j + ulysses(L, g_j)``, the per-sequence part unsplit), divided by the bag's speed (its slowest rank's), which is not
proportional across bag sizes ("unrelated machines"); the plan minimizes the predicted
step time (routing included). Either way a sequence may only go to a bag with
``g_j <= L`` (one shorter than every bag goes to a smallest bag, some chunks empty).
Two solvers:

``greedy``  KnapFormer's published baseline (kept exact for comparison); it balances the
            model's work estimate (``W(L)``, or the cost model's compute seconds) and
            ignores communication and speeds.
``knapray`` (default) starts from greedy and from LPT (earliest finish), improves both by
            moves and swaps out of the most loaded bag until no step helps, then, without
            raising the makespan, moves sequences back to a bag that contains their home
            rank so fewer tokens travel; of these candidates and greedy itself it keeps the
            best by exact peak (cost model: predicted step time), so it is never worse
            than greedy.

A memory budget (``max_tokens_per_gpu=T``) caps every rank's routed tokens: bag ``j``
holds at most ``T * g_j`` tokens (its ranks' chunks differ by at most one token, so its
busiest rank holds ``ceil(tokens_j / g_j)``). The plan above is kept when it fits; else
its candidates are repaired (sequences moved or swapped out of bags over their capacity
into bags with room), a capacity-aware LPT joins them, all are refined by moves and swaps
that keep every bag within its capacity, and the best is chosen the same way. If none
fits, a first-fit-decreasing packing by tokens is the last resort before an error.

Each step is a function of one balance group's ``GroupProblem`` (problem.py, which also
scores plans) in a module of its own: ``construct`` (greedy, LPT, the home start),
``refine`` (moves and swaps), ``home`` (repair to a makespan cap, localize), ``budget``
(the memory budget); ``lengths`` and ``chunks`` turn the input into arrays and the bags
into chunks. No step scans all sequences per bag or per move: members are grouped by one
linear-time sort, and per-sequence loops run over rounds of bags, sorted lists or blocks
(see each module). They make the plans of the per-sequence loops they replaced, which a
test checks against a frozen copy of the old solver (tests/oracle_solver.py).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from .budget import within_budget
from .chunks import make_chunks
from .construct import greedy, home_start, lpt
from ..costs.cost import CostModel
from .home import localize, repair
from ..shapes.lengths import flatten_lengths
from .plan import BalancePlan
from .problem import GroupComm, GroupProblem, Model, NoFit
from .refine import refine
from ..shapes.topology import Topology
from ..costs.workload import WorkloadModel

SOLVERS = ("knapray", "greedy")

# The names tests (and older callers) import from here.
_flatten = flatten_lengths
_make_chunks = make_chunks


def plan_balance(
    seq_lens_per_rank: Sequence[Sequence[int]],
    topology: Topology,
    model: WorkloadModel | CostModel | None = None,
    solver: str = "knapray",
    max_tokens_per_gpu: int | None = None,
    groups: Sequence[int] | None = None,
) -> BalancePlan:
    """Plan one step: ``seq_lens_per_rank[r]`` lists the lengths of rank ``r``'s sequences.

    ``model``: the paper's ``WorkloadModel`` (default) balances estimated work; a
    ``CostModel`` minimizes predicted step time (communication, per-rank speeds).

    ``max_tokens_per_gpu``: optional memory budget (see ``knapray memory``): no rank gets
    more routed tokens than this. A sequence whose chunk would exceed it even on the
    largest bag, or a step that fits no assignment, is rejected with an error naming the
    step's tokens, the budget and the capacity.

    ``groups``: plan only these balance groups; every sequence of another group stays on
    the bag that holds its home rank. Groups are planned independently (no sequence leaves
    its group), so a rank's part of the plan depends on its own group alone: a dry run of
    one rank of 65,536 plans one group, not 16,384.
    """
    t0 = time.perf_counter()
    model = model or WorkloadModel()
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; valid: {', '.join(SOLVERS)}")
    lens, home, local = flatten_lengths(seq_lens_per_rank, topology)
    budget = _check_budget(max_tokens_per_gpu, lens, topology)
    bag = np.empty(lens.size, dtype=np.int64)
    stats: dict = {"groups": []}
    is_cost = isinstance(model, CostModel)
    if is_cost:
        token_s, speed = model.bag_ulysses_token_s(topology), model.bag_speed(topology)
    nb = len(topology.group_bags)
    planned = range(topology.num_groups)
    if groups is not None:
        planned = sorted({int(g) for g in groups})
        if planned and not 0 <= planned[0] <= planned[-1] < topology.num_groups:
            raise ValueError(f"groups {planned}: the topology has balance groups 0..{topology.num_groups - 1}")
        bag[:] = topology.bag_of_rank[home]  # the groups not planned: every sequence at home
    for grp in planned:
        ranks = topology.group_ranks(grp)
        lo = np.searchsorted(home, ranks.start)
        hi = np.searchsorted(home, ranks.stop)
        bag_offset = grp * nb
        comm = None
        if is_cost:
            sl = slice(bag_offset, bag_offset + nb)
            comm = GroupComm(token_s[sl], speed[sl], ranks.start)
        group_tokens = int(lens[lo:hi].sum())
        if budget is not None and group_tokens > budget * len(ranks):
            raise ValueError(
                f"balance group {grp} (ranks {ranks.start}-{ranks.stop - 1}) holds {group_tokens} of the "
                f"step's {int(lens.sum())} tokens, over its capacity of {budget * len(ranks)} "
                f"({len(ranks)} GPUs x {budget} tokens per GPU); the world's capacity is "
                f"{budget * topology.world_size}"
            )
        try:
            sub_bag, sub_stats = _solve_group_once(
                lens[lo:hi],
                home[lo:hi] - ranks.start,
                np.asarray(topology.group_bags, dtype=np.int64),
                model,
                solver,
                budget,
                comm,
            )
        except NoFit:
            raise ValueError(
                f"found no assignment of the step's {int(lens.sum())} tokens that keeps every GPU within "
                f"the budget of {budget} tokens per GPU (world capacity {budget * topology.world_size}; "
                f"balance group {grp}: {group_tokens} tokens, capacity {budget * len(ranks)}): its long "
                f"sequences do not pack into bags of {sorted(set(topology.group_bags))} GPUs"
            ) from None
        bag[lo:hi] = sub_bag + bag_offset
        stats["groups"].append(sub_stats)
    chunk_seq, chunk_rank, chunk_start, chunk_len = make_chunks(lens, home, bag, topology)
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
    seq_lens_per_rank: Sequence[Sequence[int]], model: WorkloadModel | CostModel | None = None
) -> BalancePlan:
    """No balancing: every rank computes its own sequences (topology ``g1nW``)."""
    topology = Topology((1,), len(seq_lens_per_rank)) if seq_lens_per_rank else None
    if topology is None:
        raise ValueError("seq_lens_per_rank is empty: need one list per rank")
    lens, home, local = flatten_lengths(seq_lens_per_rank, topology)
    chunk_seq, chunk_rank, chunk_start, chunk_len = make_chunks(lens, home, home, topology)
    return BalancePlan(
        topology, model or WorkloadModel(), lens, home, local, home.copy(),
        chunk_seq, chunk_rank, chunk_start, chunk_len, solver="identity",
    )


# ---- input ------------------------------------------------------------------------------


def _check_budget(max_tokens_per_gpu: int | None, lens: np.ndarray, topology: Topology) -> int | None:
    """The budget as an int, after the checks every balance group shares."""
    if max_tokens_per_gpu is None:
        return None
    if isinstance(max_tokens_per_gpu, bool) or int(max_tokens_per_gpu) != max_tokens_per_gpu or max_tokens_per_gpu < 1:
        raise ValueError(f"max_tokens_per_gpu must be a positive integer, got {max_tokens_per_gpu!r}")
    budget = int(max_tokens_per_gpu)
    gmax = max(topology.group_bags)
    too_long = np.flatnonzero(-(-lens // gmax) > budget)
    if too_long.size:
        s = int(too_long[0])
        raise ValueError(
            f"sequence of length {int(lens[s])} needs {-(-int(lens[s]) // gmax)} tokens per GPU "
            f"even on the largest bag (g{gmax}), over the budget of {budget}"
        )
    total, world = int(lens.sum()), topology.world_size
    if total > budget * world:
        raise ValueError(
            f"the step's {total} tokens exceed the budget of {budget} tokens per GPU: the world's "
            f"capacity is {budget * world} ({world} GPUs x {budget})"
        )
    return budget


# ---- one balance group -----------------------------------------------------------------

_MEMO: dict | None = None
"""Balance groups solved inside ``memoized()``, by their inputs; None outside it."""


@contextmanager
def memoized() -> Iterator[None]:
    """Inside the block, a balance group planned again with the same inputs (lengths,
    homes, bags, the same model object, solver, budget and communication terms) gets a
    copy of the first solution instead of being solved again: the solver is deterministic,
    so the plan is the same. For callers that plan one step many times over (the
    simulator's planners try overlapping sets of topologies on every step)."""
    global _MEMO
    outer = _MEMO
    if outer is None:
        _MEMO = {}
    try:
        yield
    finally:
        _MEMO = outer


def _solve_group_once(
    lens: np.ndarray,
    home: np.ndarray,
    bag_sizes: np.ndarray,
    model: Model,
    solver: str,
    max_tokens_per_gpu: int | None,
    comm: GroupComm | None = None,
) -> tuple[np.ndarray, dict]:
    """``_solve_group``, through the memo of ``memoized()`` when one is open."""
    memo = _MEMO
    if memo is None:
        return _solve_group(lens, home, bag_sizes, model, solver, max_tokens_per_gpu, comm)
    key = (
        lens.dtype.str, lens.tobytes(), home.dtype.str, home.tobytes(), tuple(bag_sizes.tolist()), id(model),
        solver, max_tokens_per_gpu,
        None if comm is None else (comm.bag_token_s.tobytes(), comm.bag_speed.tobytes(), comm.rank_offset),
    )
    hit = memo.get(key)
    if hit is None or hit[0] is not model:
        hit = memo[key] = (model, *_solve_group(lens, home, bag_sizes, model, solver, max_tokens_per_gpu, comm))
    return hit[1].copy(), dict(hit[2])



def _solve_group(
    lens: np.ndarray,
    home: np.ndarray,
    bag_sizes: np.ndarray,
    model: Model,
    solver: str,
    max_tokens_per_gpu: int | None,
    comm: GroupComm | None = None,
) -> tuple[np.ndarray, dict]:
    """Bag (index within the group) of each sequence of one balance group."""
    n = lens.size
    if n == 0:
        return np.zeros(0, np.int64), {"start": "empty"}
    problem = GroupProblem(lens, home, bag_sizes, model, comm)
    # Token capacity of every bag (its ranks' chunks differ by at most one token).
    bag_cap = None if max_tokens_per_gpu is None else max_tokens_per_gpu * bag_sizes
    first = greedy(problem)
    if solver == "greedy":
        if bag_cap is None or problem.fits(first, bag_cap):
            return first, {"start": "greedy"}
        name, assign, _, _ = within_budget(problem, [("greedy", first, 0)], bag_cap, refine=False)
        return assign, {"start": name}
    # For equal bags of equal speed and no communication term the published greedy *is*
    # LPT, so it is the LPT start too. The home start (every sequence on the bag holding
    # its home rank) usually needs few moves.
    starts = [("greedy", first)]
    if not problem.uniform_equal:
        starts.append(("lpt", lpt(problem)))
    candidates = [("greedy", first, 0)]
    for name, start in starts:
        refined, iters = refine(problem, start)
        candidates.append((name + "+refine", refined, iters))
        candidates.append((name + "+refine+local", localize(problem, refined), iters))
    # The home start, cut down to the best makespan so far and refined. (A step that
    # changed nothing returned its input: each distinct plan is measured once.)
    cap = min(problem.makespan(a) for a in {id(a): a for _, a, _ in candidates}.values())
    # This start only has to come within the choice's tolerance of the best so far (then it
    # wins on locality), not beat it: stop there, and after few iterations in any case.
    home, iters = refine(
        problem, repair(problem, home_start(problem), cap), 2 * problem.k + 16,
        stop_at=cap + 0.25 * problem.token_work,
    )
    candidates.append(("home+repair+refine", home, iters))
    name, assign, iters, score = problem.choose(candidates)
    if comm is not None:
        # Routing time is not in the bag loads: charge each bag the routing of its busiest
        # rank under the chosen plan, refine again, and keep the result if it is better.
        for _ in range(2):
            problem.offset = problem.route_offsets(assign)
            again, more = refine(problem, assign, 2 * problem.k + 16)
            problem.offset = None
            if np.array_equal(again, assign):
                break
            alt = [(name, assign, iters), (name + "+route", again, iters + more)]
            name, assign, iters, score = problem.choose(alt)
    if bag_cap is not None and not problem.fits(assign, bag_cap):
        # Only when the budget binds: the plan without it stays as it is otherwise. The
        # chosen plan and greedy are repaired (the other candidates are mostly their
        # refinements), and a capacity-aware LPT joins them.
        name, assign, iters, score = within_budget(problem, [(name, assign, iters), candidates[0]], bag_cap)
    stats = {
        "start": name,
        "refine_iters": iters,
        "makespan_over_ideal": problem.makespan(assign) / problem.ideal if problem.ideal > 0 else 1.0,
    }
    if comm is not None:
        stats["predicted_step_s"] = score
    return assign, stats
