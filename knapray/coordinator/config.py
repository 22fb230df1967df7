"""``BalanceConfig``: the run config's ``balance`` section, how steps are balanced and who
plans them; ``CoordinatorConfig``: what the coordinator plans with (that section, the
model's facts, the world) and where it keeps its files."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from knapray.limits import MAX_TIMEOUT_S, MAX_WORLD_SIZE
from knapray.planning import SOLVERS, WorkloadModel
from knapray.planning.costs.cost import CostModel
from knapray.planning.fitting.livefit import LiveFit
from knapray.planning.search.rules import parse_rule

PLANNERS = ("workload", "cost")


def _coordinator_node(value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected 'head', 'any' or the name of a custom node resource, got {value!r} "
                         f"({type(value).__name__})")


@dataclass(frozen=True, kw_only=True, slots=True)
class BalanceConfig:
    """``balance:`` How steps are balanced and who plans them. Each field's rules (``metadata``)
    are checked when the run config is loaded (``knapray.config.run``); ``__post_init__``
    checks what relates fields, and the values a coordinator built in code is given."""

    enabled: bool = True
    """False trains unbalanced (every rank computes its own samples): the baseline."""
    topology: str = field(default="g1n2+g2n1", metadata={"check": parse_rule})
    """Bags (e.g. g8n4), replicated to the world size; 'bags_of:N'; 'auto'; or 'per-step'
    (with ``planner: cost``: every step chooses its own partition of each node of
    ``gpus_per_node`` ranks, the world if 0, into aligned power-of-two blocks; the 'auto'
    topology is the run's static one, tried every step too)."""
    solver: str = field(default="knapray", metadata={"choices": SOLVERS})
    gamma: float = field(default=0.4, metadata={"ge": 0})
    """Attention cost factor of the workload model (d_model comes from the model)."""
    gpus_per_node: int = field(default=0, metadata={"ge": 0, "le": MAX_WORLD_SIZE})
    """If > 0, bags never cross a node boundary when they fit in one."""
    planner: str = field(default="workload", metadata={"choices": PLANNERS})
    """``workload`` (the paper's work estimate) or ``cost`` (predicted seconds with
    communication and live per-rank speeds; then ``topology: auto`` searches mixed bags)."""
    cost: dict = field(default_factory=dict)
    """CostModel fields for ``planner: cost`` (num_heads and the block counts default to the
    model's)."""
    cost_profile: str = ""
    """A ``knapray calibrate`` profile for ``planner: cost`` (``cost`` overrides it)."""
    overlap: bool = False
    """With ``planner: cost``: a sequence may also run whole on a rank that serves a bag of
    several (groups that overlap on that rank, ``knapray.planning.search.overlap``), where the cost
    model predicts the step faster so; with ``topology: per-step`` the step may also take
    aligned groups of any size that divides the heads (their process groups are made at
    start)."""
    live_fit: bool = True
    """With ``planner: cost``: re-fit the cost model's compute coefficients and per-rank
    speeds from the measured per-rank times while training (``knapray.planning.fitting.livefit``);
    false plans with it as given. An unbalanced run (``enabled`` false) does not run the
    plans, so its times never fit them."""
    coordinator: bool = True
    """Plan on the BalanceCoordinator actor (else every rank plans from an all-gather)."""
    coordinator_timeout_s: float = field(default=30.0, metadata={"gt": 0, "le": MAX_TIMEOUT_S})
    """After this long without an answer a rank falls back to local planning."""
    coordinator_node: str = field(default="head", metadata={"check": _coordinator_node})
    """Where the coordinator actor runs: ``head`` (the Ray head node: it outlives the
    worker nodes, spot ones included), ``any`` (wherever Ray puts it), or the name of a
    custom resource that the nodes meant for it carry (e.g. one given to a node type in
    cluster.yaml); it asks for a thousandth of it."""

    def __post_init__(self) -> None:
        if self.planner not in PLANNERS:
            raise ValueError(f"unknown planner {self.planner!r}; valid: {', '.join(PLANNERS)}")
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; valid: {', '.join(SOLVERS)}")
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0 (0: no node boundary), got {self.gpus_per_node}")
        if self.overlap and self.planner != "cost":
            raise ValueError(f"overlap chooses where sequences run by predicted step time: it needs planner: cost, "
                             f"got planner {self.planner!r}")
        if parse_rule(self.topology)[0] == "per_step" and self.planner != "cost":
            raise ValueError(f"topology 'per-step' chooses bags by predicted step time: it needs planner: cost, "
                             f"got planner {self.planner!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    """What the coordinator plans with; validated when built, unknown keys rejected."""

    balance: BalanceConfig = field(default_factory=BalanceConfig)
    """The run's ``balance`` section: the topology rule (a concrete spec such as ``"g8n4"``,
    replicated over multiples of its size; ``"bags_of:N"``: one balance group of equal
    bags, the largest power of two ``<= N`` dividing the world and ``gpus_per_node``;
    ``"auto"``; ``"per-step"``: see ``knapray.planning.search.rules``), the solver, the planner and
    its cost model, the live fit."""
    world_size: int | None = None
    """Ranks in the world; None until ``begin_run`` says (elastic runs)."""
    d_model: int = 3072
    """Transformer width, for the workload and cost models."""
    attention_kind: str = "joint"
    """``joint`` (Flux) or ``cross`` (Wan: visual tokens cross-attend to a fixed text),
    for the workload and cost models (``knapray.planning.costs.workload``)."""
    num_heads: int | None = None
    double_blocks: int | None = None
    single_blocks: int | None = None
    """The model's heads and blocks, for the cost model where ``balance.cost`` does not give
    them (None: ``CostModel``'s defaults)."""
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
        WorkloadModel(self.d_model, self.balance.gamma, attention_kind=self.attention_kind)  # validates them
        make_planning_model(self)  # validates the cost model's fields

    @property
    def gpus_per_node(self) -> int | None:
        """Ranks per node (``balance.gpus_per_node``), None where it is not given."""
        return self.balance.gpus_per_node or None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> CoordinatorConfig:
        """From keyword arguments of both classes at once (``BalanceCoordinator(topology=...,
        world_size=...)``): the ``balance`` section's fields go to it."""
        own = [f.name for f in fields(cls) if f.name != "balance"]
        section = [f.name for f in fields(BalanceConfig)]
        unknown = sorted(set(kwargs) - set(own) - set(section))
        if unknown:
            raise ValueError(f"unknown coordinator config keys {unknown}; valid: {', '.join(own + section)}")
        balance = BalanceConfig(**{k: v for k, v in kwargs.items() if k in section})
        return cls(balance=balance, **{k: v for k, v in kwargs.items() if k in own})


def make_live_fit(config: CoordinatorConfig) -> LiveFit | None:
    """The live re-fit of the planning model (``planner="cost"`` with ``live_fit``, in a
    balanced run), or None."""
    b = config.balance
    if b.planner != "cost" or not b.live_fit or not b.enabled:
        return None
    return LiveFit(make_planning_model(config))


def make_planning_model(config: CoordinatorConfig) -> WorkloadModel | CostModel:
    """The model plans balance with; the coordinator and the local fallback build the same."""
    b = config.balance
    if b.planner == "workload":
        return WorkloadModel(config.d_model, b.gamma, attention_kind=config.attention_kind)
    overrides = dict(b.cost)
    overrides.setdefault("d_model", config.d_model)
    overrides.setdefault("attention_kind", config.attention_kind)
    for name in ("num_heads", "double_blocks", "single_blocks"):
        if getattr(config, name) is not None:
            overrides.setdefault(name, getattr(config, name))
    if config.gpus_per_node:
        overrides.setdefault("gpus_per_node", config.gpus_per_node)
    if b.cost_profile:
        return CostModel.from_profile(b.cost_profile, **overrides)
    return CostModel.from_dict(overrides)
