"""The balance coordinator: one Ray actor plans every step once, for all ranks.

``BalanceCoordinator`` holds all the logic and runs without Ray (tests drive it with
``asyncio``); ``create_coordinator`` wraps it in a named async actor, and
``CoordinatorClient`` is what a training worker calls.

Step protocol (rank ``r`` of a world of ``W`` ranks, step ``t``)
----------------------------------------------------------------
1. ``submit(t, r, seq_lens, sample_ids, exhausted)``, fire-and-forget. Workers send step
   ``t+1``'s metadata while step ``t`` computes, so planning stays off the critical path.
   Submissions are accepted in any order, across steps and ranks; an identical resend is
   ignored, a different one for the same ``(t, r)`` fails the step.
2. When all ``W`` ranks have submitted ``t``, the coordinator plans once (one
   ``plan_from_gathered`` call over the world; it plans each balance group on its own) and
   caches the plan. ``get_plan(t, r)`` waits for that and returns ``(plan, epoch_done)``,
   the same plan to every rank. If the step cannot be planned (bad submission, solver
   error) every rank's ``get_plan(t)`` raises ``StepFailed``: all ranks fail the same
   step instead of some of them hanging in a collective.
3. Commit rule: after the optimizer step that consumed steps ``<= t``, rank 0 calls
   ``commit_step(t)``. Commits are cumulative (every planned step ``<= t`` enters the
   ledger, so gradient accumulation over several planned steps needs one commit) and
   idempotent. Step-time reports never commit: they also arrive for micro-batches of an
   accumulation that a crash may still lose. A checkpoint taken at step ``c`` covers
   every step ``<= c``; rank 0 awaits ``commit_step(c)`` before reading ``state_dict()``.
4. ``report_timing(t, r, compute_s, comm_s, wait_plan_s)``, fire-and-forget, feeds the
   per-rank step-time averages and the speed factors.

Epoch end
---------
A rank that ran out of data submits an empty list with ``exhausted=True`` for every
further step; the plan still gives it chunks of the others' sequences. The first step at
which every rank submitted ``exhausted=True`` (so no rank has a sequence) is answered with
``(None, True)`` to every rank: all ranks leave the loop at that same step and no
collective hangs. The coordinator's epoch counter then goes up by one. Submissions carry
the epoch their sender is in (``CoordinatorClient`` tracks it), so prefetched submissions
for steps after the end, sent before the sender learned of it, are recognized as stale
and dropped, and the next epoch continues with the next step numbers.

(Re)start
---------
Before any rank submits, rank 0 (or the driver) calls ``begin_run(world_size,
resume_step, state)`` and waits for it, then the ranks pass a barrier. A fresh run
(``resume_step=None``) clears the ledger; a resumed run loads the checkpoint's
``state`` (if the coordinator lost it, e.g. after an actor restart), then
``truncate(resume_step)``: later ledger rows and every in-flight step are dropped and
the attempt counter goes up, so samples after the checkpoint are trained again and
recorded with the new attempt. The topology is re-planned for the new world size by
``topology_for`` and the change is logged.

Fallback
--------
If the actor cannot be reached, ``CoordinatorClient.get_plan`` raises
``CoordinatorUnavailable`` within its timeout; the training loop then all-gathers the
lengths and calls ``plan_from_gathered`` itself, the same pure function the coordinator
uses, so both paths give identical plans.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .planning import SOLVERS, BalancePlan, Topology, WorkloadModel, plan_balance
from .planning.autotopo import choose_topology
from .planning.cost import CostModel

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

STATE_VERSION = 1
_HIST_BINS = 48  # log2 length bins: bin k holds lengths in [2^k, 2^(k+1))
_RECENT = 1024  # samples kept for running means and percentiles
_WORK_STEPS = 64  # steps whose planned per-rank work is kept for speed estimates
_AUTO_MAX_BAG = 8  # largest bag "auto" considers without gpus_per_node (one node)


class CoordinatorUnavailable(RuntimeError):
    """The coordinator gave no plan within the client's timeout (actor dead, restarting,
    or a step that never completed): plan locally from an all-gather of lengths."""


class PlanTimeout(TimeoutError):
    """No plan for a step within the timeout; the message names the ranks still missing."""


class StepFailed(ValueError):
    """A step can never be planned (bad submission or solver error); raised to every rank."""


# ---- pure helpers both planning paths share -----------------------------------------------


PLANNERS = ("workload", "cost")


def make_planning_model(config: "CoordinatorConfig") -> WorkloadModel | CostModel:
    """The model plans balance with; the coordinator and the local fallback build the same."""
    if config.planner == "workload":
        return WorkloadModel(config.d_model, config.gamma)
    overrides = dict(config.cost or {})
    overrides.setdefault("d_model", config.d_model)
    if config.gpus_per_node:
        overrides.setdefault("gpus_per_node", config.gpus_per_node)
    if config.cost_profile:
        return CostModel.from_profile(config.cost_profile, **overrides)
    return CostModel.from_dict(overrides)


def plan_from_gathered(
    all_lens_per_rank: Sequence[Sequence[int]],
    topology: Topology,
    model: WorkloadModel | CostModel | None = None,
    solver: str = "knapray",
) -> BalancePlan:
    """Plan one step from every rank's lengths, in rank order.

    The coordinator and the training loop's local fallback (after an all-gather) both call
    this, so the same lengths give the same plan on either path. Lengths may come as
    lists, numpy arrays or tensors; they are normalized to int64 first.
    """
    lens = [np.asarray(list(map(int, rank_lens)), dtype=np.int64) for rank_lens in all_lens_per_rank]
    return plan_balance(lens, topology, model or WorkloadModel(), solver=solver)


def is_epoch_done(all_lens_per_rank: Sequence[Sequence[int]], exhausted_per_rank: Sequence[bool]) -> bool:
    """True when every rank is out of data and has no sequence for the step."""
    return all(exhausted_per_rank) and all(len(lens) == 0 for lens in all_lens_per_rank)


def _largest_pow2_bag(limit: int, world_size: int, gpus_per_node: int | None) -> int:
    """Largest power of two ``<= limit`` dividing the world (and the node, if given)."""
    p = 1
    while p * 2 <= limit and world_size % (p * 2) == 0 and (
        gpus_per_node is None or gpus_per_node % (p * 2) == 0
    ):
        p *= 2
    return p


# ---- config -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    """What the coordinator plans with; validated when built, unknown keys rejected."""

    world_size: int | None = None
    """Ranks in the world; None until ``begin_run`` says (elastic runs)."""
    topology: str = "bags_of:8"
    """A concrete spec (``"g8n4"``, replicated over multiples of its size), ``"bags_of:N"``
    (one balance group of equal bags, the largest power of two ``<= N`` dividing the world
    and, if given, ``gpus_per_node``) or ``"auto"`` (the equal-bag topology ``g{2^k}``
    predicted best on recent lengths, see ``BalanceCoordinator.topology_for``)."""
    gpus_per_node: int | None = None
    """If given, bags never straddle a node boundary."""
    d_model: int = 3072
    """Transformer width, for the workload model."""
    gamma: float = 0.4
    """Relative attention cost, for the workload model."""
    solver: str = "knapray"
    """``plan_balance`` solver."""
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
    state_path: str | None = None
    """If set, the actor persists its state (ledger, epoch, attempt, world, statistics)
    there after every change of the ledger and reloads it when it is restarted, so losing
    the coordinator loses nothing that was committed."""

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
        WorkloadModel(self.d_model, self.gamma)  # validates both
        if self.planner not in PLANNERS:
            raise ValueError(f"unknown planner {self.planner!r}; valid: {', '.join(PLANNERS)}")
        make_planning_model(self)  # validates the cost model's fields
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; valid: {', '.join(SOLVERS)}")
        _parse_rule(self.topology)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "CoordinatorConfig":
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ValueError(f"unknown coordinator config keys {unknown}; valid: {', '.join(valid)}")
        return cls(**kwargs)


def _parse_rule(rule: str) -> tuple[str, int | Topology | None]:
    """``("auto", None)``, ``("bags_of", N)`` or ``("spec", Topology)``."""
    if not isinstance(rule, str):
        raise ValueError(f"topology must be a string such as 'g8n4', 'bags_of:8' or 'auto', got {rule!r}")
    if rule == "auto":
        return "auto", None
    if rule.startswith("bags_of:"):
        arg = rule.split(":", 1)[1]
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"topology {rule!r}: expected 'bags_of:N' with an integer N >= 1, e.g. 'bags_of:8'")
        return "bags_of", int(arg)
    try:
        return "spec", Topology.parse(rule)
    except ValueError as e:
        raise ValueError(f"topology {rule!r} is neither 'auto', 'bags_of:N' nor a valid spec: {e}") from e


# ---- per-step state ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Submission:
    seq_lens: tuple[int, ...]
    sample_ids: tuple[int, ...]
    exhausted: bool


@dataclass(slots=True)
class _Step:
    step: int
    epoch: int | None = None
    """Epoch of the step's submissions (None until the first arrives)."""
    inbox: dict[int, _Submission] = field(default_factory=dict)
    event: asyncio.Event | None = None
    decided: bool = False
    plan: BalancePlan | None = None
    epoch_done: bool = False
    error: str | None = None

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()


@dataclass(frozen=True, slots=True)
class _LedgerEntry:
    sample_ids: np.ndarray
    home_ranks: np.ndarray
    attempt: int


# ---- the coordinator --------------------------------------------------------------------


class BalanceCoordinator:
    """Plans each step once for all ranks; keeps the ledger and running statistics.

    Not thread-safe: it runs on one asyncio event loop (the actor's), where only
    ``get_plan`` ever suspends.
    """

    def __init__(self, config: CoordinatorConfig | None = None, **overrides: Any) -> None:
        if config is not None and overrides:
            raise ValueError(f"give either a CoordinatorConfig or keyword overrides, not both: {sorted(overrides)}")
        self.config = config or CoordinatorConfig.from_kwargs(**overrides)
        self.model = make_planning_model(self.config)
        self._world_size: int | None = None
        self._topology: Topology | None = None
        self._steps: dict[int, _Step] = {}
        self._evicted_through = -1
        self._reset_run_state()
        # Statistics: they describe the data and the hardware, so they survive new runs.
        self._length_hist = np.zeros(_HIST_BINS, dtype=np.int64)
        self._length_history: deque[list[list[int]]] = deque(maxlen=self.config.history_steps)
        self._baseline_imbalance: deque[float] = deque(maxlen=_RECENT)
        self._imbalance: deque[float] = deque(maxlen=_RECENT)
        self._moved_fraction: deque[float] = deque(maxlen=_RECENT)
        self._plan_ms: deque[float] = deque(maxlen=_RECENT)
        self._wait_s: deque[float] = deque(maxlen=_RECENT)
        self._work_by_step: OrderedDict[int, np.ndarray] = OrderedDict()
        self._steps_planned = 0
        self._stale_submissions = 0
        self._unledgered_steps = 0
        self._reset_rank_stats(0)
        if self.config.world_size is not None:
            self._set_world(self.config.world_size)

    def _reset_run_state(self) -> None:
        self._ledger: dict[int, _LedgerEntry] = {}
        self._uncommitted: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._committed_step = -1
        self._epoch_ends: dict[int, int] = {}
        """Epoch -> the step at which every rank was found exhausted."""
        self._epoch = 0
        self._attempt = 0

    def _reset_rank_stats(self, world_size: int) -> None:
        self._ema = {k: np.full(world_size, np.nan) for k in ("compute_s", "comm_s", "wait_plan_s", "work", "work_time")}

    # ---- properties ---------------------------------------------------------------------

    @property
    def world_size(self) -> int | None:
        return self._world_size

    @property
    def topology(self) -> Topology | None:
        return self._topology

    @property
    def epoch(self) -> int:
        """Epochs finished so far (the epoch new submissions belong to)."""
        return self._epoch

    @property
    def attempt(self) -> int:
        """Restarts from a checkpoint so far; recorded with every ledger row."""
        return self._attempt

    @property
    def committed_step(self) -> int:
        return self._committed_step

    # ---- step protocol ------------------------------------------------------------------

    def submit(
        self,
        step: int,
        rank: int,
        seq_lens: Sequence[int],
        sample_ids: Sequence[int],
        exhausted: bool = False,
        epoch: int | None = None,
    ) -> None:
        """Record rank ``rank``'s sequences for ``step``; plan once every rank has sent.

        ``epoch``: the sender's epoch (None: the current one). A submission from an epoch
        that already ended is a leftover prefetch and is dropped. Raises ``StepFailed``
        (and fails the step for every rank) on a malformed or conflicting submission.
        """
        step = _check_index("step", step)
        if epoch is None:
            epoch = self._epoch
        end = self._epoch_ends.get(epoch)
        if epoch < self._epoch and (end is None or step > end):
            self._stale_submissions += 1
            return
        if epoch > self._epoch:
            # Only a coordinator that lost its state (actor restart) can be behind its ranks.
            log.warning("rank %s is in epoch %d, coordinator in %d: adopting it", rank, epoch, self._epoch)
            self._epoch = epoch
        if step <= self._committed_step:
            raise StepFailed(
                f"rank {rank} submitted step {step}, but steps <= {self._committed_step} are already "
                "committed; step numbers must keep increasing (across epochs too)"
            )
        st = self._step(step)
        if st.error is not None:
            raise StepFailed(st.error)
        if st.decided:
            if st.inbox.get(rank) == _submission_or_none(seq_lens, sample_ids, exhausted):
                return  # a resend of what was planned
            raise StepFailed(f"step {step}: rank {rank} submitted different data after the step was planned")
        world = self._require_world()
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world:
            self._fail(st, f"step {step}: rank {rank!r} is not in [0, {world})")
        lens, ids = _int_tuple(seq_lens), _int_tuple(sample_ids)
        if lens is None or ids is None:
            self._fail(st, f"step {step}, rank {rank}: seq_lens and sample_ids must be flat lists of integers")
        if len(lens) != len(ids):
            self._fail(
                st, f"step {step}, rank {rank}: {len(lens)} sequence lengths but {len(ids)} sample ids"
            )
        if exhausted and lens:
            self._fail(
                st,
                f"step {step}, rank {rank}: exhausted=True means no data left, but {len(lens)} "
                "sequences came with it; send the last batch with exhausted=False",
            )
        sub = _Submission(lens, ids, bool(exhausted))
        old = st.inbox.get(int(rank))
        if old is not None and old != sub:
            self._fail(st, f"step {step}: rank {rank} submitted twice with different data")
        st.inbox[int(rank)] = sub
        if st.epoch is None:
            st.epoch = epoch
        if len(st.inbox) == world:
            self._decide(st)

    async def get_plan(
        self, step: int, rank: int, timeout_s: float | None = None
    ) -> tuple[BalancePlan | None, bool]:
        """``(plan, epoch_done)`` for ``step``, once every rank has submitted it.

        Every rank gets the same plan object; ``(None, True)`` ends the epoch. Raises
        ``PlanTimeout`` after ``timeout_s`` (naming the ranks still missing) and
        ``StepFailed`` if the step can never be planned.
        """
        step = _check_index("step", step)
        world = self._require_world()
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        st = self._steps.get(step)
        if st is None:
            if step <= self._evicted_through:
                raise StepFailed(
                    f"step {step} is no longer held (plans are kept for the last "
                    f"{self.config.keep_steps} planned steps, and a run restart drops all)"
                )
            st = self._step(step)
        if not st.decided and st.error is None:
            if st.event is None:
                st.event = asyncio.Event()
            try:
                await asyncio.wait_for(st.event.wait(), timeout_s)
            except asyncio.TimeoutError:
                missing = sorted(set(range(world)) - set(st.inbox))
                raise PlanTimeout(
                    f"step {step}: no plan after {timeout_s:g}s; waiting for ranks {missing} to submit"
                ) from None
        if st.error is not None:
            raise StepFailed(st.error)
        return st.plan, st.epoch_done

    def is_ready(self, step: int) -> bool:
        st = self._steps.get(step)
        return st is not None and (st.decided or st.error is not None)

    def _step(self, step: int) -> _Step:
        st = self._steps.get(step)
        if st is None:
            st = self._steps[step] = _Step(step)
        return st

    def _fail(self, st: _Step, message: str) -> None:
        """Fail ``st`` for every rank (their ``get_plan`` raises) and raise to the caller."""
        if st.error is None:
            st.error = message
            st.wake()
        raise StepFailed(message)

    def _decide(self, st: _Step) -> None:
        world = self._require_world()
        subs = [st.inbox[r] for r in range(world)]
        lens = [list(s.seq_lens) for s in subs]
        if is_epoch_done(lens, [s.exhausted for s in subs]):
            st.epoch_done = True
            st.decided = True
            st.wake()
            self._end_epoch(st)
            return
        try:
            plan = plan_from_gathered(lens, self._topology, self._live_model(), self.config.solver)
        except ValueError as e:
            self._fail(st, f"step {st.step}: planning failed: {e}")
        st.plan, st.decided = plan, True
        st.wake()
        self._record_plan(st.step, plan, lens, subs)
        self._evict()

    def _record_plan(
        self, step: int, plan: BalancePlan, lens: list[list[int]], subs: list[_Submission]
    ) -> None:
        ids = np.fromiter((i for s in subs for i in s.sample_ids), dtype=np.int64, count=plan.num_sequences)
        self._uncommitted[step] = (ids, plan.home_rank.copy())
        self._steps_planned += 1
        self._work_by_step[step] = plan.rank_work.copy()
        while len(self._work_by_step) > _WORK_STEPS:
            self._work_by_step.popitem(last=False)
        if plan.num_sequences:
            bins = np.minimum(np.log2(plan.seq_lens).astype(np.int64), _HIST_BINS - 1)
            self._length_hist += np.bincount(bins, minlength=_HIST_BINS)
            self._length_history.append(lens)
        self._baseline_imbalance.append(plan.baseline_imbalance)
        self._imbalance.append(plan.imbalance)
        self._moved_fraction.append(plan.moved_token_fraction)
        self._plan_ms.append(plan.plan_time_ms)

    def _evict(self) -> None:
        decided = sorted(t for t, s in self._steps.items() if s.decided)
        for t in decided[: -self.config.keep_steps]:
            del self._steps[t]
            self._evicted_through = max(self._evicted_through, t)

    def _end_epoch(self, st: _Step) -> None:
        epoch, step = st.epoch, st.step
        # Ranks prefetch, so the all-exhausted prefetches for the step after the end can
        # complete before the end step itself does; the earliest such step is the end.
        if epoch in self._epoch_ends and self._epoch_ends[epoch] < step:
            return
        self._epoch_ends[epoch] = step
        self._epoch = max(self._epoch, epoch + 1)
        # Steps after the end hold only prefetches sent before the senders learned of it.
        self._discard(
            lambda s: s.step > step and (s.epoch is None or s.epoch <= epoch),
            f"epoch {epoch} ended at step {step}",
        )
        log.info("epoch %d ended at step %d", epoch, step)

    def _discard(self, which: Callable[[_Step], bool], reason: str) -> None:
        for st in [s for s in self._steps.values() if which(s)]:
            del self._steps[st.step]
            if not st.decided and st.error is None:
                st.error = f"step {st.step} was discarded: {reason}"
                st.wake()

    # ---- ledger -------------------------------------------------------------------------

    def commit_step(self, step: int) -> None:
        """Every planned step ``<= step`` has been applied by the optimizer: record its
        samples in the ledger (cumulative, idempotent)."""
        step = _check_index("step", step, allow_minus_one=True)
        for t in sorted(t for t in self._uncommitted if t <= step):
            ids, home = self._uncommitted.pop(t)
            self._ledger[t] = _LedgerEntry(ids, home, self._attempt)
        # Steps still unplanned here were trained from a local fallback plan: their samples
        # never reached the coordinator, so the ledger cannot hold them.
        unplanned = sorted(t for t, s in self._steps.items() if t <= step and not s.decided)
        if unplanned:
            self._unledgered_steps += len(unplanned)
            log.warning("steps %s committed without a coordinator plan: not in the ledger", unplanned)
            self._discard(lambda s: s.step <= step and not s.decided, f"committed at step {step} without a plan")
        self._committed_step = max(self._committed_step, step)

    def record_external(self, step: int, sample_ids: Sequence[int], home_ranks: Sequence[int]) -> None:
        """Ledger rows of a step the ranks planned without the coordinator (it was
        unreachable): committed as they are, with the current attempt."""
        step = _check_index("step", step)
        ids = np.asarray(sample_ids, dtype=np.int64)
        home = np.asarray(home_ranks, dtype=np.int64)
        if ids.shape != home.shape or ids.ndim != 1:
            raise ValueError(f"sample_ids and home_ranks must be equal-length lists, got {ids.shape}, {home.shape}")
        if step in self._ledger:
            return  # a resend after a lost acknowledgement
        self._ledger[step] = _LedgerEntry(ids, home, self._attempt)
        self._steps.pop(step, None)
        self._committed_step = max(self._committed_step, step)
        self._evicted_through = max(self._evicted_through, step)

    def inflight_state(self) -> dict:
        """Planned but not yet committed steps (small: a few steps), for the actor to
        persist after every plan, so a commit lost with a dying actor is not a lost step:
        the restarted actor reloads them and the next (cumulative) commit covers them."""
        return {"attempt": self._attempt, "uncommitted": {t: (i.copy(), h.copy()) for t, (i, h) in self._uncommitted.items()}}

    def restore_inflight(self, inflight: dict) -> None:
        if int(inflight.get("attempt", -1)) != self._attempt:
            return  # from another attempt: those steps were cut back
        for t, (ids, home) in inflight["uncommitted"].items():
            if t > self._committed_step and t not in self._ledger:
                self._uncommitted[int(t)] = (np.asarray(ids, np.int64), np.asarray(home, np.int64))
                self._evicted_through = max(self._evicted_through, int(t))

    def ledger_rows(self) -> list[tuple[int, int, int, int]]:
        """``(step, sample_id, home_rank, attempt)`` for every committed sample, by step."""
        rows: list[tuple[int, int, int, int]] = []
        for t in sorted(self._ledger):
            e = self._ledger[t]
            rows.extend((t, i, h, e.attempt) for i, h in zip(e.sample_ids.tolist(), e.home_ranks.tolist()))
        return rows

    def truncate(self, step: int) -> None:
        """Cut back to a checkpoint taken at ``step``: it covers steps ``<= step``, so those
        are committed; later rows and every in-flight step are dropped, and the attempt
        counter goes up (samples after ``step`` are trained again, recorded with it)."""
        step = _check_index("step", step, allow_minus_one=True)
        self.commit_step(step)
        self._ledger = {t: e for t, e in self._ledger.items() if t <= step}
        self._uncommitted.clear()
        self._committed_step = step
        self._epoch_ends = {e: t for e, t in self._epoch_ends.items() if t <= step}
        self._epoch = max(self._epoch_ends, default=-1) + 1
        self._discard(lambda s: True, f"truncated to step {step}")
        self._evicted_through = step
        self._attempt += 1
        log.info("ledger truncated to step %d; attempt %d", step, self._attempt)

    def state_dict(self) -> dict:
        """Ledger, epoch, attempt counter and statistics, picklable, for the checkpoint."""
        steps = sorted(self._ledger)
        entries = [self._ledger[t] for t in steps]
        counts = [e.sample_ids.size for e in entries]

        def cat(arrays: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(arrays) if arrays else np.zeros(0, np.int64)

        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "attempt": self._attempt,
            "committed_step": self._committed_step,
            "epoch_ends": dict(self._epoch_ends),
            "ledger": {
                "step": np.repeat(np.asarray(steps, dtype=np.int64), counts),
                "sample_id": cat([e.sample_ids for e in entries]),
                "home_rank": cat([e.home_ranks for e in entries]),
                "attempt": np.repeat(np.asarray([e.attempt for e in entries], dtype=np.int64), counts),
            },
            "stats": {
                "length_hist": self._length_hist.copy(),
                "length_history": [list(map(list, s)) for s in self._length_history],
                "baseline_imbalance": list(self._baseline_imbalance),
                "imbalance": list(self._imbalance),
                "moved_fraction": list(self._moved_fraction),
                "plan_ms": list(self._plan_ms),
                "wait_s": list(self._wait_s),
                "ema": {k: v.copy() for k, v in self._ema.items()},
                "steps_planned": self._steps_planned,
                "stale_submissions": self._stale_submissions,
                "unledgered_steps": self._unledgered_steps,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` captured. In-flight steps are dropped; the attempt
        counter never goes back (a live coordinator may already be past the checkpoint's)."""
        version = state.get("version") if isinstance(state, dict) else None
        if version != STATE_VERSION:
            raise ValueError(f"coordinator state version {version!r} is not supported (expected {STATE_VERSION})")
        led = state["ledger"]
        step, ids, home, att = (np.asarray(led[k], dtype=np.int64) for k in ("step", "sample_id", "home_rank", "attempt"))
        if not step.size == ids.size == home.size == att.size:
            raise ValueError(
                f"corrupt coordinator state: ledger columns have sizes {step.size}, {ids.size}, {home.size}, {att.size}"
            )
        self._discard(lambda s: True, "coordinator state loaded")
        self._uncommitted.clear()
        self._ledger = {}
        bounds = np.flatnonzero(np.diff(step)) + 1
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, step.size]):
            if hi > lo:
                self._ledger[int(step[lo])] = _LedgerEntry(ids[lo:hi].copy(), home[lo:hi].copy(), int(att[lo]))
        self._committed_step = int(state["committed_step"])
        self._evicted_through = self._committed_step
        self._epoch_ends = {int(e): int(t) for e, t in state["epoch_ends"].items()}
        self._epoch = int(state["epoch"])
        self._attempt = max(self._attempt, int(state["attempt"]))
        stats = state["stats"]
        self._length_hist = np.asarray(stats["length_hist"], dtype=np.int64).copy()
        self._length_history = deque(stats["length_history"], maxlen=self.config.history_steps)
        for name in ("baseline_imbalance", "imbalance", "moved_fraction", "plan_ms", "wait_s"):
            setattr(self, "_" + name, deque(stats[name], maxlen=_RECENT))
        ema = {k: np.asarray(v, dtype=np.float64).copy() for k, v in stats["ema"].items()}
        sizes = {v.size for v in ema.values()}
        # Per-rank averages only mean something for the same world.
        if set(ema) == set(self._ema) and len(sizes) == 1 and self._world_size in (None, *sizes):
            self._ema = ema
        else:
            self._reset_rank_stats(self._world_size or 0)
        self._steps_planned = int(stats["steps_planned"])
        self._stale_submissions = int(stats["stale_submissions"])
        self._unledgered_steps = int(stats["unledgered_steps"])

    # ---- runs and topology ----------------------------------------------------------------

    def begin_run(
        self, world_size: int, resume_step: int | None = None, state: dict | None = None
    ) -> Topology:
        """Start a run on ``world_size`` ranks; returns the topology to build groups from.

        Fresh (``resume_step=None``): the ledger, epoch and attempt start over. Resumed:
        ``state`` (the checkpoint's ``state_dict()``) is loaded if given, then the ledger is
        truncated to ``resume_step``. Either way in-flight steps are dropped: call this
        before any rank submits.
        """
        if resume_step is None:
            if state is not None:
                raise ValueError("state given without resume_step: pass the checkpoint's step too")
            self._discard(lambda s: True, "a new run began")
            self._evicted_through = -1
            self._reset_run_state()
        else:
            if state is not None:
                self.load_state_dict(state)
            self.truncate(resume_step)
        self._set_world(world_size)
        return self._topology

    def _set_world(self, world_size: int) -> None:
        old_topo, old_world = self._topology, self._world_size
        topo = self.topology_for(world_size)
        if self._ema["compute_s"].size != world_size:
            self._reset_rank_stats(world_size)
        self._world_size, self._topology = world_size, topo
        if old_topo is None:
            log.info("coordinator topology %s for world size %d (rule %r)", topo, world_size, self.config.topology)
        elif topo != old_topo:
            log.info(
                "coordinator topology changed: %s -> %s (world size %s -> %d, rule %r)",
                old_topo, topo, old_world, world_size, self.config.topology,
            )

    def topology_for(self, world_size: int) -> Topology:
        """The topology for a world of ``world_size`` ranks, by the configured rule:

        - a concrete spec is replicated into ``world_size / size`` balance groups;
        - ``bags_of:N``: one balance group of ``g{p}`` bags, ``p`` the largest power of two
          ``<= N`` that divides the world size (and ``gpus_per_node``, if given);
        - ``auto``: among ``g{2^k}`` (``2^k`` dividing the world, at most a node), the
          smallest bags whose mean imbalance, predicted by planning recent steps' lengths
          re-dealt onto the new world, is within ``auto_tolerance`` of the best; with no
          length history yet, the ``bags_of`` rule with one node's size.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
        world_size = int(world_size)
        kind, arg = _parse_rule(self.config.topology)
        gpn = self.config.gpus_per_node
        if kind == "spec":
            try:
                return Topology.parse(self.config.topology, world_size=world_size, gpus_per_node=gpn)
            except ValueError as e:
                raise ValueError(
                    f"world size {world_size} does not fit topology {self.config.topology!r} "
                    f"({arg.group_size} ranks per balance group): {e}. Use a world size that is a "
                    f"multiple of {arg.group_size}, or topology='bags_of:8' or 'auto' to re-plan "
                    "bags for any world size"
                ) from e
        if kind == "bags_of":
            p = _largest_pow2_bag(arg, world_size, gpn)
            return Topology((p,) * (world_size // p))
        return self._auto_topology(world_size)

    def _live_model(self) -> WorkloadModel | CostModel:
        """The cost model with the measured per-rank speeds, once every rank has some: a
        slow GPU or a straggling node then gets less work. The workload model has no speeds."""
        if not isinstance(self.model, CostModel) or self._world_size is None:
            return self.model
        speeds = self.speed_factors()
        if speeds.size != self._world_size or not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
            return self.model
        return self.model.with_rank_speed(speeds)

    def _auto_topology(self, world_size: int) -> Topology:
        gpn = self.config.gpus_per_node
        if isinstance(self.model, CostModel):
            # Mixed bag sizes by predicted step time (compute and communication).
            history = self._redealt_history(world_size)
            topo = choose_topology(history, world_size, self.model, gpn)
            log.info("auto topology for world size %d (cost model): %s", world_size, topo)
            return topo
        cap = gpn or _AUTO_MAX_BAG
        steps = [s for s in self._redealt_history(world_size) if any(s)]
        if not steps:
            p = _largest_pow2_bag(cap, world_size, gpn)
            log.info("auto topology: no length history yet, using g%dn%d", p, world_size // p)
            return Topology((p,) * (world_size // p))
        candidates = []
        p = 1
        while p <= cap and world_size % p == 0 and (gpn is None or gpn % p == 0):
            candidates.append(p)
            p *= 2
        scores = {}
        for p in candidates:
            topo = Topology((p,) * (world_size // p))
            scores[p] = float(np.mean([
                plan_from_gathered(s, topo, self.model, self.config.solver).imbalance for s in steps
            ]))
        best = min(scores.values())
        p = min(q for q, v in scores.items() if v <= best + self.config.auto_tolerance)
        log.info(
            "auto topology for world size %d: g%dn%d (mean predicted imbalance by bag size: %s)",
            world_size, p, world_size // p, {q: round(v, 4) for q, v in scores.items()},
        )
        return Topology((p,) * (world_size // p))

    def _redealt_history(self, world_size: int) -> list[list[list[int]]]:
        """Recent per-rank batches dealt, in order, into steps of ``world_size`` ranks (a
        rank's batch size does not change with the world size, the number of ranks does)."""
        batches = [rank for step in self._length_history for rank in step]
        if not batches:
            return []
        if len(batches) < world_size:
            return [[batches[i % len(batches)] for i in range(world_size)]]
        n = min(len(batches) // world_size, self.config.history_steps)
        return [batches[i * world_size : (i + 1) * world_size] for i in range(n)]

    # ---- timing and statistics -----------------------------------------------------------

    def report_timing(self, step: int, rank: int, compute_s: float, comm_s: float, wait_plan_s: float) -> None:
        """Measured seconds of one rank's step: model compute, communication, waiting for the plan."""
        world = self._require_world()
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        times = {"compute_s": compute_s, "comm_s": comm_s, "wait_plan_s": wait_plan_s}
        for name, value in times.items():
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"step {step}, rank {rank}: {name} must be a finite number >= 0, got {value!r}")
            self._ema_update(name, rank, float(value))
        self._wait_s.append(float(wait_plan_s))
        work = self._work_by_step.get(step)
        if work is not None and work[rank] > 0 and compute_s > 0:
            # Ratio of averages, not average of ratios: robust to steps with little work.
            self._ema_update("work", rank, float(work[rank]))
            self._ema_update("work_time", rank, float(compute_s))

    def _ema_update(self, name: str, rank: int, value: float) -> None:
        arr = self._ema[name]
        a = self.config.ema_alpha
        arr[rank] = value if np.isnan(arr[rank]) else (1 - a) * arr[rank] + a * value

    def speed_factors(self) -> np.ndarray:
        """(W,) each rank's speed (planned work per measured compute second) relative to the
        median rank; 1.0 where no timing is known yet. A rank twice as slow gets ~0.5."""
        world = self._require_world()
        speed = self._ema["work"] / self._ema["work_time"]
        known = np.isfinite(speed) & (speed > 0)
        factors = np.ones(world)
        if known.any():
            factors[known] = speed[known] / float(np.median(speed[known]))
        return factors

    def stats(self) -> dict:
        """JSON-friendly summary of recent planning and timing."""

        def mean(xs) -> float | None:
            return float(np.mean(xs)) if len(xs) else None

        def pct(xs, q: float) -> float | None:
            return float(np.percentile(xs, q)) if len(xs) else None

        def per_rank(name: str) -> list[float | None]:
            return [None if np.isnan(v) else float(v) for v in self._ema[name]]

        hist = {int(2**k): int(c) for k, c in enumerate(self._length_hist) if c}
        return {
            "world_size": self._world_size,
            "topology": None if self._topology is None else str(self._topology),
            "epoch": self._epoch,
            "attempt": self._attempt,
            "committed_step": self._committed_step,
            "ledger_rows": int(sum(e.sample_ids.size for e in self._ledger.values())),
            "steps_planned": self._steps_planned,
            "mean_baseline_imbalance": mean(self._baseline_imbalance),
            "mean_imbalance": mean(self._imbalance),
            "mean_moved_token_fraction": mean(self._moved_fraction),
            "plan_ms_p50": pct(self._plan_ms, 50),
            "plan_ms_p95": pct(self._plan_ms, 95),
            "wait_plan_s_mean": mean(self._wait_s),
            "wait_plan_s_p95": pct(self._wait_s, 95),
            "compute_s_ema": per_rank("compute_s"),
            "comm_s_ema": per_rank("comm_s"),
            "wait_plan_s_ema": per_rank("wait_plan_s"),
            "speed_factors": self.speed_factors().tolist() if self._world_size else [],
            "length_histogram": hist,
            "stale_submissions": self._stale_submissions,
            "unledgered_steps": self._unledgered_steps,
        }

    def _require_world(self) -> int:
        if self._world_size is None:
            raise StepFailed("the coordinator has no world size yet: call begin_run(world_size) first")
        return self._world_size


def _check_index(name: str, value: Any, allow_minus_one: bool = False) -> int:
    lo = -1 if allow_minus_one else 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _int_tuple(values: Sequence[int]) -> tuple[int, ...] | None:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        return None
    return tuple(int(v) for v in arr.tolist())


def _submission_or_none(seq_lens: Sequence[int], sample_ids: Sequence[int], exhausted: bool) -> _Submission | None:
    lens, ids = _int_tuple(seq_lens), _int_tuple(sample_ids)
    return None if lens is None or ids is None else _Submission(lens, ids, bool(exhausted))


# ---- Ray glue -----------------------------------------------------------------------------


class _CoordinatorActor:
    """Async actor around ``BalanceCoordinator``.

    Async, not threaded: every method runs on the actor's one event loop thread, so the
    coordinator's state needs no locks, and a ``get_plan`` waiting on its step's
    ``asyncio.Event`` yields the loop to the submits that will complete the step (a threaded
    actor would need a lock plus a condition variable for the same). Planning runs inline
    on the loop: it takes milliseconds, and the requests it delays are waiting for it.
    Submit-type calls are fire-and-forget, so they log errors instead of raising them: a
    failed step reaches every rank through ``get_plan``.
    """

    def __init__(self, config: CoordinatorConfig) -> None:
        logging.basicConfig(level=logging.INFO)
        self._core = BalanceCoordinator(config)
        self._restore()

    def _restore(self) -> None:
        """After a restart (Ray calls ``__init__`` again), pick up the persisted state."""
        path = self._core.config.state_path
        if not path or not os.path.exists(path):
            return
        with open(path, "rb") as f:
            saved = pickle.load(f)
        self._core.load_state_dict(saved["state"])
        if saved.get("world_size"):
            self._core._set_world(int(saved["world_size"]))
        if os.path.exists(path + ".inflight"):
            with open(path + ".inflight", "rb") as f:
                self._core.restore_inflight(pickle.load(f))
        log.warning(
            "coordinator restored from %s: committed step %d, world %s",
            path, self._core.committed_step, saved.get("world_size"),
        )

    def _persist(self) -> None:
        path = self._core.config.state_path
        if not path:
            return
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"state": self._core.state_dict(), "world_size": self._core.world_size}, f)
        os.replace(tmp, path)  # atomic: a crash mid-write leaves the previous state
        self._persist_inflight()

    def _persist_inflight(self) -> None:
        path = self._core.config.state_path
        if not path:
            return
        with open(path + ".inflight.tmp", "wb") as f:
            pickle.dump(self._core.inflight_state(), f)
        os.replace(path + ".inflight.tmp", path + ".inflight")

    async def config(self) -> CoordinatorConfig:
        return self._core.config

    async def submit(self, step, rank, seq_lens, sample_ids, exhausted=False, epoch=None) -> None:
        planned = self._core._steps_planned
        try:
            self._core.submit(step, rank, seq_lens, sample_ids, exhausted, epoch)
        except (ValueError, TypeError) as e:
            log.error("rejected submission: %s", e)
        if self._core._steps_planned != planned:
            self._persist_inflight()

    async def get_plan(self, step, rank, timeout_s=None) -> tuple[BalancePlan | None, bool]:
        return await self._core.get_plan(step, rank, timeout_s)

    async def epoch(self) -> int:
        return self._core.epoch

    async def commit_step(self, step) -> None:
        self._core.commit_step(step)
        self._persist()

    async def record_external(self, step, sample_ids, home_ranks) -> None:
        self._core.record_external(step, sample_ids, home_ranks)
        self._persist()

    async def report_timing(self, step, rank, compute_s, comm_s, wait_plan_s) -> None:
        try:
            self._core.report_timing(step, rank, compute_s, comm_s, wait_plan_s)
        except (ValueError, TypeError) as e:
            log.error("rejected timing report: %s", e)

    async def begin_run(self, world_size, resume_step=None, state=None) -> Topology:
        topo = self._core.begin_run(world_size, resume_step, state)
        self._persist()
        return topo

    async def topology(self) -> Topology | None:
        return self._core.topology

    async def topology_for(self, world_size) -> Topology:
        return self._core.topology_for(world_size)

    async def ledger_rows(self) -> list[tuple[int, int, int, int]]:
        return self._core.ledger_rows()

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
    **config: Any,
) -> "ActorHandle":
    """Create (or get, if one by that name exists) the named coordinator actor.

    ``num_cpus=0``: it is idle most of the time and must not take a CPU a training worker
    needs. ``max_restarts``: a restarted actor starts empty; ranks waiting on it time out
    into the local fallback and rank 0 restores its state at the next ``begin_run``.
    ``detached``: outlive the driver (for ``ray job submit`` runs driven from elsewhere).
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
        )
        .remote(cfg)
    )
    existing = ray.get(handle.config.remote())
    if existing != cfg:
        log.warning("coordinator %r already exists with a different config; using it as is: %s", name, existing)
    return handle


class CoordinatorClient:
    """A training worker's view of the coordinator: one per rank, created once per run.

    Every call that waits does so for at most ``timeout_s`` and then raises
    ``CoordinatorUnavailable``; the training loop falls back to ``plan_from_gathered``.
    """

    def __init__(self, name: str, namespace: str | None = None, rank: int = 0, timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.name, self.namespace, self.rank, self.timeout_s = name, namespace, rank, timeout_s
        self._handle = None
        self._epoch: int | None = None
        self._requested: dict[int, Any] = {}  # step -> get_plan ObjectRef asked for early
        self.last_wait_s = 0.0
        """Seconds the last ``get_plan`` waited (report it as ``wait_plan_s``)."""

    def _actor(self):
        if self._handle is None:
            import ray

            try:
                self._handle = ray.get_actor(self.name, namespace=self.namespace)
            except ValueError as e:
                raise CoordinatorUnavailable(
                    f"no coordinator actor {self.name!r} in namespace {self.namespace!r}: {e}"
                ) from e
        return self._handle

    def _get(self, ref, what: str):
        """``ray.get`` that turns every way of not getting an answer in time into
        ``CoordinatorUnavailable`` and re-raises the coordinator's own errors."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError as e:
            raise CoordinatorUnavailable(f"rank {self.rank}: {what}: no answer within {self.timeout_s:g}s") from e
        except RayActorError as e:
            self._handle = None  # look it up again next time: it may have been recreated
            raise CoordinatorUnavailable(f"rank {self.rank}: {what}: coordinator actor unreachable: {e}") from e
        except RayTaskError as e:
            if isinstance(e.cause, PlanTimeout):
                raise CoordinatorUnavailable(f"rank {self.rank}: {what}: {e.cause}") from e
            raise e.cause from e

    def _current_epoch(self) -> int:
        # Learned once per client, so a client created mid-run tags submissions correctly.
        if self._epoch is None:
            self._epoch = int(self._get(self._actor().epoch.remote(), "epoch"))
        return self._epoch

    def submit_async(
        self, step: int, seq_lens: Sequence[int], sample_ids: Sequence[int], exhausted: bool = False
    ) -> None:
        """Send this rank's sequences for ``step`` without waiting. Fire and forget: if the
        actor is away, nothing is sent and ``get_plan`` reports it (the loop then plans
        locally and sends again)."""
        try:
            epoch = self._current_epoch()
            self._actor().submit.remote(
                int(step), self.rank, [int(x) for x in seq_lens], [int(x) for x in sample_ids], bool(exhausted), epoch
            )
        except CoordinatorUnavailable:
            pass

    def request_plan(self, step: int) -> None:
        """Ask for ``step``'s plan now, without waiting, so that ``get_plan(step)`` later
        finds it already delivered (one round trip off the critical path)."""
        if step not in self._requested:
            try:
                self._requested[int(step)] = self._actor().get_plan.remote(int(step), self.rank, 0.9 * self.timeout_s)
            except CoordinatorUnavailable:
                pass  # get_plan will ask again and report it

    def get_plan(self, step: int) -> tuple[BalancePlan | None, bool]:
        """``(plan, epoch_done)`` for ``step``; ``CoordinatorUnavailable`` after ``timeout_s``."""
        t0 = time.perf_counter()
        # The actor gives up a little earlier than we do, so a step that never completes
        # comes back with its message (which ranks are missing) rather than a bare timeout.
        ref = self._requested.pop(int(step), None)
        for old in [s for s in self._requested if s < step]:
            self._requested.pop(old)
        if ref is None:
            ref = self._actor().get_plan.remote(int(step), self.rank, 0.9 * self.timeout_s)
        plan, done = self._get(ref, f"plan for step {step}")
        if done:
            # The next epoch's submissions must not be mistaken for stale prefetches.
            self._epoch = self._current_epoch() + 1
        self.last_wait_s = time.perf_counter() - t0
        return plan, done

    def forget_requests(self) -> None:
        """Drop plans asked for early (after an outage they point at a dead actor)."""
        self._requested.clear()

    def record_external(self, step: int, sample_ids: Sequence[int], home_ranks: Sequence[int]) -> None:
        """Rank 0: ledger rows of a step planned locally while the coordinator was away."""
        self._get(
            self._actor().record_external.remote(int(step), [int(i) for i in sample_ids], [int(h) for h in home_ranks]),
            f"ledger rows of step {step}",
        )

    def commit_async(self, step: int) -> None:
        """Rank 0, after the optimizer step: steps ``<= step`` are trained. Commits are
        cumulative, so one lost with an unreachable actor is covered by the next."""
        try:
            self._actor().commit_step.remote(int(step))
        except CoordinatorUnavailable:
            pass

    def commit(self, step: int) -> None:
        """Like ``commit_async`` but waits: before reading ``state_dict`` for a checkpoint."""
        self._get(self._actor().commit_step.remote(int(step)), f"commit of step {step}")

    def report_timing_async(self, step: int, compute_s: float, comm_s: float, wait_plan_s: float) -> None:
        try:
            self._actor().report_timing.remote(int(step), self.rank, float(compute_s), float(comm_s), float(wait_plan_s))
        except CoordinatorUnavailable:
            pass  # statistics only

    def begin_run(self, world_size: int, resume_step: int | None = None, state: dict | None = None) -> Topology:
        """Rank 0 (or the driver), before any submit; see ``BalanceCoordinator.begin_run``."""
        topo = self._get(self._actor().begin_run.remote(world_size, resume_step, state), "begin_run")
        self._epoch = None
        return topo

    def topology(self) -> Topology | None:
        return self._get(self._actor().topology.remote(), "topology")

    def state_dict(self) -> dict:
        return self._get(self._actor().state_dict.remote(), "state_dict")
