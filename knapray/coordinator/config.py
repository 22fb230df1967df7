"""``CoordinatorConfig``: what the coordinator plans with and where it keeps its files."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from knapray.planning import SOLVERS, WorkloadModel
from knapray.planning.cost import CostModel
from knapray.planning.livefit import LiveFit
from knapray.planning.rules import parse_rule

PLANNERS = ("workload", "cost")


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    """What the coordinator plans with; validated when built, unknown keys rejected."""

    world_size: int | None = None
    """Ranks in the world; None until ``begin_run`` says (elastic runs)."""
    topology: str = "bags_of:8"
    """A concrete spec (``"g8n4"``, replicated over multiples of its size), ``"bags_of:N"``
    (one balance group of equal bags, the largest power of two ``<= N`` dividing the world
    and, if given, ``gpus_per_node``), ``"auto"`` or ``"per-step"`` (every step chooses its
    own aligned blocks of each node; needs ``planner="cost"``; see ``knapray.planning.rules``)."""
    gpus_per_node: int | None = None
    """If given, bags never straddle a node boundary."""
    d_model: int = 3072
    """Transformer width, for the workload model."""
    gamma: float = 0.4
    """Relative attention cost, for the workload model."""
    attention_kind: str = "joint"
    """``joint`` (Flux) or ``cross`` (Wan: visual tokens cross-attend to a fixed text),
    for the workload and cost models (``knapray.planning.workload``)."""
    solver: str = "knapray"
    """``plan_balance`` solver."""
    max_tokens_per_gpu: int | None = None
    """Memory budget: no rank is routed more tokens in a step (``knapray memory`` says
    what fits); None: no limit."""
    keep_steps: int = 8
    """Planned steps whose plans stay in memory (ranks are at most ~2 steps apart)."""
    history_steps: int = 32
    """Recent steps' lengths kept for ``"auto"`` topology selection."""
    ema_alpha: float = 0.1
    """Weight of the newest timing in the per-rank moving averages."""
    auto_tolerance: float = 0.02
    """``"auto"`` picks the smallest bags whose mean predicted imbalance is within this
    (absolute) of the best: without a communication model, smaller bags mean less traffic."""
    planner: str = "workload"
    """What plans balance: ``"workload"`` (the paper's relative work, ``d_model``/``gamma``)
    or ``"cost"`` (``CostModel``: predicted seconds, Ulysses and routing communication,
    per-rank speeds measured live; ``"auto"`` then searches mixed topologies)."""
    cost: dict | None = None
    """``CostModel`` fields for ``planner="cost"`` (e.g. num_heads, flops_per_s)."""
    cost_profile: str | None = None
    """A ``knapray calibrate`` profile for ``planner="cost"`` (``cost`` overrides it)."""
    live_fit: bool = True
    """With ``planner="cost"``: re-fit the cost model's compute coefficients and per-rank
    speeds from the measured per-rank times while training (``knapray.planning.livefit``);
    False plans with the configured model as it is."""
    state_dir: str | None = None
    """If set, the directory (created if missing) where the coordinator keeps its ledger
    journal, ledger snapshots and run state (see ``knapray.coordinator.store``). A
    restarted actor restores from it, so losing the coordinator loses nothing committed.
    Without it the ledger lives in memory only."""
    snapshot_every: int = 1024
    """Ledger journal records between compacted snapshots (each snapshot rewrites the whole
    ledger, so this trades restore time against periodic write volume)."""

    def __post_init__(self) -> None:
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.keep_steps < 1 or self.history_steps < 1:
            raise ValueError(
                f"keep_steps and history_steps must be >= 1, got {self.keep_steps}, {self.history_steps}"
            )
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.auto_tolerance < 0:
            raise ValueError(f"auto_tolerance must be >= 0, got {self.auto_tolerance}")
        if self.max_tokens_per_gpu is not None and (
                isinstance(self.max_tokens_per_gpu, bool) or int(self.max_tokens_per_gpu) != self.max_tokens_per_gpu
                or self.max_tokens_per_gpu < 1):
            raise ValueError(f"max_tokens_per_gpu must be a positive integer or None, got {self.max_tokens_per_gpu!r}")
        if self.snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        WorkloadModel(self.d_model, self.gamma, attention_kind=self.attention_kind)  # validates them
        if self.planner not in PLANNERS:
            raise ValueError(f"unknown planner {self.planner!r}; valid: {', '.join(PLANNERS)}")
        make_planning_model(self)  # validates the cost model's fields
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; valid: {', '.join(SOLVERS)}")
        if parse_rule(self.topology)[0] == "per_step" and self.planner != "cost":
            raise ValueError(f"topology 'per-step' chooses bags by predicted step time: it needs planner 'cost', "
                             f"got planner {self.planner!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> CoordinatorConfig:
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ValueError(f"unknown coordinator config keys {unknown}; valid: {', '.join(valid)}")
        return cls(**kwargs)


def make_live_fit(config: CoordinatorConfig) -> LiveFit | None:
    """The live re-fit of the planning model (``planner="cost"`` with ``live_fit``), or None."""
    if config.planner != "cost" or not config.live_fit:
        return None
    return LiveFit(make_planning_model(config))


def make_planning_model(config: CoordinatorConfig) -> WorkloadModel | CostModel:
    """The model plans balance with; the coordinator and the local fallback build the same."""
    if config.planner == "workload":
        return WorkloadModel(config.d_model, config.gamma, attention_kind=config.attention_kind)
    overrides = dict(config.cost or {})
    overrides.setdefault("d_model", config.d_model)
    overrides.setdefault("attention_kind", config.attention_kind)
    if config.gpus_per_node:
        overrides.setdefault("gpus_per_node", config.gpus_per_node)
    if config.cost_profile:
        return CostModel.from_profile(config.cost_profile, **overrides)
    return CostModel.from_dict(overrides)
