"""Which plan a step runs, and which samples it trained (the ledger's rows).

Per step, on every rank:

1. ``fetch(step, this_step, next_step)``: send the *next* step's lengths to the
   coordinator (answered later) and ask for its plan early, then wait (timed) for this
   step's plan. With no coordinator, or when it does not answer in time, there is none.
   If the coordinator rejected this rank's submission for the step or failed the step,
   ``Fetched.error`` says why.
2. The trainer all-reduces ``Fetched.have_plan`` and whether ``Fetched.error`` is set with
   its other per-step counts, so every rank learns whether every rank got the plan, and
   every rank raises ``StepFailed`` together when any rank's step failed (no rank is left
   waiting in a collective, and a rejection never passes as an end of epoch).
3. ``resolve(fetched, everyone_has_plan)``: the coordinator's plan, or, if any rank lacks
   it, a plan every rank computes itself from an all-gather of lengths with the same
   solver (so all ranks always run the same plan, and nobody waits in a collective for a
   rank that has none; with ``balance.topology: per-step`` the plan carries the step's own
   bags, chosen by the same deterministic search as on the coordinator).
4. The samples a step trained enter the ledger after its optimizer step, through the
   ``LedgerKeeper`` (``ledger_keeper``): a locally planned step's ``Planned.rows`` are
   what rank 0 records, its all-gather carries every rank's recent ids (steps a lost
   coordinator may have dropped are re-sent, ``LedgerKeeper.resend``), and a step the
   coordinator planned lets rank 0 hand over the rows it still holds (``flush``).
5. ``observe(step, plan, compute_s)``: every rank's measured compute seconds (all-reduced,
   so the same everywhere) feed the live re-fit of the cost model (``LiveFit``), which
   local plans use; every rank fits the same data the same way, and the all-gather of a
   local plan carries each rank's fit digest, so a rank that somehow fitted differently
   makes every rank plan that step with the configured model instead of deadlocking on
   different plans.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from knapray.coordinator import (
    CoordinatorClient,
    CoordinatorConfig,
    CoordinatorUnavailable,
    StepFailed,
    is_epoch_done,
    make_live_fit,
    make_planning_model,
    plan_from_gathered,
)
from knapray.data import StepMeta
from knapray.distributed.step_sync import StepSync
from knapray.planning import BalancePlan, Topology
from knapray.planning.fitting.livefit import LiveFit, RankFeatures

from knapray.config.run import TrainConfig
from knapray.worker.ledger_keeper import LedgerKeeper

logger = logging.getLogger(__name__)

def coordinator_name(cfg: TrainConfig) -> str:
    return f"knapray-coordinator-{cfg.run.name}"


def coordinator_config(cfg: TrainConfig, **extra: Any) -> CoordinatorConfig:
    """The coordinator's settings: the run config's ``balance`` section and the model's
    facts, checked (the driver creates the actor with them; a rank planning locally builds
    the same planning model from them). ``extra``: fields the run config does not hold
    (world_size, state_dir)."""
    m = cfg.model
    return CoordinatorConfig(
        balance=cfg.balance, d_model=m.hidden_size,
        attention_kind=m.attention_kind,  # the family's: Wan cross-attends to its text
        num_heads=m.num_heads, double_blocks=m.depth_double, single_blocks=m.depth_single,
        max_tokens_per_gpu=cfg.data.max_tokens_per_gpu or None, **extra,
    )


def planning_model(cfg: TrainConfig):
    """What plans balance; the coordinator builds the same from ``coordinator_config``."""
    return make_planning_model(coordinator_config(cfg))


def live_fit(cfg: TrainConfig) -> LiveFit | None:
    """The local plans' live re-fit of the planning model (as the coordinator's), or None."""
    return make_live_fit(coordinator_config(cfg))


@dataclass(frozen=True)
class Fetched:
    plan: BalancePlan | None
    epoch_done: bool
    have_plan: bool
    wait_s: float
    error: str | None = None
    """Why the coordinator rejected this rank's submission or failed the step (``StepFailed``)."""


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
                 client: CoordinatorClient | None, ledger: LedgerKeeper, max_tokens_per_gpu: int | None = None,
                 live: LiveFit | None = None, per_step_node: int | None = None, overlap: bool = False) -> None:
        """``ledger``: this rank's ``LedgerKeeper`` (a local plan's all-gather carries its
        recent steps; rank 0 hands over its rows when the coordinator answers).
        ``max_tokens_per_gpu``: the memory budget local plans keep (as the coordinator's do).
        ``live``: the live re-fit of ``workload`` local plans use (``planner: cost``).
        ``per_step_node``: ranks per node when every step chooses its own bags
        (``balance.topology: per-step``; ``topology`` is then the base), else None.
        ``overlap``: ``balance.overlap`` (local plans may overlap groups, as the coordinator's)."""
        self.sync, self.topology, self.workload, self.solver = sync, topology, workload, solver
        self.per_step_node = per_step_node
        self.overlap = overlap
        self.live = live
        self.live_disagreements = 0
        """Local plans made with the configured model because the ranks' fits differed."""
        self.max_tokens_per_gpu = max_tokens_per_gpu
        self.client = client
        self.ledger = ledger

    # ---- per step ------------------------------------------------------------------------

    def begin_epoch(self, step: int, epoch: int, first: StepMeta) -> None:
        """Submit the epoch's first step (later steps are submitted one step ahead). Its
        number is the one the previous epoch ended at, if any: steps count trained steps."""
        if self.client is not None:
            self.client.set_epoch(epoch)
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
        except StepFailed as e:
            logger.error("rank %d: step %d failed on the coordinator: %s", self.sync.rank, step, e)
            return Fetched(None, False, False, time.perf_counter() - t0, error=str(e))

    def raise_failed(self, step: int, fetched: Fetched) -> None:
        """Every rank, after the per-step agreement counted a failed step: raise
        ``StepFailed`` with the failing ranks' reasons (the same message on every rank)."""
        reasons = self.sync.gather_objects(fetched.error)
        failed = "; ".join(f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None)
        raise StepFailed(f"step {step} cannot be trained: {failed}")

    def resolve(self, step: int, fetched: Fetched, everyone_has_plan: bool, this: StepMeta,
                nxt: StepMeta) -> Planned:
        if everyone_has_plan:
            self.ledger.flush()  # rows rank 0 still holds, now the coordinator answers
            return Planned(fetched.plan, fetched.epoch_done, "coordinator", fetched.wait_s)
        gathered = self.sync.gather_objects(
            (list(this.seq_lens), list(this.sample_ids), this.exhausted, self.ledger.recent,
             None if self.live is None else self.live.digest()))
        lens = [g[0] for g in gathered]
        done = is_epoch_done(lens, [g[2] for g in gathered])
        plan = None if done else plan_from_gathered(lens, self.topology, self._local_model([g[4] for g in gathered]),
                                                    self.solver, self.max_tokens_per_gpu, self.per_step_node,
                                                    overlap=self.overlap)
        rows = None
        if self.sync.rank == 0:
            rows = ([sid for g in gathered for sid in g[1]], [r for r, g in enumerate(gathered) for _ in g[1]])
            # Steps the lost coordinator may never have committed, then this one once it is trained.
            self.ledger.resend([g[3] for g in gathered])
        if self.client is not None:
            # A restarted coordinator may have lost the prefetched submission of the next
            # step: send it again (identical resends are ignored).
            self.client.forget_requests()
            self._submit(step + 1, nxt)
        return Planned(plan, done, "local", fetched.wait_s, rows)

    def observe(self, step: int, plan: BalancePlan, compute_s: list[float]) -> None:
        """The step's plan (the one that ran) and every rank's measured compute seconds, in
        rank order: the same on every rank, so every rank's live fit stays the same."""
        if self.live is not None:
            # With a coordinator, the fit runs only when a step has to be planned locally.
            self.live.observe(step, RankFeatures.of_plan(plan), compute_s, refit=self.client is None)

    def _local_model(self, digests: list[str | None]):
        """The live model if every rank's fit is the same (it is, unless their numerics
        differ), else the configured one: all ranks decide alike from the same digests."""
        if self.live is None:
            return self.workload
        if len(set(digests)) == 1:
            return self.live.model()
        self.live_disagreements += 1
        logger.warning("rank %d: the ranks' live cost fits differ (%d distinct); this step is planned with "
                       "the configured model", self.sync.rank, len(set(digests)))
        return self.workload

    # ---- helpers -------------------------------------------------------------------------

    def _submit(self, step: int, meta: StepMeta) -> None:
        if self.client is not None:
            self.client.submit_async(step, list(meta.seq_lens), list(meta.sample_ids), exhausted=meta.exhausted)
