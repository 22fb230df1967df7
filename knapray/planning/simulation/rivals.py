"""The newest balancers' ideas as planners in the simulator, under knapray's cost model.

knapray's own planners, ``auto`` (a static topology chosen from recent steps),
``per-step`` (each step's own partition of every node into aligned power-of-two blocks,
``pertopo``) and ``overlap`` (long sequences on the bags of either of those or of a
homogeneous topology, short ones whole on the least loaded GPUs, which may also serve a
bag: ``overlap``), are compared with what the systems published since KnapFormer do, each
re-implemented from its paper's description as a planner of one step (none of them ships
code for this cost model; these are their ideas, not their code):

- ``knapformer``: KnapFormer's greedy on fixed homogeneous bags, the best of
  g1n*/g2n*/g4n*/g8n* over the steps (``sim.simulate``'s ``greedy``);
- ``dynamic_cp`` (Megatron-Core dynamic context parallel): one CP degree for the whole
  step, chosen per step among the homogeneous bag sizes, knapray's solver assigning;
- ``flexsp`` (FlexSP): sequence-parallel groups of *any* size a node and the head count
  allow (24 heads: 1, 2, 3, 4, 6, 8), chosen per step: every sequence asks for the
  smallest group on which it takes at most a target time, the groups those sequences need
  go to the nodes whose sequences ask for them most (not aligned), the rest of every node
  is groups of one, and knapray's solver assigns; several targets and every one-size layout
  tried, the best kept (FlexSP solves for its groups exactly, which this heuristic does not);
- ``zellige`` (Zellige): overlapping groups: every sequence that one GPU cannot finish in
  a target time is sharded over an aligned power-of-two group of the size it needs, or of
  one size for all (both tried; on the group whose most loaded GPU is least loaded), and
  every other sequence goes whole
  to the least loaded GPU, which may also serve groups: no GPU idles inside a bag it only
  partly uses. Its per-GPU times are computed here with the cost model's own terms
  (chunk compute, Ulysses per chunk token on its group, routing of the tokens that leave
  their home), since a ``BalancePlan``'s bags are disjoint.

``rivals_step`` predicts one step with every planner; ``rivals_table`` runs mixes and
world sizes and ``rivals_markdown`` writes the table (``knapray simulate --rivals``);
``random_cases`` draws mixes nobody picked (``simulate --rivals --random N``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..search.autotopo import search_topology
from ..costs.cost import CostModel, StepTimes
from ..shapes.mix import MAX_TEXT_TOKENS, parse_code
from ..search.overlap import demand_layout, divisor_sizes, overlap_plan, step_candidates
from ..search.pertopo import plan_step
from ..balance.plan import BalancePlan
from ..balance.solver import memoized, plan_balance
from ..shapes.topology import Topology

PLANNERS = ("knapray_auto", "knapray_per_step", "knapray_overlap", "knapformer", "dynamic_cp", "flexsp", "zellige")
KNAPRAY = ("knapray_auto", "knapray_per_step", "knapray_overlap")
"""knapray's planners: its best is the fastest of these."""
MARGINS = (1.0, 1.05, 1.1, 1.2, 1.35)
"""Target step times (x the step's ideal) the demand-driven rivals try; the best is kept."""


@dataclass(frozen=True)
class Prediction:
    """One planner's predicted step."""

    planner: str
    step_s: float
    compute_s: float
    """The slowest GPU's compute seconds."""
    comm_s: float
    """Its Ulysses and routing seconds."""
    layout: str
    """What it ran on (a topology, or the groups of an overlapping plan)."""
    plan: BalancePlan | None = field(default=None, compare=False, repr=False)
    """The plan knapray's router could execute (disjoint bags); None for overlapping groups."""

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0


def _prediction(planner: str, times: StepTimes, layout: str, plan: BalancePlan | None = None) -> Prediction:
    total = times.total
    r = int(np.argmax(total)) if total.size else 0
    comm = float(times.ulysses[r] + times.route[r]) if total.size else 0.0
    return Prediction(planner, times.step_time, float(times.compute[r]) if total.size else 0.0, comm, layout, plan)


def _planned(planner: str, plan: BalancePlan, cost: CostModel) -> Prediction:
    return _prediction(planner, cost.step_times(plan), _compact(plan.topology), plan)


def pow2_sizes(gpus_per_node: int, num_heads: int) -> list[int]:
    out, g = [], 1
    while g <= gpus_per_node:
        if num_heads % g == 0:
            out.append(g)
        g *= 2
    return out


def dynamic_cp(step: list[list[int]], cost: CostModel) -> Prediction:
    """One degree for every sequence of the step, the best predicted among the homogeneous
    bag sizes."""
    world, gpn = len(step), cost.gpus_per_node
    best = None
    for g in pow2_sizes(min(gpn, world), cost.num_heads):
        if world % g:
            continue
        p = _planned("dynamic_cp", plan_balance(step, Topology((g,) * (world // g)), cost), cost)
        if best is None or p.step_s < best.step_s:
            best = p
    return best


def flexsp(step: list[list[int]], cost: CostModel) -> Prediction:
    """Variable-size groups chosen per step (any divisor of the heads up to a node)."""
    world = len(step)
    node = min(cost.gpus_per_node, world)
    lens = np.asarray([x for r in step for x in r], dtype=np.int64)
    home_node = np.repeat(np.arange(world) // node, [len(r) for r in step])
    sizes = divisor_sizes(node, cost.num_heads)
    ideal = cost.ideal_step_time(lens, world) - cost.fixed_s
    # FlexSP solves for its groups exactly; this heuristic also tries every one-size layout
    # (each a layout FlexSP's solver may pick), so it never trails dynamic CP's choice.
    layouts = [demand_layout(lens, home_node, cost, world, sizes, ideal * margin) for margin in MARGINS]
    layouts += [Topology((g,) * (world // g)) for g in sizes if node % g == 0 and world % g == 0]
    best, seen = None, set()
    for topo in layouts:
        if topo is None or tuple(topo.bags) in seen:
            continue
        seen.add(tuple(topo.bags))
        p = _planned("flexsp", plan_balance(step, topo, cost), cost)
        if best is None or p.step_s < best.step_s:
            best = p
    return best


def zellige_times(step: list[list[int]], cost: CostModel, target: float, long_group: int | None = None
                  ) -> tuple[StepTimes, str]:
    """Per-GPU times of the overlapping plan at ``target`` seconds (see the module doc);
    ``long_group``: every sharded sequence on groups of this size (None: each the smallest
    that meets the target)."""
    world, gpn = len(step), cost.gpus_per_node
    node = min(gpn, world)
    sizes = pow2_sizes(node, cost.num_heads)
    lens = np.asarray([x for r in step for x in r], dtype=np.int64)
    home = np.repeat(np.arange(world), [len(r) for r in step])
    speed = cost.speeds(world)
    # Per-rank sums as Python floats (the same additions, in the same order, as on arrays);
    # ``load`` stays an array for the least loaded rank and block.
    compute, ulysses = [0.0] * world, [0.0] * world
    sent, recv = [[0.0] * world for _ in range(2)], [[0.0] * world for _ in range(2)]  # [intra, inter] tokens
    load = np.zeros(world)
    speed_l = speed.tolist()
    groups: dict[int, int] = {}

    def move(src: int, dst: int, tokens: float) -> None:
        if src == dst:
            return
        inter = int(src // gpn != dst // gpn)
        sent[inter][src] += tokens
        recv[inter][dst] += tokens

    # Every sequence's costs at once (the loop below reads them as floats).
    whole_s = cost.compute(lens)
    order = np.argsort(-whole_s, kind="stable")
    fits = np.stack([cost.seq_cost(lens, s) <= target for s in sizes])  # (sizes, S)
    smallest = np.where(fits.any(axis=0), np.asarray(sizes)[np.argmax(fits, axis=0)], sizes[-1]).tolist()
    chunks = {g: cost.chunk(lens / g, lens, np.full(lens.size, g)).tolist() for g in sizes[1:]}
    whole_l, lens_l, home_l = whole_s.tolist(), lens.tolist(), home.tolist()
    token_s: dict[int, float] = {}  # Ulysses seconds per token on a group of each size
    for i in order.tolist():
        length, src = lens_l[i], home_l[i]
        whole = whole_l[i]
        g = 1 if whole <= target else long_group or smallest[i]
        if g == 1:
            r = int(load.argmin())
            c = whole / speed_l[r]
            compute[r] += c
            load[r] += c
            if r != src:  # ``move``, inline: most sequences take this branch
                inter = int(src // gpn != r // gpn)
                sent[inter][src] += length
                recv[inter][r] += length
            continue
        groups[g] = groups.get(g, 0) + 1
        # Aligned blocks inside nodes (g divides the node size): the one whose busiest GPU is least loaded.
        start = int(load.reshape(-1, g).max(axis=1).argmin()) * g
        chunk = chunks[g][i]
        per_token = token_s.get(g)
        if per_token is None:
            per_token = token_s[g] = cost.ulysses_token_s(g, 0)
        share, uly = length / g, length / g * per_token  # the same for every rank of the group
        for r in range(start, start + g):
            c, u = chunk / speed_l[r], uly / speed_l[r]
            compute[r] += c
            ulysses[r] += u
            load[r] += c + u
            move(src, r, share)
    compute, ulysses = np.asarray(compute), np.asarray(ulysses)
    sent, recv = np.asarray(sent), np.asarray(recv)
    t_intra, t_inter = cost.route_token_s(False), cost.route_token_s(True)
    route = np.maximum(np.maximum(sent[0], recv[0]) * t_intra, np.maximum(sent[1], recv[1]) * t_inter)
    layout = "overlapping: " + (", ".join(f"{n} group(s) of {g}" for g, n in sorted(groups.items(), reverse=True))
                                or "every sequence whole")
    return StepTimes(compute, ulysses, route, cost.fixed_s), layout


def zellige(step: list[list[int]], cost: CostModel) -> Prediction:
    world = len(step)
    lens = np.asarray([x for r in step for x in r], dtype=np.int64)
    ideal = cost.ideal_step_time(lens, world) - cost.fixed_s
    sizes = pow2_sizes(min(cost.gpus_per_node, world), cost.num_heads)
    best = None
    for margin in MARGINS:
        for long_group in (None, *sizes[1:]):  # the long sequences' groups sized by demand, or all alike
            times, layout = zellige_times(step, cost, ideal * margin, long_group)
            p = _prediction("zellige", times, layout)
            if best is None or p.step_s < best.step_s:
                best = p
    return best


def knapformer_topology(steps: Sequence[list[list[int]]], cost: CostModel) -> Topology:
    """KnapFormer's fixed bags: the homogeneous topology its greedy does best on over ``steps``."""
    world = len(steps[0])
    best, best_s = None, np.inf
    for g in pow2_sizes(min(cost.gpus_per_node, world), cost.num_heads):
        if world % g:
            continue
        topo = Topology((g,) * (world // g))
        s = sum(cost.step_times(plan_balance(st, topo, cost, solver="greedy")).step_time for st in steps)
        if s < best_s:
            best, best_s = topo, s
    return best


def rivals_step(step: list[list[int]], cost: CostModel, auto: Topology, fixed: Topology) -> dict[str, Prediction]:
    """Every planner's prediction of one step (``auto``: knapray's static topology;
    ``fixed``: KnapFormer's)."""
    out = {
        "knapray_auto": _planned("knapray_auto", plan_balance(step, auto, cost), cost),
        "knapformer": _planned("knapformer", plan_balance(step, fixed, cost, solver="greedy"), cost),
        "knapray_per_step": _planned("knapray_per_step", plan_step(step, cost, base=auto).plan, cost),
    }
    world = len(step)
    over = overlap_plan(step, cost, step_candidates(step, cost, auto, out["knapray_per_step"].plan.topology,
                                                    min(cost.gpus_per_node, world)))
    out["knapray_overlap"] = _prediction("knapray_overlap", cost.step_times(over), "overlapping: " + _compact(
        over.topology) + f" + {over.stats['overlap']['solo']} whole", over)
    out["dynamic_cp"] = dynamic_cp(step, cost)
    out["flexsp"] = flexsp(step, cost)
    out["zellige"] = zellige(step, cost)
    return out


def steps_at(mix: str, world: int, steps: int, seed: int, text_tokens: int) -> list[list[list[int]]]:
    """``steps`` steps of a mix (or an ``alternate:`` schedule) on ``world`` GPUs: its ranks'
    batches replicated over a larger world, or dealt onto a smaller one (rank r holds the
    batches of ranks r, r + W, ...: the same data on fewer GPUs)."""
    from .sim import schedule_ranks, schedule_steps

    ranks = schedule_ranks(mix)
    drawn = max(world, ranks)
    if drawn % ranks or drawn % world:
        raise ValueError(f"world {world} is neither a multiple nor a divisor of the mix's {ranks} ranks")
    _, out = schedule_steps(mix, steps, seed, drawn, text_tokens)
    if drawn == world:
        return [list(s) for s in out]
    return [[[x for j in range(r, drawn, world) for x in s[j]] for r in range(world)] for s in out]


def rivals_table(
    mixes: Sequence[tuple[str, str]],
    worlds: Sequence[int] = (8, 32, 128, 512),
    cost: CostModel | None = None,
    steps: int = 3,
    seed: int = 0,
    history_steps: int = 2,
    progress=None,
) -> list[dict]:
    """One row per (mix, world): every planner's mean predicted step time and communication
    share over ``steps`` steps. ``mixes``: (mix, model preset) pairs (``wan`` plans with the
    Wan 14B cross-attention model)."""
    from ..costs.cost import MODEL_PRESETS

    rows = []
    for world in worlds:
        for mix, model in mixes:
            t0 = time.perf_counter()
            c = cost or CostModel(**MODEL_PRESETS[model])
            text = 0 if c.attention_kind == "cross" else MAX_TEXT_TOKENS  # a cross-attention model charges the text
            evaluated = steps_at(mix, world, steps, seed, text)
            history = steps_at(mix, world, history_steps, seed + 1000, text)
            # The planners plan the same balance groups on the same topologies again and
            # again (every rival that tries g8n4 on the step): each is solved once.
            with memoized():
                auto = search_topology(history, world, c, c.gpus_per_node).topology
                fixed = knapformer_topology(history, c)
                preds = [rivals_step(s, c, auto, fixed) for s in evaluated]
            row = {"mix": mix, "model": model, "world_size": world, "steps": steps,
                   "seconds": time.perf_counter() - t0, "planners": {}}
            for name in PLANNERS:
                ps = [p[name] for p in preds]
                row["planners"][name] = {
                    "step_s": float(np.mean([p.step_s for p in ps])),
                    "comm_share": float(np.mean([p.comm_share for p in ps])),
                    "layouts": sorted({p.layout for p in ps}),
                }
            best = min(row["planners"][n]["step_s"] for n in KNAPRAY)
            row["knapray_best_s"] = best
            row["ratios"] = {n: row["planners"][n]["step_s"] / best for n in PLANNERS}
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def rivals_markdown(rows: list[dict], command: str) -> str:
    head = ("| mix | GPUs | knapray auto s | knapray per-step s | knapray overlap s | KnapFormer greedy | dynamic CP "
            "| FlexSP-style | Zellige-style | comm. share (best knapray / Zellige) | sim s |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        p, q = r["planners"], r["ratios"]
        best = min(KNAPRAY, key=lambda n: p[n]["step_s"])
        mix = f"{r['mix']} ({r['model']})"
        cells = [f"{p[n]['step_s']:.4f} ({q[n]:.3f}x)" for n in ("knapformer", "dynamic_cp", "flexsp", "zellige")]
        lines.append(
            f"| {mix} | {r['world_size']} | " + " | ".join(f"{p[n]['step_s']:.4f}" for n in KNAPRAY) + " | "
            + " | ".join(cells)
            + f" | {p[best]['comm_share']:.1%} / {p['zellige']['comm_share']:.1%} | {r['seconds']:.0f} |")
    return (f"Command: `{command}`. Predicted step seconds (means over {rows[0]['steps'] if rows else 0} steps); "
            "each rival's step time over knapray's best (auto, per-step or overlap) in brackets: above 1.000x the rival is "
            "slower.\n\n" + "\n".join(lines) + "\n")


def _compact(topology: Topology) -> str:
    from ..search.autotopo import composition_spec

    spec = composition_spec(topology)
    return spec if topology.num_groups == 1 else f"{spec} x{topology.num_groups}"


# ---- mixes nobody picked ------------------------------------------------------------------

RANDOM_WORLDS = (8, 16, 32, 64, 128, 256)
IMAGE_SIDES = (256, 384, 512, 640, 768, 1024, 1536, 2048)
CLIP_SIDES = (256, 384, 512, 768)


def random_mix(rng: np.random.Generator, ranks: int = 8) -> str:
    """A mix of ``ranks`` ranks drawn at random: 1 to 5 parts, each images of a random side
    and batch (fewer for larger sides) or clips of a random side, length and VAE (3.4x or
    Wan's causal 4x), 1 or 2 a rank; only codes ``parse_code`` accepts."""
    while True:
        k = int(rng.integers(1, min(5, ranks) + 1))
        cuts = np.sort(rng.choice(np.arange(1, ranks), size=k - 1, replace=False)) if k > 1 else np.zeros(0, int)
        codes = []
        for g in np.diff(np.concatenate([[0], cuts, [ranks]])).tolist():
            if rng.random() < 0.35:
                vae = int(rng.choice([1, 2]))
                frames = int(rng.choice([17, 33, 49, 81] if vae == 2 else [17, 33, 49, 85]))
                codes.append(f"g{g}b{int(rng.integers(1, 3))}i{int(rng.choice(CLIP_SIDES))}f{frames}s{vae}")
            else:
                side = int(rng.choice(IMAGE_SIDES))
                most = max(2, int(32 * (256 / side) ** 2))
                codes.append(f"g{g}b{int(rng.integers(1, most + 1))}i{side}f1s0")
        try:
            for c in codes:
                parse_code(c)
        except ValueError:
            continue
        return ",".join(codes)


def random_cases(n: int, seed: int, worlds: Sequence[int] = RANDOM_WORLDS) -> list[tuple[str, str, int, int]]:
    """``n`` (mix, model preset, world size, step seed) cases, seeded: a random mix of 8
    ranks (replicated to the world), either preset, a world from ``worlds``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        mix = random_mix(rng)
        model = "flux" if rng.random() < 0.5 else "wan14b"
        out.append((mix, model, int(rng.choice(worlds)), int(rng.integers(0, 2**31))))
    return out


def random_rivals_table(n: int, seed: int, steps: int = 1, worlds: Sequence[int] = RANDOM_WORLDS,
                        progress=None) -> list[dict]:
    """``rivals_table``'s rows for ``random_cases(n, seed)``, one case each; a row's
    ``behind`` is how far knapray's best trails the best rival (0: it does not)."""
    rows = []
    for mix, model, world, step_seed in random_cases(n, seed, worlds):
        (row,) = rivals_table([(mix, model)], worlds=(world,), steps=steps, seed=step_seed, history_steps=1)
        row["step_seed"] = step_seed
        row["behind"] = max(0.0, 1.0 - min(v for k, v in row["ratios"].items() if k not in KNAPRAY))
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows
