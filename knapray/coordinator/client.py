"""``CoordinatorClient``: a training worker's view of the coordinator actor."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from knapray.planning import BalancePlan, Topology

from .errors import CoordinatorUnavailable
from .steps import PlanTimeout
from .wire import unpack

_BULK_TIMEOUT_S = 600.0
"""How long whole-ledger calls may take (ten million rows: seconds, not the plan timeout)."""


RECENT_TIMINGS = 8
"""Timing reports a client holds while it has nothing to submit (older ones are dropped)."""


class CoordinatorClient:
    """A training worker's view of the coordinator: one per rank, created once per run.

    Every call that waits does so for at most ``timeout_s`` and then raises
    ``CoordinatorUnavailable``; the training loop falls back to ``plan_from_gathered``.
    """

    def __init__(self, name: str, namespace: str | None = None, rank: int = 0, timeout_s: float = 30.0,
                 node_ranks: int = 1) -> None:
        """``node_ranks``: ranks of the run on this rank's node (this one included). With
        more than one, submissions go through the node's ``NodeRelay``, which sends the
        coordinator one call per node and step."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if node_ranks < 1:
            raise ValueError(f"node_ranks must be >= 1, got {node_ranks}")
        self.name, self.namespace, self.rank, self.timeout_s = name, namespace, rank, timeout_s
        self.node_ranks = int(node_ranks)
        self._handle = None
        self._relay_handle = None
        self._epoch: int | None = None
        self._requested: dict[int, Any] = {}  # step -> ObjectRef of (plan_ref, epoch_done), asked for early
        self._timings: list[tuple[int, int, float, float, float]] = []  # sent with the next exchange
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

    def _relay(self):
        """This node's relay (created by the first rank of the node that asks)."""
        if self._relay_handle is None:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            from .actor import max_concurrency_for
            from .relay import NodeRelay

            node = ray.get_runtime_context().get_node_id()
            self._relay_handle = ray.remote(NodeRelay).options(
                name=f"{self.name}-relay-{node}", namespace=self.namespace, get_if_exists=True, num_cpus=0,
                max_concurrency=max_concurrency_for(self.node_ranks),
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(self.name, self.namespace)
        return self._relay_handle

    def _get(self, ref, what: str, timeout_s: float | None = None):
        """``ray.get`` that turns every way of not getting an answer in time into
        ``CoordinatorUnavailable`` and re-raises the coordinator's own errors."""
        import ray
        from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=timeout_s or self.timeout_s)
        except GetTimeoutError as e:
            raise CoordinatorUnavailable(
                f"rank {self.rank}: {what}: no answer within {timeout_s or self.timeout_s:g}s"
            ) from e
        except (RayActorError, ObjectLostError) as e:
            # ObjectLostError: a plan put by an actor that died since (its owner) is gone with it.
            self._handle = self._relay_handle = None  # look them up again next time: they may have been recreated
            raise CoordinatorUnavailable(f"rank {self.rank}: {what}: coordinator actor unreachable: {e}") from e
        except RayTaskError as e:
            if isinstance(e.cause, PlanTimeout):
                raise CoordinatorUnavailable(f"rank {self.rank}: {what}: {e.cause}") from e
            raise e.cause from e

    def _current_epoch(self) -> int:
        # The trainer says which epoch it is in (``set_epoch``); a client used without it
        # learns the coordinator's once and follows the epoch ends it is told of.
        if self._epoch is None:
            self._epoch = int(self._get(self._actor().epoch.remote(), "epoch"))
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch this rank trains now: every submission and plan request carries it,
        so that the coordinator tells a new epoch's steps from an ended one's. Plans asked
        for early and submissions of another epoch are forgotten."""
        if epoch != self._epoch:
            self._requested.clear()
        self._epoch = int(epoch)

    def submit_async(
        self, step: int, seq_lens: Sequence[int], sample_ids: Sequence[int], exhausted: bool = False
    ) -> None:
        """Send this rank's sequences for ``step`` without waiting, with the timing reports
        since the last call (one actor call per rank and step: to the node's relay when
        the node has several ranks, which forwards one call per node). The same call asks
        for the step's plan: ``get_plan(step)`` collects the answer, and raises the coordinator's
        ``StepFailed`` if it rejected the submission. If the actor is away, nothing is sent
        and ``get_plan`` reports it (the loop then plans locally and sends again)."""
        try:
            epoch = self._current_epoch()
            sub = (self.rank, [int(x) for x in seq_lens], [int(x) for x in sample_ids], bool(exhausted))
            if self.node_ranks > 1:
                self._actor()  # no coordinator, no relay: reported by get_plan as before
                self._requested[int(step)] = self._relay().exchange.remote(
                    int(step), epoch, sub, self._timings, 0.9 * self.timeout_s, self.node_ranks)
            else:
                self._requested[int(step)] = self._actor().exchange.remote(
                    int(step), epoch, [sub], self._timings, 0.9 * self.timeout_s)
            self._timings = []
        except CoordinatorUnavailable:
            pass

    def request_plan(self, step: int) -> None:
        """Ask for ``step``'s plan now, without waiting, unless this rank's submission of it
        already did, so that ``get_plan(step)`` later finds it delivered."""
        if step not in self._requested:
            try:
                epoch = self._current_epoch()
                self._requested[int(step)] = self._actor().get_plan.remote(
                    int(step), self.rank, 0.9 * self.timeout_s, epoch)
            except CoordinatorUnavailable:
                pass  # get_plan will ask again and report it

    def get_plan(self, step: int) -> tuple[BalancePlan | None, bool]:
        """``(plan, epoch_done)`` for ``step``; ``CoordinatorUnavailable`` after ``timeout_s``,
        ``StepFailed`` if the coordinator rejected this rank's submission for ``step`` or
        failed the step for every rank. The plan is read from the object store, where the
        coordinator put it once for every rank."""
        t0 = time.perf_counter()
        step = int(step)
        # The actor gives up a little earlier than we do, so a step that never completes
        # comes back with its message (which ranks are missing) rather than a bare timeout.
        ref = self._requested.pop(step, None)
        for old in [s for s in self._requested if s < step]:
            self._requested.pop(old)
        if ref is None:
            ref = self._actor().get_plan.remote(step, self.rank, 0.9 * self.timeout_s, self._current_epoch())
        plan_ref, done = self._get(ref, f"plan for step {step}")
        left = max(self.timeout_s - (time.perf_counter() - t0), 0.1 * self.timeout_s)
        plan = None if plan_ref is None else unpack(self._get(plan_ref, f"plan for step {step} (object store)", left))
        if done:
            # The next epoch's steps start afresh (its first one reuses this step number).
            self.set_epoch(self._current_epoch() + 1)
        self.last_wait_s = time.perf_counter() - t0
        return plan, done

    def forget_requests(self) -> None:
        """Drop plans asked for early (after an outage they point at a dead actor; the
        loop sends the next step again)."""
        self._requested.clear()

    def record_external(self, step: int, sample_ids: Sequence[int], home_ranks: Sequence[int],
                        epoch: int | None = None, expert: int = 0) -> None:
        """Rank 0: ledger rows of a step planned locally while the coordinator was away
        (trained by ``expert``)."""
        self._get(
            self._actor().record_external.remote(int(step), [int(i) for i in sample_ids], [int(h) for h in home_ranks],
                                                 None if epoch is None else int(epoch), int(expert)),
            f"ledger rows of step {step}",
        )

    def commit_async(self, step: int, experts: dict[int, int] | None = None) -> None:
        """Rank 0, after the optimizer step: steps ``<= step`` are trained (``experts``:
        step -> the expert that trained it, a run of two experts' recent steps). Commits are
        cumulative, so one lost with an unreachable actor is covered by the next."""
        try:
            self._actor().commit_step.remote(int(step), experts or None)
        except CoordinatorUnavailable:
            pass

    def commit(self, step: int, experts: dict[int, int] | None = None) -> None:
        """Like ``commit_async`` but waits: before reading ``state_dict`` for a checkpoint."""
        self._get(self._actor().commit_step.remote(int(step), experts or None), f"commit of step {step}")

    def report_timing_async(self, step: int, compute_s: float, comm_s: float, wait_plan_s: float) -> None:
        """Measured seconds of this rank's ``step``: sent with its next submission (no call
        of its own; statistics only, so reports still held when a run ends are dropped)."""
        self._timings.append((int(step), self.rank, float(compute_s), float(comm_s), float(wait_plan_s)))
        del self._timings[:-RECENT_TIMINGS]

    def begin_run(self, world_size: int, resume_step: int | None = None, state: dict | None = None,
                  node_sizes: Sequence[int] | None = None) -> Topology:
        """Rank 0 (or the driver), before any submit; see ``BalanceCoordinator.begin_run``."""
        nodes = None if node_sizes is None else [int(n) for n in node_sizes]
        topo = self._get(self._actor().begin_run.remote(world_size, resume_step, state, nodes), "begin_run")
        self._epoch = None
        return topo

    def topology(self) -> Topology | None:
        return self._get(self._actor().topology.remote(), "topology")

    def state_dict(self) -> dict:
        """What a checkpoint carries: the ledger's position and the epoch state, a few
        numbers (``BalanceCoordinator.state_dict``); hand it back to ``begin_run`` on resume.
        Call ``commit(step)`` first so that it covers the checkpoint's step."""
        return self._get(self._actor().state_dict.remote(), "state_dict")

    def ledger(self) -> dict[str, np.ndarray]:
        """Every committed row as columns ``step, sample_id, home_rank, attempt, epoch``
        (through the object store: for small ledgers; see ``write_ledger_jsonl``)."""
        return self._get(self._actor().ledger_columns.remote(), "ledger", _BULK_TIMEOUT_S)

    def epoch_sample_ids(self, epoch: int) -> np.ndarray:
        """(n,) sample ids committed in ``epoch``, each once."""
        return self._get(self._actor().epoch_sample_ids.remote(int(epoch)), f"sample ids of epoch {epoch}",
                         _BULK_TIMEOUT_S)

    def write_ledger_jsonl(self, path: str) -> int:
        """The actor writes ``ledger.jsonl`` at ``path`` (on its node: use a shared run
        directory); returns the number of rows. Nothing crosses the object store."""
        return self._get(self._actor().write_ledger_jsonl.remote(str(path)), f"ledger.jsonl at {path}",
                         _BULK_TIMEOUT_S)
