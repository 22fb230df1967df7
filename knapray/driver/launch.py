"""Ray wiring: the only module that touches ray.train. Prepares the run directory,
builds the dataset, creates the coordinator actor, runs ``TorchTrainer`` and writes the
run directory's summary files.

While the workers train the driver owns SIGINT and SIGTERM (``knapray.stopping``): either
one, once, stops the run (Ray Train's controller aborted, killed if it does not answer
within ``ABORT_WAIT_S``: a controller waiting for its placement group answers nothing),
raising ``Interrupted`` with the signal. Ray Train's own SIGINT handler, which took three
Ctrl-C to stop a run whose workers waited, is not installed (``_KnaprayTrainer``). Workers
that wait longer than ``scaling.start_timeout_s`` for Ray to place them stop the run the
same way, with ``StartTimeout`` and Ray's reason (``knapray.driver.placement``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

import torch

from knapray.config.run import TrainConfig, config_from_dict
from knapray.worker.ledger_files import ledger_dir
from knapray.driver import preflight
from knapray.driver.preflight import CorpusCheck, Preflight
from knapray.worker.checkpoint import read_trainer_state
from knapray.driver.run_dir import RunError, RunStart
from knapray.worker.metrics import read_metrics
from knapray.driver.placement import PlacementWatch, job_groups, monitor_words, worker_request
from knapray.driver.report import ProgressTail, expected_steps, run_length_note, summarize, write_run_files
from knapray.stopping import Stop, stop_on_signals
from knapray.worker.step_planner import coordinator_config, coordinator_name
from knapray.worker.trainer import Trainer
from knapray.run_files import RunDir

logger = logging.getLogger(__name__)


class RayTrainContext:
    """TrainContext over ``ray.train``'s worker context."""

    def __init__(self, cfg: TrainConfig) -> None:
        import ray.train

        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.local_rank = ctx.get_local_rank()
        self._batch_size = cfg.samples_per_rank(self.world_size)
        self._seed = cfg.data.seed
        from knapray.data import mean_row_bytes, shuffle_rows

        self._shuffle_rows = shuffle_rows(cfg.data.shuffle_buffer_mb, mean_row_bytes(cfg.data.corpus))

    def device(self, use_gpu: bool) -> torch.device:
        """The GPU Ray assigned this worker (``ray.train.torch.get_device``: it maps the
        worker's GPU ids through CUDA_VISIBLE_DEVICES, which the local rank does not when a
        node's workers see different device lists), bound as the current device."""
        if use_gpu and torch.cuda.is_available():
            from ray.train.torch import get_device

            device = get_device()
            torch.cuda.set_device(device)
            return device
        return torch.device("cpu")

    def node_id(self) -> str:
        """The Ray node this worker runs on. Not Ray Train's node_rank: that groups
        workers by IP address, which several nodes can share (containers, emulated
        clusters); Ray Train gives the workers of one node consecutive ranks."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def rows(self, epoch: int, on_bad_shard):
        """This worker's split of the dataset, shuffled locally among ``data.shuffle_buffer_mb``
        of rows with a seed drawn from (seed, epoch): Ray Train hands the same split order
        every epoch. The driver
        checked the shards before training, so ``on_bad_shard`` is not needed here."""
        import ray.train

        from knapray.data import epoch_seed, shard_batches

        return shard_batches(ray.train.get_dataset_shard("train"), batch_size=self._batch_size,
                             shuffle_buffer=self._shuffle_rows, shuffle_seed=epoch_seed(self._seed, epoch))

    def report(self, metrics: dict) -> None:
        import ray.train

        ray.train.report(metrics)


def _train_func(config: dict) -> dict:
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    logging.basicConfig(level=logging.INFO)
    cfg = config_from_dict(config)
    return Trainer(RayTrainContext(cfg), cfg).train()


def _every_row_data_config(execution_options):
    """Ray Train's DataConfig splits with ``streaming_split(equal=True)``, which drops up
    to world_size - 1 rows per epoch to even the shards out. knapray needs no even shards
    (the coordinator gives a dry rank work from the others), and must not lose a sample:
    split with ``equal=False``."""
    from ray.train import DataConfig

    class EveryRowDataConfig(DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            output = [{} for _ in range(world_size)]
            hints = worker_node_ids if self._enable_shard_locality else None
            for name, ds in datasets.items():
                if ds.name is None:
                    ds.set_name(name)
                ds = ds.copy(ds)
                ds.context.execution_options = self._resolve_execution_options(name)
                for i, split in enumerate(ds.streaming_split(world_size, equal=False, locality_hints=hints)):
                    output[i][name] = split
            return output

    return EveryRowDataConfig(execution_options=execution_options)


def run_training(cfg: TrainConfig, *, checked: Preflight | None = None) -> dict:
    """Train on the Ray cluster this process is connected to (``ray.init`` first).
    Everything that can be wrong with the run's inputs fails here, before any worker
    starts (``RunError``, ``BadCorpus``, ``ValueError``: one line naming the value).
    ``checked``: ``cfg``'s pre-flight, when the caller ran it already."""
    pre = checked if checked is not None else preflight.check(cfg, cfg.world_sizes())
    cfg = pre.cfg  # paths resolved
    start, lock = preflight.prepare(pre)
    try:
        print(f"[knapray] {start.message}", flush=True)
        saved = None if start.resume_from is None else read_trainer_state(start.resume_from)
        complete = saved is not None and run_complete(cfg, saved)
        if complete:
            # Nothing left to train: no worker starts, and nothing is rewritten (the run
            # files a stopped driver left unwritten are written, after the lock's release).
            summary = {"records": [], "world_size": saved.get("world_size"), "topology": saved.get("topology"),
                       "run": {"summary": summarize(read_metrics(cfg.run_dir))}}
        else:
            summary = _fit(cfg, pre.corpus, checkpoint_step(start.resume_from) + 1)
    finally:
        lock.release()
    if complete:
        finish_run_files(cfg)
    # Rank 0 rewrites metrics.jsonl back to the resumed checkpoint, so every step after it
    # was trained by this call (earlier attempts of a restarted group included).
    covered = checkpoint_step(start.resume_from)
    summary["new_steps"] = sum(r["step"] > covered for r in read_metrics(cfg.run_dir))
    summary["resumed_from_step"] = None if start.resume_from is None else covered
    return summary


def completed_run(cfg: TrainConfig, start: RunStart) -> int | None:
    """The last step of the checkpoint a run resumes from (``start``, pre-flight's decision)
    if that checkpoint says the run has nothing left to train (``run_complete``), else None.
    Reads files only (no Ray, no lock): ``knapray train`` answers a finished run before it
    starts Ray."""
    if start.resume_from is None:
        return None
    saved = read_trainer_state(start.resume_from)
    return int(saved["step"]) if run_complete(cfg, saved) else None


def finish_run_files(cfg: TrainConfig) -> dict | None:
    """A complete run whose driver stopped after its last checkpoint but before its run files
    (a signal in between): the ledger rows its last checkpoint carried recorded (the
    coordinator went with the run's Ray), then ``summary.json``, ``ledger.jsonl`` and the
    per-rank plot written, under the run's lock. Returns the run-level summary, or None when
    the run has its files already (they are left as they are)."""
    from knapray.driver.run_dir import RunLock
    from knapray.worker.checkpoint import completed_checkpoints
    from knapray.worker.ledger_files import take_over

    run = RunDir(cfg.run_dir)
    if os.path.exists(run.summary):
        return None
    lock = RunLock(cfg.run_dir).acquire()
    try:
        newest = completed_checkpoints(run.checkpoints)
        if os.path.exists(run.summary) or not newest:  # finished meanwhile, or nothing to finish
            return None
        take_over(cfg.run_dir, newest[-1])
        saved = read_trainer_state(newest[-1])
        return write_run_files(cfg, {"topology": saved.get("topology"), "world_size": saved.get("world_size")})
    finally:
        lock.release()


def run_complete(cfg: TrainConfig, saved: dict) -> bool:
    """The checkpoint's state says the run has nothing left: it finished ``data.epochs``
    epochs, or its steps reached ``run.max_steps``. (A checkpoint taken at the last step
    before its epoch's end was seen says neither; the workers then find the epoch empty
    and train nothing, which the caller counts the same way.)"""
    steps_done = int(saved["step"]) + 1
    epochs_done = bool(cfg.data.epochs) and int(saved["epoch"]) >= cfg.data.epochs  # data.epochs=0: max_steps decides
    return epochs_done or bool(cfg.run.max_steps and steps_done >= cfg.run.max_steps)


def checkpoint_step(path: str | None) -> int:
    """The last step a checkpoint directory (``.../step-000000123``) covers; -1 for None."""
    return -1 if path is None else int(os.path.basename(os.path.normpath(path)).split("-", 1)[1])


def _fit(cfg: TrainConfig, corpus: CorpusCheck, done_steps: int) -> dict:
    """``done_steps``: the steps the checkpoint resumed from covers (0 for a fresh run)."""
    import ray
    from ray.data import DataContext

    from knapray.coordinator import create_coordinator

    DataContext.get_current().enable_progress_bars = False  # the training bar is enough
    run_dir = cfg.run_dir
    placement = coordinator_resources(cfg.balance.coordinator_node)
    missing = sorted(set(placement) - set(ray.cluster_resources()))
    if missing:
        raise RunError(f"balance.coordinator_node={cfg.balance.coordinator_node!r}: no node of this Ray cluster has "
                       f"the resource {missing[0]!r}; give it to a node (a node type's resources in cluster.yaml, or "
                       "ray start --resources), or use 'head' or 'any'")
    coordinator = create_coordinator(coordinator_name(cfg), resources=placement,
                                     config=coordinator_config(cfg, state_dir=ledger_dir(run_dir)))
    from knapray.local_ray import started_here

    start_timeout = worker_start_timeout(cfg, os.environ)
    # Ray Train reads them in the driver and hands them to its controller (ENV_VARS_TO_PROPAGATE):
    # set for this fit only, the driver's environment as it was afterwards.
    with scoped_env(START_TIMEOUT_ENV, None if start_timeout is None else f"{start_timeout:g}"), \
            scoped_env(PREEMPTION_WATCHER_ENV, preemption_watcher(os.environ, single_machine=started_here(ray))):
        return _fit_in(cfg, corpus, done_steps, coordinator, run_dir)


def _fit_in(cfg: TrainConfig, corpus: CorpusCheck, done_steps: int, coordinator: Any, run_dir: str) -> dict:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from knapray.data import corpus_dataset, ingest_execution_options

    ds = corpus_dataset(cfg.data.corpus, rows_per_block=cfg.samples_per_rank(cfg.scaling.num_workers),
                        shards=list(corpus.good_shards))  # pre-flight quarantined the others
    workers: Any = cfg.scaling.num_workers
    if cfg.scaling.min_workers:
        workers = (cfg.scaling.min_workers, cfg.scaling.num_workers)
    trainer = _trainer_class(TorchTrainer)(
        _train_func,
        train_loop_config=cfg.to_dict(),
        datasets={"train": ds},
        dataset_config=_every_row_data_config(ingest_execution_options()),
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo",
                                 timeout_s=cfg.distributed.timeout_s),
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker, **cfg.scaling.resources_per_worker},
            elastic_resize_monitor_interval_s=cfg.scaling.elastic_monitor_interval_s,
        ),
        # Ray's own run state goes beside ours; checkpoints are the trainer's (run_dir/checkpoints),
        # so every fit, a restart after a failure included, resumes from the run directory.
        run_config=RunConfig(
            name=f"fit-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=os.path.join(run_dir, "ray"),
            failure_config=FailureConfig(max_failures=cfg.run.max_failures),
        ),
    )
    total = expected_steps(cfg, corpus.info.num_samples, done_steps)
    cap = run_length_note(cfg, corpus.info.num_samples)
    if cap:
        print(f"[knapray] note: {cap}", flush=True)
    print(f"[knapray] starting {cfg.scaling.num_workers} workers"
          f"{f' (elastic down to {cfg.scaling.min_workers})' if cfg.scaling.min_workers else ''}, "
          f"{'GPU/NCCL' if cfg.scaling.use_gpu else 'CPU/gloo'}, about {total} steps; worker logs stay in Ray's "
          "session logs", flush=True)
    result = _fit_or_stop(trainer, cfg, ray, total, done_steps)
    summary = result.return_value or {}
    try:  # by name: the actor may have been replaced while the run went on
        summary["coordinator_stats"] = ray.get(ray.get_actor(coordinator_name(cfg)).stats.remote(), timeout=30)
    except Exception as e:  # noqa: BLE001 - statistics only; the run itself is done
        logger.warning("coordinator statistics unavailable: %s", e)
        # Gone for good (killed without a restart, its node lost): the rows it could not take
        # are in the newest checkpoint; nothing else writes the journal now.
        from knapray.worker.checkpoint import completed_checkpoints
        from knapray.worker.ledger_files import take_over

        newest = completed_checkpoints(RunDir(run_dir).checkpoints)
        added = take_over(run_dir, newest[-1] if newest else None)
        if added:
            print(f"[knapray] the coordinator is gone: the driver recorded the ledger rows of {len(added)} step(s) "
                  f"({added[0]}..{added[-1]}) the last checkpoint carried", flush=True)
    del coordinator
    summary["run"] = write_run_files(cfg, summary)
    return summary


ABORT_WAIT_S = 10.0
"""How long a stopped run's controller may take to abort its workers before it is killed
(its workers go with it): a controller waiting for a placement group answers only when the
wait (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s by default) ends."""


def _trainer_class(base: type) -> type:
    """``base`` (``TorchTrainer``) whose ``fit`` leaves SIGINT to knapray and keeps its
    controller's handle (``.controller``) so that knapray can stop it."""

    class _KnaprayTrainer(base):  # type: ignore[misc, valid-type]
        controller = None

        def _register_sigint_handler(self, controller) -> None:  # Ray Train 2.60, in fit() on the main thread
            self.controller = controller

    if not hasattr(base, "_register_sigint_handler"):
        raise RuntimeError(f"{base.__name__} has no _register_sigint_handler: this Ray Train is not the one knapray "
                           "was written for (2.60)")
    return _KnaprayTrainer


def _fit_or_stop(trainer: Any, cfg: TrainConfig, ray: Any, total: int, done_steps: int) -> Any:
    """``trainer.fit()``, with the progress bar (``total`` steps after ``done_steps``); stopped
    by SIGINT or SIGTERM (``Interrupted``) or by workers waiting past
    ``scaling.start_timeout_s`` (``StartTimeout``)."""
    stopping = _Stopping()
    watch = PlacementWatch(timeout_s=cfg.scaling.start_timeout_s, request=worker_request(cfg),
                           groups=lambda: job_groups(ray), on_timeout=stopping.time_out,
                           cluster=ray.cluster_resources, ray_words=lambda: monitor_words(_logs_dir()))
    with ProgressTail(RunDir(cfg.run_dir).metrics, total, cfg.run.name, start_step=done_steps), \
            stop_on_signals() as signals:
        try:
            watch.start()
            return trainer.fit()
        except (KeyboardInterrupt, SystemExit) as e:
            # Ray's get turns the Stop a handler raised inside it into a plain KeyboardInterrupt:
            # which signal it was is what the handler saw first.
            signum = signals.first or (e.signum if isinstance(e, Stop) else signal.SIGINT)
            watch.stop()  # no more questions to Ray's GCS from its thread while the run stops
            answered = _abort_within(ray, trainer, cfg, signals, ABORT_WAIT_S + ABORT_SLACK_S)
            if stopping.reason is not None:
                raise StartTimeout(stopping.reason) from None
            raise Interrupted(cfg.run_dir, signum, ray_lost=not answered) from None
        finally:
            watch.stop()


class _Stopping:
    """The placement watch's way into the main thread: the reason, then a SIGINT as if typed."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def time_out(self, reason: str) -> None:
        import _thread

        self.reason = reason
        _thread.interrupt_main(signal.SIGINT)


ABORT_SLACK_S = 5.0
"""How much longer than ``ABORT_WAIT_S`` stopping the run may take before the driver stops
waiting on Ray: a signal sent to every process of a job (a Slurm step's) stops the Ray's GCS
too, and each call to it then waited 60 s before Ray ended the process, exit 1, no line."""


def _abort_within(ray: Any, trainer: Any, cfg: TrainConfig, signals, limit_s: float) -> bool:
    """``_abort`` on a thread of its own, waited for up to ``limit_s``, or until the
    single-machine Ray this command started is gone (``local_ray.gone_here``: the signal
    stopped its servers too, and nothing more will answer): whether it finished (False: Ray
    did not answer; the run's workers went with its servers)."""
    import threading

    from knapray.local_ray import SETTLE_S, gone_here, gone_within, started_here

    if started_here(ray) and gone_within(ray, SETTLE_S):  # a question their stop cuts short ends
        return False  # the driver from inside Ray (a failed check in its placement group table)
    thread = threading.Thread(target=_abort, args=(ray, trainer, cfg, signals), name="knapray-abort", daemon=True)
    thread.start()
    deadline = time.monotonic() + limit_s
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(min(ABORT_POLL_S, max(0.0, deadline - time.monotonic())))
        if thread.is_alive() and gone_here(ray):
            return False
    return not thread.is_alive()


ABORT_POLL_S = 0.5
"""How often a stopping driver checks whether its own Ray is gone while it waits."""


def _abort(ray: Any, trainer: Any, cfg: TrainConfig, signals) -> None:
    """Stop the run's controller and its workers: ask it to abort, wait up to ``ABORT_WAIT_S``
    (a second signal: no longer; no worker placed yet: not at all, it would not answer), then
    kill it; then remove the placement groups of workers it had asked for (a waiting one would
    otherwise take its resources when they free)."""
    controller = getattr(trainer, "controller", None)
    if controller is not None:
        seen = signals.count
        try:
            placed = any(g.get("state") == "CREATED" for g in job_groups(ray).values())
        except Exception:  # noqa: BLE001 - unknown: ask it, as if placed
            placed = True
        try:
            ref = controller.abort.remote()
            deadline = time.monotonic() + (ABORT_WAIT_S if placed else 0.0)
            while time.monotonic() < deadline and signals.count == seen:
                done, _ = ray.wait([ref], timeout=0.2)
                if done:
                    break
            ray.kill(controller)
        except Exception as e:  # noqa: BLE001 - gone already: what it owned went with it
            logger.info("stopping the controller: %s", e)
    _remove_groups(ray, worker_request(cfg))


def _remove_groups(ray: Any, request: dict) -> None:
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    try:
        for pg_id, group in job_groups(ray).items():
            bundles = list((group.get("bundles") or {}).values())
            if group.get("state") != "REMOVED" and bundles and all(
                    {k: float(v) for k, v in b.items()} == {k: float(v) for k, v in request.items()} for b in bundles):
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    except Exception as e:  # noqa: BLE001 - best effort: the job's end removes them too
        logger.info("removing the run's placement groups: %s", e)


def _logs_dir() -> str | None:
    try:  # not public API; only for Ray's own words on a placement it cannot make
        from ray._private.worker import _global_node

        return _global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001
        return None


class Interrupted(KeyboardInterrupt):
    """The driver was stopped by a signal (``signum``: SIGINT or SIGTERM) while the workers
    trained or waited; they were stopped."""

    def __init__(self, run_dir: str, signum: int = signal.SIGINT, ray_lost: bool = False) -> None:
        super().__init__(run_dir)
        self.signum = int(signum)
        self.ray_lost = ray_lost
        """Ray did not answer while the run was stopped: the caller should not wait on it again."""


class StartTimeout(RuntimeError):
    """The workers waited longer than ``scaling.start_timeout_s`` for Ray to place them; the
    message says why, in one line. The workers were stopped."""


def interrupted_line(cfg: TrainConfig) -> str:
    """Where an interrupted run stopped and how to go on: its last complete checkpoint."""
    from knapray.worker.checkpoint import completed_checkpoints

    done = completed_checkpoints(RunDir(cfg.run_dir).checkpoints)
    if not done:
        return (f"run {cfg.run.name!r} stopped before its first checkpoint ({cfg.run_dir}); run the same "
                "command again to start it afresh")
    return (f"run {cfg.run.name!r} stopped; its last checkpoint is step {checkpoint_step(done[-1])} ({done[-1]}); "
            "run the same command again to resume from it")


HEAD_RESOURCE = "node:__internal_head__"
"""The resource only Ray's head node has (Ray pins its own Train state actor with it)."""
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
ELASTIC_START_TIMEOUT_S = 10.0
"""Elastic runs' wait for a worker group's placement group before Ray Train retries. After
a node loss Ray first asks for the old size from a view of the cluster refreshed every
20 s (its AutoscalingCoordinator's tick), which the nodes left cannot place; Ray's 60 s
default makes every node loss cost a minute before the retry at the size that fits."""


def coordinator_resources(node: str) -> dict[str, float]:
    """The Ray resources that place the coordinator actor (``balance.coordinator_node``): a
    thousandth of the head node's own resource, of a named custom resource, or none."""
    if node == "any":
        return {}
    return {HEAD_RESOURCE if node == "head" else node: 0.001}


@contextlib.contextmanager
def scoped_env(name: str, value: str | None):
    """``os.environ[name] = value`` inside the block (None: left as it is), and as it was
    after it: a setting one Ray call needs does not outlive the call."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def preemption_watcher(environ, *, single_machine: bool) -> str | None:
    """``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER`` for a fit: "0" on the single-machine Ray knapray
    started (``knapray train`` without an address, ``make run``), unless the environment sets
    it; else None (Ray's default, on). The watcher is an actor Ray Train starts beside every
    fit to poll Ray for nodes being drained; the one node of an embedded Ray is the driver's
    own, and nothing drains it while the run goes on."""
    if single_machine and PREEMPTION_WATCHER_ENV not in environ:
        return "0"
    return None


def worker_start_timeout(cfg: TrainConfig, environ) -> float | None:
    """``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` for this run (``scaling.worker_start_timeout_s``;
    0: ``ELASTIC_START_TIMEOUT_S`` for an elastic run unless the environment sets it, else
    None: Ray's default or the environment's)."""
    if cfg.scaling.worker_start_timeout_s:
        return cfg.scaling.worker_start_timeout_s
    if cfg.scaling.min_workers and START_TIMEOUT_ENV not in environ:
        return ELASTIC_START_TIMEOUT_S
    return None
