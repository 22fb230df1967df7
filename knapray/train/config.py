"""Typed run configuration, loaded from YAML; unknown keys are rejected with the valid ones.

Overrides: ``--set model.hidden_size=128`` (dotted path, YAML-parsed value).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, get_type_hints

import yaml

from knapray.models import MMDiTConfig


@dataclass(kw_only=True, slots=True)
class DataConfig:
    corpus: str = "datasets/generated/demo"
    """Directory of parquet shards + schema.json (built by datasets/build_synthetic.py)."""
    build_mix: str = ""
    """If set and the corpus is missing, build a synthetic corpus from this mix first."""
    build_scale: int = 8
    """Scale of the synthetic corpus built from ``build_mix`` (8 = CPU demo)."""
    build_steps: int = 4
    """Steps of the mix the built corpus holds."""
    samples_per_step: int = 2
    """Samples each rank draws per step (the paper's B)."""
    epochs: int = 1
    """Passes over the corpus."""
    seed: int = 0
    max_tokens_per_gpu: int = 0
    """Memory budget: a sample longer than this times the largest bag is quarantined
    (reason ``too_long``) instead of trained; 0 = no limit."""
    max_bad_fraction: float = 0.5
    """Stop the run with an error once more than this fraction of the rows read (after at
    least 16) had to be quarantined: a mostly broken corpus must not train on nothing."""


@dataclass(kw_only=True, slots=True)
class BalanceConfig:
    enabled: bool = True
    """False trains unbalanced (every rank computes its own samples): the baseline."""
    topology: str = "g1n2+g2n1"
    """Bags (e.g. g8n4), replicated to the world size; or 'auto'."""
    solver: str = "knapray"
    gamma: float = 0.4
    """Attention cost factor of the workload model (d_model comes from the model)."""
    gpus_per_node: int = 0
    """If > 0, bags never cross a node boundary when they fit in one."""
    planner: str = "workload"
    """``workload`` (the paper's work estimate) or ``cost`` (predicted seconds with
    communication and live per-rank speeds; then ``topology: auto`` searches mixed bags)."""
    cost: dict = field(default_factory=dict)
    """CostModel fields for ``planner: cost`` (num_heads defaults to the model's)."""
    cost_profile: str = ""
    """A ``knapray calibrate`` profile for ``planner: cost``."""
    coordinator: bool = True
    """Plan on the BalanceCoordinator actor (else every rank plans from an all-gather)."""
    coordinator_timeout_s: float = 30.0
    """After this long without an answer a rank falls back to local planning."""


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    """Clip the global gradient norm (0 disables)."""
    warmup_steps: int = 0


@dataclass(kw_only=True, slots=True)
class RunConfig:
    name: str = "demo"
    storage: str = "runs"
    """Run directory parent (absolute or relative to the working directory)."""
    num_workers: int = 4
    """Ray Train workers (one per GPU on a GPU cluster)."""
    min_workers: int = 0
    """If > 0, elastic: the worker group may run with min_workers..num_workers."""
    use_gpu: bool = False
    cpus_per_worker: float = 0.5
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources each worker requests besides ``cpus_per_worker``, e.g.
    ``{knapray_slot: 1}`` with a custom node resource that fits one worker per node."""
    elastic_monitor_interval_s: float = 60.0
    """Elastic runs: how often (seconds) Ray Train checks whether the cluster now holds
    a different number of workers and restarts the group at that size."""
    max_steps: int = 0
    """Stop after this many steps (0: run the epochs out)."""
    checkpoint_every: int = 10
    max_failures: int = 1
    precision: str = "auto"
    log_every: int = 1
    timeout_s: int = 120
    """Collective timeout: a dead peer surfaces as an error instead of a hang."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: MMDiTConfig = field(default_factory=MMDiTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def run_dir(self) -> str:
        return os.path.abspath(os.path.join(self.run.storage, self.run.name))


def _build(cls: type, data: Any, path: str) -> Any:
    if not dataclasses.is_dataclass(cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config {path or 'root'}: expected a mapping, got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(
            f"config {path or 'root'}: unknown key(s) {unknown}; valid keys: {names}"
        )
    hints = get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        sub = f"{path}.{name}" if path else name
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, value, sub)
        elif isinstance(value, list):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config {path or 'root'}: {e}") from e


def load_config(path: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    data: dict = {}
    if path:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected dotted.key=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return _build(TrainConfig, data, "")


def config_from_dict(data: dict) -> TrainConfig:
    return _build(TrainConfig, data, "")
