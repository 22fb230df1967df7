"""The trainer: one worker's whole run, under Ray Train, torchrun or a test.

It takes rank, world size, rows and reporting from a ``TrainContext`` and never imports
ray.train. ``Trainer.__init__`` builds everything (model, optimizer, restore from the
newest checkpoint, topology, process groups, step planner, bad-data guard);
``Trainer.train`` runs the epochs; ``Trainer.train_step`` is one step:

1. take this step's samples (``StepStream``) and fetch its plan (``StepPlanner``: the
   coordinator's, prefetched a step ahead, if it answered);
2. one small all-reduce of host numbers on the gloo group agrees on the step's image
   tokens, whether every rank has the plan, whether any rank's step failed on the
   coordinator (then every rank raises ``StepFailed``), and the bad-data counts
   (``BadDataGuard``);
3. if any rank lacks the plan, every rank plans locally from an all-gather of lengths;
4. balanced forward + backward (``balanced_forward``) under the run's precision,
   gradients summed over ranks, clip, optimizer step: whether the loss and the gradients
   were finite is summed over ranks on the device and gates the update there (the fused
   optimizer's ``found_inf``), so the step never waits for the device;
5. every ``metrics.log_every`` steps (and before a checkpoint, at an epoch's and the run's
   end) one all-reduce reads the steps since the last read: their losses, every rank's
   compute/communication seconds; rank 0 writes their metrics rows, their samples go
   into the ledger, Ray gets one report;
6. every ``checkpoint.every`` steps, and at the end of the run, a checkpoint
   (``Checkpointer``: DCP, atomic, resumable at another world size).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass
import math
import os
import time

import numpy as np
import torch

from knapray.attention import activate_flash_impl
from knapray.coordinator import CoordinatorClient, CoordinatorUnavailable
from knapray.corpus.unconditional import unconditional_embeddings
from knapray.data import (
    CaptionDropout,
    DecodedStep,
    StepMeta,
    StepStream,
    build_packed_batch,
    check_model_config,
    corpus_info,
)
from knapray.distributed.block_groups import StepGroups
from knapray.distributed.parallel_dims import ParallelDims
from knapray.models.families import build_model, cross_text_pad
from knapray.models.flops import model_flops, peak_tflops
from knapray.models.flow import flow_loss
from knapray.models.timesteps import EXPERT_NAMES
from knapray.models.packing import PackedBatch
from knapray.nofollow import open_nofollow
from knapray.planning import BalancePlan, Topology, identity_plan
from knapray.planning.shapes.blocks import block_sizes
from knapray.planning.costs.cost import CostModel
from knapray.planning.search.rules import per_step_node, planning_node
from knapray.planning.shapes.topology import node_sizes_of
from knapray.worker.timing import StepTimer

from knapray.worker.balanced import balanced_forward, prepare_step
from knapray.worker.checkpoint import Checkpointer
from knapray.config.run import TrainConfig
from knapray.worker.context import TrainContext
from knapray.worker.guard import BadDataGuard, NonFiniteSteps, quarantined_duplicates
from knapray.worker.ema import build_ema
from knapray.worker.experts import Expert, expert_parts
from knapray.worker.ledger_keeper import LedgerKeeper
from knapray.worker.metrics import MetricsFile, StepRecord
from knapray.worker.optim import LRSchedule, build_optimizer
from knapray.worker.parallelize import compute_dtype, materialize, parallelize
from knapray.worker.profiling import StepProfiler
from knapray.worker.sinks import MetricSinks, scalars_of
from knapray.worker.metrics import most_used_first, truncate_metrics
from knapray.worker.startup import StartupClock
from knapray.worker.step_planner import (
    Planned,
    StepPlanner,
    coordinator_config,
    coordinator_name,
    live_fit,
    planning_model,
)
from knapray.run_files import RunDir

logger = logging.getLogger(__name__)

RECORDS_RETURNED = 4096
"""Step records ``train`` returns (the newest); every step's is in metrics.jsonl."""
MAX_NONFINITE_STEPS = 3
"""Optimizer steps in a row whose loss or gradients were not finite before the run stops
(``NonFiniteSteps``): one bad sample spoils one step; three in a row is a diverged model."""


class TopologyError(ValueError):
    """The world Ray (or torchrun) gave cannot be trained as configured: the message names
    the world, where its ranks are and what would be valid. Raised on every rank."""


def check_node_layout(cfg: TrainConfig, node_sizes: tuple[int, ...]) -> None:
    """What the real node layout must give the run before anything is built: with
    ``parallel.fsdp: hybrid`` every node holds whole shards of ``balance.gpus_per_node``
    consecutive ranks (a shard never spans two machines). Raises ``TopologyError``."""
    gpn = cfg.balance.gpus_per_node
    if cfg.parallel.fsdp == "hybrid" and gpn and any(n % gpn for n in node_sizes):
        raise TopologyError(
            f"parallel.fsdp=hybrid shards over blocks of balance.gpus_per_node={gpn} consecutive ranks, but the "
            f"{sum(node_sizes)} workers are on nodes of {list(node_sizes)} ranks (in rank order): every node must "
            f"hold a multiple of {gpn} workers (give each node {gpn} worker slots, e.g. {gpn} GPUs, or set "
            "balance.gpus_per_node to a size that divides every node)")


def _plan_order(plan: BalancePlan, text_slots: dict[str, list[float]]) -> np.ndarray:
    """(S,) text tokens of every sequence of ``plan``, from each rank's slots
    (``text_tokens.i``: its i-th sequence's count, one entry per rank)."""
    held = int(np.diff(plan.seq_offsets).max(initial=0))
    if held > len(text_slots):
        raise ValueError(f"a rank holds {held} sequences, more than the {len(text_slots)} samples per step "
                         "whose text counts the step's all-reduce carries")
    counts = [int(n) for r in range(plan.world_size)
              for n in (text_slots[f"text_tokens.{i}"][r] for i in range(int(np.diff(plan.seq_offsets)[r])))]
    return np.asarray(counts, dtype=np.int64)


def _split_lengths(plan: BalancePlan) -> list[list[int]]:
    offs = plan.seq_offsets.tolist()
    lens = plan.seq_lens.tolist()
    return [lens[offs[r] : offs[r + 1]] for r in range(plan.world_size)]


class Trainer:
    def __init__(self, ctx: TrainContext, cfg: TrainConfig) -> None:
        self.startup = StartupClock()
        self.ctx, self.cfg = ctx, cfg
        self.rank, self.world = ctx.rank, ctx.world_size
        self.device = ctx.device(cfg.scaling.use_gpu)
        node_ids = self._join_world()
        self.dtype = compute_dtype(cfg.parallel.precision, self.device)
        self.peak_tflops = peak_tflops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        self.flash_impl = activate_flash_impl(self.device)  # FA3 / FA4 where installed, else None
        if self.flash_impl and self.rank == 0:
            logger.info("attention: torch's flash kernels routed to %s", self.flash_impl)
        self.samples_per_step = cfg.samples_per_rank(self.world)
        self.run_dir = cfg.run_dir
        os.makedirs(self.run_dir, exist_ok=True)
        self.info = corpus_info(cfg.data.corpus)
        check_model_config(self.info, cfg.model)

        self._build_experts()
        self.startup.mark("model_ready")
        # FSDP gathers parameters in the compute dtype itself; without it, bf16 is autocast.
        self.autocast = not self.parallel.sharded and self.dtype != torch.float32
        self.guidance = cfg.flow.guidance if getattr(cfg.model, "guidance_embeds", False) else None
        self.unconditional = unconditional_embeddings(cfg.data.corpus, self.info.text_dim, self.info.pooled_dim) \
            if cfg.data.caption_dropout > 0 else None
        self.accum = cfg.optim.grad_accum_steps

        self.client = (
            CoordinatorClient(coordinator_name(cfg), None, rank=self.rank, timeout_s=cfg.balance.coordinator_timeout_s,
                              node_ranks=node_ids.count(ctx.node_id()))  # a node's ranks share one relay
            if cfg.balance.coordinator else None
        )
        self.ledger = LedgerKeeper(self.rank, self.client, self.run_dir)
        """This rank's side of the sample ledger; a checkpoint holds its state, a resume gives it back."""
        latest = self._restore()
        self.startup.mark("restored")
        self._start_schedules()
        self._prefetched: tuple | None = None
        """(stream, step, next metadata, host batch): the next step, read while the device
        computed the last one."""
        self._unread_state()

        self.ledger.open(latest)  # without a coordinator, rank 0's journal
        self.topology = self._choose_topology()
        """The run's static topology (with ``per-step``: the base every step also tries); checkpoints keep it."""
        node = planning_node(self.world, cfg.balance.gpus_per_node or None, self.node_sizes)
        self.per_step_node = per_step_node(cfg.balance.topology, self.world, node)
        self.groups = self._build_groups() if cfg.balance.enabled else None
        self.workload = planning_model(cfg)
        self.planner = StepPlanner(self.sync, self.topology, self.workload, cfg.balance.solver, self.client,
                                   self.ledger, cfg.data.max_tokens_per_gpu or None, live=live_fit(cfg),
                                   per_step_node=self.per_step_node, overlap=cfg.balance.overlap)
        self.max_seq_len = self._max_seq_len()
        self._open_outputs()
        self._write_pid()
        if self.rank == 0:
            logger.info("topology %s for %d ranks (balance %s)%s", self.topology, self.world, cfg.balance.enabled,
                        "" if self.per_step_node is None else
                        f"; per-step: every step chooses aligned blocks of nodes of {self.per_step_node} ranks, "
                        f"{self.topology} is the base it also tries")

    # ---- set-up pieces ------------------------------------------------------------------

    def _unread_state(self) -> None:
        """What the steps between two reads (``_read``) leave for it."""
        self.pending: list[_Unread] = []
        """The micro-steps accumulated, to enter the ledger once their optimizer step is done."""
        self.unread: list[_Unread] = []
        """Steps trained whose numbers the host has not read yet."""
        self.applied: list[tuple[list[_Unread], torch.Tensor]] = []
        """Optimizer steps done since the last read: their micro-steps, and the device flag
        (> 0: not applied, its loss or gradients were not finite) that gated them."""
        self.group_bad = torch.zeros((), device=self.device)
        """Micro-steps accumulated so far whose loss was not finite on this rank (device)."""
        self.device_skip = _fused(self.optimizer)
        """The optimizer skips a non-finite update itself (fused: ``found_inf``); else the
        host reads the flag first (a CPU, where that costs nothing, or a non-fused GPU run)."""

    def _join_world(self) -> list:
        """Every process group, created in one order on every rank (``ParallelDims``): the
        step's sync group now, the FSDP mesh in ``parallelize``, the bags once the topology
        is known. Then where every rank really runs (bags and FSDP's node shards must not
        cross a node; ``TopologyError`` if they would). Returns every rank's node id."""
        cfg = self.cfg
        self.dims = ParallelDims(world_size=self.world, device_type=self.device.type,
                                 gpus_per_node=cfg.balance.gpus_per_node or None)
        self.sync = self.dims.step_sync(self.device, gloo_socket_ifname=cfg.distributed.gloo_socket_ifname)
        node_ids = self.sync.gather_objects(self.ctx.node_id())
        self.node_sizes = node_sizes_of(node_ids)
        check_node_layout(cfg, self.node_sizes)
        return node_ids

    def _build_experts(self) -> None:
        """The run's model, or its two experts (``flow.expert_boundary``), each with its
        optimizer and EMA; the first one in use."""
        self.split = self.cfg.flow.experts()
        """Two experts, one per side of a timestep boundary (Wan 2.2 A14B), or None: one model."""
        self.experts: list[Expert] = []
        """The models this run trains, each with its optimizer, EMA, LR schedule and
        timesteps; a step trains one (``_use``: the trainer's ``model``, ``optimizer``, ...)."""
        for i in range(2 if self.split else 1):
            self.experts.append(self._build_expert(i))
        self.lora_base = self.experts[0].lora_base
        """A LoRA run's base: {path, fingerprint of its safetensors files} (trainer.json; weights.checks.base_record)."""
        self._choose = self.split.chooser(self.cfg.data.seed, self.cfg.flow.distribution()) if self.split else None
        """``step -> expert`` of a group starting at ``step`` (``ExpertSplit.chooser``)."""
        self._use(0)

    def _start_schedules(self) -> None:
        """Every expert's LR schedule at the step the run starts at (optimizer steps so far:
        checkpoints fall on accumulation boundaries; an idle expert's schedule follows the
        run's optimizer steps too), and the expert that step trains in use."""
        for e in self.experts:
            e.schedule = LRSchedule(e.optimizer, self.cfg.optim, self._optimizer_steps(self.cfg.run.max_steps),
                                    start_step=self._optimizer_steps(self.step))
        self.micro_steps = 0
        """Micro-steps whose gradients are accumulated but not yet applied."""
        self._use(self._expert_for(self.step))

    def _build_expert(self, index: int) -> Expert:
        """Expert ``index``'s model (the run's only one for index 0 of one), built on the meta
        device (no storage), parallelized, then given storage and its weights shard by shard:
        a pretrained model's from its checkpoint (each rank reads only its shard; the second
        expert from a pipeline's ``transformer_2/``), else its initial ones (``materialize``:
        the same weights as building it on the CPU from this seed), without holding the whole
        model anywhere; then its optimizer and EMA over FSDP's sharded parameters (the
        checkpoint comes after)."""
        cfg = self.cfg
        model_cfg = cfg.model
        if index and model_cfg.pretrained:
            from knapray.weights.source import expert_path

            model_cfg = dataclasses.replace(model_cfg, pretrained=expert_path(model_cfg.pretrained, index))
        torch.manual_seed(cfg.data.seed)  # the same initial model on every rank
        with torch.device("meta"):
            model = build_model(model_cfg)
        if model_cfg.lora.enabled:  # the frozen base in the compute dtype, before FSDP shards it
            from knapray.models.families import fp8_base_layers
            from knapray.models.lora import hold_base_in

            hold_base_in(model, self.dtype, fp8_base_layers(model_cfg))
        parallel = parallelize(model, cfg.parallel.for_world(self.world), self.dims, compute_dtype=self.dtype,
                               mesh=self.experts[0].parallel.mesh if index else None)
        if model_cfg.pretrained:
            self._load_pretrained(model, model_cfg)
        else:
            materialize(model, self.device)
        lora_base = None
        if model_cfg.lora.enabled:
            from knapray.models.lora import init_adapters
            from knapray.weights.checks import base_record

            init_adapters(model, model_cfg.lora, cfg.data.seed)
            lora_base = base_record(model_cfg)
        base = cfg.flow.distribution()
        return Expert(name=EXPERT_NAMES[index] if self.split else "transformer", model=model, parallel=parallel,
                      optimizer=build_optimizer(model, cfg.optim), ema=build_ema(model, cfg.optim),
                      timesteps=self.split.distribution(index, base) if self.split else base, lora_base=lora_base)

    def _use(self, index: int) -> None:
        """Make expert ``index`` the one the steps train: ``model``, ``parallel``,
        ``optimizer``, ``ema``, ``schedule`` are its (switched only between optimizer steps)."""
        e = self.experts[index]
        self.active = index
        self.model, self.parallel, self.optimizer, self.ema = e.model, e.parallel, e.optimizer, e.ema
        self.schedule = e.schedule

    def _expert_for(self, step: int) -> int:
        """The expert step ``step`` trains (0 with one model): inside an accumulation group the
        group's; a group's first step draws it from the run's seed and that step's number
        (``ExpertSplit.chooser``), so a resume (which starts a group) and every rank agree."""
        if self._choose is None:
            return 0
        return self.active if self.micro_steps else self._choose(step)

    def _restore(self) -> str | None:
        """The checkpointer, then the newest checkpoint if there is one (its path, else
        None): the checkpointer owns the cadence and the parts (model, optimizer, EMA); the
        trainer's own state (step, epoch, the ledger keeper's) is its state dict, in JSON."""
        self.checkpointer = Checkpointer(RunDir(self.run_dir).checkpoints, rank=self.rank,
                                         group=self.sync.meta_group, every=self.cfg.checkpoint.every, state=self,
                                         parts=expert_parts(self.experts))
        self.step, self.epoch, self.resumed_from = 0, 0, None
        self.out_of_data = False
        """An epoch trained no step (``data.epochs: 0`` stops there rather than loop on empty epochs)."""
        self.nonfinite_run: list[list[int]] = []
        """The steps of each of the last optimizer steps in a row not applied (non-finite)."""
        self.last_saved: int | None = None
        self.saved_epoch: int | None = None
        """The epoch the last checkpoint recorded (an epoch end after it makes it stale)."""
        latest = self.checkpointer.latest()
        if latest is not None:
            self.checkpointer.load(latest)  # every part, then load_state_dict(trainer.json)
            if self.rank == 0:
                truncate_metrics(self.run_dir, self.step)
                logger.info("resumed from %s: step %d, epoch %d", latest, self.step, self.epoch)
        return latest

    def _max_seq_len(self) -> int | None:
        """The longest sequence a step may hold: the memory budget per GPU times the largest
        bag (with ``per-step``, the largest block a node can form); None without a budget."""
        cfg = self.cfg
        largest_bag = max(self.topology.bags) if self.per_step_node is None else max(
            max(self.topology.bags), max(block_sizes(self.per_step_node, cfg.model.num_heads)))
        return cfg.data.max_tokens_per_gpu * largest_bag if cfg.data.max_tokens_per_gpu else None

    def _open_outputs(self) -> None:
        """What the run writes besides checkpoints: the bad-data guard, rank 0's metrics and
        sinks, the profiler, the validator."""
        cfg = self.cfg
        self.guard = BadDataGuard(self.run_dir, self.rank, cfg.data.corpus, cfg.data.max_bad_fraction)
        self.duplicates = quarantined_duplicates(self.run_dir)
        """Ids pre-flight quarantined because several corpus rows carry them: never trained."""
        self.metrics = MetricsFile(self.run_dir) if self.rank == 0 else None
        self.profiler = StepProfiler(self.run_dir, self.rank, cfg.metrics.profile_steps if any(cfg.metrics.profile_steps)
                                     else None, self.device)
        self.sinks = MetricSinks(cfg, start_step=self.step) if self.rank == 0 else None
        from knapray.worker.validation import Validator

        self.validator = Validator(cfg, rank=self.rank, group=self.sync.meta_group if self.world > 1 else None)

    def _write_pid(self) -> None:
        """``pids/rank<r>.pid``: for operators (and the chaos script) to find workers."""
        os.makedirs(RunDir(self.run_dir).pids, exist_ok=True)
        with open_nofollow(RunDir(self.run_dir).pid_file(self.rank), "w") as f:
            f.write(str(os.getpid()))

    def _load_pretrained(self, model: torch.nn.Module, model_cfg) -> None:
        """Allocate the meta-built (sharded) ``model`` and fill it from ``model_cfg.pretrained``,
        unless a checkpoint of this run will overwrite every weight anyway."""
        from knapray.weights.load import load_pretrained

        from knapray.worker.checkpoint import completed_checkpoints

        model.to_empty(device=self.device)
        if completed_checkpoints(RunDir(self.run_dir).checkpoints) and not model_cfg.lora.enabled:
            return  # (a LoRA checkpoint holds the adapters only: the base is always read)
        report = load_pretrained(model, model_cfg)
        logger.info("rank %d: %s", self.rank, report.line())

    def _optimizer_steps(self, steps: int) -> int:
        return -(-steps // self.accum)

    def _build_groups(self) -> StepGroups:
        """The static topology's groups and, for a per-step run, a group for every aligned
        block of each node: created once, by every rank in the same order."""
        return self.dims.step_groups(self.topology, self.cfg.model.num_heads, self.per_step_node,
                                     divisors=self.cfg.balance.overlap)

    def _choose_topology(self) -> Topology:
        """Rank 0 starts the coordinator's run (``LedgerKeeper.begin_run``: the rows the
        checkpoint carried first; it answers with the topology for this world and its
        nodes) and hands it to every rank; without a coordinator, the same rule locally.
        Every rank must build the same groups: rank 0's answer wins, and a world the rule
        cannot serve (a bag would cross a node) fails on every rank with rank 0's message."""
        from knapray.coordinator import BalanceCoordinator

        topo, error = None, None
        if self.rank == 0:
            try:
                topo = self.ledger.begin_run(self.world, self.node_sizes)
                if topo is None:
                    topo = BalanceCoordinator(coordinator_config(self.cfg, world_size=self.world)).topology_for(
                        self.world, self.node_sizes)
            except ValueError as e:
                error = (f"no topology for {self.world} workers on nodes of {list(self.node_sizes)} ranks "
                         f"(balance.topology={self.cfg.balance.topology!r}): {e}")
        group_bags, num_groups, error = self.sync.broadcast_object(
            (None, None, error) if topo is None else (topo.group_bags, topo.num_groups, None))
        if error is not None:
            raise TopologyError(error)
        return Topology(tuple(group_bags), num_groups)

    # ---- the run ----------------------------------------------------------------------

    def train(self) -> dict:
        """Train; returns rank 0's summary (other ranks return their own partial view)."""
        cfg = self.cfg
        # The driver gets the last RECORDS_RETURNED step records (metrics.jsonl has them
        # all): a long run's summary stays small, and nothing grows with its length here.
        records: collections.deque[dict] = collections.deque(maxlen=RECORDS_RETURNED)
        topologies: dict[str, int] = {}

        def keep(read: list[dict]) -> None:  # step records as they are read
            if read and not self.startup.written and self.rank == 0:
                self.startup.mark("first_step")
                self.startup.write(self.run_dir, step=read[0]["step"], world_size=self.world,
                                   node_sizes=list(self.node_sizes), topology=read[0]["topology"])
            for rec in read:
                records.append(rec)
                topologies[rec["topology"]] = topologies.get(rec["topology"], 0) + 1

        while self._epochs_left() and not self._at_max_steps():
            first_step = self.step
            # What the epoch trained already (a resumed epoch's ledger rows, the rows the
            # checkpoint carried), and ids several corpus rows carry (data.duplicate_ids).
            skip = np.union1d(self.ledger.trained_ids(self.epoch, through_step=self.resumed_from), self.duplicates)
            dropout = None if self.unconditional is None else CaptionDropout(
                cfg.data.caption_dropout, cfg.data.seed, self.epoch, *self.unconditional)
            stream = StepStream.for_corpus(
                self.ctx.rows(self.epoch, self.guard.on_bad_shard), self.info, samples_per_step=self.samples_per_step,
                on_corrupt=self.guard.on_corrupt, skip_sample_ids=skip, max_seq_len=self.max_seq_len,
                caption_dropout=dropout,
            )
            self.planner.begin_epoch(self.step, self.epoch, stream.peek_next())
            while not self._at_max_steps():
                with self.profiler.step(self.step):
                    read = self.train_step(stream)
                if read is None:  # the epoch is over for every rank
                    self._apply_gradients()  # an accumulation group the epoch cut short
                    keep(self._read())
                    # The end step trained nothing: the next epoch's first step takes its
                    # number (steps count trained steps; the coordinator tells them apart
                    # by epoch).
                    self.epoch += 1
                    self.resumed_from = None
                    if not cfg.data.epochs and self.step == first_step:  # nothing left to train, ever
                        logger.warning("epoch %d trained no step (every sample skipped): stopping before "
                                       "run.max_steps=%d (data.epochs=0)", self.epoch - 1, cfg.run.max_steps)
                        self.out_of_data = True
                    break
                keep(read)
                self.step += 1
                if self.micro_steps == 0 and self.validator.due(self.step - 1):  # at an optimizer step
                    self.validator.run(self.step - 1, self.model, self.ema, self.sinks)
        self._apply_gradients()
        keep(self._read())
        last = self.step - 1 if self.step > 0 else None
        if last is not None and self.validator.enabled and self.validator.last_step != last:
            self.validator.run(last, self.model, self.ema, self.sinks)  # the run's last weights too
        if cfg.checkpoint.final and last is not None and (self.last_saved, self.saved_epoch) != (last, self.epoch):
            # The last steps of a run are never lost, and the checkpoint says which epochs
            # are done (a finished run is then known as such before any worker starts).
            self._save(last)
        self.close()
        try:
            self.ledger.finish(last)
        except CoordinatorUnavailable as e:
            logger.error("coordinator unreachable at the end of the run: ledger incomplete (%s)", e)
        return {"steps": self.step, "records": list(records), "topology": str(self.topology),
                "step_topologies": most_used_first(topologies),
                "node_sizes": list(self.node_sizes), "world_size": self.world, "epoch": self.epoch}

    def _at_max_steps(self) -> bool:
        return bool(self.cfg.run.max_steps) and self.step >= self.cfg.run.max_steps

    def _epochs_left(self) -> bool:
        """``data.epochs`` not done; with ``data.epochs: 0`` (as many as ``run.max_steps``
        takes), until an epoch finds nothing left to train."""
        epochs = self.cfg.data.epochs
        return self.epoch < epochs if epochs else not self.out_of_data

    def train_step(self, stream: StepStream) -> list[dict] | None:
        """One step; None (on every rank together) when the epoch is over, else the records
        of the steps read at this one (``_read``: none between two reads)."""
        cfg, rank, step = self.cfg, self.rank, self.step
        t_step = time.perf_counter()
        self._use(self._expert_for(step))  # (between optimizer steps: a group keeps its expert)
        current, nxt, host_batch = self._take_batch(stream)
        fetched = self.planner.fetch(step, current.meta, nxt)
        batch = host_batch.to(self.device)
        # Every sequence's text-token count rides along (one slot per sample a rank may hold):
        # with the plan it tells every rank, on the host, which routed tokens are text. All
        # host numbers, agreed on the gloo group: nothing here waits for the device.
        text = host_batch.text_tokens_per_sequence()
        agree, text_slots = self.sync.sum_over_ranks(summed={
            "img_tokens": _loss_tokens(host_batch), "tokens": int(host_batch.seq_lens.sum()),
            "have_plan": fetched.have_plan,
            "plan_failed": fetched.error is not None, **self.guard.step_counts(stream.stats),
        }, per_rank={f"text_tokens.{i}": int(text[i]) if i < text.size else 0
                     for i in range(self.samples_per_step)}, host=True)
        if agree["plan_failed"]:
            self.planner.raise_failed(step, fetched)  # on every rank, with the same message
        self.guard.check(agree, step)
        planned: Planned = self.planner.resolve(step, fetched, int(agree["have_plan"]) == self.world,
                                                current.meta, nxt)
        if planned.epoch_done:
            return None
        global_img = max(int(agree["img_tokens"]), 1)
        run_plan = planned.plan if cfg.balance.enabled else identity_plan(_split_lengths(planned.plan),
                                                                          planned.plan.model)

        bag_group, route_group = self.groups.for_topology(run_plan.topology) if self.groups else (None, None)
        # Index tensors built on the host and copied without blocking: nothing in the timed
        # region below waits for the device (knapray dryrun counts such waits).
        layout = prepare_step(host_batch, run_plan, rank, _plan_order(run_plan, text_slots), self.device,
                              bag_group=bag_group, route_group=route_group, cross_pad=cross_text_pad(self.cfg.model))

        # ---- compute ----
        timer = StepTimer(self.device)
        with timer:
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.autocast):
                out = balanced_forward(self.model, batch, run_plan, rank, bag_group=bag_group,
                                       route_group=route_group, layout=layout)
                loss = flow_loss(out, batch.targets, global_img, batch.loss_tokens)
            loss.backward()
        # The loss of predicting zero velocity on the same batch: the loss over it is 1.0
        # at initialization (adaLN-zero) and falls as the model learns, free of the
        # step-to-step variance of the data and the timesteps.
        zero_loss = flow_loss(torch.zeros_like(batch.targets), batch.targets, global_img, batch.loss_tokens)
        loss = loss.detach()
        self.group_bad = self.group_bad + (~torch.isfinite(loss)).to(self.group_bad.dtype)
        self.micro_steps += 1
        entry = _Unread(
            step=step, epoch=self.epoch, planned=planned, meta=current.meta, plan=run_plan, timer=timer,
            numbers=torch.stack([loss.float(), zero_loss.detach().float()]), tokens=int(agree["tokens"]),
            lr=self.schedule.get_last_lr()[0],  # what this step trains with
            attention=_attention_fields(layout.attention.choice), recompiles=self.parallel.recompiles,
            peak_mem_gib=torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None,
            expert=self.active,
        )
        self.pending.append(entry)
        self.unread.append(entry)
        if self.micro_steps == self.accum:  # an accumulation boundary: the optimizer step
            self._apply_gradients()
        # The step's kernels are queued: the host decodes and packs the next step's batch
        # while the device computes.
        self._prefetched = (stream, *self._read_batch(stream, step + 1))
        entry.started = t_step
        saving = self.checkpointer.should_save(step, boundary=not self.micro_steps)
        read = self._read() if saving or step % cfg.metrics.log_every == 0 or (
            cfg.run.max_steps and step + 1 >= cfg.run.max_steps) else []
        if saving:
            self._save(step)
        return read

    def _read(self) -> list[dict]:
        """Read the numbers of the steps trained since the last read, in one collective
        (waiting for the device once): write their metrics rows, commit the optimizer steps
        done since (the ledger; a non-finite one's samples quarantined) and report to Ray.
        Every rank calls it at the same steps. Returns the steps' records."""
        cfg, entries, groups = self.cfg, self.unread, self.applied
        if not entries and not groups:
            return []
        self.unread, self.applied = [], []
        took = [e.timer.result() for e in entries]
        summed: dict = {}
        for i, e in enumerate(entries):
            summed[f"loss.{i}"], summed[f"zero_loss.{i}"] = e.numbers[0], e.numbers[1]
        for j, (_, bad) in enumerate(groups):
            summed[f"bad.{j}"] = bad  # already summed over ranks: > 0 is what counts
        per_rank = {}
        for i, t in enumerate(took):
            per_rank[f"compute_s.{i}"], per_rank[f"comm_s.{i}"] = t.compute_s, t.comm_s
        totals, gathered = self.sync.sum_over_ranks(summed=summed, per_rank=per_rank)
        # The steps' wall time: from the first one's start to now (the device's work on them
        # done), shared evenly (with log_every 1, each step's own, its read included).
        seconds = (time.perf_counter() - entries[0].started) / len(entries) if entries else 0.0
        last_of_bad = {members[-1].step for j, (members, _) in enumerate(groups) if totals[f"bad.{j}"] > 0}
        records = []
        for i, (e, t) in enumerate(zip(entries, took)):
            run_plan, planned = e.plan, e.planned
            loss, zero = totals[f"loss.{i}"], totals[f"zero_loss.{i}"]
            compute_s = gathered[f"compute_s.{i}"]
            if self.client is not None:
                self.client.report_timing_async(e.step, t.compute_s, t.comm_s, planned.wait_s)
            self.planner.observe(e.step, run_plan, compute_s)
            rec = StepRecord(
                step=e.step, loss=loss, loss_rel=loss / max(zero, 1e-30), tokens=e.tokens, seconds=seconds,
                imbalance=run_plan.imbalance, baseline_imbalance=run_plan.baseline_imbalance, compute_s=compute_s,
                comm_s=gathered[f"comm_s.{i}"], wait_plan_s=planned.wait_s, planned_by=planned.planned_by,
                rank_work=run_plan.rank_work.tolist(), baseline_rank_work=run_plan.baseline_rank_work.tolist(),
                topology=str(planned.plan.topology),
                whole_on_shared=int((planned.plan.bag >= planned.plan.topology.num_bags).sum()),
                flops=model_flops(run_plan.seq_lens.tolist(), cfg.model),
                clock=t.clock, peak_mem_gib=e.peak_mem_gib, epoch=e.epoch, lr=e.lr, peak_tflops=self.peak_tflops,
                predicted_compute_s=self._predicted_compute(run_plan), recompiles=e.recompiles,
                node_sizes=list(self.node_sizes), **e.attention,
            ).to_json()
            if not math.isfinite(loss) or e.step in last_of_bad:
                rec["nonfinite"] = True  # its loss or its group's gradients: not applied, its samples quarantined
            if self.split is not None:
                rec["expert"] = e.expert  # 0: the high-noise transformer, 1: transformer_2
            records.append(rec)
            if self.metrics is not None:
                self.metrics.append(rec)
                self.sinks.log(e.step, scalars_of(rec))
                if e.step % cfg.metrics.log_every == 0:
                    err = rec["prediction_error"]
                    logger.info(
                        "step %d loss %.4f (rel %.3f) tokens/s %.0f imbalance %.2f->%.3f compute max/mean %.2f wait %.1f%%%s%s",
                        e.step, rec["loss"], rec["loss_rel"], rec["tokens_per_s"], rec["baseline_imbalance_planned"],
                        rec["imbalance_planned"], rec["compute_max_over_mean"], 100 * rec["wait_plan_frac"],
                        "" if err is None else f" predicted compute off {err:.1%}",
                        "" if self.per_step_node is None else f" topology {rec['topology']}",
                    )
                    if self.split is not None:
                        logger.info("step %d trained expert %s", e.step, self.experts[e.expert].name)
        for j, (members, _) in enumerate(groups):
            self._commit(members, finite=totals[f"bad.{j}"] == 0)
        if records:
            self.ctx.report({"step": records[-1]["step"], **scalars_of(records[-1])})  # a barrier under Ray
        return records

    def _read_batch(self, stream: StepStream, step: int) -> tuple[DecodedStep, StepMeta, PackedBatch]:
        """The stream's next step (step ``step``), the metadata of the one after, and the
        step's packed batch on the host (its timesteps from the side of the expert it trains)."""
        current = stream.next_step()
        timesteps = self.experts[self._expert_for(step)].timesteps
        host_batch = build_packed_batch(current.samples, self.cfg.model, seed=self.cfg.data.seed, epoch=self.epoch,
                                        timesteps=timesteps, guidance=self.guidance,
                                        first_frame_share=self.cfg.flow.first_frame_share)
        return current, stream.peek_next(), host_batch

    def _take_batch(self, stream: StepStream) -> tuple[DecodedStep, StepMeta, PackedBatch]:
        """The batch the previous step read ahead from this stream, else read now. (A batch
        read ahead and never trained, at the end of a run, is dropped with its stream: what
        was trained is what the ledger says, never what a stream has read.)"""
        ahead, self._prefetched = self._prefetched, None
        if ahead is not None and ahead[0] is stream:
            return ahead[1:]
        return self._read_batch(stream, self.step)

    def _predicted_compute(self, plan: BalancePlan) -> list[float] | None:
        """Per-rank compute seconds the plan's cost model predicts (``planner: cost``)."""
        if not isinstance(plan.model, CostModel):
            return None
        times = plan.step_times()
        return (times.compute + times.overhead).tolist()

    def _reduce_gradients(self) -> torch.Tensor:
        """The accumulated gradients summed over ranks (FSDP reduced them in backward
        already); returns a 0-d device flag, 1 where this rank's gradients are not finite."""
        self.parallel.reduce_gradients(group=self.sync.group)
        return self.parallel.nonfinite_gradients()

    def _apply_gradients(self) -> None:
        """The optimizer step over the micro-steps accumulated so far: gradients (summed over
        ranks by ``_reduce_gradients``) averaged over the micro-steps, clipped, applied; then
        the LR schedule and the EMA. Whether every micro-step's loss and the gradients were
        finite is summed over ranks on the device, and a non-finite group is not applied:
        the fused optimizer skips it on the device (``found_inf``) and the EMA keeps its
        shadow, so the host never waits here; another optimizer has the host read the flag
        first. The group waits for the next ``_read`` to enter the ledger (``_commit``)."""
        n = self.micro_steps
        if not n:
            return
        bad = self.sync.sum_on_device(self.group_bad + self._reduce_gradients().to(self.group_bad.device))
        if n > 1:  # each micro-step's loss is a mean over its own tokens: average them
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(n)
        skipped = (bad > 0).to(torch.float32)
        if self.device_skip:
            if self.cfg.optim.grad_clip > 0:
                self.parallel.clip_grad_norm_(self.cfg.optim.grad_clip)
            self.optimizer.found_inf = skipped  # read by the fused kernel: no update, its step count kept
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
            if self.ema is not None:
                self.ema.update(self.model, skipped=skipped)
        elif not bool(skipped):  # the host reads the flag: free on a CPU, a sync on a GPU
            if self.cfg.optim.grad_clip > 0:
                self.parallel.clip_grad_norm_(self.cfg.optim.grad_clip)
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update(self.model)
        elif self.ema is not None:
            self.ema.num_updates += 1  # taken back by _commit, as the device path's count is
        for e in self.experts:  # a skipped update keeps its place in the schedule (a resume counts steps)
            e.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.parallel.after_optimizer_step()
        self.applied.append((list(self.pending), bad))
        self.pending.clear()
        self.micro_steps = 0
        self.group_bad = torch.zeros((), device=self.device)

    def _commit(self, members: list[_Unread], finite: bool) -> None:
        """An optimizer step's micro-steps enter the ledger (a step is committed once its
        update is done: applied, or skipped as non-finite with its samples quarantined; they
        were drawn, a resume must not draw them again). After ``MAX_NONFINITE_STEPS`` skipped
        optimizer steps in a row every rank raises ``NonFiniteSteps``."""
        steps = [e.step for e in members]
        if not finite:
            if self.ema is not None:
                self.ema.uncount(1)
            for e in members:
                self.guard.on_nonfinite(e.step, e.meta.sample_ids)
            logger.warning("steps %s: the loss or the gradients were not finite: their update was not applied and "
                           "this rank's samples of them were quarantined (%s)", steps, self.guard.path)
        self.nonfinite_run = [] if finite else [*self.nonfinite_run, steps]
        for e in members:
            self.ledger.committed(e.step, e.epoch, e.planned, e.meta, e.expert)
        if len(self.nonfinite_run) >= MAX_NONFINITE_STEPS:
            raise NonFiniteSteps(
                f"the loss or the gradients were not finite at steps "
                f"{', '.join(str(t) for group in self.nonfinite_run for t in group)} in a "
                f"row (their updates not applied, their samples quarantined in {self.run_dir}/quarantine-rank*.jsonl): "
                "the model diverged (lower optim.lr, set optim.grad_clip) or the corpus holds values it cannot take "
                "(huge latents?); the run stopped at its last checkpoint")

    # ---- Stateful: what trainer.json holds ---------------------------------------------

    def state_dict(self) -> dict:
        """The trainer's part of a checkpoint (JSON; the checkpointer adds the step): the
        epoch, where it ran, and the ledger's position or the rows it could not hand over."""
        return {"epoch": self.epoch, "world_size": self.world, "topology": self.topology.spec,
                **self.ledger.state_dict(),  # "ledger" (its position), "ledger_rows" (rows carried)
                **({"lora_base": self.lora_base} if self.lora_base else {}),
                **({"experts": self._experts_state()} if self.split is not None else {})}

    def _experts_state(self) -> dict:
        """trainer.json's ``experts``: the boundary, the high-noise expert's share of steps,
        and each expert's name and LoRA base (``weights.checks.base_record``)."""
        return {"boundary": self.split.boundary, "share": self.split.high_share(self.cfg.flow.distribution()),
                "names": [e.name for e in self.experts],
                "lora_bases": [e.lora_base for e in self.experts]}

    def load_state_dict(self, state: dict) -> None:
        """Resume after the checkpoint's step (``trainer.json``, checked as data on read)."""
        step = int(state["step"])
        self.step, self.epoch = step + 1, int(state["epoch"])
        self.resumed_from = self.last_saved = step
        self.saved_epoch = self.epoch
        self.ledger.load_state_dict(state)  # its "ledger" and "ledger_rows"

    def close(self) -> None:
        """Flush and close what the run holds open: the profiler window, the metric sinks,
        the local ledger (idempotent)."""
        self.profiler.close()
        if getattr(self, "validator", None) is not None:
            self.validator.close()  # its pictures go to the sinks: before they close
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None
        self.ledger.close()

    def _save(self, step: int) -> None:
        """A checkpoint covering every step <= ``step`` (the ledger first: rank 0 hands
        over the rows of locally planned steps and waits for the coordinator's commit, so
        the ledger position it records is durable and covers every step the checkpoint
        does; rows the coordinator cannot take now travel in the checkpoint instead)."""
        self.ledger.settle(step)
        self.checkpointer.save(step, barrier=self.sync.barrier)
        self.last_saved, self.saved_epoch = step, self.epoch


def _loss_tokens(host_batch: PackedBatch) -> int:
    """The image tokens a host batch's loss covers (all, or its ``loss_tokens``)."""
    mask = host_batch.loss_tokens
    return host_batch.x_img.shape[0] if mask is None else int(mask.sum())


def _attention_fields(choice) -> dict:
    """The step record's ``attention`` and ``attention_reason`` (none: a step without tokens)."""
    return {} if choice is None else {"attention": choice.backend, "attention_reason": choice.reason}


@dataclass(eq=False)
class _Unread:
    """A step trained whose numbers wait on the device for the next ``Trainer._read``."""

    step: int
    epoch: int
    planned: Planned
    meta: StepMeta
    plan: BalancePlan
    """The plan the step ran (the identity plan when balancing is off)."""
    timer: StepTimer
    numbers: torch.Tensor
    """(loss, zero-velocity loss) of this rank, on the device."""
    tokens: int
    lr: float
    attention: dict
    recompiles: int
    peak_mem_gib: float | None
    started: float = 0.0
    """``time.perf_counter()`` at the step's start."""
    expert: int = 0
    """The expert it trained (``Trainer.experts``)."""


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group of ``optimizer`` runs torch's fused kernel (which takes
    ``found_inf`` and skips a non-finite update on the device)."""
    return all(g.get("fused") for g in optimizer.param_groups)
