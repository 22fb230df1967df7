"""Cluster step-time simulator: predicted seconds per rank of plans, under a ``CostModel``.

For each step of a data mix (or of recorded lengths) it plans three ways and predicts
every rank's time (compute, Ulysses all-to-alls, routing; ``CostModel.step_times``):

- ``baseline``: no balancing, every rank computes its own sequences;
- ``greedy``: KnapFormer's greedy on a fixed topology (with ``--topology auto``: the best
  of the homogeneous ``g1n*``, ``g2n*``, ``g4n*``, ``g8n*`` that fit the world);
- ``knapray``: our solver with the cost model, on the given topology or the one
  ``autotopo`` chooses from *other* steps of the same mix (as the coordinator would, from
  recent history); with ``per-step``, on a topology chosen every step (``pertopo``: a
  partition of every node into aligned power-of-two blocks, or the static ``auto``
  topology when that predicts faster), and the static ``auto`` topology is reported beside
  it (``static_auto``) with the per-step comparison.

Efficiency is the ideal step time (total compute over the ranks' total speed, no
communication) over the predicted step time, both summed over the steps.

Mixes: a paper mix's name, data codes, or a non-stationary schedule
``alternate:MIX[*K]/MIX[*K]/...``: K steps (default 1) of each mix in turn, cycling
(``alternate:low-res/image+video`` alternates image-only and video-heavy steps;
``alternate:low-res*3/image+video`` runs three image-only steps per video step). Every
mix of a schedule must fit the world (its rank count divides it).
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from knapray.planning import PAPER_MIXES, Topology, identity_plan, plan_balance
from knapray.planning.shapes.mix import MAX_TEXT_TOKENS, MIXES
from knapray.planning.search.autotopo import composition_spec, search_topology
from knapray.planning.costs.cost import CostModel, StepTimes
from knapray.planning.search.pertopo import plan_step
from knapray.planning.simulation.runner import mix_ranks, mix_steps

MODES = ("baseline", "greedy", "knapray")
PER_STEP = "per-step"
ALTERNATE = "alternate:"
NONSTATIONARY_MIXES = ("alternate:low-res/image+video", "alternate:low-res*2/image+video*2")
"""The table's non-stationary mixes: image-only steps alternating with the paper's video mix,
one step each, and in phases of two steps (the static topology's two history steps then
see one phase only, as a choice made at the start of a run sees the data of its start)."""
FIXED_SIZES = (1, 2, 4, 8)
HISTORY_SEED_OFFSET = 1000  # auto chooses from steps the evaluation never sees


def resolve_mix(mix: str) -> str:
    """A named mix (``mixed-res``, ``wan``) or data codes."""
    return MIXES.get(mix, mix)


def parse_schedule(mix: str) -> list[tuple[str, str, int]]:
    """``(name, data codes, steps in a row)`` of every part of a mix: one part for a paper
    mix or codes, one per ``/``-separated part of ``alternate:A[*K]/B[*K]/...``."""
    if not mix.startswith(ALTERNATE):
        return [(mix, resolve_mix(mix), 1)]
    parts = []
    for part in mix[len(ALTERNATE):].split("/"):
        name, star, count = part.strip().partition("*")
        if not name or (star and not count.strip().isdigit()) or (star and int(count) < 1):
            raise ValueError(
                f"bad part {part!r} of {mix!r}: expected MIX or MIX*K (K >= 1 steps in a row), parts joined "
                "by '/', e.g. 'alternate:low-res/image+video' or 'alternate:low-res*3/image+video'"
            )
        parts.append((name, resolve_mix(name), int(count) if star else 1))
    if len(parts) < 2:
        raise ValueError(f"{mix!r}: an alternating schedule needs at least two parts joined by '/'")
    return parts


def schedule_ranks(mix: str) -> int:
    """The smallest world every part of a mix fits (the least common multiple of their ranks)."""
    return int(np.lcm.reduce([mix_ranks(codes) for _, codes, _ in parse_schedule(mix)]))


def schedule_steps(
    mix: str, steps: int, seed: int, world_size: int, max_text_tokens: int = MAX_TEXT_TOKENS,
) -> tuple[list[str], list[list[list[int]]]]:
    """Labels and per-rank lengths of ``steps`` steps of a mix (a schedule cycles its parts);
    each part draws from its own generator, seeded ``seed + part index``."""
    parts = parse_schedule(mix)
    gens = [mix_steps(codes, steps, seed + i, world_size=world_size, max_text_tokens=max_text_tokens)
            for i, (_, codes, _) in enumerate(parts)]
    order = [i for i, (_, _, k) in enumerate(parts) for _ in range(k)]
    labels, out = [], []
    for t in range(steps):
        i = order[t % len(order)]
        labels.append(parts[i][0])
        out.append(next(gens[i]))
    return labels, out


def fixed_topologies(world_size: int, gpus_per_node: int, sizes: Sequence[int] = FIXED_SIZES) -> list[Topology]:
    """``g{g}n{W/g}`` for every ``g`` in ``sizes`` that divides the world (one balance group)."""
    out = []
    for g in sizes:
        if world_size % g == 0:
            out.append(Topology.parse(f"g{g}n{world_size // g}", world_size=world_size, gpus_per_node=gpus_per_node))
    return out


def simulate(
    steps: Sequence[Sequence[Sequence[int]]],
    topology: str | Topology,
    cost: CostModel,
    history: Sequence[Sequence[Sequence[int]]] | None = None,
    gpus_per_node: int | None = None,
) -> dict:
    """Predicted step times of ``steps`` (per-rank lengths) for the three modes.

    ``topology``: a spec, a ``Topology``, or ``"auto"`` (chosen from ``history``, default
    ``steps``)."""
    t0 = time.perf_counter()
    steps = [list(s) for s in steps]
    if not steps:
        raise ValueError("no steps to simulate")
    world = len(steps[0])
    gpn = int(gpus_per_node or cost.gpus_per_node)
    if gpn != cost.gpus_per_node:
        cost = cost.replace(gpus_per_node=gpn)
    cost.speeds(world)  # validates rank_speed against the world
    auto = None
    per_step = isinstance(topology, str) and topology == PER_STEP
    if isinstance(topology, str) and topology in ("auto", PER_STEP):
        hist = history if history is not None else steps
        auto = search_topology(hist, world, cost, gpn)
        ours_topo = auto.topology
        greedy_topos = fixed_topologies(world, gpn)
    else:
        ours_topo = topology if isinstance(topology, Topology) else Topology.parse(topology, world, gpn)
        greedy_topos = [ours_topo]
    ideal = np.array([cost.ideal_step_time(_flat(s), world) for s in steps])
    baseline = [cost.step_times(identity_plan(s, cost)) for s in steps]
    greedy_runs = {
        str(t): [cost.step_times(plan_balance(s, t, cost, solver="greedy")) for s in steps] for t in greedy_topos
    }
    greedy_name = min(greedy_runs, key=lambda k: sum(x.step_time for x in greedy_runs[k]))
    plan_ms = []
    ours, static, chosen = [], [], []
    for s in steps:
        t1 = time.perf_counter()
        if per_step:
            choice = plan_step(s, cost, base=ours_topo)
            plan = choice.plan
            static.append(cost.step_times(plan_balance(s, ours_topo, cost)))
            chosen.append(choice)
        else:
            plan = plan_balance(s, ours_topo, cost)
        plan_ms.append((time.perf_counter() - t1) * 1e3)
        ours.append(cost.step_times(plan))
    modes = {
        "baseline": _mode("g1n%d (no balancing)" % world, baseline, ideal),
        "greedy": _mode(greedy_name, greedy_runs[greedy_name], ideal),
        "knapray": _mode(
            PER_STEP if per_step else (_auto_name(ours_topo) if auto else str(ours_topo)), ours, ideal
        ),
    }
    modes["knapray"]["plan_ms_p50"] = float(np.median(plan_ms))
    result = {
        "world_size": world,
        "gpus_per_node": gpn,
        "steps": len(steps),
        "ideal_step_s": float(ideal.mean()),
        "modes": modes,
        "greedy_by_topology": {
            k: {"step_s": float(np.mean([x.step_time for x in v])),
                "efficiency": float(ideal.sum() / sum(x.step_time for x in v))}
            for k, v in greedy_runs.items()
        },
        "speedup_vs_greedy": modes["greedy"]["step_s"] / modes["knapray"]["step_s"],
        "speedup_vs_baseline": modes["baseline"]["step_s"] / modes["knapray"]["step_s"],
    }
    if auto is not None:
        result["auto"] = auto.summary()
        result["auto"]["layout_full"] = ours_topo.spec
    if per_step:
        modes["static_auto"] = _mode(_auto_name(ours_topo), static, ideal)
        ratios = np.array([a.step_time / b.step_time for a, b in zip(static, ours)])
        result["per_step"] = [
            {"step_s": b.step_time, "static_auto_s": a.step_time, "source": c.source,
             "topology": composition_spec(c.topology) if c.source != "base" else _auto_name(c.topology),
             "candidates": len(c.scores)}
            for a, b, c in zip(static, ours, chosen)
        ]
        result["speedup_vs_static_auto"] = modes["static_auto"]["step_s"] / modes["knapray"]["step_s"]
        result["per_step_ratio_min"] = float(ratios.min())
        result["steps_behind_static_auto"] = int(np.sum(ratios < 1 - 1e-12))
    result["simulate_s"] = time.perf_counter() - t0
    return result


def simulate_mix(
    mix: str,
    topology: str = "auto",
    world_size: int | None = None,
    cost: CostModel | None = None,
    steps: int = 4,
    seed: int = 0,
    history_steps: int = 2,
    gpus_per_node: int | None = None,
) -> dict:
    """``simulate`` on ``steps`` steps of a mix (paper name, data codes or an
    ``alternate:`` schedule); ``auto`` (and ``per-step``'s static topology) chooses from
    ``history_steps`` other steps of the mix (a schedule's first ones, other seeds). With a
    cross-attention cost model a sequence is its visual tokens (the model charges the text)."""
    world = world_size or schedule_ranks(mix)
    cost = cost or CostModel()
    text = 0 if cost.attention_kind == "cross" else MAX_TEXT_TOKENS
    labels, evaluated = schedule_steps(mix, steps, seed, world, text)
    _, history = schedule_steps(mix, history_steps, seed + HISTORY_SEED_OFFSET, world, text)
    result = simulate(evaluated, topology, cost, history=history, gpus_per_node=gpus_per_node)
    result["mix"] = mix
    result["step_mix"] = labels
    return result


def paper_table(
    worlds: Sequence[int] = (32, 1024),
    cost: CostModel | None = None,
    steps: int = 3,
    seed: int = 0,
    progress=None,
) -> list[dict]:
    """``auto`` vs the best greedy x {g1n*, g2n*, g4n*, g8n*} on the paper's three mixes."""
    rows = []
    for world in worlds:
        for name in PAPER_MIXES:
            r = simulate_mix(name, "auto", world, cost, steps=steps, seed=seed)
            m = r["modes"]
            rows.append({
                "mix": name,
                "world_size": world,
                "auto_topology": m["knapray"]["topology"],
                "auto_num_groups": r["auto"]["num_groups"],
                "auto_efficiency": m["knapray"]["efficiency"],
                "auto_step_s": m["knapray"]["step_s"],
                "greedy_topology": m["greedy"]["topology"],
                "greedy_efficiency": m["greedy"]["efficiency"],
                "greedy_step_s": m["greedy"]["step_s"],
                "baseline_efficiency": m["baseline"]["efficiency"],
                "ratio": r["speedup_vs_greedy"],
                "seconds": r["simulate_s"],
            })
            if progress is not None:
                progress(rows[-1])
    return rows


def per_step_table(
    worlds: Sequence[int] = (32, 1024),
    mixes: Sequence[str] = (*PAPER_MIXES, *NONSTATIONARY_MIXES),
    cost: CostModel | None = None,
    steps: int = 4,
    seed: int = 0,
    progress=None,
) -> list[dict]:
    """Per-step topology vs static ``auto`` on every mix and world."""
    rows = []
    for world in worlds:
        for mix in mixes:
            r = simulate_mix(mix, PER_STEP, world, cost, steps=steps, seed=seed)
            m = r["modes"]
            per_mix = {}
            for lab, p in zip(r["step_mix"], r["per_step"]):
                a, b = per_mix.get(lab, (0.0, 0.0))
                per_mix[lab] = (a + p["static_auto_s"], b + p["step_s"])
            rows.append({
                "mix": mix,
                "world_size": world,
                "static_topology": m["static_auto"]["topology"],
                "static_step_s": m["static_auto"]["step_s"],
                "per_step_s": m["knapray"]["step_s"],
                "ratio": r["speedup_vs_static_auto"],
                "worst_step_ratio": r["per_step_ratio_min"],
                "steps_behind": r["steps_behind_static_auto"],
                "ratio_by_part": {k: a / b for k, (a, b) in per_mix.items()},
                "chosen": sorted({p["topology"] for p in r["per_step"]}),
                "seconds": r["simulate_s"],
            })
            if progress is not None:
                progress(rows[-1])
    return rows


def per_step_markdown(rows: list[dict], command: str, steps: int) -> str:
    lines = [
        ("| mix | GPUs | static `auto` | static step s | per-step step s | ratio | worst step | steps behind "
         "| ratio per part | per-step topologies | sim s |"),
        "|---|---:|---|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in rows:
        parts = ", ".join(f"{k} {v:.4f}" for k, v in r["ratio_by_part"].items()) if len(r["ratio_by_part"]) > 1 else ""
        chosen = "; ".join(f"`{_short(t, 40)}`" for t in r["chosen"])
        lines.append(
            f"| {r['mix']} | {r['world_size']} | `{_short(r['static_topology'], 40)}` | {r['static_step_s']:.4f} | "
            f"{r['per_step_s']:.4f} | {r['ratio']:.4f} | {r['worst_step_ratio']:.4f} | {r['steps_behind']} | "
            f"{parts} | {chosen} | {r['seconds']:.1f} |"
        )
    head = (f"Command: `{command}` ({steps} steps per row; ratio = static step time / per-step step time, "
            "means over the steps; worst step = the smallest per-step ratio)")
    return head + "\n\n" + "\n".join(lines) + "\n"


def table_markdown(rows: list[dict], command: str, cost: CostModel, steps: int = 3) -> str:
    lines = [
        "# Simulated step time: `auto` topology vs the best fixed greedy",
        "",
        f"Command: `{command}`",
        "",
        "Predicted by `knapray.planning.CostModel` with its defaults (Flux-size MMDiT: d 3072, "
        "19 double + 38 single blocks; 400 TFLOP/s bf16 per GPU; backward 2x forward plus a "
        "recomputed forward; Ulysses 12 all-to-alls per layer; 300 GB/s in a node, 40 GB/s "
        f"between nodes; {cost.gpus_per_node} GPUs per node). `greedy` is KnapFormer's greedy on the "
        "best of g1n\\*, g2n\\*, g4n\\*, g8n\\* (one balance group over the world); `auto` is "
        "knapray's solver on the topology `autotopo` chose from two other steps of the mix "
        f"(`xN`: N balance groups of that composition). Means over {steps} steps per row. Efficiency = ideal step "
        "time (total compute / GPUs, no communication) / predicted step time; ratio = greedy "
        "step time / auto step time; sim s = wall seconds of the row (topology search, "
        "all plans, predictions) on a 2-core CPU.",
        "",
        "| mix | GPUs | auto topology | auto eff. | best greedy | greedy eff. | unbalanced eff. | ratio | sim s |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mix']} | {r['world_size']} | `{r['auto_topology']}` | {r['auto_efficiency']:.4f} | "
            f"`{r['greedy_topology']}` | {r['greedy_efficiency']:.4f} | {r['baseline_efficiency']:.4f} | "
            f"{r['ratio']:.4f} | {r.get('seconds', float('nan')):.1f} |"
        )
    return "\n".join(lines) + "\n"


def print_report(r: dict) -> None:
    print(f"mix {r.get('mix', '(lengths)')}  ranks {r['world_size']} ({r['gpus_per_node']} per node)  "
          f"steps {r['steps']}  ideal step {r['ideal_step_s']:.4f} s")
    print(f"{'mode':<11} {'topology':<32} {'step s':>8} {'eff.':>7} {'compute':>8} {'ulysses':>8} {'route':>7}")
    for name in MODES + (("static_auto",) if "static_auto" in r["modes"] else ()):
        m = r["modes"][name]
        print(f"{name:<11} {_short(m['topology'], 32):<32} {m['step_s']:>8.4f} {m['efficiency']:>7.4f} "
              f"{m['compute_s_mean']:>8.4f} {m['ulysses_s_mean']:>8.4f} {m['route_s_mean']:>7.4f}")
    if "auto" in r:
        a = r["auto"]
        print(f"auto: {a['topology']} ({a['candidates']} candidates on {a['search_ranks']} ranks, "
              f"{a['search_s']:.1f} s)")
        print("greedy by topology: " + ", ".join(
            f"{k} {v['efficiency']:.4f}" for k, v in r["greedy_by_topology"].items()))
    if "per_step" in r:
        labels = r.get("step_mix") or [""] * len(r["per_step"])
        print(f"{'step':>4} {'mix':<14} {'static auto s':>13} {'per-step s':>10} {'ratio':>7}  chosen")
        for i, (lab, p) in enumerate(zip(labels, r["per_step"])):
            print(f"{i:>4} {_short(lab, 14):<14} {p['static_auto_s']:>13.4f} {p['step_s']:>10.4f} "
                  f"{p['static_auto_s'] / p['step_s']:>7.4f}  {p['source']}: {_short(p['topology'], 40)}")
        print(f"per-step vs static auto: {r['speedup_vs_static_auto']:.4f}x (worst step {r['per_step_ratio_min']:.4f}x, "
              f"{r['steps_behind_static_auto']} steps behind)")
    print(f"knapray vs greedy: {r['speedup_vs_greedy']:.4f}x   vs unbalanced: {r['speedup_vs_baseline']:.3f}x "
          "(predicted step time)")
    print("compute / ulysses / route: per-rank means in seconds; eff. = ideal / predicted step time")


def plot_rank_times(path: str, r: dict) -> str:
    """Per-rank predicted time (mean over steps) of the three modes, split into compute,
    Ulysses and routing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True, sharey=True)
    ranks = np.arange(r["world_size"])
    for ax, name in zip(axes, MODES):
        m = r["modes"][name]
        comp, uly, route = (np.asarray(m[k]) for k in ("rank_compute_s", "rank_ulysses_s", "rank_route_s"))
        width = 1.0 if ranks.size > 64 else 0.8
        ax.bar(ranks, comp, width, color="#2a6fdb", label="compute")
        ax.bar(ranks, uly, width, bottom=comp, color="#e08020", label="Ulysses all-to-all")
        ax.bar(ranks, route, width, bottom=comp + uly, color="#50a050", label="routing")
        ax.axhline(r["ideal_step_s"], color="k", lw=0.8, ls="--", label="ideal step")
        ax.set_title(f"{name}: {_short(m['topology'], 60)}  step {m['step_s']:.3f} s, "
                     f"efficiency {m['efficiency']:.3f}", fontsize=9)
        ax.set_ylabel("seconds")
    axes[0].legend(loc="upper left", fontsize=7, ncol=4)
    axes[-1].set_xlabel("rank")
    fig.suptitle(f"predicted per-rank step time (mean over {r['steps']} steps): {r.get('mix', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- helpers ---------------------------------------------------------------------------------


def _auto_name(topology: Topology) -> str:
    """Bag counts of a balance group, and how many groups there are."""
    spec = composition_spec(topology)
    return spec if topology.num_groups == 1 else f"{spec} x{topology.num_groups}"


def _flat(step) -> np.ndarray:
    return np.asarray([x for r in step for x in r], dtype=np.int64)


def _mode(topology: str, times: list[StepTimes], ideal: np.ndarray) -> dict:
    step = np.array([t.step_time for t in times])
    mean = lambda attr: np.mean([getattr(t, attr) for t in times], axis=0)  # noqa: E731
    comp, uly, route = mean("compute"), mean("ulysses"), mean("route")
    return {
        "topology": topology,
        "step_s": float(step.mean()),
        "efficiency": float(ideal.sum() / step.sum()),
        "compute_s_mean": float(comp.mean()),
        "ulysses_s_mean": float(uly.mean()),
        "route_s_mean": float(route.mean()),
        "rank_s": mean("total").tolist(),
        "rank_compute_s": comp.tolist(),
        "rank_ulysses_s": uly.tolist(),
        "rank_route_s": route.tolist(),
    }


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
