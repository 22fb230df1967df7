"""A gang of sampling ranks that each hold a trained run's model once and draw batches of
jobs together (``worker.denoise``): local processes for ``knapray sample --world-size N``
(``sample_local``), Ray actors for ``knapray serve`` (``Gang``). gloo on CPUs, NCCL on GPUs.

Where things live (the placement ``knapray dryrun --sample`` counts):

- the transformer on every rank, in the compute dtype (bf16 on a GPU, cast once: no fp32
  copy), compiled and warmed up on start (``worker.denoise.prepare_model``, ``warm_up``); a
  run of two experts, both (``models.sampling.Experts``: a step runs the one of its time);
- the text encoder on rank 0 only, in bf16 on a GPU: it encodes a batch's captions in one
  call (``inference.prepare.resolve_jobs``). ``encoders``: ``keep`` (resident: serving),
  ``offload`` (on the host between batches, on the device only to encode), ``free``
  (``knapray sample``: encode first, free it, then the transformer loads);
- the VAE on every bag's lead, which decodes its own jobs; on rank 0 it also encodes the
  batch's conditioning images, with, for a Wan 2.1 I2V run, the image encoder of its tokens
  (the corpus's record, or ``image_encoder``: built on first use, kept).

Every rank plans a batch the same way; each bag's lead returns its jobs. A rank that dies
mid-batch loses the jobs of its bag only: the other bags never talk to it, and the gang
marks those jobs ``lost`` for the caller to retry on a restarted gang. A rank that stops
answering (stuck in a collective with a partner that never comes) is noticed the same way:
every rank reports its steps as it takes them, and a bag whose ranks report nothing for
``timeout_s`` is lost (its process group's collectives time out after as long).
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from knapray.inference.jobs import Job, RunRules

ENCODER_POLICIES = ("keep", "offload", "free")
DEFAULT_TIMEOUT_S = 300.0
"""How long a gang waits for a rank that reports no step (and a collective for a partner)."""


class SamplerRank:
    """One rank: the run's model (loaded once by ``load``; a run of two experts: its
    ``models.sampling.Experts``), its codecs, its sampling groups."""

    def __init__(self, run_dir: str, checkpoint: str | None, rank: int, world_size: int, topology: str,
                 device: str = "cpu", ema: bool = True, cfg_parallel: bool = True, *, precision: str = "auto",
                 compile: bool | None = None, encoders: str = "keep", load: bool = True,
                 step_cache: float | None = None, shard: str = "auto", adapters: dict | None = None,
                 image_encoder: str | None = None, image_processor: str | None = None) -> None:
        from knapray.driver.trained import read_run
        from knapray.worker.checkpoint import check_checkpoint

        if encoders not in ENCODER_POLICIES:
            raise ValueError(f"encoders must be one of {list(ENCODER_POLICIES)}, got {encoders!r}")
        if shard not in SHARD_POLICIES:
            raise ValueError(f"shard must be one of {list(SHARD_POLICIES)}, got {shard!r}")
        self.rank, self.world_size, self.spec = rank, world_size, topology
        self.cfg_parallel, self.ema_wanted, self.precision, self.compile = cfg_parallel, ema, precision, compile
        self.encoders, self.step_cache, self.shard = encoders, step_cache, shard
        self.adapters: dict[str, str] = dict(adapters or {})
        """Name -> LoRA run served beside the run's own model (``add_adapter``)."""
        self.image_encoder = (image_encoder, image_processor)
        """A Wan 2.1 I2V run's image encoder (and processor) in place of its corpus's record (None: the record's)."""
        self.device = f"cuda:{_local_device(rank)}" if device.startswith("cuda") else device
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(self.device)  # collectives and current-device tensors (Wan) land here
        self.cfg, self.checkpoint = read_run(run_dir, checkpoint)
        check_checkpoint(self.checkpoint)
        self.model = self.ema = None
        self.parallel: tuple = ()
        """``parallelize``'s handle of every model the rank holds (two experts: two)."""
        self.groups = None
        self.steps_done, self.last_step_at = 0, time.monotonic()
        """Steps this rank has taken (every rank of a bag takes its bag's), and when the last was."""
        self._text: Any = None
        self._preparing = threading.Lock()
        """One ``prepare`` at a time: the gang may send the next arrivals' before the last's
        ended (the actor runs calls at once), and one's end moves the text encoder to the host
        (``encoders: offload``) while the other encodes on the device."""
        if load:
            self.load()

    def load(self) -> None:
        """The model, in the compute dtype, on the rank's device (sharded over the rank's bag
        when ``shard``: every rank of the gang calls this together); compiled and warmed up
        where compiled (a first batch then compiles nothing)."""
        from knapray.driver.trained import load_weights
        from knapray.worker.denoise import prepare_model
        from knapray.worker.parallelize import compute_dtype

        dtype = compute_dtype(self.precision, self.device)
        group = self._shard_group()
        made: list = []

        def prepare(model) -> None:
            made.append(prepare_model(model, self.device, precision=self.precision, compile=self.compile,
                                      shard_group=group))

        self.model, self.ema = load_weights(self.cfg, self.checkpoint, ema=self.ema_wanted, device=self.device,
                                            dtype=dtype, prepare=prepare, group=group)
        self.parallel = tuple(made)
        for name, run in self.adapters.items():
            self._load_adapter(name, run)
        if self.compiled:
            self._warm_up()

    @property
    def compiled(self) -> bool:
        return any(p.compile_stats is not None for p in self.parallel)

    @property
    def recompiles(self) -> int:
        """Recompilations of every model's blocks since they were compiled."""
        return sum(p.recompiles for p in self.parallel)

    def _warm_up(self) -> None:
        """Compiled blocks warmed up once per adapter the rank serves (the active one is part
        of what a compiled graph assumes)."""
        from knapray.worker.denoise import warm_up

        if not self.adapters:
            warm_up(self.model)
            return
        from knapray.models.lora import use_adapter

        for name in [self._own_adapter(), *self.adapters]:
            use_adapter(self.model, name)
            warm_up(self.model)

    def _load_adapter(self, name: str, run: str) -> None:
        from knapray.driver.trained import load_adapter
        from knapray.worker.parallelize import compute_dtype

        if any(p.sharded for p in self.parallel):
            raise ValueError(f"adapter {name}: a model sharded over its bags takes no adapters at run time")
        load_adapter(self.model, (self.cfg, self.checkpoint), name, run, device=self.device,
                     dtype=compute_dtype(self.precision, self.device))

    def add_adapter(self, name: str, run: str) -> None:
        """Another LoRA run of the same base, served as adapter ``name`` (no block may run:
        the gang calls this between blocks, on every rank)."""
        from knapray.models.lora import use_adapter
        from knapray.worker.denoise import warm_up

        self._load_adapter(name, run)
        self.adapters[name] = run
        if self.compiled:
            use_adapter(self.model, name)
            warm_up(self.model)

    def _shard_group(self):
        """The bag's group the model is sharded over, else None: ``shard`` ``bags``, or ``auto``
        where the weights would not fit one rank's device (``weights_fit``; every rank of the
        gang agrees: one collective)."""
        if self.shard == "off":
            return None
        wanted = self.shard == "bags"
        if self.shard == "auto":
            wanted = not weights_fit(self.cfg.model, self.device, self.precision,
                                     models=2 if self.cfg.flow.expert_boundary else 1)
            import torch
            import torch.distributed as dist

            if dist.is_initialized():  # one answer for the gang (a rank's device may differ)
                flag = torch.tensor([int(wanted)], device=self.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                wanted = bool(flag.item())
        if not wanted:
            return None
        if self.groups is None or len(self.groups) != 1:
            raise ValueError("the model is sharded over its bags (it does not fit one GPU, or --shard bags): that needs "
                             "one --topology, not auto, and a gang of several ranks")
        (groups,) = self.groups.values()
        if min(groups.topology.bags) < 2:
            raise ValueError(f"the model is sharded over its bags (it does not fit one GPU, or --shard bags), but "
                             f"topology {groups.topology} has bags of one rank: give bags of 2 or more "
                             f"(e.g. g2n{self.world_size // 2})")
        return groups.whole

    def join(self, address: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """The world's process group (its collectives give up after ``timeout_s``) and every
        candidate topology's groups, made once for the gang's life."""
        from knapray.planning.inference.sampling import candidate_topologies

        self.join_blocks(address, port, candidate_topologies(self.spec, self.world_size, self.cfg.model.num_heads),
                         timeout_s)

    def join_blocks(self, address: str, port: int, specs: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """The world's process group and the groups of every topology of ``specs`` (a serving
        gang's blocks: ``gang_blocks``), made once for the gang's life."""
        import datetime

        import torch
        import torch.distributed as dist

        from knapray.worker.denoise import SamplingGroups

        if self.device == "cpu":  # ranks share the cores
            torch.set_num_threads(1)
        if address in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("nccl" if self.device.startswith("cuda") else "gloo",
                                init_method=f"tcp://{address}:{port}", rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.groups = SamplingGroups.build_all(specs, self.world_size, self.rank)

    # ---- codecs: the text encoder on rank 0, the VAE on the leads -------------------------

    def text_encoder(self) -> Any:
        """The corpus's text encoder on this rank's device (built on first use)."""
        from knapray.inference.conditioning import corpus_text_encoder

        if self._text is None:
            self._text = corpus_text_encoder(self.cfg.data.corpus, self.device)
        elif self.encoders == "offload":
            _move(self._text, self.device)
        return self._text

    def release_text_encoder(self) -> None:
        """After a batch's captions: per the ``encoders`` policy, kept, moved to the host, or freed."""
        if self._text is None or self.encoders == "keep":
            return
        if self.encoders == "offload":
            _move(self._text, "cpu")
        else:
            self._text = None
        _empty_cache(self.device)

    @functools.cached_property
    def decoder(self) -> Any:
        from knapray.inference.conditioning import corpus_decoder

        return corpus_decoder(self.cfg.data.corpus, self.device)

    @functools.cached_property
    def conditioning(self) -> Any:
        """What encodes a conditioning image: the VAE (a time per token, Wan 2.2 TI2V), or, for a
        model that takes image tokens (Wan 2.1 I2V), ingest's conditioning encoder over it and the
        image encoder (None: the corpus records none)."""
        from knapray.inference.conditioning import conditioning_image_encoder, corpus_conditioning

        if not getattr(self.cfg.model, "image_dim", 0):
            return self.decoder
        info = conditioning_image_encoder(self.cfg.data.corpus, self.cfg.model, *self.image_encoder)
        if info is None or self.decoder is None:
            return None
        return corpus_conditioning(self.cfg.data.corpus, self.decoder, info, self.device)

    @functools.cached_property
    def unconditional(self) -> tuple[np.ndarray, np.ndarray]:
        from knapray.corpus.unconditional import unconditional_embeddings

        m = self.cfg.model
        return unconditional_embeddings(self.cfg.data.corpus, m.text_dim, m.pooled_dim)

    def prepare(self, jobs: list[Job], max_text_tokens: int = 256, shared_seed: int | None = None) -> list:
        """Each job's ``DenoiseJob``, or the error (a string) that rules it out; the batch's
        captions encoded in one call, on this rank's device; conditioning images encoded by
        the VAE this rank decodes with (rank 0 leads a bag: it holds one)."""
        from knapray.inference.conditioning import corpus_records
        from knapray.inference.prepare import resolve_jobs

        down = int(corpus_records(self.cfg.data.corpus)[2].get("vae_downsample", 8))
        with self._preparing:
            text = self.text_encoder() if any(j.caption is not None for j in jobs) else None
            images = self.conditioning if any(j.image is not None for j in jobs) else None
            try:
                return resolve_jobs(self.cfg, jobs, text, self.unconditional, down=down, shared_seed=shared_seed,
                                    max_text_tokens=max_text_tokens, image_encoder=images)
            finally:
                self.release_text_encoder()

    # ---- a batch ------------------------------------------------------------------------------

    def run(self, djobs: list, decode: bool = True, progress: int | None = None) -> dict[int, np.ndarray]:
        """This rank's part of the batch: the latents (``decode``: pictures (T, H, W, 3)
        uint8) of the jobs of the bag it leads. ``progress``: show a bar over this many steps."""
        from knapray.progress import progress_bar
        from knapray.worker.denoise import denoise_rank

        self.last_step_at = time.monotonic()  # a batch starts: idle time between batches is no stall
        self._bar = progress_bar(progress, "denoising", "step") if progress else None
        try:
            latents = denoise_rank(self.model, djobs, self.groups, cfg_parallel=self.cfg_parallel, on_step=self._tick,
                                   step_cache=self.step_cache)
        finally:
            if self._bar is not None:
                self._bar.close()
        return {k: self.picture(z) for k, z in latents.items()} if decode else latents

    def run_block(self, spec: str, keys: list[int], djobs: list, decode) -> dict:
        """A serving gang's block: this rank's part of running ``djobs`` on its bag of topology
        ``spec`` (every rank of the block is called with the same jobs). On the block's lead:
        ``{"results": {index: pictures or latent}, "stopped": [indices], "seconds": {index:
        {"denoise", "decode"}}}``; ``cancel`` stops a job (by its key) between two steps."""
        from knapray.worker.denoise import denoise_bag

        decode = [decode] * len(djobs) if isinstance(decode, bool) else list(decode)
        self.last_step_at = time.monotonic()
        self._cancelled = set()
        latents, left, stopped, began = {}, {}, [], {}
        # Jobs of one adapter at a time: each group is one packed loop (each job's result is
        # its own whatever shares its loop), the adapter set between loops.
        for adapter in dict.fromkeys(getattr(d, "adapter", None) for d in djobs):
            mine = [i for i, d in enumerate(djobs) if getattr(d, "adapter", None) == adapter]
            if self.adapters or adapter is not None:
                from knapray.models.lora import use_adapter

                use_adapter(self.model, adapter if adapter is not None else self._own_adapter())
            self._keys = [keys[i] for i in mine]
            stats: dict = {}
            t0 = time.monotonic()
            got = denoise_bag(self.model, [djobs[i] for i in mine], self.groups[spec], cfg_parallel=self.cfg_parallel,
                              on_step=self._tick, step_cache=self.step_cache, stats=stats, stop=self._stops)
            t1 = time.monotonic()
            for j, i in enumerate(mine):
                began[i] = t0
                if j in got:
                    latents[i] = got[j]
                    left[i] = stats["left_at"].get(j, t1)
            stopped += [mine[j] for j in stats.get("stopped", [])]
        results, seconds = {}, {}
        for k, z in latents.items():
            seconds[k] = {"denoise": left[k] - began[k]}
            if decode[k]:
                d0 = time.monotonic()
                results[k] = self.picture(z)
                seconds[k]["decode"] = time.monotonic() - d0
            else:
                results[k] = z
        return {"results": results, "stopped": stopped, "seconds": seconds}

    def _own_adapter(self) -> str | None:
        """The served run's own adapter (``default`` for a LoRA run), or None (its model alone)."""
        return "default" if self.cfg.model.lora.enabled else None

    def _stops(self) -> set[int]:
        return {i for i, k in enumerate(self._keys) if k in self._cancelled}

    def cancel(self, keys: list[int]) -> None:
        """Stop these jobs of the running block between two steps (asked of its lead)."""
        self._cancelled = set(getattr(self, "_cancelled", set())) | set(keys)

    def _tick(self, step: int) -> None:
        self.steps_done += 1
        self.last_step_at = time.monotonic()
        if getattr(self, "_bar", None) is not None:
            self._bar.update(1)

    def progress(self) -> tuple[int, float]:
        """(steps taken, seconds since the last): answered while ``run`` is busy (the actor
        runs two calls at once)."""
        return self.steps_done, time.monotonic() - self.last_step_at

    def picture(self, latent: np.ndarray) -> np.ndarray:
        from knapray.inference.images import preview

        return self.decoder.decode(latent) if self.decoder is not None else preview(latent)

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def rendezvous(self, gpu: bool) -> tuple[str, int]:
        """Where the gang's rank 0 (this actor) holds the process groups' store: its node's
        address (127.0.0.1 for a CPU gang, which runs on one machine) and a port free on that
        node. The port is picked here, on the node that binds it, not on the driver's."""
        from knapray.distributed.local import free_port

        return (self.node_address() if gpu else "127.0.0.1"), free_port()

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


SHARD_POLICIES = ("auto", "off", "bags")
"""How a gang holds the transformer: ``auto`` (whole on every rank where it fits, else
sharded over each bag), ``off`` (whole), ``bags`` (FSDP2 over each bag's ranks)."""
WEIGHTS_SHARE = 0.7
"""The share of a device the transformer's weights may take whole (the rest: activations,
the encoders, the VAE)."""


def weights_fit(model_cfg: Any, device: str, precision: str = "auto", models: int = 1) -> bool:
    """Whether the weights of ``models`` models of ``model_cfg`` (a run of two experts holds
    both), in the compute dtype, fit ``WEIGHTS_SHARE`` of one ``device`` (any CPU: yes)."""
    import torch

    from knapray.models.families import param_shapes
    from knapray.worker.parallelize import compute_dtype

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return True
    itemsize = torch.empty((), dtype=compute_dtype(precision, device)).element_size()
    numel = sum(int(np.prod(s)) for s in param_shapes(model_cfg).values())
    return models * numel * itemsize <= WEIGHTS_SHARE * torch.cuda.get_device_properties(device).total_memory


def _move(encoder: Any, device: str) -> None:
    """A text encoder's models to ``device`` (the hash stand-in has none)."""
    for name in ("text", "pooled_model"):
        holder = getattr(encoder, name, None)
        if holder is not None and hasattr(holder, "model"):
            holder.model.to(device)
            holder.device = device


def _empty_cache(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _local_device(rank: int) -> int:
    """The CUDA device of a rank: the one Ray gave the process, or the rank's own."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return 0 if visible and len(visible.split(",")) == 1 else rank


# ---- local processes: knapray sample --world-size N ----------------------------------------


@dataclass(frozen=True)
class LocalSampling:
    """What ``sample_local`` hands its ranks (picklable)."""

    run_dir: str
    checkpoint: str | None
    jobs: list
    """``Job``s, resolved by rank 0 (its text encoder on its device), or ``DenoiseJob``s."""
    topology: str
    device: str = "cpu"
    ema: bool = True
    cfg_parallel: bool = True
    precision: str = "auto"
    compile: bool | None = None
    seed: int | None = None
    """The shared noise seed of the batch (``knapray sample``'s ``--seed``)."""
    max_text_tokens: int = 256
    decode: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    step_cache: float | None = None
    """The first-block cache's threshold (``knapray.models.step_cache``; None: off)."""
    shard: str = "auto"
    """``SHARD_POLICIES``."""
    image_encoder: str | None = None
    """A Wan 2.1 I2V run's image encoder directory in place of the corpus's record (``--image-encoder``)."""
    image_processor: str | None = None
    """Its processor's directory, where not its own (``--image-processor``)."""


def _local_rank(rank: int, world: int, port: int | None, what: LocalSampling, out_dir: str) -> None:
    """One rank of ``sample_local`` (``port`` None: the only one, in this process, no group)."""
    import json

    from knapray.models.sampling import DenoiseJob
    from knapray.planning.inference.sampling import candidate_topologies
    from knapray.worker.denoise import SamplingGroups, batch_plan

    r = SamplerRank(what.run_dir, what.checkpoint, rank, world, what.topology, what.device, what.ema,
                    what.cfg_parallel, precision=what.precision, compile=what.compile, encoders="free", load=False,
                    step_cache=what.step_cache, shard=what.shard, image_encoder=what.image_encoder,
                    image_processor=what.image_processor)
    if port is None:
        r.groups = {what.topology: SamplingGroups.alone()}
    else:
        r.join("127.0.0.1", port, what.timeout_s)
    try:
        box = [None]
        if rank == 0:  # the batch's captions encoded on rank 0's device, then the encoder freed
            box = [what.jobs if all(isinstance(j, DenoiseJob) for j in what.jobs) else
                   r.prepare(what.jobs, what.max_text_tokens, shared_seed=what.seed)]
        if port is not None:
            import torch.distributed as dist

            dist.broadcast_object_list(box, src=0)
        djobs = box[0]
        errors = [d for d in djobs if isinstance(d, str)]
        if errors:
            raise ValueError(errors[0])
        r.load()
        specs = candidate_topologies(what.topology, world, r.cfg.model.num_heads)
        chosen, plan = batch_plan(r.cfg.model, djobs, specs, world)  # what every rank chooses
        mine = [djobs[k].steps for k in plan.jobs_of(int(plan.topology.bag_of_rank[rank]))]
        latents = r.run(djobs, decode=False, progress=max(mine, default=0) if rank == 0 else None)
        # Plain arrays, read back without unpickling (job index -> latent, and its pictures).
        arrays = {f"latent_{k}": z for k, z in latents.items()}
        if what.decode:
            arrays.update({f"frames_{k}": r.picture(z) for k, z in latents.items()})
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
        if rank == 0:
            with open(os.path.join(out_dir, "plan.json"), "w") as f:
                json.dump({"topology": chosen, "bags": plan.bag.tolist(), "tokens": [j.tokens for j in djobs],
                           "recompiles": r.recompiles, "ema": bool(r.ema)}, f)
    finally:
        r.leave()


@dataclass
class LocalResult:
    latents: list[np.ndarray]
    """(C, T, H, W) per job."""
    frames: list[np.ndarray] | None
    """(T, H, W, 3) uint8 per job, decoded by its bag's lead (None: not decoded)."""
    topology: str
    bags: list[int]
    recompiles: int
    ema: bool
    """Drawn with the checkpoint's EMA weights."""


def sample_local(what: LocalSampling, world_size: int) -> LocalResult:
    """``what.jobs`` drawn by ``world_size`` local processes on ``what.topology`` (one: this process)."""
    import json

    from knapray.distributed.local import free_port, spawn_local

    with tempfile.TemporaryDirectory(prefix="knapray-sample-") as out:
        if world_size == 1:  # this process, no process group
            _local_rank(0, 1, None, what, out)
        else:
            spawn_local(_local_rank, (world_size, free_port(), what, out), world_size)
        got: dict[str, np.ndarray] = {}
        for r in range(world_size):
            with np.load(os.path.join(out, f"rank{r}.npz"), allow_pickle=False) as part:
                got.update({k: part[k] for k in part.files})
        with open(os.path.join(out, "plan.json")) as f:
            plan = json.load(f)
    n = len(what.jobs)
    missing = [k for k in range(n) if f"latent_{k}" not in got]
    if missing:
        raise RuntimeError(f"jobs {missing} came back from no rank")
    frames = [got[f"frames_{k}"] for k in range(n)] if what.decode else None
    return LocalResult([got[f"latent_{k}"] for k in range(n)], frames, plan["topology"], plan["bags"],
                       int(plan["recompiles"]), bool(plan["ema"]))


# ---- Ray actors: knapray serve -------------------------------------------------------------


@dataclass
class JobResult:
    frames: np.ndarray | None = None
    """(T, H, W, 3) uint8; T == 1 for an image."""
    error: str | None = None
    latent: np.ndarray | None = None
    """(C, T, H, W), instead of ``frames``, from ``decode=False``."""
    lost: bool = False
    """A rank of its block was lost while it ran: the caller may retry it (the gang restarts)."""
    cancelled: bool = False
    """Dropped by ``Gang.cancel``: while waiting, or between two of its steps."""
    seconds: dict = field(default_factory=dict)
    """Where its time went: ``queue`` (arrival to its block's start), ``encode`` (its batch's
    captions on rank 0), ``denoise`` (its loop), ``decode`` (its latent through the VAE)."""
    ranks: tuple = ()
    """The ranks of the block that ran it."""


@functools.cache
def _actor_class():
    import ray

    # Calls at once: ``run_block`` draws, while ``prepare`` (rank 0), ``progress`` and
    # ``cancel`` answer.
    return ray.remote(max_concurrency=4)(SamplerRank)


BLOCK_NODE = 8
"""Ranks to a node, for the aligned blocks of a gang on ``auto`` (a block never spans two)."""


def gang_blocks(spec: str | None, world: int, heads: int) -> tuple[tuple[tuple[int, int], ...], list[str],
                                                                     list[tuple[str, int]]]:
    """(blocks as (first rank, size), the topologies whose groups hold them, each block's
    (topology, bag)): for ``auto`` (or None) every aligned power-of-two block of a node, and
    of whole nodes, whose size divides the heads; for a topology, its bags."""
    from knapray.planning import Topology
    from knapray.planning.shapes.blocks import blocks_of

    if spec not in (None, "auto"):
        topo = Topology.parse(spec, world_size=world)
        blocks = tuple((int(topo.bag_starts[b]), int(topo.bag_sizes[b])) for b in range(topo.num_bags))
        return blocks, [spec], [(spec, b) for b in range(topo.num_bags)]
    node = min(world, BLOCK_NODE)
    sizes = [g for g in (1, 2, 4, 8) if g <= node and heads % g == 0]
    if world % node == 0:  # whole nodes: 2, 4, ... of them
        sizes += [g for g in (16, 32, 64) if g <= world and heads % g == 0]
    blocks = blocks_of(world, tuple(sizes), node)
    specs, where = {}, []
    for first, g in blocks:
        if g not in specs:
            tiles = [(a, size) for a, size in blocks if size == g]
            covered = sum(size for _, size in tiles)
            specs[g] = f"g{g}n{len(tiles)}" + (f"+g1n{world - covered}" if covered < world else "")
            if covered < world and any(a >= covered for a, _ in tiles):
                raise ValueError(f"blocks of {g} ranks do not tile the front of a world of {world}")
        where.append((specs[g], first // g))
    return blocks, list(dict.fromkeys(specs.values())), where


@dataclass(eq=False)
class _Submission:
    key: int
    job: Any
    """A ``Job`` (rank 0 resolves it) or a ``DenoiseJob`` (resolved already)."""
    decode: bool
    future: Any
    arrival: float
    djob: Any = None
    seconds: dict = field(default_factory=dict)
    state: str = "new"
    """new, waiting, running, done."""
    prepares: int = 0
    """Times it was sent to rank 0 to be prepared (``PREPARE_TRIES`` at most)."""


@dataclass
class Gang:
    """``world_size`` Ray actors holding the run's model, one process group, serving requests
    continuously: each on a block of ranks the serving policy (``planning.inference.scheduler``, the
    one the simulator predicts) gives it, a block taking the next requests when it finishes."""

    run_dir: str
    world_size: int
    topology: str
    """``auto``: every aligned block (``gang_blocks``), the balanced policy choosing among
    their partitions; or one topology, its bags the blocks."""
    rules: RunRules
    model_cfg: Any
    device: str = "cpu"
    checkpoint: str | None = None
    cfg_parallel: bool = True
    precision: str = "auto"
    compile: bool | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    """A block whose ranks take no step for this long is lost (and a collective gives up after it)."""
    shard: str = "auto"
    """``SHARD_POLICIES``."""
    adapters: dict = field(default_factory=dict)
    """Name -> LoRA run of the served run's base, each a ``Job.adapter`` (``add_adapter``)."""
    actors: list = field(default_factory=list)
    broken: bool = False
    """A rank failed: no block starts until the running ones end and the gang restarts."""
    last_blocks: list = field(default_factory=list)
    """The blocks (ranks) of the last requests started."""
    restarts: int = 0
    """Restarts since the gang started (after a loss, or asked)."""

    @classmethod
    def start(cls, run_dir: str, world_size: int, *, topology: str | None = None, device: str = "cpu",
              checkpoint: str | None = None, cfg_parallel: bool = True, precision: str = "auto",
              compile: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, shard: str = "auto",
              adapters: dict | None = None) -> "Gang":
        from knapray.driver.trained import check_adapter, read_run
        from knapray.distributed.groups import check_heads
        from knapray.inference.jobs import run_rules
        from knapray.planning import Topology
        from knapray.worker.checkpoint import check_checkpoint

        cfg, ckpt = read_run(run_dir, checkpoint)
        check_checkpoint(ckpt)
        spec = topology or "auto"
        for one in gang_blocks(spec, world_size, cfg.model.num_heads)[1]:
            check_heads(cfg.model.num_heads, Topology.parse(one, world_size=world_size))
        for name, run in (adapters or {}).items():  # every one checked before a rank starts
            check_adapter((cfg, ckpt), name, run)
        gang = cls(run_dir, world_size, spec, run_rules(cfg), cfg.model, device, checkpoint, cfg_parallel, precision,
                   compile, timeout_s, shard, dict(adapters or {}))
        gang._spawn()
        return gang

    def __post_init__(self) -> None:
        import threading

        from knapray.planning.inference.scheduler import BagScheduler
        from knapray.worker.denoise import sampling_cost

        self.blocks, self.specs, self.where = gang_blocks(self.topology, self.world_size, self.model_cfg.num_heads)
        self.scheduler = BagScheduler(self.blocks, "balanced")
        self.cost = sampling_cost(self.model_cfg)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[_Submission] = []
        self._cancels: list[int] = []
        self._subs: dict[int, _Submission] = {}
        self._running: dict[int, dict] = {}
        """Block -> its run: refs, submissions, start time."""
        self._preparing: list[tuple[Any, list[_Submission], float]] = []
        self._new_adapters: list[tuple[str, str, Any]] = []
        """(name, run, future) of adapters to load once no block runs."""
        self._next_key = 0
        self._thread = None
        self._closing = False

    def _spawn(self) -> None:
        import ray

        gpu = self.device.startswith("cuda")
        cls = _actor_class().options(num_gpus=1 if gpu else 0, num_cpus=0 if not gpu else 1)
        topology = self.specs[0] if len(self.specs) == 1 else "auto"
        self.actors = [cls.remote(self.run_dir, self.checkpoint, r, self.world_size, topology, self.device,
                                  True, self.cfg_parallel, precision=self.precision, compile=self.compile,
                                  load=False, shard=self.shard, adapters=self.adapters)
                       for r in range(self.world_size)]
        address, port = ray.get(self.actors[0].rendezvous.remote(gpu))
        ray.get([a.join_blocks.remote(address, port, self.specs, self.timeout_s) for a in self.actors])
        ray.get([a.load.remote() for a in self.actors])
        self.broken = False

    # ---- the caller's side --------------------------------------------------------------------

    def submit(self, job: Any, decode: bool = True):
        """A ``concurrent.futures.Future`` of the job's ``JobResult`` (its ``key`` attribute is
        what ``cancel`` takes). A ``Job`` is checked against the run's rules first (an error
        result at once) and resolved by rank 0; a ``DenoiseJob`` runs as it is."""
        import concurrent.futures
        import threading

        future: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(job, Job):
            try:
                self.rules.check(job)
                if job.adapter is not None and job.adapter not in self.adapters:
                    raise ValueError(f"adapter: {job.adapter[:40]!r}; this gang serves "
                                     f"{', '.join(map(repr, self.adapters)) or 'none'} (and the run's own: none given)")
            except ValueError as e:
                future.set_result(JobResult(error=str(e)))
                future.key = -1
                return future
        with self._lock:
            key = self._next_key
            self._next_key += 1
            future.key = key
            sub = _Submission(key, job, decode, future, time.monotonic())
            self._subs[key] = sub
            self._inbox.append(sub)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve_forever, name="knapray-gang", daemon=True)
                self._thread.start()
        self._wake.set()
        return future

    def state(self, key: int) -> str:
        """Where a submitted job is: ``waiting`` (for its captions or a block), ``running``,
        ``done`` (answered) or ``unknown``."""
        with self._lock:
            return self._state_locked(key)

    def _state_locked(self, key: int) -> str:
        sub = self._subs.get(key)
        if sub is None:
            return "unknown"
        if sub.future.done():
            return "done"
        return "running" if sub.state == "running" else "waiting"

    def cancel(self, key: int) -> str:
        """Cancel a submitted job: ``dropped`` (it had not started: its result says cancelled),
        ``stopping`` (it runs: its block drops it between two steps), ``done`` or ``unknown``."""
        with self._lock:
            state = self._state_locked(key)
            if state in ("unknown", "done"):
                return state
            self._cancels.append(key)
        self._wake.set()
        return "stopping" if state == "running" else "dropped"

    def add_adapter(self, name: str, run_dir: str, timeout_s: float = 600.0) -> None:
        """Serve LoRA run ``run_dir`` (of the served run's base) as adapter ``name`` from now on,
        without a restart: checked here, loaded on every rank once the running blocks end
        (no new block starts meanwhile). ValueError in one line for a run that cannot be."""
        import concurrent.futures
        import threading

        from knapray.driver.trained import check_adapter, read_run

        if name in self.adapters:
            raise ValueError(f"adapter {name!r}: served already ({self.adapters[name]})")
        check_adapter(read_run(self.run_dir, self.checkpoint), name, run_dir)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._new_adapters.append((name, run_dir, done))
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve_forever, name="knapray-gang", daemon=True)
                self._thread.start()
        self._wake.set()
        done.result(timeout=timeout_s)

    def generate(self, jobs: list, decode: bool = True) -> list[JobResult]:
        """One result per job, in order: every job submitted, all waited for."""
        futures = [self.submit(job, decode) for job in jobs]
        return [f.result() for f in futures]

    # ---- the scheduler's thread ---------------------------------------------------------------

    POLL_S = 0.05
    """How often the thread looks at running blocks when nothing arrives."""
    PROGRESS_S = 1.0
    """How often a running block's ranks are asked for their progress."""

    def _serve_forever(self) -> None:
        import ray

        last_progress = time.monotonic()
        while not self._closing:
            self._wake.wait(self.POLL_S)
            self._wake.clear()
            try:
                self._intake()
                self._prepared()
                self._finish_blocks()
                if time.monotonic() - last_progress > self.PROGRESS_S:
                    self._stalls()
                    last_progress = time.monotonic()
                if self.broken and not self._running:
                    self._restart_now()
                if self._new_adapters:  # no block starts until they are loaded
                    if not self._running:
                        self._load_new_adapters()
                elif not self.broken:
                    self._start_blocks()
                else:
                    self._apply_cancels()
            except ray.exceptions.RayError as e:  # rank 0 lost while preparing, say
                self._lose_everything_running(f"{type(e).__name__}")
            except Exception as e:  # noqa: BLE001 - a restart that failed: try again, never die
                logging.getLogger(__name__).error("gang: %s: %s (restarting)", type(e).__name__, str(e)[:300])
                self._lose_everything_running(f"{type(e).__name__}")
                time.sleep(min(5.0, self.POLL_S * 20))

    def _load_new_adapters(self) -> None:
        import ray

        with self._lock:
            todo, self._new_adapters = self._new_adapters, []
        for name, run, done in todo:
            try:
                ray.get([a.add_adapter.remote(name, run) for a in self.actors], timeout=self.timeout_s)
                self.adapters[name] = run
                done.set_result(None)
            except Exception as e:  # noqa: BLE001 - the caller gets it; a rank may hold it half: restart
                self.broken = True
                done.set_exception(e if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}"))

    PREPARE_TRIES = 2
    """A job whose preparation rank 0 did not answer (lost, or past ``timeout_s``) waits for the
    restarted gang and is sent again, once: it never ran, and a job that fails rank 0 twice is
    answered lost rather than kill every gang to come."""

    def _intake(self) -> None:
        """New submissions taken, unless the gang is broken: then they wait in the inbox for the
        restarted gang (rank 0, which prepares every job, may be the rank that was lost; a job
        retried after its block lost a rank arrives here while the gang has not restarted)."""
        import ray

        from knapray.models.sampling import DenoiseJob

        if self.broken:
            return
        with self._lock:
            new, self._inbox = self._inbox, []
        ready = [s for s in new if isinstance(s.job, DenoiseJob)]
        for s in ready:
            s.djob = s.job
            self._wait(s)
        jobs = [s for s in new if not isinstance(s.job, DenoiseJob)]
        if jobs:  # every new caption of this moment encoded together on rank 0
            for s in jobs:
                s.prepares += 1
            self._preparing.append((self.actors[0].prepare.remote([s.job for s in jobs]), jobs, time.monotonic()))
        del ray

    def _prepare_failed(self, subs: list[_Submission], error: str) -> None:
        """Rank 0 did not prepare ``subs``: the gang restarts; each is sent again after it
        (back in the inbox, its arrival kept) or, at ``PREPARE_TRIES``, answered lost."""
        self.broken = True
        again = []
        for s in subs:
            if s.prepares < self.PREPARE_TRIES and not s.future.done():
                again.append(s)
            else:
                self._resolve(s, JobResult(error=error, lost=True))
        with self._lock:
            self._inbox[:0] = again

    def _prepared(self) -> None:
        import ray

        still = []
        for ref, subs, t0 in self._preparing:
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                if time.monotonic() - t0 > self.timeout_s:
                    self._prepare_failed(subs, "the gang's rank 0 did not answer")
                    continue
                still.append((ref, subs, t0))
                continue
            try:
                out = ray.get(ref)
            except ray.exceptions.RayError as e:
                self._prepare_failed(subs, f"the gang's rank 0 failed: {type(e).__name__}")
                continue
            took = time.monotonic() - t0
            for s, p in zip(subs, out):
                s.seconds["encode"] = took
                if isinstance(p, str):
                    self._resolve(s, JobResult(error=p, seconds=s.seconds))
                else:
                    s.djob = p
                    self._wait(s)
        self._preparing = still

    def _wait(self, s: _Submission) -> None:
        from knapray.planning.inference.sampling import job_seconds

        with self._lock:
            if s.future.done():  # cancelled while it was prepared
                return
            s.state = "waiting"
        d = s.djob
        self.scheduler.add(s.key, s.arrival, job_seconds(d.tokens, d.steps, d.passes, [g for _, g in self.blocks],
                                                          self.cost), d.steps)

    def _apply_cancels(self) -> None:
        with self._lock:
            self._apply_cancels_locked()

    def _apply_cancels_locked(self) -> None:
        keys, self._cancels = self._cancels, []
        for key in keys:
            s = self._subs.get(key)
            if s is None or s.future.done():
                continue
            if self.scheduler.cancel(key) or s.state == "new":
                s.state = "done"  # a job still being prepared: dropped when it comes back
                self._resolve(s, JobResult(error="cancelled", cancelled=True, seconds=s.seconds), locked=True)
            elif s.state == "running":
                for block, run in self._running.items():
                    if key in [x.key for x in run["subs"]]:
                        first = self.blocks[block][0]
                        self.actors[first].cancel.remote([key])  # the block's lead decides

    def _start_blocks(self) -> None:
        """Cancels applied, then the scheduler's starts, under the lock: a job ``cancel``
        called ``dropped`` never starts."""
        with self._lock:
            self._apply_cancels_locked()
            now = time.monotonic()
            started = self.scheduler.decide(now)
            for _, keys in started:
                for k in keys:
                    self._subs[k].state = "running"
        for block, keys in started:
            subs = [self._subs[k] for k in keys]
            first, g = self.blocks[block]
            spec, _ = self.where[block]
            for s in subs:
                s.seconds["queue"] = now - s.arrival
            djobs = [s.djob for s in subs]
            decode = [s.decode for s in subs]
            refs = [self.actors[r].run_block.remote(spec, keys, djobs, decode) for r in range(first, first + g)]
            self._running[block] = {"refs": refs, "subs": subs, "start": now}
            self.last_blocks = [tuple(range(first, first + g))]

    def _finish_blocks(self) -> None:
        import ray

        for block, run in list(self._running.items()):
            done, _ = ray.wait(run["refs"], num_returns=len(run["refs"]), timeout=0)
            failed = False
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError:
                    failed = True
            if failed:
                self._lose(block, "a worker of its block was lost")
            elif len(done) == len(run["refs"]):
                out = ray.get(run["refs"][0])  # the block's lead's
                first, g = self.blocks[block]
                ranks = tuple(range(first, first + g))
                for i, s in enumerate(run["subs"]):
                    got = out["results"].get(i)
                    seconds = {**s.seconds, **out["seconds"].get(i, {})}
                    if i in out["stopped"]:
                        result = JobResult(error="cancelled", cancelled=True)
                    elif got is None:
                        result = JobResult(error="its block gave no result", lost=True)
                    elif s.decode:
                        result = JobResult(frames=got)
                    else:
                        result = JobResult(latent=got)
                    result.seconds, result.ranks = seconds, ranks
                    self._resolve(s, result)
                del self._running[block]
                self.scheduler.finished(block, time.monotonic())

    def _stalls(self) -> None:
        """Blocks whose every rank took its last step more than ``timeout_s`` ago (or does not
        answer within it) are lost: their ranks are stuck in a collective with a partner that
        does not come."""
        import ray

        for block, run in list(self._running.items()):
            first, g = self.blocks[block]
            quiet = []
            for r in range(first, first + g):
                try:
                    _, idle = ray.get(self.actors[r].progress.remote(), timeout=self.timeout_s)
                    quiet.append(idle > self.timeout_s)
                except (ray.exceptions.RayError, TimeoutError):
                    quiet.append(True)
            if all(quiet):
                self._lose(block, f"its block took no step for {self.timeout_s:g} s")

    def _lose(self, block: int, why: str) -> None:
        run = self._running.pop(block)
        first, g = self.blocks[block]
        for s in run["subs"]:
            self._resolve(s, JobResult(error=why, lost=True, seconds=s.seconds, ranks=tuple(range(first, first + g))))
        self.scheduler.finished(block, time.monotonic())
        self.broken = True

    def _lose_everything_running(self, why: str) -> None:
        for block in list(self._running):
            self._lose(block, why)
        self.broken = True

    def _resolve(self, s: _Submission, result: JobResult, locked: bool = False) -> None:
        """Answer ``s`` (first: ``cancel`` on it meanwhile says ``done``), then forget it."""
        s.state = "done"
        if not s.future.done():
            s.future.set_result(result)
        if locked:
            self._subs.pop(s.key, None)
            return
        with self._lock:
            self._subs.pop(s.key, None)

    def restart(self, timeout_s: float = 600.0) -> None:
        """New actors: the old ones are killed first; waiting jobs wait on. With requests in
        flight the gang's thread does it once its running blocks have ended (as after a loss)."""
        import threading

        if self._thread is None or not self._thread.is_alive() or threading.current_thread() is self._thread:
            self._restart_now()
            return
        self.broken = True
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while self.broken and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.broken:
            raise RuntimeError(f"the gang did not restart within {timeout_s:g} s")

    def _restart_now(self) -> None:
        self.close_actors()
        self._spawn()
        self.restarts += 1

    def close_actors(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
        self.actors = []

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.close_actors()
        for s in list(self._subs.values()):
            self._resolve(s, JobResult(error="the gang closed", lost=True))
