"""Which plan a step runs, and which samples it trained (the ledger's rows).

Per step, on every rank:

1. ``fetch(step, this_step, next_step)``: send the *next* step's lengths to the
   coordinator (fire and forget) and ask for its plan early, then wait (timed) for this
   step's plan. With no coordinator, or when it does not answer in time, there is none.
2. The trainer all-reduces ``Fetched.have_plan`` with its other per-step counts, so
   every rank learns whether every rank got the plan.
3. ``resolve(fetched, everyone_has_plan)``: the coordinator's plan, or, if any rank lacks
   it, a plan every rank computes itself from an all-gather of lengths with the same
   solver (so all ranks always run the same plan, and nobody waits in a collective for a
   rank that has none).
4. After the optimizer step, ``committed(step, planned)``: rank 0 records the step in
   the ledger: by a commit to the coordinator (which knows the step's samples), or, for a
   locally planned step, by rows it hands the coordinator once it is back (steps the
   coordinator may have lost are re-sent from every rank's recent ids), or, without a
   coordinator, by appending to the run's own ledger journal.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from knapray.coordinator import (
    CoordinatorClient,
    CoordinatorConfig,
    CoordinatorUnavailable,
    is_epoch_done,
    make_planning_model,
    plan_from_gathered,
)
from knapray.data import StepMeta
from knapray.distributed.step_sync import StepSync
from knapray.planning import BalancePlan, Topology

from .config import TrainConfig

logger = logging.getLogger(__name__)

def coordinator_name(cfg: TrainConfig) -> str:
    return f"knapray-coordinator-{cfg.run.name}"


def coordinator_config(cfg: TrainConfig) -> dict:
    """The coordinator's settings from the run config (the driver creates the actor with
    them; a rank planning locally builds the same planning model from them)."""
    cost = dict(cfg.balance.cost)
    if cfg.balance.planner == "cost":
        cost.setdefault("num_heads", cfg.model.num_heads)
        cost.setdefault("double_blocks", cfg.model.depth_double)
        cost.setdefault("single_blocks", cfg.model.depth_single)
    return dict(
        topology=cfg.balance.topology, d_model=cfg.model.hidden_size, gamma=cfg.balance.gamma,
        solver=cfg.balance.solver, gpus_per_node=cfg.balance.gpus_per_node or None,
        planner=cfg.balance.planner, cost=cost or None, cost_profile=cfg.balance.cost_profile or None,
    )


def planning_model(cfg: TrainConfig):
    """What plans balance; the coordinator builds the same from ``coordinator_config``."""
    return make_planning_model(CoordinatorConfig(**coordinator_config(cfg)))


RECENT_STEPS = 32
"""Steps whose sample ids each rank keeps, to re-record steps a lost coordinator dropped."""


@dataclass(frozen=True)
class Fetched:
    plan: BalancePlan | None
    epoch_done: bool
    have_plan: bool
    wait_s: float


@dataclass(frozen=True)
class Planned:
    plan: BalancePlan | None
    """None when the epoch is over for every rank."""
    epoch_done: bool
    planned_by: str
    """``coordinator`` or ``local``."""
    wait_s: float
    rows: tuple[list[int], list[int]] | None = None
    """(sample ids, home ranks) of the step's samples, on rank 0 of a locally planned step."""


class StepPlanner:
    def __init__(self, sync: StepSync, topology: Topology, workload, solver: str,
                 client: CoordinatorClient | None, local_ledger=None) -> None:
        """``local_ledger``: rank 0's ledger when there is no coordinator (it has
        ``append(step, epoch, sample_ids, home_ranks)``); None elsewhere."""
        self.sync, self.topology, self.workload, self.solver = sync, topology, workload, solver
        self.client = client
        self.local_ledger = local_ledger
        self._pending: dict[int, tuple[list[int], list[int]]] = {}
        """Rank 0: rows of locally planned steps the coordinator has not taken yet."""
        self._recent: dict[int, list[int]] = {}
        """This rank's sample ids of recent steps (a lost coordinator drops commits)."""

    # ---- per step ------------------------------------------------------------------------

    def begin_epoch(self, step: int, first: StepMeta) -> None:
        """Submit the epoch's first step (later steps are submitted one step ahead)."""
        self._submit(step, first)

    def fetch(self, step: int, this: StepMeta, nxt: StepMeta) -> Fetched:
        if self.client is None:
            return Fetched(None, False, False, 0.0)
        self._submit(step + 1, nxt)  # planned while this step computes
        self.client.request_plan(step + 1)
        t0 = time.perf_counter()
        try:
            plan, done = self.client.get_plan(step)
            return Fetched(plan, done, True, time.perf_counter() - t0)
        except CoordinatorUnavailable as e:
            logger.warning("rank %d: coordinator unavailable at step %d (%s); planning locally", self.sync.rank, step, e)
            return Fetched(None, False, False, time.perf_counter() - t0)

    def resolve(self, step: int, fetched: Fetched, everyone_has_plan: bool, this: StepMeta,
                nxt: StepMeta) -> Planned:
        if everyone_has_plan:
            if self.sync.rank == 0 and self._pending:
                self._flush_pending()
            return Planned(fetched.plan, fetched.epoch_done, "coordinator", fetched.wait_s)
        gathered = self.sync.gather_objects(
            (list(this.seq_lens), list(this.sample_ids), this.exhausted, self._recent))
        lens = [g[0] for g in gathered]
        done = is_epoch_done(lens, [g[2] for g in gathered])
        plan = None if done else plan_from_gathered(lens, self.topology, self.workload, self.solver)
        rows = None
        if self.sync.rank == 0:
            rows = ([sid for g in gathered for sid in g[1]], [r for r, g in enumerate(gathered) for _ in g[1]])
            if self.client is not None:
                # Steps the lost coordinator may never have committed (resent rows of steps
                # it did commit are ignored), then this one once it is trained.
                for t in sorted(set().union(*(g[3] for g in gathered))):
                    self._pending.setdefault(t, (
                        [sid for g in gathered for sid in g[3].get(t, [])],
                        [r for r, g in enumerate(gathered) for _ in g[3].get(t, [])],
                    ))
        if self.client is not None:
            # A restarted coordinator may have lost the prefetched submission of the next
            # step: send it again (identical resends are ignored).
            self.client.forget_requests()
            self._submit(step + 1, nxt)
        return Planned(plan, done, "local", fetched.wait_s, rows)

    def committed(self, step: int, epoch: int, planned: Planned, this: StepMeta) -> None:
        """After the optimizer step that trained ``step``."""
        self._recent[step] = [int(i) for i in this.sample_ids]
        if len(self._recent) > RECENT_STEPS:
            self._recent.pop(min(self._recent))
        if self.sync.rank != 0:
            return
        if self.client is None:
            assert planned.rows is not None and self.local_ledger is not None
            self.local_ledger.append(step, epoch, *planned.rows)
        elif planned.planned_by == "coordinator":
            self.client.commit_async(step)
        else:
            assert planned.rows is not None
            self._pending[step] = planned.rows

    def finish(self, last_step: int | None) -> None:
        """Rank 0 at the end of the run: hand over what is pending and commit the last step."""
        if self.sync.rank != 0 or self.client is None:
            return
        self._flush_pending()
        if self._pending:
            raise CoordinatorUnavailable(f"ledger rows of steps {sorted(self._pending)} could not be handed over")
        if last_step is not None:
            self.client.commit(last_step)

    # ---- helpers -------------------------------------------------------------------------

    def _submit(self, step: int, meta: StepMeta) -> None:
        if self.client is not None:
            self.client.submit_async(step, list(meta.seq_lens), list(meta.sample_ids), exhausted=meta.exhausted)

    def _flush_pending(self) -> None:
        for t in sorted(self._pending):
            try:
                self.client.record_external(t, *self._pending[t])
            except CoordinatorUnavailable:
                return  # still away: try again after the next step
            del self._pending[t]
