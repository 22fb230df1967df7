"""The named async Ray actor around ``BalanceCoordinator``, and ``create_coordinator``.

Per step and rank one call, ``exchange``: the rank's submission for the step (or several
ranks' at once), its timing reports of earlier steps folded in, answered once the step is
planned with ``(plan_ref, epoch_done)``. The plan itself is put into the object store
once per step (``ray.put`` on the actor), packed (``wire.pack``: lengths, bags and
per-rank counts, from which each rank rebuilds the chunks exactly; no cached statistics);
every rank reads it through that reference, so Ray moves it once per node, and the actor's
replies stay a few hundred bytes whatever the world size.
"""

from __future__ import annotations

import dataclasses

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from knapray.planning import BalancePlan, Topology

from .config import CoordinatorConfig
from .coordinator import BalanceCoordinator
from .steps import StepFailed
from .wire import pack

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

CALLS_PER_RANK = 4
"""Calls one rank may have in flight on the actor at once: a step's ``exchange`` (waiting
for its plan), a plan asked for again after an outage, a commit, one spare."""
MIN_CONCURRENCY = 1000
"""Ray's default for async actors; never less."""


def max_concurrency_for(world_size: int | None) -> int:
    """Concurrent calls the actor admits: enough for every rank of the largest world it
    may serve to wait for its plan at once (``CALLS_PER_RANK`` each). A waiting call holds
    one of Ray's slots; with Ray's default of 1000, a world of ~1000 ranks filled them and
    the last ranks' submissions waited out the timeout. Without a known world size the
    bound is ``knapray.limits.MAX_WORLD_SIZE``'s (waiting calls cost a coroutine each, not
    a thread)."""
    from knapray.limits import MAX_WORLD_SIZE

    return max(MIN_CONCURRENCY, CALLS_PER_RANK * (world_size or MAX_WORLD_SIZE) + 64)


class _CoordinatorActor:
    """Async actor around ``BalanceCoordinator``.

    Async, not threaded: every method runs on the actor's one event loop thread, so the
    coordinator's state needs no locks, and a ``get_plan`` waiting on its step's
    ``asyncio.Event`` yields the loop to the submits that will complete the step (a threaded
    actor would need a lock plus a condition variable for the same). Planning and the
    ledger's journal writes run inline on the loop: they take milliseconds, and the
    requests they delay are waiting for them. A rejected submission is logged and raised
    to its sender (the same call that waits for the step's plan); a failed step reaches
    every rank through its ``exchange`` or ``get_plan``. Timing reports, which ride along
    with the next ``exchange``, are statistics only: they log errors instead of raising
    them. Every call waiting for a plan holds one of the actor's concurrency slots, so
    ``create_coordinator`` sizes them from the world (``max_concurrency_for``). When Ray restarts the actor, ``__init__``
    runs again and the coordinator restores itself from ``state_dir``.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        logging.basicConfig(level=logging.INFO)
        self._core = BalanceCoordinator(config)
        self._refs: dict[int, tuple[BalancePlan, ObjectRef]] = {}
        """step -> (its plan, the plan in the object store, packed): put once, read by every rank."""

    def _plan_ref(self, step: int, plan: BalancePlan | None) -> ObjectRef | None:
        if plan is None:
            return None
        held = self._refs.get(step)
        if held is None or held[0] is not plan:  # epochs reuse step numbers: the plan decides
            import ray

            held = self._refs[step] = (plan, ray.put(pack(plan)))
            for old in sorted(self._refs)[: -2 * self._core.config.keep_steps]:
                del self._refs[old]  # ranks still reading it hold their own reference
        return held[1]

    async def config(self) -> CoordinatorConfig:
        return self._core.config

    async def exchange(self, step, epoch, submissions, timings=(), timeout_s=None) -> tuple[ObjectRef | None, bool]:
        """One call per rank and step (or per group of ranks): ``submissions``, a list of
        ``(rank, seq_lens, sample_ids, exhausted)`` for ``step`` of ``epoch``; ``timings``,
        ``(step, rank, compute_s, comm_s, wait_plan_s)`` reports of earlier steps
        (statistics: errors are logged). Answers ``(plan_ref, epoch_done)`` once the step
        is planned, as ``get_plan``. A rejected submission raises ``StepFailed`` to the
        caller (after the others are recorded) as well as failing the step for every rank."""
        for report in timings:
            try:
                self._core.report_timing(*report)
            except (ValueError, TypeError) as e:
                log.error("rejected timing report: %s", e)
        rejected = None
        for rank, seq_lens, sample_ids, exhausted in submissions:
            try:
                self._core.submit(step, rank, seq_lens, sample_ids, exhausted, epoch)
            except (ValueError, TypeError) as e:
                log.error("rejected submission: %s", e)
                rejected = rejected or (e if isinstance(e, StepFailed) else StepFailed(f"rejected submission: {e}"))
        if rejected is not None:
            raise rejected
        if not submissions:
            raise StepFailed(f"step {step}: an exchange with no submission")
        return await self.get_plan(step, submissions[0][0], timeout_s, epoch)

    async def get_plan(self, step, rank, timeout_s=None, epoch=None) -> tuple[ObjectRef | None, bool]:
        """``(plan_ref, epoch_done)`` for ``step`` (``BalanceCoordinator.get_plan``), the
        plan as an object-store reference (None when the epoch is over)."""
        plan, done = await self._core.get_plan(step, rank, timeout_s, epoch)
        return self._plan_ref(step, plan), done

    async def epoch(self) -> int:
        return self._core.epoch

    async def commit_step(self, step, experts=None) -> None:
        self._core.commit_step(step, experts)

    async def record_external(self, step, sample_ids, home_ranks, epoch=None, expert=0) -> None:
        self._core.record_external(step, sample_ids, home_ranks, epoch, expert)

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
    config: CoordinatorConfig | None = None,
    **overrides: Any,
) -> ActorHandle:
    """Create (or get, if one by that name exists) the named coordinator actor.

    ``num_cpus=0``: it is idle most of the time and must not take a CPU a training worker
    needs. ``max_restarts``: a restarted actor restores from ``state_dir`` (without one it
    starts empty; ranks waiting on it time out into the local fallback). ``detached``:
    outlive the driver (for ``ray job submit`` runs driven from elsewhere). ``resources``:
    Ray resources that place it (and its restarts), e.g. ``{"node:__internal_head__":
    0.001}`` for the head node, which a spot worker node's loss never takes with it.
    """
    # ``config`` (typed: a run's is ``knapray.worker.step_planner.coordinator_config``), its
    # fields replaced by ``overrides``; or the fields alone. Checked here, not in the actor.
    cfg = CoordinatorConfig.from_kwargs(**overrides) if config is None else dataclasses.replace(config, **overrides)
    import ray

    handle = (
        ray.remote(_CoordinatorActor)
        .options(
            name=name,
            namespace=namespace,
            num_cpus=0,
            max_concurrency=max_concurrency_for(cfg.world_size),
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
