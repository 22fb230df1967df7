"""Plan many steps of a mix or of recorded lengths and summarize: what `knapray plan` runs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ..costs.cost import CostModel
from ..shapes.mix import MAX_TEXT_TOKENS, mix_world_size, parse_mix, sample_step
from ..balance.plan import BalancePlan
from ..balance.solver import plan_balance
from ..shapes.topology import Topology
from ..costs.workload import WorkloadModel


def mix_steps(
    mix: str, steps: int, seed: int, world_size: int | None = None, max_text_tokens: int = MAX_TEXT_TOKENS,
) -> Iterable[list[list[int]]]:
    """Sequence lengths of ``steps`` steps drawn from a mix, deterministic in ``seed``
    (``max_text_tokens=0``: visual tokens only, for a cross-attention model)."""
    codes = parse_mix(mix)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield sample_step(codes, rng, world_size, max_text_tokens)


def mix_ranks(mix: str) -> int:
    return mix_world_size(parse_mix(mix))


def load_lengths(path: str) -> list[list[list[int]]]:
    """A JSON file holding a list of steps, each a list of per-rank lists of lengths."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:  # lists in lists past Python's recursion limit
        raise ValueError(f"{path}: nested too deeply: expected a list of steps, each a list of per-rank lists of "
                         "lengths (3 levels)") from None
    if not isinstance(data, list) or not data or not all(isinstance(s, list) for s in data):
        raise ValueError(
            f"{path}: expected a JSON list of steps, each a list of per-rank lists of lengths, "
            "e.g. [[[300, 1200], [4096]], ...]"
        )
    if not all(isinstance(r, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in r)
               for s in data for r in s):
        raise ValueError(f"{path}: every length must be an integer >= 1, in per-rank lists")
    sizes = {len(s) for s in data}
    if len(sizes) != 1:
        raise ValueError(f"{path}: every step must list the same number of ranks, got {sorted(sizes)}")
    return data


@dataclass
class RunSummary:
    """Per-step results of planning a run, and their summary."""

    topology: str
    world_size: int
    solver: str
    baseline_imbalance: list[float] = field(default_factory=list)
    imbalance: list[float] = field(default_factory=list)
    greedy_imbalance: list[float] = field(default_factory=list)
    moved_token_fraction: list[float] = field(default_factory=list)
    plan_ms: list[float] = field(default_factory=list)
    baseline_rank_work: list[np.ndarray] = field(default_factory=list)
    rank_work: list[np.ndarray] = field(default_factory=list)
    plans: list[BalancePlan] = field(default_factory=list)
    predicted_step_s: list[float] = field(default_factory=list)
    """Cost-model plans only: predicted step time, and greedy's on the same topology."""
    greedy_predicted_step_s: list[float] = field(default_factory=list)
    ideal_step_s: list[float] = field(default_factory=list)

    def add(self, plan: BalancePlan, greedy: BalancePlan | None) -> None:
        if isinstance(plan.model, CostModel):
            self.predicted_step_s.append(plan.predicted_step_time)
            self.ideal_step_s.append(plan.model.ideal_step_time(plan.seq_lens, plan.world_size))
            if greedy is not None:
                self.greedy_predicted_step_s.append(plan.model.step_times(greedy).step_time)
        self.baseline_imbalance.append(plan.baseline_imbalance)
        self.imbalance.append(plan.imbalance)
        if greedy is not None:
            self.greedy_imbalance.append(greedy.imbalance)
        self.moved_token_fraction.append(plan.moved_token_fraction)
        self.plan_ms.append(plan.plan_time_ms)
        self.baseline_rank_work.append(plan.baseline_rank_work)
        self.rank_work.append(plan.rank_work)

    def to_dict(self) -> dict:
        d = {
            "topology": self.topology,
            "world_size": self.world_size,
            "solver": self.solver,
            "steps": len(self.imbalance),
            "baseline_imbalance_mean": float(np.mean(self.baseline_imbalance)),
            "baseline_imbalance_max": float(np.max(self.baseline_imbalance)),
            "imbalance_mean": float(np.mean(self.imbalance)),
            "imbalance_max": float(np.max(self.imbalance)),
            "moved_token_fraction_mean": float(np.mean(self.moved_token_fraction)),
            "plan_ms_p50": float(np.median(self.plan_ms)),
            "plan_ms_max": float(np.max(self.plan_ms)),
        }
        if self.predicted_step_s:
            d["predicted_step_s_mean"] = float(np.mean(self.predicted_step_s))
            d["efficiency"] = float(np.sum(self.ideal_step_s) / np.sum(self.predicted_step_s))
        if self.greedy_predicted_step_s:
            d["greedy_predicted_step_s_mean"] = float(np.mean(self.greedy_predicted_step_s))
            d["greedy_efficiency"] = float(np.sum(self.ideal_step_s) / np.sum(self.greedy_predicted_step_s))
        if self.greedy_imbalance:
            d["greedy_imbalance_mean"] = float(np.mean(self.greedy_imbalance))
            d["greedy_imbalance_max"] = float(np.max(self.greedy_imbalance))
            d["steps_worse_than_greedy"] = int(
                np.sum(np.asarray(self.imbalance) > np.asarray(self.greedy_imbalance) * (1 + 1e-12))
            )
        return d


def plan_run(
    steps: Iterable[Sequence[Sequence[int]]],
    topology: Topology | str,
    model: WorkloadModel | CostModel,
    solver: str = "knapray",
    compare_greedy: bool = True,
    keep_plans: bool = False,
    progress=None,
) -> RunSummary:
    summary: RunSummary | None = None
    for lens in steps:
        topo = topology if isinstance(topology, Topology) else Topology.parse(topology, len(lens))
        if summary is None:
            summary = RunSummary(str(topo), topo.world_size, solver)
        plan = plan_balance(lens, topo, model, solver=solver)
        greedy = (
            plan_balance(lens, topo, model, solver="greedy")
            if compare_greedy and solver != "greedy"
            else None
        )
        summary.add(plan, greedy)
        if keep_plans:
            summary.plans.append(plan)
        if progress is not None:
            progress.update(1)
    if summary is None:
        raise ValueError("no steps to plan")
    return summary
