"""The per-step protocol: submissions in, one plan per step out, the same to every rank.

Step protocol (rank ``r`` of a world of ``W`` ranks, step ``t``, epoch ``e``)
------------------------------------------------------------------------------
1. ``submit(t, r, seq_lens, sample_ids, exhausted, e)``. Workers send step ``t+1``'s
   metadata while step ``t`` computes, so planning stays off the critical path.
   Submissions are accepted in any order, across steps and ranks; an identical resend is
   ignored, a different one for the same ``(t, r)`` fails the step for every rank. A
   submission the coordinator rejects raises ``StepFailed`` to its sender too
   (``CoordinatorClient`` checks the answer of every submission before it asks for that
   step's plan): a rejection is never only a log line.
2. When all ``W`` ranks have submitted ``t``, the coordinator plans once (one
   ``plan_from_gathered`` call over the world; it plans each balance group on its own) and
   caches the plan. ``get_plan(t, r, epoch=e)`` waits for that and returns ``(plan,
   epoch_done)``, the same plan to every rank. If the step cannot be planned (bad
   submission, solver error) every rank's ``get_plan(t)`` raises ``StepFailed``: all ranks
   fail the same step instead of some of them hanging in a collective.
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
collective hangs. The epoch counter then goes up by one.

That end step trains nothing, so it does not use up a step number: the trainer's step
counter counts trained steps, and the next epoch's first step has the same number as
the end step of the one before. Steps are therefore told apart by ``(step, epoch)``:
the end step is recorded in ``epoch_ends`` and dropped from the steps in flight, so
the next epoch's submissions for that number start a new step, while a rank still
asking for the end step with its old epoch is answered from ``epoch_ends``. Prefetched
submissions for steps after the end, sent before their senders learned of it, carry the
old epoch and are dropped as stale. (A next epoch that starts at a later step number is
accepted too.)

This module holds steps 1, 2 and the epoch end; committing (3) is the ledger's
(``ledger.py``), timings (4) the statistics' (``stats.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from knapray.planning import BalancePlan, Topology, WorkloadModel, plan_balance
from knapray.planning.costs.cost import CostModel
from knapray.planning.search.overlap import overlap_plan, step_candidates
from knapray.planning.search.pertopo import plan_step

log = logging.getLogger(__name__)


class PlanTimeout(TimeoutError):
    """No plan for a step within the timeout; the message names the ranks still missing."""


class StepFailed(ValueError):
    """A step can never be planned (bad submission or solver error); raised to every rank."""


def plan_from_gathered(
    all_lens_per_rank: Sequence[Sequence[int]],
    topology: Topology,
    model: WorkloadModel | CostModel | None = None,
    solver: str = "knapray",
    max_tokens_per_gpu: int | None = None,
    per_step_node: int | None = None,
    groups: Sequence[int] | None = None,
    overlap: bool = False,
) -> BalancePlan:
    """Plan one step from every rank's lengths, in rank order.

    The coordinator and the training loop's local fallback (after an all-gather) both call
    this, so the same lengths give the same plan on either path. Lengths may come as
    lists, numpy arrays or tensors; they are normalized to int64 first.

    ``max_tokens_per_gpu``: the run's memory budget (``data.max_tokens_per_gpu``): no rank
    is routed more tokens. A step that no assignment fits (more tokens than the world
    holds, or a bin packing the solver cannot close) is planned without the budget and
    logged as a warning naming the step's busiest rank: an out-of-memory risk the user
    sees, rather than a run that stops on one unlucky draw.

    ``per_step_node``: ranks per node of a run whose steps choose their own bags (rule
    ``"per-step"``, ``knapray.planning.search.rules.per_step_node``): the step is planned on the
    partition of every node into aligned blocks that ``plan_step`` predicts fastest, with
    ``topology`` (the run's static one) among the candidates; the plan's ``topology`` says
    which. Needs a ``CostModel``. None: the step is planned on ``topology``.

    ``groups``: only these balance groups of ``topology`` are planned (``plan_balance``);
    not with ``per_step_node``.

    ``overlap`` (``balance.overlap``, a ``CostModel``): the plan above is compared with the
    best overlapping plan (``knapray.planning.search.overlap``) on the topologies whose groups the
    run has (``step_candidates``), within the same memory budget, and the faster kept. Not
    with ``groups`` (a dry run of one rank plans its own group alone).
    """
    lens = [np.asarray(list(map(int, rank_lens)), dtype=np.int64) for rank_lens in all_lens_per_rank]
    model = model or WorkloadModel()
    if per_step_node is not None and not isinstance(model, CostModel):
        raise ValueError("a topology chosen every step needs the cost model (balance.planner: cost), "
                         f"got {type(model).__name__}")

    def plan_on(budget: int | None) -> BalancePlan:
        if per_step_node is None:
            plan = plan_balance(lens, topology, model, solver=solver, max_tokens_per_gpu=budget, groups=groups)
        else:
            plan = plan_step(lens, model, gpus_per_node=per_step_node, base=topology, solver=solver,
                             max_tokens_per_gpu=budget).plan
        if overlap and groups is None and isinstance(model, CostModel):
            over = overlap_plan(lens, model, step_candidates(lens, model, topology, plan.topology, per_step_node),
                                max_tokens_per_gpu=budget, plain=plan)
            if over is not None and over.predicted_step_time < plan.predicted_step_time:
                return over
        return plan

    if max_tokens_per_gpu:
        try:
            return plan_on(max_tokens_per_gpu)
        except ValueError as e:
            plan = plan_on(None)
            log.warning("memory budget of %d tokens per GPU does not fit this step (%s): planned without it, "
                        "busiest rank gets %d tokens", max_tokens_per_gpu, e, int(plan.rank_tokens.max()))
            return plan
    return plan_on(None)


def is_epoch_done(all_lens_per_rank: Sequence[Sequence[int]], exhausted_per_rank: Sequence[bool]) -> bool:
    """True when every rank is out of data and has no sequence for the step."""
    return all(exhausted_per_rank) and all(len(lens) == 0 for lens in all_lens_per_rank)


@dataclass(frozen=True, slots=True)
class Submission:
    seq_lens: tuple[int, ...]
    sample_ids: tuple[int, ...]
    exhausted: bool


@dataclass(slots=True)
class StepState:
    step: int
    epoch: int | None = None
    """Epoch of the step's submissions (None until the first arrives)."""
    inbox: dict[int, Submission] = field(default_factory=dict)
    event: asyncio.Event | None = None
    decided: bool = False
    plan: BalancePlan | None = None
    epoch_done: bool = False
    error: str | None = None

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()

    def lengths(self) -> list[list[int]]:
        """(W, n_r) every rank's sequence lengths, in rank order."""
        return [list(self.inbox[r].seq_lens) for r in range(len(self.inbox))]

    def sample_ids(self) -> np.ndarray:
        """(N,) every rank's sample ids, in rank order (the plan's sequence order)."""
        return np.fromiter((i for r in range(len(self.inbox)) for i in self.inbox[r].sample_ids), dtype=np.int64)


class StepProtocol:
    """Submissions, plans and epoch ends of the steps in flight.

    ``plan(lengths_per_rank)`` plans a complete step (the coordinator's live model and
    topology). Not thread-safe: it runs on one asyncio event loop, where only ``get_plan``
    ever suspends.
    """

    def __init__(self, keep_steps: int, plan: Callable[[list[list[int]]], BalancePlan]) -> None:
        self._keep_steps = keep_steps
        self._plan = plan
        self._steps: dict[int, StepState] = {}
        self.world_size: int | None = None
        self.evicted_through = -1
        """Steps ``<=`` this are no longer held (evicted, committed or cut back)."""
        self.epoch = 0
        """Epochs finished so far (the epoch new submissions belong to)."""
        self.epoch_ends: dict[int, int] = {}
        """Epoch -> the step at which every rank was found exhausted."""
        self.stale_submissions = 0

    def submit(
        self,
        step: int,
        rank: int,
        seq_lens: Sequence[int],
        sample_ids: Sequence[int],
        exhausted: bool,
        epoch: int | None,
        committed_step: int,
    ) -> StepState | None:
        """Record rank ``rank``'s sequences for ``step``; plan once every rank has sent.

        Returns the step if this submission completed it (planned, or the epoch ended), else
        None. ``epoch``: the sender's epoch (None: the current one); a submission from an
        epoch that already ended is a leftover prefetch and is dropped. Raises
        ``StepFailed`` (and fails the step for every rank) on a malformed or conflicting
        submission.
        """
        step = check_index("step", step)
        if epoch is None:
            epoch = self.epoch
        epoch = check_index("epoch", epoch)
        end = self.epoch_ends.get(epoch)
        if end is not None and step >= end:
            if step > end:  # a prefetch sent before its sender learned of the end
                self.stale_submissions += 1
                return None
            if exhausted and not len(seq_lens):
                return None  # the end step sent again (a resend, or a rank resumed just before it)
            raise StepFailed(f"step {step}: rank {rank} submitted data for epoch {epoch}, which ended at this "
                             "step when every rank was out of data")
        if epoch < self.epoch and end is None:
            self.stale_submissions += 1  # an epoch whose end this coordinator no longer knows
            return None
        if epoch > self.epoch:
            # Only a coordinator that lost its state (actor restart) can be behind its ranks.
            log.warning("rank %s is in epoch %d, coordinator in %d: adopting it", rank, epoch, self.epoch)
            self.epoch = epoch
        if step <= committed_step:
            raise StepFailed(
                f"rank {rank} submitted step {step}, but steps <= {committed_step} are already "
                "committed; step numbers must keep increasing (across epochs too)"
            )
        st = self._step(step)
        if st.error is not None:
            raise StepFailed(st.error)
        if st.decided:
            if st.inbox.get(rank) == _submission_or_none(seq_lens, sample_ids, exhausted):
                return None  # a resend of what was planned
            # Fail the step for every rank still to ask for it; the ranks that already
            # have its plan learn of it from their trainer's per-step agreement.
            self._fail(st, f"step {step}: rank {rank} submitted different data after the step was planned")
        if st.epoch is not None and st.epoch != epoch:
            self._fail(st, f"step {step}: rank {rank} submitted it for epoch {epoch}, other ranks for epoch {st.epoch}")
        world = self.require_world()
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world:
            self._fail(st, f"step {step}: rank {rank!r} is not in [0, {world})")
        lens, ids = _int_tuple(seq_lens), _int_tuple(sample_ids)
        if lens is None or ids is None:
            self._fail(st, f"step {step}, rank {rank}: seq_lens and sample_ids must be flat lists of integers")
        if len(lens) != len(ids):
            self._fail(st, f"step {step}, rank {rank}: {len(lens)} sequence lengths but {len(ids)} sample ids")
        if exhausted and lens:
            self._fail(
                st,
                f"step {step}, rank {rank}: exhausted=True means no data left, but {len(lens)} "
                "sequences came with it; send the last batch with exhausted=False",
            )
        sub = Submission(lens, ids, bool(exhausted))
        old = st.inbox.get(int(rank))
        if old is not None and old != sub:
            self._fail(st, f"step {step}: rank {rank} submitted twice with different data")
        st.inbox[int(rank)] = sub
        if st.epoch is None:
            st.epoch = epoch
        if len(st.inbox) == world:
            return self._decide(st)
        return None

    async def get_plan(self, step: int, rank: int, timeout_s: float | None = None,
                       epoch: int | None = None) -> tuple[BalancePlan | None, bool]:
        """``(plan, epoch_done)`` for ``step``, once every rank has submitted it.

        Every rank gets the same plan object; ``(None, True)`` ends the epoch. ``epoch``:
        the asking rank's epoch; a rank asking for the step its epoch ended at gets
        ``(None, True)`` at once, even after the next epoch reused the step number (None:
        the end step until a new epoch reuses its number; every trainer passes it). Raises
        ``PlanTimeout`` after ``timeout_s`` (naming the ranks still missing) and
        ``StepFailed`` if the step can never be planned.
        """
        step = check_index("step", step)
        world = self.require_world()
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        if epoch is None:
            # No epoch given: an end step no new epoch has reused yet is still the end.
            if step not in self._steps and step in self.epoch_ends.values():
                return None, True
        else:
            end = self.epoch_ends.get(check_index("epoch", epoch))
            if end is not None and step >= end:
                if step == end:
                    return None, True
                raise StepFailed(f"step {step} is after the end of epoch {epoch} (at step {end}): no plan")
        st = self._steps.get(step)
        if st is None:
            if step <= self.evicted_through:
                raise StepFailed(
                    f"step {step} is no longer held (plans are kept for the last "
                    f"{self._keep_steps} planned steps, and a run restart drops all)"
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

    def require_world(self) -> int:
        if self.world_size is None:
            raise StepFailed("the coordinator has no world size yet: call begin_run(world_size) first")
        return self.world_size

    # ---- changes from outside the protocol -----------------------------------------------

    def drop_unplanned_through(self, step: int) -> list[int]:
        """Steps ``<= step`` never planned here but committed: the ranks planned them
        locally (the coordinator was away). They are dropped; returns their numbers."""
        unplanned = sorted(t for t, s in self._steps.items() if t <= step and not s.decided)
        if unplanned:
            self._discard(lambda s: s.step <= step and not s.decided, f"committed at step {step} without a plan")
        return unplanned

    def forget(self, step: int) -> None:
        """``step`` was planned elsewhere and recorded: never plan it here."""
        self._steps.pop(step, None)
        self.evicted_through = max(self.evicted_through, step)

    def hold_back(self, step: int) -> None:
        """Plans of steps ``<= step`` are gone (restored in-flight steps after a restart)."""
        self.evicted_through = max(self.evicted_through, step)

    def cut(self, step: int) -> None:
        """Back to a checkpoint at ``step``: every in-flight step is dropped, epoch ends after
        ``step + 1`` are forgotten and the epoch counter follows the ones that remain. (An
        epoch that ended at ``step + 1`` had all its samples in steps ``<= step``, which the
        checkpoint covers: a checkpoint taken after that end resumes in the next epoch.)"""
        self.epoch_ends = {e: t for e, t in self.epoch_ends.items() if t <= step + 1}
        self.epoch = max(self.epoch_ends, default=-1) + 1
        self._discard(lambda s: True, f"truncated to step {step}")
        self.evicted_through = step

    def restart(self, reason: str, epoch: int = 0, epoch_ends: dict[int, int] | None = None,
                evicted_through: int = -1) -> None:
        """Drop every in-flight step and take the given epoch state (a new run, or a load)."""
        self._discard(lambda s: True, reason)
        self.epoch, self.epoch_ends = epoch, dict(epoch_ends or {})
        self.evicted_through = evicted_through

    # ---- internals ------------------------------------------------------------------------

    def _step(self, step: int) -> StepState:
        st = self._steps.get(step)
        if st is None:
            st = self._steps[step] = StepState(step)
        return st

    def _fail(self, st: StepState, message: str) -> None:
        """Fail ``st`` for every rank (their ``get_plan`` raises) and raise to the caller."""
        if st.error is None:
            st.error = message
            st.wake()
        raise StepFailed(message)

    def _decide(self, st: StepState) -> StepState:
        lens = st.lengths()
        if is_epoch_done(lens, [s.exhausted for s in st.inbox.values()]):
            st.epoch_done = True
            st.decided = True
            st.wake()
            self._end_epoch(st)
            return st
        try:
            plan = self._plan(lens)
        except ValueError as e:
            self._fail(st, f"step {st.step}: planning failed: {e}")
        st.plan, st.decided = plan, True
        st.wake()
        self._evict()
        return st

    def _evict(self) -> None:
        decided = sorted(t for t, s in self._steps.items() if s.decided)
        for t in decided[: -self._keep_steps]:
            del self._steps[t]
            self.evicted_through = max(self.evicted_through, t)

    def _end_epoch(self, st: StepState) -> None:
        epoch, step = st.epoch, st.step
        # Ranks prefetch, so the all-exhausted prefetches for the step after the end can
        # complete before the end step itself does; the earliest such step is the end.
        # The end step trains nothing: the next epoch reuses its number, as a new step.
        self._steps.pop(step, None)
        if epoch in self.epoch_ends and self.epoch_ends[epoch] < step:
            return
        self.epoch_ends[epoch] = step
        self.epoch = max(self.epoch, epoch + 1)
        # Steps after the end hold only prefetches sent before the senders learned of it.
        self._discard(
            lambda s: s.step > step and (s.epoch is None or s.epoch <= epoch),
            f"epoch {epoch} ended at step {step}",
        )
        log.info("epoch %d ended at step %d", epoch, step)

    def _discard(self, which: Callable[[StepState], bool], reason: str) -> None:
        for st in [s for s in self._steps.values() if which(s)]:
            del self._steps[st.step]
            if not st.decided and st.error is None:
                st.error = f"step {st.step} was discarded: {reason}"
                st.wake()


def check_index(name: str, value: Any, allow_minus_one: bool = False) -> int:
    lo = -1 if allow_minus_one else 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _int_tuple(values: Sequence[int]) -> tuple[int, ...] | None:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        return None
    return tuple(int(v) for v in arr.tolist())


def _submission_or_none(seq_lens: Sequence[int], sample_ids: Sequence[int], exhausted: bool) -> Submission | None:
    lens, ids = _int_tuple(seq_lens), _int_tuple(sample_ids)
    return None if lens is None or ids is None else Submission(lens, ids, bool(exhausted))
