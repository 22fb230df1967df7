"""The measured part of ``knapray bench serve``: the mixed stream served for real by ``ranks``
local gloo processes running the code ``knapray serve``'s gang runs (``worker.denoise.
denoise_bag`` on blocks of ranks), decided by the policy ``knapray serve`` runs and the
simulator predicts (``planning.inference.scheduler.BagScheduler``):

- ``knapray``: every aligned block of 1, 2 or 4 ranks (``planning.shapes.blocks.blocks_of``),
  each request to the block where it would finish earliest, oldest first, with backfilling;
  a block runs one request at a time and takes the next when it finishes;
- ``usp``: one block of all ranks, first in first out (static USP, as xDiT serves);
- ``dp``: blocks of one rank, first in first out (data parallel);
- ``batches``: the gang before continuous batching: when every rank is free, the waiting
  requests (at most ``WINDOW``) planned over the halving bags (``g2n1+g1n2`` for 4 ranks),
  each bag running its requests packed in one loop, and the next batch after the last bag.

A driver process keeps the clock and the scheduler; it sends a block's ranks the request it
starts and hears back when each of them is done (the block's lead with the finish time).
The decisions use the seconds measured first: every kind alone on a block of every size,
all blocks of a size at once (on a shared machine the contention is in the number).

**The stream at CPU scale** (``CPU_MIX``): the issue's kinds with their token counts over
16 and steps over 7 (a tiny MMDiT: width 64, 4 heads, 2 blocks, 8 text tokens): 512² -> 64
image tokens, 1024² -> 256, 1024x576 -> 144, 2048² -> 1,024, each 4 steps, one pass; the
480p clip -> 2,048 tokens (16 latent frames of 16x32), 7 steps, two passes (classifier-free
guidance). **Load** is relative to the capacity measured first on one rank per kind,
``capacity = ranks / Σ share · seconds``.
"""

from __future__ import annotations

import queue as queue_module
import time
from dataclasses import dataclass

import numpy as np

from knapray.planning.inference.sampling import halving_topology
from knapray.planning.inference.serving import Served, request_stream

WINDOW = 16
"""The most requests one batch takes."""


@dataclass(frozen=True)
class CpuKind:
    name: str
    latent: tuple[int, int, int]
    """(T, H, W) of the latent (4 channels, patches 1x2x2)."""
    steps: int
    passes: int
    weight: float


CPU_MIX = (
    CpuKind("512x512", (1, 16, 16), 4, 1, 0.30),
    CpuKind("1024x1024", (1, 32, 32), 4, 1, 0.30),
    CpuKind("1024x576", (1, 18, 32), 4, 1, 0.20),
    CpuKind("2048x2048", (1, 64, 64), 4, 1, 0.10),
    CpuKind("480p clip", (16, 16, 32), 7, 2, 0.10),
)
TEXT_TOKENS = 8


POLICY_ORDERS = {"knapray": "balanced", "usp": "fifo", "dp": "fifo"}


def policy_blocks(policy: str, ranks: int) -> tuple[tuple[int, int], ...]:
    """The blocks (first rank, size) a policy serves on (``batches``: the halving bags)."""
    from knapray.planning import Topology
    from knapray.planning.shapes.blocks import blocks_of

    if policy == "knapray":
        return blocks_of(ranks, tuple(g for g in (1, 2, 4, 8) if g <= ranks and 4 % g == 0))
    if policy == "usp":
        return ((0, ranks),)
    if policy == "dp":
        return tuple((r, 1) for r in range(ranks))
    if policy == "batches":
        topo = Topology.parse(halving_topology(ranks, 4), world_size=ranks)
        return tuple((int(topo.bag_starts[b]), int(topo.bag_sizes[b])) for b in range(topo.num_bags))
    raise ValueError(f"policy {policy!r}: one of knapray, usp, dp, batches")


def _spec(first: int, size: int, ranks: int) -> tuple[str, int]:
    """(topology whose bag this block is, the bag): bags of one size tile the ranks."""
    return f"g{size}n{ranks // size}", first // size


def _model():
    import torch

    from knapray.models import MMDiT, MMDiTConfig

    cfg = MMDiTConfig(in_channels=4, patch_size=(1, 2, 2), hidden_size=64, num_heads=4, depth_double=1,
                      depth_single=1, text_dim=16, pooled_dim=16, rope_axes_dim=(4, 6, 6))
    torch.manual_seed(0)
    model = MMDiT(cfg)
    model.init_weights(std=0.02)
    return model.eval()


def _job(cfg, kind: CpuKind, seed: int):
    from knapray.models.sampling import denoise_job, job_noise

    rng = np.random.default_rng(seed)
    cond = (rng.standard_normal((TEXT_TOKENS, cfg.text_dim)).astype(np.float32),
            rng.standard_normal(cfg.pooled_dim).astype(np.float32))
    (noise,) = job_noise(cfg, [kind.latent], [seed])
    return denoise_job(cfg, noise, cond, steps=kind.steps, guidance=2.0 if kind.passes == 2 else 1.0, shift=1.0,
                       unconditional=None)


def _calibrate(model, groups: dict, rank: int, ranks: int, blocks) -> np.ndarray:
    """(kinds, blocks) seconds of every kind alone on every block: for each block size, every
    block of that size runs the kind at once (the faster of two runs), every rank times it."""
    import torch.distributed as dist

    from knapray.worker.denoise import denoise_bag

    sizes = sorted({g for _, g in blocks})
    per_size = np.zeros((len(CPU_MIX), len(sizes)))
    for j, g in enumerate(sizes):
        spec, _ = _spec(0, g, ranks)
        for k, kind in enumerate(CPU_MIX):
            job = _job(model.cfg, kind, k)
            best = float("inf")
            for _ in range(2):
                dist.barrier()
                t = time.perf_counter()
                denoise_bag(model, [job], groups[spec], cfg_parallel=True)
                best = min(best, time.perf_counter() - t)
            per_size[k, j] = best
    every: list = [None] * ranks
    dist.all_gather_object(every, per_size)
    per_size = np.max(every, axis=0)  # a block's time: its slowest rank's
    return per_size[:, [sizes.index(g) for _, g in blocks]]


def _worker(rank: int, ranks: int, port: int, blocks, inbox, outbox) -> None:
    """One rank: calibrate with the others, then run what the driver sends its blocks."""
    import torch.distributed as dist

    from knapray.distributed.local import init_local_gloo
    from knapray.worker.denoise import SamplingGroups, denoise_bag

    init_local_gloo(rank, ranks, port)
    try:
        model = _model()
        specs = sorted({_spec(first, g, ranks)[0] for first, g in blocks} | {f"g1n{ranks}"})
        groups = SamplingGroups.build_all(specs, ranks, rank)
        seconds = _calibrate(model, groups, rank, ranks, blocks)
        one = _calibrate(model, groups, rank, ranks, tuple((r, 1) for r in range(ranks)))[:, 0]
        outbox.put(("calibrated", rank, seconds, one))
        while True:
            cmd = inbox.get()
            if cmd[0] == "stop":
                break
            _, block, keys, djobs = cmd
            first, g = blocks[block]
            spec, bag = _spec(first, g, ranks)
            assert groups[spec].bag == bag, (rank, block, spec)
            stats: dict = {}
            latents = denoise_bag(model, djobs, groups[spec], cfg_parallel=True, stats=stats)
            left = [stats["left_at"][k] for k in range(len(keys))] if latents else None  # the lead's
            outbox.put(("done", rank, block, keys, time.monotonic(), left))
    finally:
        dist.destroy_process_group()


class _Gang:
    """The driver's side of the local ranks: start, send a block its requests, hear back."""

    def __init__(self, ranks: int, blocks) -> None:
        import multiprocessing

        import torch.multiprocessing as mp

        from knapray.distributed.local import free_port

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
        self.ranks, self.blocks = ranks, blocks
        self.inboxes = [ctx.Queue() for _ in range(ranks)]
        self.outbox = ctx.Queue()
        self.procs = mp.start_processes(_worker_entry, args=(ranks, free_port(), blocks, self.inboxes, self.outbox),
                                        nprocs=ranks, join=False, start_method="forkserver")
        got = [self._get(600) for _ in range(ranks)]
        self.seconds = got[0][2]  # every rank holds the gathered numbers
        self.one = got[0][3]
        self.pending: dict[int, set[int]] = {}
        self._finish: dict[int, float] = {}

    def _get(self, timeout: float):
        try:
            return self.outbox.get(timeout=timeout)
        except queue_module.Empty:
            raise RuntimeError("a rank of the measured gang stopped answering") from None

    def start(self, block: int, keys: list[int], djobs: list) -> None:
        first, g = self.blocks[block]
        self.pending[block] = set(range(first, first + g))
        for r in range(first, first + g):
            self.inboxes[r].put(("run", block, keys, djobs))

    def wait(self, timeout: float) -> list[tuple[int, list[int], list[float]]]:
        """Blocks whose every rank is done (block, its requests, when each left the lead's
        loop), waiting at most ``timeout`` for the first."""
        done, finish = [], self._finish
        try:
            msg = self.outbox.get(timeout=max(timeout, 0.0))
        except queue_module.Empty:
            return done
        while True:
            _, rank, block, keys, at, left = msg
            if left is not None:  # the lead's: when each request left its loop
                finish[block] = left
            self.pending[block].discard(rank)
            if not self.pending[block]:
                del self.pending[block]
                done.append((block, keys, finish.pop(block)))
            try:
                msg = self.outbox.get_nowait()
            except queue_module.Empty:
                return done

    def close(self) -> None:
        for box in self.inboxes:
            box.put(("stop",))
        self.procs.join()


def _worker_entry(rank: int, ranks: int, port: int, blocks, inboxes, outbox) -> None:
    _worker(rank, ranks, port, blocks, inboxes[rank], outbox)


def _serve(gang: _Gang, policy: str, stream, jobs: list, t0: float) -> Served:
    """One stream served in real time on ``gang`` by ``policy``."""
    from knapray.planning.inference.scheduler import BagScheduler

    n, blocks = len(jobs), gang.blocks
    start, finish = np.full(n, np.nan), np.full(n, np.nan)
    ranks: list[tuple[int, ...]] = [()] * n
    if policy == "batches":
        return _serve_batches(gang, stream, jobs, t0)
    mine = policy_blocks(policy, gang.ranks)
    index = [blocks.index(b) for b in mine]  # the policy's blocks among the gang's
    sched = BagScheduler(mine, POLICY_ORDERS[policy])
    nxt, done = 0, 0
    while done < n:
        now = time.monotonic() - t0
        while nxt < n and stream.arrival[nxt] <= now:
            sched.add(nxt, float(stream.arrival[nxt]), gang.seconds[stream.kind[nxt]][index], jobs[nxt].steps)
            nxt += 1
        for b, keys in sched.decide(now):
            first, g = mine[b]
            for i in keys:
                start[i] = now
                ranks[i] = tuple(range(first, first + g))
            gang.start(index[b], keys, [jobs[i] for i in keys])
        wait = (stream.arrival[nxt] - now) if nxt < n else 600.0
        for block, keys, left in gang.wait(wait):
            for i, at in zip(keys, left):
                finish[i] = at - t0
            sched.finished(index.index(block), time.monotonic() - t0)
            done += len(keys)
    return Served(policy, gang.ranks, stream.arrival.copy(), start, finish, tuple(ranks), np.zeros(n),
                  plans=sched.decisions)


def _serve_batches(gang: _Gang, stream, jobs: list, t0: float) -> Served:
    """The batch-by-batch gang: when every rank is free, the waiting requests (at most
    ``WINDOW``) planned over the halving bags by ``plan_jobs``, each bag's requests packed in
    one loop, and the next batch after the last bag."""
    from knapray.planning import Topology
    from knapray.planning.inference.sampling import plan_jobs

    n = len(jobs)
    start, finish = np.full(n, np.nan), np.full(n, np.nan)
    ranks: list[tuple[int, ...]] = [()] * n
    topo = Topology.parse(halving_topology(gang.ranks, 4), world_size=gang.ranks)
    nxt, plans = 0, 0
    while nxt < n:
        now = time.monotonic() - t0
        if stream.arrival[nxt] > now:
            time.sleep(float(stream.arrival[nxt] - now))
            now = time.monotonic() - t0
        batch = []
        while nxt < n and stream.arrival[nxt] <= now and len(batch) < WINDOW:
            batch.append(nxt)
            nxt += 1
        plans += 1
        plan = plan_jobs([jobs[i].tokens for i in batch], [jobs[i].steps for i in batch],
                         [jobs[i].passes for i in batch], topo)
        for b in range(topo.num_bags):
            mine = [batch[k] for k in plan.jobs_of(b).tolist()]
            if mine:
                block = gang.blocks.index((int(topo.bag_starts[b]), int(topo.bag_sizes[b])))
                gang.start(block, mine, [jobs[i] for i in mine])
                for i in mine:
                    start[i] = now
                    ranks[i] = tuple(topo.bag_ranks(b))
        while gang.pending:
            for _, keys, left in gang.wait(600.0):
                for i, at in zip(keys, left):
                    finish[i] = at - t0
    return Served("batches", gang.ranks, stream.arrival.copy(), start, finish, tuple(ranks), np.zeros(n),
                  plans=plans)


def serve_measured(policies, loads: list[float], n: int, seed: int, ranks: int = 4) -> dict:
    """``{"served": {policy: [Served per load]}, "capacity": req/s, "seconds": per kind on one
    rank}``: every policy of ``policies`` serving the same ``n`` requests at each load (the
    same arrival rates) on one set of ``ranks`` local gloo processes, calibrated once."""
    policies = [policies] if isinstance(policies, str) else list(policies)
    for policy in policies:
        policy_blocks(policy, ranks)  # a bad policy before any process starts
    blocks = policy_blocks("knapray", ranks)  # every aligned block: every policy's bags are among them
    gang = _Gang(ranks, blocks)
    try:
        shares = np.array([k.weight for k in CPU_MIX])
        capacity = ranks / float(shares / shares.sum() @ gang.one)
        cfg = _model().cfg
        served: dict[str, list] = {p: [] for p in policies}
        for load in loads:
            stream = request_stream(n, load * capacity, seed, mix=CPU_MIX)
            jobs = [_job(cfg, CPU_MIX[int(k)], seed * 100_000 + i) for i, k in enumerate(stream.kind)]
            for policy in policies:
                sv = _serve(gang, policy, stream, jobs, time.monotonic())
                best = gang.seconds.min(axis=1)[stream.kind]
                served[policy].append(Served(sv.policy, ranks, sv.arrival, sv.start, sv.finish, sv.ranks, best,
                                             plans=sv.plans))
    finally:
        gang.close()
    return {"served": served, "capacity": capacity, "seconds": gang.one}
