"""The balance coordinator: one Ray actor plans every step once, for all ranks, and keeps
the ledger of trained samples.

One job per module:

- ``steps``: the per-step protocol (submissions in, one plan per step out, epoch ends),
  and the pure ``plan_from_gathered`` / ``is_epoch_done`` the local fallback shares;
- ``ledger``: committed rows, in memory as numpy columns, on disk as an append-only
  journal with compacted snapshots; its position is what checkpoints carry;
- ``stats``: length histogram, imbalance / plan-time / wait samples, per-rank averages
  and speed factors, and the live re-fit of the cost model (``planning.fitting.livefit``) it feeds;
- ``store``: the files (journal and snapshot formats, atomic writes; never pickle);
- ``coordinator``: ``BalanceCoordinator``, which composes them (runs without Ray);
- ``actor``: the thin async Ray actor and ``create_coordinator``: one ``exchange`` call per
  rank (or node) and step, answered with a reference to the plan in the object store;
- ``relay``: ``NodeRelay``, one per node, batching its ranks' submissions into one call;
- ``wire``: the plan as the object store holds it (packed; rebuilt exactly on each rank);
- ``client``: ``CoordinatorClient``, what a training worker calls;
- ``config``: ``BalanceConfig`` (the run config's ``balance`` section), ``CoordinatorConfig``
  (it, the model's facts, the world), ``make_planning_model`` and ``make_live_fit``.

Topology rules (``"g8n4"``, ``"bags_of:N"``, ``"auto"``) are pure planning:
``knapray.planning.search.rules``.
"""

from .actor import create_coordinator
from .client import CoordinatorClient
from .errors import CoordinatorUnavailable
from .config import PLANNERS, BalanceConfig, CoordinatorConfig, make_live_fit, make_planning_model
from .coordinator import STATE_VERSION, BalanceCoordinator
from .ledger import Ledger
from .steps import PlanTimeout, StepFailed, is_epoch_done, plan_from_gathered
from .store import LedgerFileError, StateStore

__all__ = [
    "PLANNERS",
    "STATE_VERSION",
    "BalanceConfig",
    "BalanceCoordinator",
    "CoordinatorClient",
    "CoordinatorConfig",
    "CoordinatorUnavailable",
    "Ledger",
    "LedgerFileError",
    "PlanTimeout",
    "StateStore",
    "StepFailed",
    "create_coordinator",
    "is_epoch_done",
    "make_live_fit",
    "make_planning_model",
    "plan_from_gathered",
]
