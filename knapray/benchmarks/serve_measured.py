"""The measured part of ``knapray bench serve``: the mixed stream served for real by ``ranks``
local gloo processes (``worker.denoise``, the code ``knapray serve``'s gang runs), by the
three policies:

- ``knapray``: each batch planned by ``plan_jobs`` over the bags of the gang's default
  topology (``halving_topology``, 4 ranks: ``g2n1+g1n2``), CFG parallel on an even bag; or
  (``knapray_topology="auto"``) over the topology of least predicted makespan among
  ``planning.sampling.candidate_topologies`` (``g1n4``, ``g2n1+g1n2``, ``g2n2``, ``g4n1``);
- ``usp``: one bag of all ranks (``g{N}n1``), every request with Ulysses over all of them,
  both guidance passes in it (no CFG parallel), as static USP runs;
- ``dp``: ``N`` bags of one (``g1n{N}``), one request per rank, no communication.

All three serve the same way, so only the plan differs: rank 0 keeps the clock; when the
gang is free it takes the requests that have arrived (at most ``WINDOW``), or sleeps until
the next arrival; every rank draws the batch; a request's finish is when its bag's lead
has its latent. A bag that finishes early waits for the batch's last bag (the gang's
batch window: what ``knapray serve`` does).

**The stream at CPU scale** (``CPU_MIX``): the issue's kinds with their token counts over
16 and steps over 7 (a tiny MMDiT: width 64, 4 heads, 2 blocks, 8 text tokens): 512² -> 64
image tokens, 1024² -> 256, 1024x576 -> 144, 2048² -> 1,024, each 4 steps, one pass; the
480p clip -> 2,048 tokens (16 latent frames of 16x32), 7 steps, two passes (classifier-free
guidance). **Load** is relative to the capacity measured first: every rank times every
kind alone on one rank (all ranks at once, so on a shared machine the contention is in
the number), ``capacity = ranks / Σ share · seconds``.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from knapray.planning.sampling import halving_topology
from knapray.planning.serving import Served, request_stream

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


def topology_of(policy: str, ranks: int, knapray_topology: str | None = None) -> tuple[str, bool]:
    """(topology, CFG parallel) of a policy on ``ranks`` ranks (``knapray_topology``: the
    knapray policy's, ``auto`` or one spec; None: the gang's default, ``halving_topology``)."""
    if policy == "knapray":
        return knapray_topology or halving_topology(ranks, 4), True
    if policy == "usp":
        return f"g{ranks}n1", False
    if policy == "dp":
        return f"g1n{ranks}", False
    raise ValueError(f"policy {policy!r}: one of knapray, usp, dp")


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


def _calibrate(model) -> np.ndarray:
    """Seconds of every kind alone on this rank (the faster of two runs): a world of one
    rank, no group, the model run as ``sample_latents`` runs it."""
    from knapray.planning import Topology
    from knapray.worker.denoise import SamplingGroups, denoise_rank

    alone = SamplingGroups(Topology((1,)), rank=0, bag=0, whole=None, half=None)
    out = []
    for k, kind in enumerate(CPU_MIX):
        job = _job(model.cfg, kind, k)
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            denoise_rank(model, [job], alone, cfg_parallel=False)
            best = min(best, time.perf_counter() - t)
        out.append(best)
    return np.array(out)


def _rank(rank: int, world: int, port: int, policy: str, loads: list[float], n: int, seed: int, out: str,
          knapray_topology: str) -> None:
    import torch.distributed as dist

    from knapray.distributed.local import init_local_gloo
    from knapray.planning import Topology
    from knapray.planning.sampling import candidate_topologies
    from knapray.worker.denoise import SamplingGroups, batch_plan, denoise_rank

    init_local_gloo(rank, world, port)
    try:
        model = _model()
        spec, cfg_parallel = topology_of(policy, world, knapray_topology)
        specs = candidate_topologies(spec, world, model.cfg.num_heads)
        groups = SamplingGroups.build_all(specs, world, rank)
        seconds = _calibrate(model)
        every: list = [None] * world
        dist.all_gather_object(every, seconds)
        seconds = np.mean(every, axis=0)  # the ranks ran at once: the shared machine's speed
        shares = np.array([k.weight for k in CPU_MIX])
        capacity = world / float(shares / shares.sum() @ seconds)
        results = []
        for load in loads:
            stream = request_stream(n, load * capacity, seed, mix=CPU_MIX)
            jobs = [_job(model.cfg, CPU_MIX[int(k)], seed * 100_000 + i) for i, k in enumerate(stream.kind)]
            start, finish, bag_ranks = np.zeros(n), np.zeros(n), [()] * n
            served = np.zeros(n, dtype=bool)
            box = [time.monotonic()]
            dist.broadcast_object_list(box, src=0)
            t0 = box[0]
            while not served.all():
                box = [None]
                if rank == 0:
                    now = time.monotonic() - t0
                    waiting = np.flatnonzero(~served)
                    if stream.arrival[waiting[0]] > now:
                        time.sleep(float(stream.arrival[waiting[0]] - now))
                        now = time.monotonic() - t0
                    box = [(now, waiting[stream.arrival[waiting] <= now][:WINDOW].tolist())]
                dist.broadcast_object_list(box, src=0)
                now, batch = box[0]
                mine = denoise_rank(model, [jobs[i] for i in batch], groups, cfg_parallel=cfg_parallel)
                done = {batch[k]: time.monotonic() - t0 for k in mine}
                gathered: list = [None] * world
                dist.all_gather_object(gathered, done)
                for part in gathered:
                    for i, t in part.items():
                        finish[i] = t
                for i in batch:
                    start[i], served[i] = now, True
                chosen, plan = batch_plan(model.cfg, [jobs[i] for i in batch], specs, world)
                topo = Topology.parse(chosen, world_size=world)
                for k, i in enumerate(batch):
                    bag_ranks[i] = tuple(topo.bag_ranks(int(plan.bag[k])))
            best = seconds[stream.kind]
            results.append(Served(policy, world, stream.arrival.copy(), start, finish, tuple(bag_ranks), best))
        if rank == 0:  # plain arrays and JSON, read back without unpickling
            import json

            for j, sv in enumerate(results):
                np.savez(os.path.join(out, f"load{j}.npz"), arrival=sv.arrival, start=sv.start, finish=sv.finish,
                         best=sv.best, ranks=np.array([list(r) + [-1] * (world - len(r)) for r in sv.ranks]))
            with open(os.path.join(out, "measured.json"), "w") as f:
                json.dump({"capacity": capacity, "seconds": seconds.tolist(), "loads": len(results)}, f)
    finally:
        dist.destroy_process_group()


def serve_measured(policy: str, loads: list[float], n: int, seed: int, ranks: int = 4,
                   knapray_topology: str | None = None) -> dict:
    """``{"served": [Served per load], "capacity": req/s, "seconds": per kind}`` of ``policy``
    serving ``n`` requests at each load on ``ranks`` local gloo processes."""
    import json

    from knapray.distributed.local import free_port, spawn_local

    topology_of(policy, ranks)  # a bad policy before any process starts
    with tempfile.TemporaryDirectory(prefix="knapray-serve-bench-") as out:
        spawn_local(_rank, (ranks, free_port(), policy, list(loads), n, seed, out, knapray_topology), ranks)
        with open(os.path.join(out, "measured.json")) as f:
            doc = json.load(f)
        served = []
        for j in range(doc["loads"]):
            with np.load(os.path.join(out, f"load{j}.npz"), allow_pickle=False) as a:
                bag_ranks = tuple(tuple(int(r) for r in row if r >= 0) for row in a["ranks"])
                served.append(Served(policy, ranks, a["arrival"], a["start"], a["finish"], bag_ranks, a["best"]))
    return {"served": served, "capacity": doc["capacity"], "seconds": np.array(doc["seconds"])}
