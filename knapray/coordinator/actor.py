"""The named async Ray actor around ``BalanceCoordinator``, and ``create_coordinator``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from knapray.planning import BalancePlan, Topology

from .config import CoordinatorConfig
from .coordinator import BalanceCoordinator
from .steps import StepFailed

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)


class _CoordinatorActor:
    """Async actor around ``BalanceCoordinator``.

    Async, not threaded: every method runs on the actor's one event loop thread, so the
    coordinator's state needs no locks, and a ``get_plan`` waiting on its step's
    ``asyncio.Event`` yields the loop to the submits that will complete the step (a threaded
    actor would need a lock plus a condition variable for the same). Planning and the
    ledger's journal writes run inline on the loop: they take milliseconds, and the
    requests they delay are waiting for them. A rejected submission is logged and raised
    (its sender's client checks the answer before asking for the step's plan); a failed
    step reaches every rank through ``get_plan``. Timing reports are statistics only:
    they log errors instead of raising them. When Ray restarts the actor, ``__init__``
    runs again and the coordinator restores itself from ``state_dir``.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        logging.basicConfig(level=logging.INFO)
        self._core = BalanceCoordinator(config)

    async def config(self) -> CoordinatorConfig:
        return self._core.config

    async def submit(self, step, rank, seq_lens, sample_ids, exhausted=False, epoch=None) -> None:
        try:
            self._core.submit(step, rank, seq_lens, sample_ids, exhausted, epoch)
        except (ValueError, TypeError) as e:
            log.error("rejected submission: %s", e)
            # Raised to the sender as well: its client checks every submission's answer
            # before it asks for that step's plan, so a rejection never goes unseen.
            raise e if isinstance(e, StepFailed) else StepFailed(f"rejected submission: {e}") from None

    async def get_plan(self, step, rank, timeout_s=None, epoch=None) -> tuple[BalancePlan | None, bool]:
        return await self._core.get_plan(step, rank, timeout_s, epoch)

    async def epoch(self) -> int:
        return self._core.epoch

    async def commit_step(self, step) -> None:
        self._core.commit_step(step)

    async def record_external(self, step, sample_ids, home_ranks, epoch=None) -> None:
        self._core.record_external(step, sample_ids, home_ranks, epoch)

    async def report_timing(self, step, rank, compute_s, comm_s, wait_plan_s) -> None:
        try:
            self._core.report_timing(step, rank, compute_s, comm_s, wait_plan_s)
        except (ValueError, TypeError) as e:
            log.error("rejected timing report: %s", e)

    async def begin_run(self, world_size, resume_step=None, state=None, node_sizes=None) -> Topology:
        return self._core.begin_run(world_size, resume_step, state, node_sizes)

    async def topology(self) -> Topology | None:
        return self._core.topology

    async def topology_for(self, world_size, node_sizes=None) -> Topology:
        return self._core.topology_for(world_size, node_sizes)

    async def ledger_rows(self) -> list[tuple[int, int, int, int]]:
        return self._core.ledger_rows()

    async def ledger_columns(self) -> dict[str, np.ndarray]:
        return self._core.ledger_columns()

    async def epoch_sample_ids(self, epoch) -> np.ndarray:
        return self._core.epoch_sample_ids(epoch)

    async def write_ledger_jsonl(self, path) -> int:
        return self._core.write_ledger_jsonl(path)

    async def truncate(self, step) -> None:
        self._core.truncate(step)

    async def state_dict(self) -> dict:
        return self._core.state_dict()

    async def load_state_dict(self, state) -> None:
        self._core.load_state_dict(state)

    async def speed_factors(self) -> np.ndarray:
        return self._core.speed_factors()

    async def stats(self) -> dict:
        return self._core.stats()


def create_coordinator(
    name: str,
    namespace: str | None = None,
    *,
    max_restarts: int = -1,
    detached: bool = False,
    resources: dict[str, float] | None = None,
    start_timeout_s: float = 300.0,
    **config: Any,
) -> ActorHandle:
    """Create (or get, if one by that name exists) the named coordinator actor.

    ``num_cpus=0``: it is idle most of the time and must not take a CPU a training worker
    needs. ``max_restarts``: a restarted actor restores from ``state_dir`` (without one it
    starts empty; ranks waiting on it time out into the local fallback). ``detached``:
    outlive the driver (for ``ray job submit`` runs driven from elsewhere). ``resources``:
    Ray resources that place it (and its restarts), e.g. ``{"node:__internal_head__":
    0.001}`` for the head node, which a spot worker node's loss never takes with it.
    """
    cfg = CoordinatorConfig.from_kwargs(**config)  # fail here, not in the actor
    import ray

    handle = (
        ray.remote(_CoordinatorActor)
        .options(
            name=name,
            namespace=namespace,
            num_cpus=0,
            max_restarts=max_restarts,
            get_if_exists=True,
            lifetime="detached" if detached else None,
            resources=resources or None,
        )
        .remote(cfg)
    )
    try:
        existing = ray.get(handle.config.remote(), timeout=start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"coordinator actor {name!r} did not start within {start_timeout_s:g}s "
                           f"(resources {resources or {}}: does a live node have them?)") from None
    if existing != cfg:
        log.warning("coordinator %r already exists with a different config; using it as is: %s", name, existing)
    return handle
