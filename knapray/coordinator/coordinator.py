"""``BalanceCoordinator``: the step protocol, the ledger and the statistics, composed.

It holds all of the coordinator's logic and runs without Ray (tests drive it with
``asyncio``); ``actor.py`` wraps it in a named async actor and ``client.py`` is what a
training worker calls. The protocol itself is described in ``steps.py``.

(Re)start
---------
Before any rank submits, rank 0 (or the driver) calls ``begin_run(world_size,
resume_step, state)`` and waits for it, then the ranks pass a barrier. A fresh run
(``resume_step=None``) starts a new, empty ledger. A resumed run loads the checkpoint's
``state`` (``state_dict()``: the ledger's *position*, not its rows; the live ledger,
restored from its files if the actor restarted, is checked to still hold everything the
checkpoint covers), then ``truncate(resume_step)``: later rows and every in-flight step
are dropped and the attempt counter goes up, so samples after the checkpoint are trained
again and recorded with the new attempt. The topology is re-planned for the new world
size by the configured rule (``knapray.planning.search.rules``) and the change is logged.

Persistence
-----------
With ``state_dir`` the ledger keeps its journal and snapshots there (``ledger.py``,
``store.py``); ``run.json`` holds the small run state (world size, epoch, epoch ends and
the planned but uncommitted steps), rewritten after every plan, so a commit lost with a
dying actor is not a lost step: the restarted actor reloads those steps and the next,
cumulative commit covers them. ``stats.json`` is rewritten every ``STATS_EVERY`` plans and
at every run start. A new ``BalanceCoordinator`` on the same directory (Ray restarting
the actor) restores all of it.

Fallback
--------
If the actor cannot be reached, ``CoordinatorClient.get_plan`` raises
``CoordinatorUnavailable`` within its timeout; the training loop then all-gathers the
lengths and calls ``plan_from_gathered`` itself, the same pure function the coordinator
uses, so both paths give identical plans. Rank 0 hands the rows of such steps to
``record_external`` once the coordinator is back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from knapray.planning import BalancePlan, Topology, WorkloadModel
from knapray.planning.costs.cost import CostModel
from knapray.planning.search.rules import PER_STEP, per_step_node, planning_node, resolve_rule

from .config import CoordinatorConfig, make_live_fit, make_planning_model
from .ledger import Ledger
from .stats import RunningStats
from .steps import StepProtocol, check_index, plan_from_gathered
from .store import LedgerFileError, StateStore

log = logging.getLogger(__name__)

STATE_VERSION = 2
"""``state_dict()`` format: 2 = the ledger position (1, which carried every row, is refused)."""
STATS_EVERY = 256
"""Plans between rewrites of ``stats.json`` (statistics only: a restart may lose some)."""


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
        self._node_sizes: tuple[int, ...] | None = None
        """Ranks per node where the run's workers really are (``begin_run``); None: unknown."""
        self._topology: Topology | None = None
        self._steps = StepProtocol(self.config.keep_steps, self._plan)
        self._stats = RunningStats(self.config.history_steps, self.config.ema_alpha, live=make_live_fit(self.config))
        self._store = StateStore(self.config.state_dir) if self.config.state_dir else None
        self.ledger = Ledger(self._store, snapshot_every=self.config.snapshot_every)
        if self._store is not None:
            self._restore_stats()
        if self.config.world_size is not None:
            self._set_world(self.config.world_size)
        if self._store is not None:
            self._restore_run_state()

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
        return self._steps.epoch

    @property
    def attempt(self) -> int:
        """Restarts from a checkpoint so far; recorded with every ledger row."""
        return self.ledger.attempt

    @property
    def committed_step(self) -> int:
        return self.ledger.committed_step

    @property
    def bytes_written(self) -> int:
        """Bytes written to ``state_dir`` so far (journal, snapshots, JSON files)."""
        return 0 if self._store is None else self._store.bytes_written

    # ---- step protocol (see steps.py) ---------------------------------------------------

    def submit(
        self,
        step: int,
        rank: int,
        seq_lens: Sequence[int],
        sample_ids: Sequence[int],
        exhausted: bool = False,
        epoch: int | None = None,
    ) -> None:
        """Record rank ``rank``'s sequences for ``step``; plan once every rank has sent
        (``StepProtocol.submit``). A planned step's rows are staged in the ledger."""
        st = self._steps.submit(step, rank, seq_lens, sample_ids, exhausted, epoch, self.ledger.committed_step)
        if st is None:
            return
        if st.plan is not None:
            self.ledger.stage(st.step, st.epoch, st.sample_ids(), st.plan.home_rank)
            self._stats.record_plan(st.step, st.plan, st.lengths())
            if self._stats.steps_planned % STATS_EVERY == 0:
                self._save_stats()
        self._save_run_state()

    async def get_plan(self, step: int, rank: int, timeout_s: float | None = None,
                       epoch: int | None = None) -> tuple[BalancePlan | None, bool]:
        """``(plan, epoch_done)`` for ``step`` of ``epoch`` once every rank has submitted it
        (``StepProtocol.get_plan``)."""
        return await self._steps.get_plan(step, rank, timeout_s, epoch)

    def is_ready(self, step: int) -> bool:
        return self._steps.is_ready(step)

    def _plan(self, lens: list[list[int]]) -> BalancePlan:
        """One step's plan: on the run's topology, or (rule ``"per-step"``) on the step's own
        aligned blocks with it as the base; the local fallback calls the same function."""
        c = self.config
        node = per_step_node(c.balance.topology, self._world_size,
                             planning_node(self._world_size, c.gpus_per_node, self._node_sizes))
        return plan_from_gathered(lens, self._topology, self._live_model(), c.balance.solver, c.max_tokens_per_gpu,
                                  node, overlap=c.balance.overlap)

    def _live_model(self) -> WorkloadModel | CostModel:
        """The cost model re-fitted to the measured per-rank times (``LiveFit``: its
        coefficients and per-rank speeds, so a slow GPU or a straggling node gets less
        work), or, with the live fit off, the configured one. The workload model has no
        speeds."""
        if not isinstance(self.model, CostModel) or self._world_size is None:
            return self.model
        if self._stats.live is None:
            return self.model
        model = self._stats.live.model()
        if model.rank_speed is not None and len(model.rank_speed) != self._world_size:
            model = model.with_rank_speed(None)  # fitted for another world size
        return model

    # ---- ledger -------------------------------------------------------------------------

    def commit_step(self, step: int, experts: Mapping[int, int] | None = None) -> None:
        """Every planned step ``<= step`` has been applied by the optimizer: record its
        samples in the ledger (cumulative, idempotent; fsync'd before this returns).
        ``experts``: step -> the expert that trained it, for a run of two experts (rank 0's
        recent steps; a step not there was trained by expert 0)."""
        step = check_index("step", step, allow_minus_one=True)
        self.ledger.commit_through(step, _experts(experts))
        # Steps still unplanned here were trained from a local fallback plan: their samples
        # never reached the coordinator, so the ledger cannot hold them (``record_external``).
        unplanned = self._steps.drop_unplanned_through(step)
        if unplanned:
            self._stats.unledgered_steps += len(unplanned)
            log.warning("steps %s committed without a coordinator plan: not in the ledger", unplanned)

    def record_external(self, step: int, sample_ids: Sequence[int], home_ranks: Sequence[int],
                        epoch: int | None = None, expert: int = 0) -> None:
        """Ledger rows of a step the ranks planned without the coordinator (it was
        unreachable): committed as they are, with the current attempt. ``epoch``: the
        step's epoch as the ranks knew it (None: the coordinator's epoch bookkeeping);
        ``expert``: the one that trained it."""
        step = check_index("step", step)
        ids = np.asarray(sample_ids, dtype=np.int64)
        home = np.asarray(home_ranks, dtype=np.int64)
        if ids.shape != home.shape or ids.ndim != 1:
            raise ValueError(f"sample_ids and home_ranks must be equal-length lists, got {ids.shape}, {home.shape}")
        epoch = self._epoch_of(step) if epoch is None else check_index("epoch", epoch)
        if self.ledger.add(step, epoch, ids, home, _expert(expert)):
            self._steps.forget(step)

    def _epoch_of(self, step: int) -> int:
        """The epoch ``step`` trained in: the first that ended after it (an epoch's end step
        trains nothing; the next epoch's first step has its number)."""
        ends = self._steps.epoch_ends
        return next((e for e in sorted(ends) if ends[e] > step), self._steps.epoch)

    def truncate(self, step: int) -> None:
        """Cut back to a checkpoint taken at ``step``: it covers steps ``<= step``, so those
        are committed; later rows and every in-flight step are dropped, and the attempt
        counter goes up (samples after ``step`` are trained again, recorded with it)."""
        step = check_index("step", step, allow_minus_one=True)
        self.commit_step(step)
        self.ledger.truncate(step, self.ledger.attempt + 1)
        self._steps.cut(step)
        self._save_run_state()
        log.info("ledger truncated to step %d; attempt %d", step, self.ledger.attempt)

    def ledger_rows(self) -> list[tuple[int, int, int, int]]:
        """``(step, sample_id, home_rank, attempt)`` for every committed sample, by step."""
        return self.ledger.rows_list()

    def ledger_columns(self) -> dict[str, np.ndarray]:
        """Every committed row as int64 columns ``step, sample_id, home_rank, attempt, epoch, expert``, by step."""
        return self.ledger.columns()

    def epoch_sample_ids(self, epoch: int) -> np.ndarray:
        """(n,) sample ids committed in ``epoch`` (each once: cut-back attempts are gone)."""
        return self.ledger.epoch_sample_ids(epoch)

    def write_ledger_jsonl(self, path: str) -> int:
        """Write ``ledger.jsonl`` (one row per line); returns the number of rows."""
        return self.ledger.write_jsonl(path)

    # ---- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a training checkpoint carries: the ledger's position (``Ledger.position``:
        identity, journal record count, committed step, attempt) and the epoch state, a few
        numbers. The rows stay in the ledger's files; see ``begin_run`` for the resume."""
        return {"version": STATE_VERSION, **self.ledger.position(), "epoch": self.epoch,
                "epoch_ends": dict(self._steps.epoch_ends)}

    def load_state_dict(self, state: dict) -> None:
        """Go back to a checkpoint's ``state_dict()``: the ledger is cut back to its
        committed step, in-flight steps are dropped, the epoch state is the checkpoint's.
        The attempt counter never goes back (a live coordinator may be past the
        checkpoint's). If the ledger no longer holds everything the checkpoint covers
        (its files were lost, or it was cut back below it since) that is logged as an
        error: training goes on, and the ledger lacks those rows."""
        version = state.get("version") if isinstance(state, dict) else None
        if version != STATE_VERSION:
            raise ValueError(f"coordinator state version {version!r} is not supported (expected {STATE_VERSION})")
        why = self.ledger.covers(state)
        if why is not None:
            log.error("the coordinator's ledger misses rows the checkpoint at step %s covers: %s",
                      state["committed_step"], why)
        self.ledger.truncate(int(state["committed_step"]), max(self.ledger.attempt, int(state["attempt"])))
        ends = {int(e): int(t) for e, t in state["epoch_ends"].items()}
        self._steps.restart("coordinator state loaded", int(state["epoch"]), ends, self.ledger.committed_step)
        self._save_run_state()

    # ---- runs and topology --------------------------------------------------------------

    def begin_run(self, world_size: int, resume_step: int | None = None, state: dict | None = None,
                  node_sizes: Sequence[int] | None = None) -> Topology:
        """Start a run on ``world_size`` ranks; returns the topology to build groups from.

        ``node_sizes``: ranks per node, in rank order, where the workers really run (the
        trainer gathers them); no bag crosses a node, or ValueError says why none can.

        Fresh (``resume_step=None``): a new, empty ledger; epoch and attempt start over.
        Resumed: ``state`` (the checkpoint's ``state_dict()``) is loaded if given, then the
        ledger is truncated to ``resume_step``. Either way in-flight steps are dropped: call
        this before any rank submits.
        """
        nodes = None if node_sizes is None else tuple(int(n) for n in node_sizes)
        topo = self.topology_for(world_size, nodes)  # a bad world or layout fails before anything changes
        if resume_step is None:
            if state is not None:
                raise ValueError("state given without resume_step: pass the checkpoint's step too")
            self._steps.restart("a new run began")
            self.ledger.reset()
        else:
            if state is not None:
                self.load_state_dict(state)
            self.truncate(resume_step)
        self._set_world(world_size, topo, nodes)
        self._save_run_state()
        self._save_stats()
        return self._topology

    def _set_world(self, world_size: int, topo: Topology | None = None,
                   node_sizes: tuple[int, ...] | None = None) -> None:
        old_topo, old_world = self._topology, self._world_size
        topo = topo or self.topology_for(world_size, node_sizes)
        self._node_sizes = node_sizes
        if self._stats.ranks != world_size:
            self._stats.reset_ranks(world_size)
        self._world_size, self._topology = world_size, topo
        self._steps.world_size = world_size
        if old_topo is None:
            log.info("coordinator topology %s for world size %d (rule %r)", topo, world_size,
                     self.config.balance.topology)
        elif topo != old_topo:
            log.info(
                "coordinator topology changed: %s -> %s (world size %s -> %d, rule %r)",
                old_topo, topo, old_world, world_size, self.config.balance.topology,
            )

    def topology_for(self, world_size: int, node_sizes: Sequence[int] | None = None) -> Topology:
        """The topology for a world of ``world_size`` ranks on nodes of ``node_sizes`` ranks
        (in rank order; None: the config's ``gpus_per_node`` says where nodes are) by the
        configured rule (``knapray.planning.search.rules.resolve_rule``; ``"auto"`` judges by
        recent lengths)."""
        c, rule = self.config, self.config.balance.topology
        choice = resolve_rule(
            rule, world_size, gpus_per_node=c.gpus_per_node, node_sizes=node_sizes,
            history=self._stats.length_history,
            model=self.model, solver=c.balance.solver, auto_tolerance=c.auto_tolerance, history_steps=c.history_steps,
        )
        if rule in ("auto", PER_STEP) or node_sizes is not None:
            log.info("%s topology for world size %d: %s (%s)", rule, world_size, choice.topology, choice.reason)
        return choice.topology

    # ---- timing and statistics ----------------------------------------------------------

    def report_timing(self, step: int, rank: int, compute_s: float, comm_s: float, wait_plan_s: float) -> None:
        """Measured seconds of one rank's step: model compute, communication, waiting for the plan."""
        world = self._steps.require_world()
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        self._stats.report_timing(step, rank, compute_s, comm_s, wait_plan_s)

    def speed_factors(self) -> np.ndarray:
        """(W,) each rank's speed relative to the median rank (``RunningStats.speed_factors``)."""
        self._steps.require_world()
        return self._stats.speed_factors()

    def stats(self) -> dict:
        """JSON-friendly summary of the run, the ledger, recent planning and timing."""
        return {
            "world_size": self._world_size,
            "topology": None if self._topology is None else str(self._topology),
            "epoch": self.epoch,
            "attempt": self.attempt,
            "committed_step": self.committed_step,
            "ledger_rows": self.ledger.rows,
            **self._stats.summary(),
            "stale_submissions": self._steps.stale_submissions,
        }

    # ---- the run state and statistics files -----------------------------------------------

    def _save_run_state(self) -> None:
        if self._store is None:
            return
        self._store.write_json("run.json", {
            "version": 1,
            "ledger_id": self.ledger.ledger_id,
            "cuts": self.ledger.cuts,
            "world_size": self._world_size,
            "node_sizes": None if self._node_sizes is None else list(self._node_sizes),
            "epoch": self.epoch,
            "epoch_ends": {str(e): t for e, t in self._steps.epoch_ends.items()},
            "inflight": [{"step": t, "epoch": e, "sample_ids": ids.tolist(), "home_ranks": home.tolist()}
                         for t, (e, ids, home) in sorted(self.ledger.staged().items())],
        })

    def _restore_run_state(self) -> None:
        """After a restart: epoch state, world size and in-flight steps from ``run.json``."""
        path = os.path.join(self._store.directory, "run.json")
        run = self._store.read_json("run.json")
        if run is None:
            return
        committed = self.ledger.committed_step
        try:
            if run["version"] != 1:
                raise ValueError(f"version {run['version']!r}, expected 1")
            ends = {int(e): int(t) for e, t in run["epoch_ends"].items()}
            # Written after the ledger's last cut? If not (a crash in between), its epochs
            # after the cut and its in-flight steps are from before it.
            current = run["ledger_id"] == self.ledger.ledger_id and run["cuts"] == self.ledger.cuts
            if not current:
                ends = {e: t for e, t in ends.items() if t <= committed + 1}  # as StepProtocol.cut
            epoch = int(run["epoch"]) if current else max(ends, default=-1) + 1
            world = None if run["world_size"] is None else int(run["world_size"])
            nodes = run.get("node_sizes")  # absent from files of earlier versions
            nodes = None if nodes is None else tuple(int(n) for n in nodes)
            inflight = [(int(f["step"]), int(f["epoch"]), np.asarray(f["sample_ids"], np.int64),
                         np.asarray(f["home_ranks"], np.int64)) for f in (run["inflight"] if current else [])]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LedgerFileError(f"{path} is malformed: {e!r}") from None
        self._steps.restart("coordinator restored", epoch, ends, committed)
        if world is not None:
            self._set_world(world, node_sizes=nodes)
        for step, step_epoch, ids, home in inflight:
            if step > committed and not self.ledger.has_step(step):
                self.ledger.stage(step, step_epoch, ids, home)
                self._steps.hold_back(step)
        log.warning(
            "coordinator restored from %s: committed step %d, attempt %d, %d ledger rows, world %s, %d steps in flight",
            self._store.directory, committed, self.attempt, self.ledger.rows, self._world_size,
            len(self.ledger.staged()),
        )

    def _save_stats(self) -> None:
        if self._store is not None:
            self._store.write_json("stats.json", {"version": 1, "stale_submissions": self._steps.stale_submissions,
                                                  **self._stats.to_json()})

    def _restore_stats(self) -> None:
        try:
            saved = self._store.read_json("stats.json")
            if saved is not None:
                self._stats.load_json(saved)
                self._steps.stale_submissions = int(saved["stale_submissions"])
        except (LedgerFileError, KeyError, TypeError, ValueError) as e:
            log.warning("coordinator statistics not restored (statistics only, starting over): %s", e)

    def close(self) -> None:
        """Close the ledger's journal (a coordinator object is done; its files stay)."""
        self.ledger.close()


def _expert(value: Any) -> int:
    """An expert number from a rank (a run has at most a few): an int in [0, 255]."""
    expert = check_index("expert", value)
    if expert > 255:
        raise ValueError(f"expert must be in [0, 255], got {expert}")
    return expert


def _experts(experts: Mapping[int, int] | None) -> dict[int, int]:
    """``step -> expert`` from rank 0 (its recent steps), every key and value checked."""
    if experts is None:
        return {}
    if not isinstance(experts, Mapping) or len(experts) > 1 << 12:
        raise ValueError(f"experts must be a mapping of at most 4096 steps to experts, got {type(experts).__name__}")
    return {check_index("step", t): _expert(e) for t, e in experts.items()}
