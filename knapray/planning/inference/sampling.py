"""Planning a batch of sampling jobs over the bags of a topology (pure: numpy only).

A job is one request's denoising loop: ``steps`` forward passes of one sequence (two with
classifier-free guidance: the conditional and the unconditional pass). The batch is
planned once, by the training planner's solver (``GroupProblem``, greedy / LPT starts and
refinement): a job's cost on a bag of ``g`` GPUs is its steps times its passes times the
cost of one pass there (``W(L)/g`` for the workload model; ``CostModel.seq_cost`` with
Ulysses communication for a cost model). Each bag then runs its jobs' loops on its own,
with no step in step with another bag.

Inside a bag (``bag_plan``), every step is an ordinary ``BalancePlan`` over the world's
ranks whose sequences all live on the bag's first rank (the *lead*, which holds the
latents and takes the Euler steps) and run on the bag's ranks only:

- the bag whole: every pass cut into ``g`` chunks (Ulysses over the bag);
- **CFG parallel** (a bag of even ``g`` holding a job with guidance): the bag splits into
  two halves of ``g/2``; every conditional pass runs on the first half and every
  unconditional one on the second (Ulysses over each half), and the lead combines the two
  velocities each step. A job without guidance goes to the lighter half.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..balance.chunks import make_chunks
from ..balance.construct import greedy, lpt
from ..costs.cost import CostModel
from ..shapes.lengths import flatten_lengths
from ..balance.plan import BalancePlan
from ..balance.problem import GroupComm, GroupProblem
from ..balance.refine import refine
from ..shapes.topology import Topology
from ..costs.workload import WorkloadModel


@dataclass(frozen=True)
class JobPlan:
    """Which bag runs every job, and what the plan predicts."""

    topology: Topology
    bag: np.ndarray
    """(J,) bag of every job."""
    loads: np.ndarray
    """(bags,) predicted per-GPU cost of every bag (the model's units)."""
    start: str
    """Which construction won (greedy, lpt, and their refinements)."""

    @property
    def makespan(self) -> float:
        return float(self.loads.max()) if self.loads.size else 0.0

    def jobs_of(self, bag: int) -> np.ndarray:
        return np.flatnonzero(self.bag == bag)


def plan_jobs(tokens, steps, passes, topology: Topology,
              model: WorkloadModel | CostModel | None = None, max_tokens_per_gpu: int | None = None) -> JobPlan:
    """Bag of every job: ``tokens[j]`` its sequence length (text and image tokens of one
    pass), ``steps[j]`` its denoising steps, ``passes[j]`` 1 or 2 (classifier-free
    guidance). Minimizes the busiest bag's cost (steps x passes x one pass's cost).

    ``max_tokens_per_gpu``: what one GPU may hold of a job's passes (its activations): a
    job goes only to bags where ``tokens x passes / g`` fits; one that fits no bag is a
    ValueError naming its tokens, the budget and the largest bag."""
    lens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    reps = np.asarray(steps, dtype=np.int64).reshape(-1) * np.asarray(passes, dtype=np.int64).reshape(-1)
    if reps.shape != lens.shape:
        raise ValueError(f"tokens, steps and passes must have one entry per job, got {lens.size}, {reps.size}")
    if lens.size and (lens.min() < 1 or reps.min() < 1):
        raise ValueError("every job needs at least one token, one step and one pass")
    if topology.num_groups != 1:
        topology = Topology(tuple(topology.bags))  # one problem over every bag
    sizes = topology.bag_sizes
    model = model or WorkloadModel()
    if not lens.size:
        return JobPlan(topology, np.zeros(0, np.int64), np.zeros(sizes.size), "empty")
    comm = None
    if isinstance(model, CostModel):  # each bag's Ulysses seconds per token, as the training planner's
        comm = GroupComm(model.bag_ulysses_token_s(topology), model.bag_speed(topology), 0)
    p = GroupProblem(lens, np.zeros(lens.size, np.int64), sizes, model, comm, repeats=reps)
    if max_tokens_per_gpu is not None:
        held = (lens * np.asarray(passes, dtype=np.int64).reshape(-1))[:, None] / p.sizes[None, :]  # (J, sizes)
        over = held > max_tokens_per_gpu
        if over.all(axis=1).any():
            j = int(np.flatnonzero(over.all(axis=1))[0])
            raise ValueError(f"job {j}: {int(lens[j])} tokens x {int(passes[j])} passes fit no bag within "
                             f"{max_tokens_per_gpu} tokens per GPU (largest bag: {int(sizes.max())} GPUs)")
        cls_over = over[:, np.searchsorted(p.sizes, p.bag_sizes)]  # (J, bags)
        for c in range(p.cost.shape[1]):  # no construction or move keeps a job where it does not fit
            p.cost[cls_over[:, int(np.argmax(p.cls == c))], c] = np.inf
    candidates = [("greedy", greedy(p)), ("lpt", lpt(p))]
    for name, start in list(candidates):
        candidates.append((name + "+refine", refine(p, start)[0]))
    name, bag = min(candidates, key=lambda c: p.makespan(c[1]))
    if max_tokens_per_gpu is not None and cls_over[np.arange(lens.size), bag].any():
        raise ValueError(f"no plan keeps every job within {max_tokens_per_gpu} tokens per GPU on {topology}")
    return JobPlan(topology, bag.astype(np.int64), p.loads(bag), name)


COND, UNCOND, SINGLE = 0, 1, 2
"""What a sequence of a bag's step is: a guided job's conditional or unconditional pass,
or the one pass of a job without classifier-free guidance."""


def halving_topology(world_size: int, num_heads: int | None = None) -> str:
    """Bags halving in size (4 ranks: ``g2n1+g1n2``; 8: ``g4n1+g2n1+g1n2``): a bag for the
    large requests and single ranks for the small ones, each size dividing the heads."""
    sizes, rest = [], world_size
    while rest > 1:
        b = 1 << max(0, (rest // 2).bit_length() - 1)
        while num_heads and num_heads % b:
            b //= 2
        sizes.append(b)
        rest -= b
    sizes += [1] * rest
    counts: dict[int, int] = {}
    for b in sizes:
        counts[b] = counts.get(b, 0) + 1
    return "+".join(f"g{b}n{n}" for b, n in counts.items())


AUTO = "auto"
"""A sampling topology chosen per batch among ``candidate_topologies``."""


def candidate_topologies(spec: str, world_size: int, num_heads: int | None = None) -> list[str]:
    """The topologies a gang prepares groups for: ``spec`` itself, or for ``auto`` one rank
    per bag (data parallel), the halving layout, and bags of every power-of-two size that
    divides the heads and the world, up to one bag of all (static USP), smallest first."""
    if spec != AUTO:
        return [spec]
    out = [f"g1n{world_size}", halving_topology(world_size, num_heads)]
    b = 2
    while b <= world_size:
        if world_size % b == 0 and (not num_heads or num_heads % b == 0):
            out.append(f"g{b}n{world_size // b}")
        b *= 2
    return list(dict.fromkeys(out))


def choose_job_plan(tokens, steps, passes, topologies: list[Topology],
                    model: WorkloadModel | CostModel | None = None,
                    max_tokens_per_gpu: int | None = None) -> tuple[int, JobPlan]:
    """(index, plan) of the topology whose plan has the smallest predicted makespan (a cost
    model's Ulysses seconds included); the first on a tie (the list goes smallest bags
    first: less communication). Topologies no plan fits within the budget are skipped."""
    best, err = None, None
    for i, topo in enumerate(topologies):
        try:
            plan = plan_jobs(tokens, steps, passes, topo, model, max_tokens_per_gpu)
        except ValueError as e:
            err = err or e
            continue
        if best is None or plan.makespan < best[1].makespan * (1 - 1e-9):
            best = (i, plan)
    if best is None:
        raise err
    return best


def cfg_parallel_bag(bag_size: int, has_guided_job: bool, enabled: bool = True) -> bool:
    """Whether a bag runs CFG parallel: an even bag holding a job with two passes."""
    return enabled and has_guided_job and bag_size >= 2 and bag_size % 2 == 0


def bag_plan(topology: Topology, bag: int, lens, passes, cfg_parallel: bool,
             model: WorkloadModel | CostModel | None = None) -> BalancePlan:
    """One step of ``bag``: a ``BalancePlan`` over the world whose sequences (``lens``, in
    the lead's order) live on the bag's first rank and run on the bag's ranks. ``passes[s]``
    says what sequence ``s`` is: ``COND`` / ``UNCOND`` (a guided job's two passes) or
    ``SINGLE`` (a job without classifier-free guidance). Under ``cfg_parallel`` the bag runs
    as two halves: ``COND`` passes on the first, ``UNCOND`` on the second, ``SINGLE`` ones on
    the lighter, longest first. The other bags keep their sizes and get nothing."""
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    kind = np.asarray(passes, dtype=np.int64).reshape(-1)
    if kind.shape != lens.shape or (kind.size and not np.isin(kind, (COND, UNCOND, SINGLE)).all()):
        raise ValueError(f"passes: one of COND, UNCOND, SINGLE per sequence, got {kind.tolist()[:8]}")
    sizes = [int(g) for g in topology.bags]
    g = sizes[bag]
    model = model or WorkloadModel()
    if cfg_parallel:
        if g % 2:
            raise ValueError(f"CFG parallel needs a bag of an even size, bag {bag} has {g} ranks")
        sub = Topology(tuple(sizes[:bag] + [g // 2, g // 2] + sizes[bag + 1:]))
        half = np.where(kind == UNCOND, 1, 0)
        work = model(lens)
        paired = kind != SINGLE
        load = np.bincount(half[paired], weights=work[paired], minlength=2).astype(np.float64)
        for s in np.argsort(-work, kind="stable"):
            if not paired[s]:
                half[s] = int(np.argmin(load))
                load[half[s]] += work[s]
        bag_of_seq = bag + half
    else:
        sub = Topology(tuple(sizes))
        bag_of_seq = np.full(lens.size, bag, dtype=np.int64)
    lead = int(topology.bag_starts[bag])
    per_rank: list[list[int]] = [[] for _ in range(sub.world_size)]
    per_rank[lead] = lens.tolist()
    lens_, home, local = flatten_lengths(per_rank, sub)
    chunk_seq, chunk_rank, chunk_start, chunk_len = make_chunks(lens_, home, bag_of_seq, sub)
    return BalancePlan(sub, model, lens_, home, local, bag_of_seq.astype(np.int64), chunk_seq, chunk_rank,
                       chunk_start, chunk_len, solver="bag")


def job_seconds(tokens: int, steps: int, passes: int, sizes, cost: CostModel) -> np.ndarray:
    """Predicted seconds of one job alone on a bag of each size of ``sizes``: ``steps x passes
    x cost.seq_cost(tokens, g)``, or for two passes on an even bag the two at once on its
    halves (CFG parallel), whichever is faster (what a serving gang's scheduler compares)."""
    out = []
    for g in sizes:
        t = steps * passes * float(cost.seq_cost(tokens, int(g)))
        if passes == 2 and g % 2 == 0:
            t = min(t, steps * float(cost.seq_cost(tokens, int(g) // 2)))
        out.append(max(t, 1e-9))
    return np.asarray(out)
