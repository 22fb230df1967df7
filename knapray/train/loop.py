"""The per-worker training loop. Runs under Ray Train, torchrun or a test: it takes rank,
world size, rows, reporting and checkpoints from a ``TrainContext`` and never imports
ray.train.

One step on one rank:

1. take this step's samples from the ``StepStream`` and send the *next* step's lengths to
   the coordinator (fire and forget), so its plan is ready when the next step starts;
2. get this step's plan (waiting is measured; usually it is already there);
3. one tiny all-reduce agrees on the global image-token count and on whether every rank
   got the plan; if any did not, all ranks plan locally from an all-gather of lengths
   with the same solver, so no rank hangs and every rank uses the same plan;
4. balanced forward + backward (``balanced_forward``), gradients summed across ranks
   together with the loss and per-rank timings (one collective), clip, AdamW;
5. rank 0 commits the step to the ledger; every ``checkpoint_every`` steps it writes a
   checkpoint (model, optimizer, step, coordinator state) that every rank resumes from.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from knapray.coordinator import (
    BalanceCoordinator,
    CoordinatorConfig,
    make_planning_model,
    CoordinatorClient,
    CoordinatorUnavailable,
    is_epoch_done,
    plan_from_gathered,
)
from knapray.data import StepStream, batch_generator, build_packed_batch, check_model_config, corpus_info
from knapray.distributed import BagGroups
from knapray.distributed.grads import allreduce_gradients
from knapray.distributed.step_sync import StepSync
from knapray.models import MMDiT
from knapray.models.flops import model_flops
from knapray.models.flow import flow_loss
from knapray.planning import BalancePlan, Topology, identity_plan
from knapray.timing import StepTimer

from .balanced import balanced_forward
from .config import TrainConfig
from .context import TrainContext

logger = logging.getLogger(__name__)


def coordinator_name(cfg: TrainConfig) -> str:
    return f"knapray-coordinator-{cfg.run.name}"


STATE_FILE = "state.pt"


@dataclass
class StepRecord:
    step: int
    loss: float
    loss_rel: float
    """Loss over the loss of predicting zero velocity on the same batch."""
    tokens: int
    seconds: float
    imbalance: float
    baseline_imbalance: float
    compute_s: list[float]
    comm_s: list[float]
    wait_plan_s: float
    planned_by: str
    rank_work: list[float]
    baseline_rank_work: list[float]
    topology: str = ""
    flops: float = 0.0
    """Model FLOPs of the step over all ranks (``knapray.models.flops``)."""
    clock: str = ""
    """What measured compute_s / comm_s: ``cuda_events`` or ``thread_time``."""
    peak_mem_gib: float | None = None
    """Rank 0's peak allocated device memory so far (CUDA only)."""

    def to_json(self) -> dict:
        compute = np.asarray(self.compute_s)
        return {
            "step": self.step,
            "loss": self.loss,
            "loss_rel": self.loss_rel,
            "tokens": self.tokens,
            "step_s": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0,
            "imbalance_planned": self.imbalance,
            "baseline_imbalance_planned": self.baseline_imbalance,
            "compute_s": self.compute_s,
            "compute_max_over_mean": float(compute.max() / compute.mean()) if compute.mean() > 0 else 1.0,
            "comm_s": self.comm_s,
            "wait_plan_s": self.wait_plan_s,
            "wait_plan_frac": self.wait_plan_s / self.seconds if self.seconds > 0 else 0.0,
            "planned_by": self.planned_by,
            "rank_work": self.rank_work,
            "baseline_rank_work": self.baseline_rank_work,
            "world_size": len(self.rank_work),
            "topology": self.topology,
            "model_tflops": self.flops / self.seconds / 1e12 if self.seconds > 0 else 0.0,
            "model_tflops_per_gpu": self.flops / self.seconds / 1e12 / len(self.rank_work) if self.seconds > 0 else 0.0,
            "clock": self.clock,
            "peak_mem_gib": self.peak_mem_gib,
        }


def _split_lengths(plan: BalancePlan) -> list[list[int]]:
    offs = plan.seq_offsets.tolist()
    lens = plan.seq_lens.tolist()
    return [lens[offs[r] : offs[r + 1]] for r in range(plan.world_size)]


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


def _workload(cfg: TrainConfig):
    return make_planning_model(CoordinatorConfig(**coordinator_config(cfg)))


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """``run.precision`` on ``device``: ``auto`` is bf16 on CUDA and fp32 elsewhere."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def _choose_topology(cfg: TrainConfig, client: CoordinatorClient | None, sync: StepSync,
                     resume_step: int | None, coord_state: dict | None) -> Topology:
    """Rank 0 starts the coordinator's run (it answers with the topology for this world),
    everyone waits on a barrier, then asks. Without a coordinator, the same rule locally."""
    topo = None
    world = sync.world_size
    if client is not None:
        try:
            if sync.rank == 0:
                client.begin_run(world, resume_step=resume_step, state=coord_state)
            sync.barrier()
            topo = client.topology()
        except CoordinatorUnavailable:
            topo = None
    if topo is None:
        local = BalanceCoordinator(world_size=world, **coordinator_config(cfg))
        topo = local.topology_for(world)
    # Every rank must build the same groups: agree on rank 0's answer.
    return Topology.parse(sync.broadcast_object(topo.spec), world_size=world)


def _load_checkpoint(path: str) -> dict:
    return torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=False)


def train_loop(ctx: TrainContext, cfg: TrainConfig) -> dict:
    """Train; returns rank 0's summary (other ranks return their own partial view)."""
    rank, world = ctx.rank, ctx.world_size
    device = ctx.device(cfg.run.use_gpu)
    sync = StepSync.build(device)
    dtype = compute_dtype(cfg.run.precision, device)
    run_dir = cfg.run_dir
    os.makedirs(run_dir, exist_ok=True)
    info = corpus_info(cfg.data.corpus)
    check_model_config(info, cfg.model)

    torch.manual_seed(cfg.data.seed)  # the same initial model on every rank
    model = MMDiT(cfg.model).to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )
    state = ctx.load_checkpoint(_load_checkpoint)
    start_step, trained_ids, coord_state = 0, set(), None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_step = state["step"] + 1
        coord_state = state["coordinator"]
        trained_ids = {int(i) for i in state["trained_ids"]}

    client = (
        CoordinatorClient(coordinator_name(cfg), None, rank=rank, timeout_s=cfg.balance.coordinator_timeout_s)
        if cfg.balance.coordinator
        else None
    )
    topo = _choose_topology(cfg, client, sync, start_step - 1 if state else None, coord_state)
    groups = BagGroups.build(topo, cfg.model.num_heads) if cfg.balance.enabled else None
    workload = _workload(cfg)
    if rank == 0:
        logger.info("topology %s for %d ranks (balance %s)", topo, world, cfg.balance.enabled)

    quarantine_path = os.path.join(run_dir, f"quarantine-rank{rank}.jsonl")
    os.makedirs(os.path.join(run_dir, "pids"), exist_ok=True)
    with open(os.path.join(run_dir, "pids", f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))  # for operators (and the chaos script) to find workers
    max_seq_len = cfg.data.max_tokens_per_gpu * max(topo.bags) if cfg.data.max_tokens_per_gpu else None

    def quarantine(sample_id, reason: str) -> None:
        with open(quarantine_path, "a") as f:
            f.write(json.dumps({"sample_id": int(sample_id) if sample_id is not None else None,
                                "reason": reason, "rank": rank}) + "\n")

    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    records: list[dict] = []
    step = start_step
    # Rank 0: ledger rows of steps planned locally, until the coordinator takes them.
    pending_rows: dict[int, tuple[list[int], list[int]]] = {}
    # This rank's sample ids of recent steps: if the coordinator dies, commits sent to it
    # in the meantime are lost, so rank 0 re-records these steps once it is back.
    recent_ids: dict[int, list[int]] = {}
    bad_total = rows_total = 0  # this rank's quarantined / read rows so far
    world_bad = [0.0, 0.0]  # the same, summed over ranks
    for epoch in range(cfg.data.epochs):
        stream = StepStream.for_corpus(
            ctx.rows(epoch), info, samples_per_step=cfg.data.samples_per_step,
            on_corrupt=quarantine, skip_sample_ids=trained_ids, max_seq_len=max_seq_len,
        )
        nxt = stream.peek_next()
        if client is not None:
            client.submit_async(step, list(nxt.seq_lens), list(nxt.sample_ids), exhausted=nxt.exhausted)
        while True:
            if cfg.run.max_steps and step >= cfg.run.max_steps:
                break
            t_step = time.perf_counter()
            current = stream.next_step()
            nxt = stream.peek_next()
            if client is not None:  # plan step+1 while this step computes, and ask for it
                client.submit_async(step + 1, list(nxt.seq_lens), list(nxt.sample_ids), exhausted=nxt.exhausted)
                client.request_plan(step + 1)
            t_wait = time.perf_counter()
            plan, done, got = None, False, 0
            if client is not None:
                try:
                    plan, done = client.get_plan(step)
                    got = 1
                except CoordinatorUnavailable as e:
                    logger.warning("rank %d: coordinator unavailable at step %d (%s); planning locally", rank, step, e)
            wait_s = time.perf_counter() - t_wait
            batch = build_packed_batch(
                current.samples, cfg.model, generator=batch_generator(cfg.data.seed, step, rank)
            ).to(device)
            st = stream.stats
            agree, _ = sync.sum_over_ranks(summed={
                "img_tokens": batch.x_img.shape[0], "have_plan": got,
                "bad_rows": st.corrupt - bad_total, "rows": st.samples + st.corrupt - rows_total,
            })
            bad_total, rows_total = st.corrupt, st.samples + st.corrupt
            _check_bad_fraction(agree, world_bad, cfg, run_dir, step)
            planned_by = "coordinator"
            if int(agree["have_plan"]) < world:  # someone lacks the plan: everyone plans locally
                planned_by = "local"
                gathered = sync.gather_objects(
                    (list(current.meta.seq_lens), list(current.meta.sample_ids), current.meta.exhausted, recent_ids),
                )
                lens = [g[0] for g in gathered]
                done = is_epoch_done(lens, [g[2] for g in gathered])
                plan = None if done else plan_from_gathered(lens, topo, workload, cfg.balance.solver)
                if rank == 0:
                    # Steps the lost coordinator may never have committed (resent rows of
                    # steps it did commit are ignored), then this locally planned one.
                    for t in sorted(set().union(*(g[3] for g in gathered))):
                        pending_rows.setdefault(t, (
                            [sid for g in gathered for sid in g[3].get(t, [])],
                            [r for r, g in enumerate(gathered) for _ in g[3].get(t, [])],
                        ))
                    if not done:
                        pending_rows[step] = (
                            [sid for g in gathered for sid in g[1]],
                            [r for r, g in enumerate(gathered) for _ in g[1]],
                        )
                if client is not None:
                    # The coordinator (restarted, or back) may have lost the prefetched
                    # submission of the next step: send it again (resends are ignored).
                    client.forget_requests()
                    client.submit_async(step + 1, list(nxt.seq_lens), list(nxt.sample_ids), exhausted=nxt.exhausted)
            elif rank == 0 and pending_rows and client is not None:
                _flush_pending(client, pending_rows)
            if done:
                break
            global_img = int(agree["img_tokens"])
            run_plan = plan if cfg.balance.enabled else identity_plan(_split_lengths(plan), workload)

            # ---- compute ----
            with StepTimer(device) as timer:
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    out = balanced_forward(
                        model, batch, run_plan, rank,
                        bag_group=groups.bag_group if groups else None,
                        route_group=groups.balance_group if groups else None,
                    )
                    loss = flow_loss(out, batch.targets, max(global_img, 1))
                loss.backward()
            allreduce_gradients(model.parameters(), group=sync.group)
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            # The optimizer step is queued: now wait for the step's own kernels (once) and
            # gather the numbers of the step in one collective.
            took = timer.result()
            # The loss of predicting zero velocity on the same batch: the loss over it is
            # 1.0 at initialization (adaLN-zero) and falls as the model learns, free of the
            # step-to-step variance of the data and the timesteps.
            zero_loss = flow_loss(torch.zeros_like(batch.targets), batch.targets, max(global_img, 1))
            totals, per_rank = sync.sum_over_ranks(
                summed={"loss": loss.detach(), "zero_loss": zero_loss, "tokens": int(batch.seq_lens.sum())},
                per_rank={"compute_s": took.compute_s, "comm_s": took.comm_s},
            )
            if rank == 0 and client is not None and planned_by == "coordinator":
                client.commit_async(step)
            if client is not None:
                client.report_timing_async(step, took.compute_s, took.comm_s, wait_s)
            rec = StepRecord(
                step=step, loss=totals["loss"], loss_rel=totals["loss"] / max(totals["zero_loss"], 1e-30),
                tokens=int(totals["tokens"]),
                seconds=time.perf_counter() - t_step, imbalance=run_plan.imbalance,
                baseline_imbalance=run_plan.baseline_imbalance,
                compute_s=per_rank["compute_s"], comm_s=per_rank["comm_s"],
                wait_plan_s=wait_s, planned_by=planned_by,
                rank_work=run_plan.rank_work.tolist(), baseline_rank_work=run_plan.baseline_rank_work.tolist(),
                topology=str(topo), flops=model_flops(run_plan.seq_lens.tolist(), cfg.model), clock=took.clock,
                peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            ).to_json()
            records.append(rec)
            trained_ids.update(int(i) for i in current.meta.sample_ids)
            recent_ids[step] = [int(i) for i in current.meta.sample_ids]
            if len(recent_ids) > 32:
                recent_ids.pop(min(recent_ids))
            if rank == 0:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                if step % cfg.run.log_every == 0:
                    logger.info(
                        "step %d loss %.4f tokens/s %.0f imbalance %.2f->%.3f compute max/mean %.2f wait %.1f%%",
                        step, rec["loss"], rec["tokens_per_s"], rec["baseline_imbalance_planned"],
                        rec["imbalance_planned"], rec["compute_max_over_mean"], 100 * rec["wait_plan_frac"],
                    )
            ckpt_dir = None
            due = cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0
            if due:
                ckpt_dir = _save_checkpoint(sync, step, model, opt, client, trained_ids)
            ctx.report({"step": step, "loss": rec["loss"], "epoch": epoch}, ckpt_dir)
            step += 1
        if cfg.run.max_steps and step >= cfg.run.max_steps:
            break
    summary = {"steps": step, "records": records, "topology": str(topo), "world_size": world,
               "quarantined": bad_total}
    if rank == 0 and client is not None:
        try:
            _flush_pending(client, pending_rows)
            if step > start_step:
                client.commit(step - 1)
            summary["ledger"] = client.state_dict()["ledger"]
        except CoordinatorUnavailable as e:
            logger.error("coordinator unreachable at the end of the run: ledger not written (%s)", e)
    return summary


def _flush_pending(client: CoordinatorClient, pending: dict[int, tuple[list[int], list[int]]]) -> None:
    """Hand the coordinator the ledger rows of locally planned steps (rank 0)."""
    for t in sorted(pending):
        try:
            client.record_external(t, *pending[t])
        except CoordinatorUnavailable:
            return  # still away: try again after the next step
        del pending[t]


def _check_bad_fraction(agree: dict[str, float], totals: list[float], cfg: TrainConfig, run_dir: str,
                        step: int) -> None:
    """Every rank sees the same summed counts, so every rank raises together."""
    totals[0] += agree["bad_rows"]
    totals[1] += agree["rows"]
    if totals[1] >= 16 and totals[0] > cfg.data.max_bad_fraction * totals[1]:
        raise RuntimeError(
            f"corpus {cfg.data.corpus!r} is mostly bad: {int(totals[0])} of {int(totals[1])} rows read by step "
            f"{step} were quarantined (limit data.max_bad_fraction={cfg.data.max_bad_fraction}); reasons are "
            f"in {run_dir}/quarantine-rank*.jsonl"
        )


def _save_checkpoint(sync: StepSync, step, model, opt, client, trained_ids) -> str | None:
    """Rank 0 writes the checkpoint; every rank contributes its trained ids first."""
    ids = sync.gather_objects(sorted(trained_ids))
    if sync.rank != 0:
        return None
    coord_state = None
    if client is not None:
        try:
            client.commit(step)  # the checkpoint covers steps <= step
            coord_state = client.state_dict()
        except CoordinatorUnavailable:
            coord_state = None
    all_ids = sorted(set().union(*map(set, ids)))
    path = tempfile.mkdtemp(prefix=f"knapray-ckpt-{step}-")
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
         "coordinator": coord_state, "trained_ids": all_ids},
        os.path.join(path, STATE_FILE),
    )
    return path
