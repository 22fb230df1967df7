"""A gang of sampling ranks that each hold a trained run's model once and draw batches of
jobs together (``worker.denoise``): local processes for ``knapray sample --world-size N``
(``sample_local``), Ray actors for ``knapray serve`` (``Gang``). gloo on CPUs, NCCL on GPUs.

Rank 0 resolves a batch (captions encoded, noise drawn: ``inference.prepare``); every
rank plans it the same way; each bag's lead decodes its own jobs' latents. A rank that dies
mid-batch loses the jobs of its bag only: the other bags never talk to it, and the gang
marks those jobs ``lost`` for the caller to retry on a restarted gang.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from knapray.inference.jobs import Job, RunRules
from knapray.planning.sampling import halving_topology


class SamplerRank:
    """One rank: the run's model (loaded once), its codecs, and its sampling groups."""

    def __init__(self, run_dir: str, checkpoint: str | None, rank: int, world_size: int, topology: str,
                 device: str = "cpu", ema: bool = True, cfg_parallel: bool = True) -> None:
        from knapray.driver.trained import load_weights, read_run
        from knapray.worker.checkpoint import check_checkpoint

        self.rank, self.world_size, self.spec = rank, world_size, topology
        self.cfg_parallel = cfg_parallel
        self.device = f"cuda:{_local_device(rank)}" if device.startswith("cuda") else device
        self.cfg, ckpt = read_run(run_dir, checkpoint)
        check_checkpoint(ckpt)
        self.model, self.ema = load_weights(self.cfg, ckpt, ema=ema, device=self.device)
        self.groups = None

    def join(self, address: str, port: int, timeout_s: float = 120.0) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        from knapray.planning.sampling import candidate_topologies
        from knapray.worker.denoise import SamplingGroups

        if self.device == "cpu":  # ranks share the cores
            torch.set_num_threads(1)
        if address in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("nccl" if self.device.startswith("cuda") else "gloo",
                                init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        specs = candidate_topologies(self.spec, self.world_size, self.model.cfg.num_heads)
        self.groups = SamplingGroups.build_all(specs, self.world_size, self.rank)

    @functools.cached_property
    def codecs(self) -> tuple[Any, Any, dict, tuple[np.ndarray, np.ndarray]]:
        from knapray.corpus.unconditional import unconditional_embeddings
        from knapray.inference.conditioning import corpus_codecs

        m = self.cfg.model
        text, decoder, dims = corpus_codecs(self.cfg.data.corpus, self.device)
        return text, decoder, dims, unconditional_embeddings(self.cfg.data.corpus, m.text_dim, m.pooled_dim)

    def prepare(self, jobs: list[Job], max_text_tokens: int = 256) -> list:
        """Each job's ``DenoiseJob``, or the error (a string) that rules it out."""
        from knapray.inference.prepare import denoise_jobs

        text, _, dims, uncond = self.codecs
        out: list = []
        for job in jobs:
            try:
                (dj,) = denoise_jobs(self.cfg, [job], text, uncond, down=int(dims.get("vae_downsample", 8)),
                                     max_text_tokens=max_text_tokens)
                out.append(dj)
            except ValueError as e:
                out.append(str(e))
        return out

    def run(self, djobs: list, decode: bool = True) -> dict[int, np.ndarray]:
        """This rank's part of the batch: the latents (``decode``: pictures (T, H, W, 3)
        uint8) of the jobs of the bag it leads."""
        from knapray.worker.denoise import denoise_rank

        latents = denoise_rank(self.model, djobs, self.groups, cfg_parallel=self.cfg_parallel)
        return {k: self.picture(z) for k, z in latents.items()} if decode else latents

    def picture(self, latent: np.ndarray) -> np.ndarray:
        from knapray.inference.images import preview

        decoder = self.codecs[1]
        return decoder.decode(latent) if decoder is not None else preview(latent)

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _local_device(rank: int) -> int:
    """The CUDA device of a rank: the one Ray gave the process, or the rank's own."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return 0 if visible and len(visible.split(",")) == 1 else rank


# ---- local processes: knapray sample --world-size N ----------------------------------------


def _local_rank(rank: int, world: int, port: int, args: tuple, out_dir: str) -> None:
    run_dir, checkpoint, ema, topology, device, cfg_parallel, djobs = args
    r = SamplerRank(run_dir, checkpoint, rank, world, topology, device, ema, cfg_parallel)
    r.join("127.0.0.1", port)
    try:
        # Plain arrays, read back without unpickling (job index -> latent).
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **{str(k): z for k, z in r.run(djobs, decode=False).items()})
    finally:
        r.leave()


def sample_local(run_dir: str, checkpoint: str | None, djobs: list, *, world_size: int, topology: str,
                 device: str = "cpu", ema: bool = True, cfg_parallel: bool = True) -> list[np.ndarray]:
    """Latents of ``djobs`` drawn by ``world_size`` local processes on ``topology``."""
    from knapray.distributed.local import free_port, spawn_local

    with tempfile.TemporaryDirectory(prefix="knapray-sample-") as out:
        args = (run_dir, checkpoint, ema, topology, device, cfg_parallel, djobs)
        spawn_local(_local_rank, (world_size, free_port(), args, out), world_size)
        got: dict[int, np.ndarray] = {}
        for r in range(world_size):
            with np.load(os.path.join(out, f"rank{r}.npz"), allow_pickle=False) as part:
                got.update({int(k): part[k] for k in part.files})
    missing = [k for k in range(len(djobs)) if k not in got]
    if missing:
        raise RuntimeError(f"jobs {missing} came back from no rank")
    return [got[k] for k in range(len(djobs))]


# ---- Ray actors: knapray serve -------------------------------------------------------------


@dataclass
class JobResult:
    frames: np.ndarray | None = None
    """(T, H, W, 3) uint8; T == 1 for an image."""
    error: str | None = None
    latent: np.ndarray | None = None
    """(C, T, H, W), instead of ``frames``, from ``generate(..., decode=False)``."""
    lost: bool = False
    """Its bag lost a rank mid-batch: the caller may retry it on a restarted gang."""


@functools.cache
def _actor_class():
    import ray

    return ray.remote(SamplerRank)


@dataclass
class Gang:
    """``world_size`` Ray actors holding the run's model, one process group."""

    run_dir: str
    world_size: int
    topology: str
    """A topology (default: ``halving_topology``), or ``auto``: each batch on the candidate of
    least predicted makespan (``planning.sampling.candidate_topologies``)."""
    rules: RunRules
    model_cfg: Any
    device: str = "cpu"
    checkpoint: str | None = None
    cfg_parallel: bool = True
    actors: list = field(default_factory=list)
    broken: bool = False
    """A rank failed: the next batch starts a new gang first."""
    last_topology: str | None = None
    """The topology of the last batch."""

    @classmethod
    def start(cls, run_dir: str, world_size: int, *, topology: str | None = None, device: str = "cpu",
              checkpoint: str | None = None, cfg_parallel: bool = True) -> "Gang":
        from knapray.driver.trained import read_run
        from knapray.distributed.groups import check_heads
        from knapray.inference.jobs import run_rules
        from knapray.planning import Topology
        from knapray.planning.sampling import candidate_topologies
        from knapray.worker.checkpoint import check_checkpoint

        cfg, ckpt = read_run(run_dir, checkpoint)
        check_checkpoint(ckpt)
        spec = topology or halving_topology(world_size, cfg.model.num_heads)
        for one in candidate_topologies(spec, world_size, cfg.model.num_heads):
            check_heads(cfg.model.num_heads, Topology.parse(one, world_size=world_size))
        gang = cls(run_dir, world_size, spec, run_rules(cfg), cfg.model, device, checkpoint, cfg_parallel)
        gang._spawn()
        return gang

    def _spawn(self) -> None:
        import ray

        from knapray.distributed.local import free_port

        gpu = self.device.startswith("cuda")
        cls = _actor_class().options(num_gpus=1 if gpu else 0, num_cpus=0 if not gpu else 1)
        self.actors = [cls.remote(self.run_dir, self.checkpoint, r, self.world_size, self.topology, self.device,
                                  True, self.cfg_parallel) for r in range(self.world_size)]
        address = "127.0.0.1" if not gpu else ray.get(self.actors[0].node_address.remote())
        port = free_port()
        ray.get([a.join.remote(address, port) for a in self.actors])
        self.broken = False

    def generate(self, jobs: list[Job], decode: bool = True) -> list[JobResult]:
        """One result per job, in order: the jobs planned and drawn together (``decode``:
        pictures, else the latents)."""
        import ray

        from knapray.planning import Topology
        from knapray.planning.sampling import candidate_topologies
        from knapray.worker.denoise import batch_plan

        results = [JobResult() for _ in jobs]
        if not jobs:
            return results
        checked = []
        for i, job in enumerate(jobs):
            try:
                self.rules.check(job)
                checked.append(i)
            except ValueError as e:
                results[i].error = str(e)
        if self.broken:
            self.restart()
        try:
            prepared = ray.get(self.actors[0].prepare.remote([jobs[i] for i in checked]))
        except ray.exceptions.RayError as e:
            self.broken = True
            for i in checked:
                results[i] = JobResult(error=f"the gang's rank 0 failed: {type(e).__name__}", lost=True)
            return results
        ok = []
        for i, p in zip(checked, prepared):
            if isinstance(p, str):
                results[i].error = p
            else:
                ok.append(i)
        if not ok:
            return results
        djobs = [p for p in prepared if not isinstance(p, str)]
        specs = candidate_topologies(self.topology, self.world_size, self.model_cfg.num_heads)
        spec, plan = batch_plan(self.model_cfg, djobs, specs, self.world_size)  # what every rank chooses
        topo, bag = Topology.parse(spec, world_size=self.world_size), plan.bag
        self.last_topology = spec
        pictures, lost_bags = self._collect([a.run.remote(djobs, decode) for a in self.actors], topo)
        for k, i in enumerate(ok):
            if int(bag[k]) in lost_bags or k not in pictures:
                results[i] = JobResult(error="a worker of its bag was lost mid-batch", lost=True)
            elif decode:
                results[i].frames = pictures[k]
            else:
                results[i].latent = pictures[k]
        return results

    def _collect(self, refs: list, topo) -> tuple[dict[int, np.ndarray], set[int]]:
        """Every rank's results as they come; a rank that fails fails its bag, whose other
        ranks (stuck in a collective with it) are not waited for: the gang is then
        ``broken`` and restarts before its next batch."""
        import ray

        bag_of = {ref: int(topo.bag_of_rank[r]) for r, ref in enumerate(refs)}
        pending, pictures, lost = list(refs), {}, set()
        while pending:
            (ref,), pending = ray.wait(pending, num_returns=1)
            try:
                pictures.update(ray.get(ref))
            except ray.exceptions.RayError:
                lost.add(bag_of[ref])
                pending = [p for p in pending if bag_of[p] not in lost]
        self.broken = self.broken or bool(lost)
        return pictures, lost

    def restart(self) -> None:
        """New actors (after a loss): the old ones are killed first."""
        self.close()
        self._spawn()

    def close(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
        self.actors = []
