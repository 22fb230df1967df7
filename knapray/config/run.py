"""Typed run configuration, loaded from YAML; every value is checked at load.

Overrides: ``--set model.hidden_size=128`` (dotted path, value read as YAML);
``--set model.hidden_size=null`` removes a key the file gives, so the value is what the run
takes without it (the default, or a width from ``model.pretrained`` or the corpus).

Every field is checked against its annotation (int, float, bool, str, a fixed-length
tuple, ``dict[str, float]``, ``dict``, a nested section) and against the rules in its
``metadata``:

- ``ge`` / ``gt`` / ``le`` / ``lt``: bounds, on each element of a tuple; a str bound names
  another field of the same section; a bounded value must be finite (no nan, inf);
- ``choices``: the valid values;
- ``check``: a function of the value as written that raises ValueError saying what is
  wrong and what is valid.

Each section is a dataclass. A section that only the run config has is named ``...Section``
here (``RunSection``, ``DataSection``...: named apart from Ray Train's ``RunConfig``,
``ScalingConfig``, ``DataConfig`` and ``CheckpointConfig``, which the Ray launcher uses
beside them); a component that owns its section declares it beside its code and the run
config embeds it: ``balance`` is ``knapray.coordinator.config.BalanceConfig``, ``parallel``
``knapray.config.parallel.ParallelConfig``, ``model`` the family's config.

The model section (``DiTConfig``: the class of its ``model.family``, ``MMDiTConfig`` by default)
declares its rules the same way and keeps its own ``__post_init__`` checks; with
``model.pretrained`` the checkpoint's config.json fills the architecture fields the file
leaves out (and a field that disagrees with it is an error). Unknown keys are rejected with the valid ones. Every error is a
``ConfigError`` (a ValueError): one line naming the dotted key, the value and what is valid.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from knapray.coordinator.config import BalanceConfig
from knapray.files import read_text
from knapray.limits import (MAX_EPOCHS, MAX_GLOBAL_BATCH, MAX_MICRO_BATCHES, MAX_RANK_TOKENS, MAX_RUN_NAME,
                            MAX_SAMPLES_PER_RANK, MAX_SEED, MAX_SHUFFLE_BUFFER_MB, MAX_STEPS, MAX_TIMEOUT_S,
                            MAX_WORLD_SIZE, SIZE_FORM)
from knapray.models import DiTConfig, MMDiTConfig
from knapray.models.flow import TIMESTEP_KINDS
from knapray.models.timesteps import ExpertSplit, ResolutionShift, TimestepDistribution

from knapray.config.parallel import ParallelConfig


class ConfigError(ValueError):
    """A bad config file, override or value; the message is one line."""


_SHOWN = reprlib.Repr()
"""How much of a value an error shows: a few levels, a few items (a 1 MB list, or a value
nested deep, is never walked whole)."""
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 3, 8, 8, 60, 60


def _got(value: Any) -> str:
    shown = _SHOWN.repr(value)
    if len(shown) > 80:
        shown = f"{shown[:77]}..."
    return f"got {shown} ({type(value).__name__})"


_DIRECTORY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def _directory_name(name: Any) -> None:
    if not isinstance(name, str) or len(name) > MAX_RUN_NAME or not _DIRECTORY_NAME.fullmatch(name):
        shown = name if not isinstance(name, str) or len(name) <= 40 else f"{name[:37]}..."
        more = f", {len(name)} characters" if isinstance(name, str) and len(name) > 40 else ""
        raise ValueError(
            f"expected a directory name of 1 to {MAX_RUN_NAME} letters, digits, '.', '_' and '-' that does not start "
            f"with '.' or '-', got {shown!r} ({type(name).__name__}{more})"
        )


def _finite(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):  # other non-numbers: the type check
        raise ValueError(f"expected a finite number, {_got(value)}")


@dataclass(kw_only=True, slots=True)
class DataSection:
    """``data:`` The corpus, how much of it a step draws, in what order, and what is left out."""

    corpus: str = "datasets/generated/demo"
    """Directory of parquet shards + schema.json. It must exist: knapray never builds or
    replaces a corpus on its own (build one with ``knapray synthetic`` or
    ingest images with ``knapray ingest``)."""
    samples_per_step: int = field(default=2, metadata={"ge": 1, "le": MAX_SAMPLES_PER_RANK})
    """Samples each rank draws per step (the paper's B), unless ``global_batch`` is set."""
    global_batch: int = field(default=0, metadata={"ge": 0, "le": MAX_GLOBAL_BATCH})
    """Samples per step over the whole world (0: ``samples_per_step`` on every rank). Each
    rank then draws global_batch / world_size, so the world size must divide it; under the
    torchrun launcher a step trains the same samples at any world size, and a run resumed
    at another one continues the same loss curve."""
    epochs: int = field(default=1, metadata={"ge": 0, "le": MAX_EPOCHS})
    """Passes over the corpus; 0: as many as ``run.max_steps`` steps take (the corpus's size
    decides: 12 pictures at 8 a step are 2 steps an epoch, so 200 steps are 100 epochs)."""
    seed: int = field(default=0, metadata={"ge": 0, "le": MAX_SEED})
    max_tokens_per_gpu: int = field(default=0, metadata={"ge": 0, "le": MAX_RANK_TOKENS})
    """Memory budget (``knapray memory`` says what fits): the planner routes no rank more
    tokens in a step, and a sample longer than this times the largest bag is quarantined
    (reason ``too_long``) instead of trained; 0 = no limit."""
    duplicate_ids: str = field(default="error", metadata={"choices": ("error", "quarantine")})
    """A sample id that more than one corpus row carries (the ledger counts samples by id):
    ``error`` stops the run in pre-flight naming the shards and rows; ``quarantine`` leaves
    every row of such an id out (listed in ``quarantine.jsonl``, reason ``duplicate_id``)."""
    caption_dropout: float = field(default=0.0, metadata={"ge": 0, "lt": 1})
    """Fraction of samples trained unconditionally: their text and pooled embeddings are
    replaced by the corpus's unconditional ones (the empty caption's, recorded at ingest;
    what ``knapray sample`` uses for guidance), decided per (seed, epoch, sample id)."""
    shuffle_buffer_mb: int = field(default=256, metadata={"ge": 0, "le": MAX_SHUFFLE_BUFFER_MB})
    """MiB of rows each Ray Train worker shuffles among while streaming (a new order every
    epoch; 0: no local shuffle), at most 256 rows (``knapray.data.SHUFFLE_ROWS_MAX``). 256 MiB
    is ~64 rows of a Flux-size corpus (a 1024² latent, 1 MiB, and 512 fp32 T5-XXL tokens,
    8 MiB; ~128 rows with bf16 text), where 256 rows held ~1 GB per worker and delayed the
    first step by 35-45 s; corpora of small rows keep 256. The torchrun launcher reads rows
    in shard order and does not use it."""
    max_bad_fraction: float = field(default=0.5, metadata={"ge": 0, "le": 1})
    """Stop the run with an error once more than this fraction of the rows read (after at
    least 16) had to be quarantined: a mostly broken corpus must not train on nothing."""


@dataclass(kw_only=True, slots=True)
class OptimSection:
    """``optim:`` The optimizer (AdamW), its learning-rate schedule, accumulation and the EMA."""

    lr: float = field(default=1e-3, metadata={"gt": 0})
    weight_decay: float = field(default=0.0, metadata={"ge": 0})
    betas: tuple[float, float] = field(default=(0.9, 0.999), metadata={"ge": 0, "lt": 1})
    grad_clip: float = field(default=1.0, metadata={"ge": 0})
    """Clip the global gradient norm (0 disables)."""
    warmup_steps: int = field(default=0, metadata={"ge": 0, "le": MAX_STEPS})
    """Optimizer steps of linear warm-up: step s < warmup_steps trains at lr·(s+1)/(warmup_steps+1)."""
    schedule: str = field(default="constant", metadata={"choices": ("constant", "cosine")})
    """The learning rate after warm-up: ``constant`` (lr), or ``cosine``: from lr down to
    ``min_lr_ratio``·lr at step ``decay_steps``, then held there."""
    decay_steps: int = field(default=0, metadata={"ge": 0, "le": MAX_STEPS})
    """Where the cosine ends; 0: ``run.max_steps``. With both 0 (a run that runs its epochs
    out has no known length) ``cosine`` is refused when the schedule is built; it must be
    > ``warmup_steps``. Unused by ``constant``."""
    min_lr_ratio: float = field(default=0.0, metadata={"ge": 0, "le": 1})
    """The cosine's final learning rate as a fraction of lr."""
    grad_accum_steps: int = field(default=1, metadata={"ge": 1, "le": MAX_MICRO_BATCHES})
    """Micro-batches per optimizer step; the loss is normalized over the image tokens of
    the whole group, so the step equals one step on all its micro-batches at once."""
    ema_decay: float = field(default=0.0, metadata={"ge": 0, "lt": 1})
    """EMA of the weights, updated after every optimizer step (0: none; e.g. 0.9999). Its
    fp32 copy is checkpointed under ``ema.`` and ``knapray sample`` uses it."""
    ema_warmup: bool = True
    """Warm the EMA's decay up: update n (from 0) uses min(ema_decay, (1+n)/(10+n)), so the
    average follows the fast-moving early weights instead of keeping the initial ones."""


@dataclass(kw_only=True, slots=True)
class FlowSection:
    """``flow:`` How training draws each sample's timestep, and the guidance it trains with."""

    timesteps: str = field(default="logit_normal", metadata={"choices": TIMESTEP_KINDS})
    """How training draws each sample's timestep t in (0, 1) (t = 1 is pure noise):
    ``logit_normal``: sigmoid(N(timestep_mean, timestep_std)) (SD3), ``uniform``: U(0, 1)."""
    timestep_mean: float = field(default=0.0, metadata={"check": _finite})
    """Mean of the logit-normal's normal (> 0 favors noisier t)."""
    timestep_std: float = field(default=1.0, metadata={"gt": 0})
    """Standard deviation of the logit-normal's normal."""
    timestep_shift: float = field(default=1.0, metadata={"gt": 0})
    """SD3's resolution shift, applied after drawing: t -> s·t / (1 + (s-1)·t); s > 1 moves
    t toward noise (SD3 uses 3 at 1024²); 1 leaves t as drawn. ``knapray sample --shift``
    is its counterpart at sampling time."""
    resolution_shift: bool = False
    """Flux's shift instead: each sample's from its own image token count n, shift =
    exp(mu) with mu linear in n from ``base_shift`` at ``base_image_tokens`` to ``max_shift``
    at ``max_image_tokens``, so in a mixed-resolution batch every sample gets its own (as
    FLUX.1 samples; needs ``timestep_shift`` 1)."""
    base_image_tokens: int = field(default=256, metadata={"ge": 0, "lt": "max_image_tokens"})
    max_image_tokens: int = field(default=4096, metadata={"ge": 1})
    base_shift: float = field(default=0.5, metadata={"check": _finite})
    max_shift: float = field(default=1.15, metadata={"check": _finite})
    timestep_range: tuple[float, float] = field(default=(0.0, 1.0), metadata={"ge": 0, "le": 1})
    """Train only on t in [low, high) (after the shift; t = 1 is noise): the timestep
    distribution truncated to it. Wan 2.2's two experts split t at a boundary (0.875 for
    T2V A14B): the high-noise expert (``transformer``) trains on [0.875, 1], the low-noise
    one (``transformer_2``) on [0, 0.875] (docs/models.md)."""
    expert_boundary: float = field(default=0.0, metadata={"ge": 0, "lt": 1})
    """0: one model. In (0, 1): two experts in one run, as Wan 2.2 A14B's (its
    model_index.json's ``boundary_ratio``: 0.875 for T2V, 0.9 for I2V): the high-noise one
    (``transformer``) trained on t in [boundary, 1), the low-noise one (``transformer_2``)
    on [0, boundary); each optimizer step trains one of them (its own optimizer, EMA and
    checkpoint parts), chosen from the seed and the step's index (docs/models.md). With
    ``model.pretrained`` a pipeline folder holding ``transformer/`` and ``transformer_2/``,
    each starts from its own."""
    expert_share: float = field(default=0.0, metadata={"ge": 0, "lt": 1})
    """With two experts, the high-noise one's share of optimizer steps; 0: the share of the
    timestep distribution at or above the boundary (37% for Wan 2.2 T2V at shift 5)."""
    first_frame_share: float = field(default=0.0, metadata={"ge": 0, "le": 1})
    """For a model with a time per token (``model.expand_timesteps``, Wan 2.2 TI2V-5B): the
    share of clips trained image-to-video on their own first frame (that latent frame kept
    clean at time 0 and out of the loss, as TI2V samples from an image); the rest are
    trained text-to-video. 0: all text-to-video."""
    guidance: float = field(default=3.5, metadata={"ge": 0})
    """The guidance strength a model that embeds one is trained with (FLUX.1-dev; diffusers'
    Flux fine-tuning scripts use 3.5); unused by models without a guidance embedding."""

    def __post_init__(self) -> None:
        if self.resolution_shift and self.timestep_shift != 1:
            raise ValueError(f"resolution_shift computes each sample's shift; timestep_shift must be 1, "
                             f"got {self.timestep_shift!r}")
        low, high = self.timestep_range
        if not low < high:
            raise ValueError(f"timestep_range [{low}, {high}] is empty: low must be below high")
        if self.resolution_shift and (low, high) != (0.0, 1.0):
            raise ValueError("timestep_range and resolution_shift exclude each other (each sample's shift would "
                             "move the range's bounds)")
        if self.expert_boundary and ((low, high) != (0.0, 1.0) or self.resolution_shift):
            raise ValueError(f"expert_boundary={self.expert_boundary} splits the timesteps between two experts: "
                             "timestep_range must be [0.0, 1.0] and resolution_shift false")
        if self.expert_share and not self.expert_boundary:
            raise ValueError(f"expert_share={self.expert_share} is the high-noise expert's share: set "
                             "expert_boundary (e.g. 0.875) to train two experts")

    def experts(self) -> ExpertSplit | None:
        """The two experts' split (None: one model)."""
        return ExpertSplit(self.expert_boundary, self.expert_share) if self.expert_boundary else None

    def distribution(self) -> TimestepDistribution:
        """The distribution these fields describe (what ``build_packed_batch`` draws from)."""
        resolution = ResolutionShift(base_tokens=self.base_image_tokens, max_tokens=self.max_image_tokens,
                                     base_shift=self.base_shift, max_shift=self.max_shift) \
            if self.resolution_shift else None
        return TimestepDistribution(
            kind=self.timesteps, mean=self.timestep_mean, std=self.timestep_std, shift=self.timestep_shift,
            resolution=resolution, low=self.timestep_range[0], high=self.timestep_range[1],
        )


@dataclass(kw_only=True, slots=True)
class RunSection:
    """``run:`` What the run is called, where it lives, how long it runs and how often Ray Train
    restarts it."""

    name: str = field(default="demo", metadata={"check": _directory_name})
    """The run's directory name under ``storage`` (also names its coordinator actor)."""
    storage: str = "runs"
    """Run directory parent (absolute or relative to the working directory)."""
    max_steps: int = field(default=0, metadata={"ge": 0, "le": MAX_STEPS})
    """Stop after this many steps (0: run the epochs out)."""
    max_failures: int = field(default=1, metadata={"ge": -1, "le": MAX_STEPS})
    """Worker-group restarts Ray Train allows (-1: unlimited)."""


@dataclass(kw_only=True, slots=True)
class DistributedSection:
    """``distributed:`` How the ranks' process groups wait and which network they use (both
    launchers: Ray Train's and torchrun)."""

    timeout_s: int = field(default=1800, metadata={"ge": 1, "le": MAX_TIMEOUT_S})
    """Collective timeout (seconds): a dead peer surfaces as an error instead of a hang. It
    must also outlast the longest a rank may wait in a collective for a live peer, which the
    first steps set: with ``compile`` every rank compiles its blocks cold (minutes with
    inductor, longer with several ranks sharing a node's CPUs) while the faster ranks wait
    in the next collective. 1800 is torch's own default for NCCL."""
    gloo_socket_ifname: str = ""
    """Network interface(s) of the gloo groups (the step's object exchanges, checkpoint
    coordination), e.g. ``eth0`` or ``ens5,ens6``: set as GLOO_SOCKET_IFNAME before they are
    created. On a node with several NICs gloo otherwise binds whichever interface the
    hostname resolves to, which may not reach the other nodes. "" leaves the environment's
    GLOO_SOCKET_IFNAME (or gloo's choice) as it is. See docs/gpu.md."""


@dataclass(kw_only=True, slots=True)
class ScalingSection:
    """``scaling:`` How many workers, on what resources, and how an elastic run resizes (what
    the Ray launcher gives Ray Train's ``ScalingConfig``)."""

    num_workers: int = field(default=4, metadata={"ge": 1, "le": MAX_WORLD_SIZE})
    """Ray Train workers (one per GPU on a GPU cluster)."""
    min_workers: int = field(default=0, metadata={"ge": 0, "le": "num_workers"})
    """If > 0, elastic: the worker group may run with min_workers..num_workers."""
    use_gpu: bool = False
    cpus_per_worker: float = field(default=0.5, metadata={"gt": 0})
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources each worker requests besides ``cpus_per_worker``, e.g.
    ``{knapray_slot: 1}`` with a custom node resource that fits one worker per node."""
    elastic_monitor_interval_s: float = field(default=60.0, metadata={"gt": 0, "le": MAX_TIMEOUT_S})
    """Elastic runs: how often (seconds) Ray Train checks whether the cluster now holds
    a different number of workers and restarts the group at that size."""
    worker_start_timeout_s: float = field(default=0.0, metadata={"ge": 0, "le": MAX_TIMEOUT_S})
    """How long Ray Train waits for a worker group's resources before it tries again
    (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``). 0: 10 s for an elastic run (after a node
    loss Ray first asks for the old size, which can no longer be placed; the retry sizes
    the group from the nodes left), Ray's own default (60 s, or the environment variable
    if set) otherwise (a fixed-size run may wait for the autoscaler to add nodes)."""
    start_timeout_s: float = field(default=900.0, metadata={"ge": 0, "le": MAX_TIMEOUT_S})
    """How long a run's workers may wait for Ray to place them (their resources, on nodes
    the cluster has or its autoscaler adds) before the run stops with Ray's reason in one
    line; counted again after every restart. 15 minutes: a cloud autoscaler's new GPU node
    takes minutes. 0: wait for good. (Pre-flight refuses at once what can never be placed.)"""


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    """``checkpoint:`` When checkpoints are written and whether a run continues one."""

    every: int = field(default=10, metadata={"ge": 0, "le": MAX_STEPS})
    """Save a checkpoint every this many steps (0: none on the way)."""
    final: bool = True
    """Also save one after the last step, so that the run's last steps are never lost
    (false: only ``every``'s; the GPU check, whose runs are not resumed, skips it)."""
    resume: str = field(default="auto", metadata={"choices": ("auto", "never", "must")})
    """``auto``: continue the run directory's newest checkpoint if its saved config is
    compatible (same model and data order), else start fresh; ``never``: an existing run
    directory is an error; ``must``: there must be a checkpoint to continue."""


@dataclass(kw_only=True, slots=True)
class ValidationSection:
    """``metrics.validation:`` samples drawn while training, every ``every`` steps, with the
    run's current weights (the EMA's when the run keeps one), into TensorBoard (images; a
    clip as a strip of its frames) and ``validation/step-<N>.png`` in the run directory."""

    every: int = field(default=0, metadata={"ge": 0, "le": MAX_STEPS})
    """Steps between validations (0: none). Also after the last step."""
    like: tuple[int, ...] = ()
    """Corpus sample ids whose caption embeddings condition the samples (no encoder needed)."""
    captions: tuple[str, ...] = ()
    """Captions, encoded once by the corpus's text encoder (the corpus must record one
    knapray rebuilds, as ``knapray sample --caption``)."""
    sizes: tuple[str, ...] = ("256x256",)
    """WIDTHxHEIGHT of each sample, paired with the prompts as ``knapray sample`` pairs them."""
    frames: int = field(default=1, metadata={"ge": 1, "le": 1024})
    """Latent frames per sample (1: images)."""
    steps: int = field(default=20, metadata={"ge": 1, "le": 1000})
    """Euler steps per sample."""
    seed: int = field(default=0, metadata={"ge": 0, "le": 2**31 - 1})
    """The noise's seed: every validation draws from the same noise, so steps compare."""
    guidance: float = field(default=0.0, metadata={"ge": 0, "le": 100})
    """Guidance (the embedded guidance of a model that has it, else classifier-free); 0: the
    family's default (3.5 embedded, 1 otherwise)."""

    def __post_init__(self) -> None:
        self.like, self.captions, self.sizes = tuple(self.like), tuple(self.captions), tuple(self.sizes)
        if self.every and not (self.like or self.captions):
            raise ValueError("validation.every > 0 needs prompts: validation.like (corpus sample ids) or "
                             "validation.captions")
        for size in self.sizes:
            match = re.fullmatch(SIZE_FORM, str(size)) if len(str(size)) <= 40 else None
            if not (match and int(match[1]) > 0 and int(match[2]) > 0):
                raise ValueError(f"validation.sizes: expected WIDTHxHEIGHT such as 512x512, got {reprlib.repr(size)} "
                                 "(ASCII digits and a lowercase x)")


@dataclass(kw_only=True, slots=True)
class MetricsSection:
    """``metrics:`` Where the step metrics go, how often, and which steps are profiled."""

    log_every: int = field(default=1, metadata={"ge": 1, "le": MAX_STEPS})
    """Read the step numbers every this many steps (and before a checkpoint, at an epoch's
    end): the losses, timings and non-finite flags of the steps since, in one collective,
    then every one of them gets its ``metrics.jsonl`` row, the ledger its samples, Ray one
    report and the log one line. Between two reads the host never waits for the device."""
    tensorboard: str = field(default="auto", metadata={"choices": ("auto", "on", "off")})
    """TensorBoard event files in the run directory (``tensorboard/``): ``auto`` writes them
    when the tensorboard package is installed (a knapray dependency) and warns once where it
    is not (a bare torch machine), ``on`` requires it, ``off`` writes none. Every step is in
    ``metrics.jsonl`` either way."""
    wandb_project: str = ""
    """Also log the step metrics to this Weights & Biases project ("": no W&B). The run is
    named ``run.name`` and a resumed run continues the same W&B run (its id is kept in the
    run directory); needs the ``wandb`` package (``pip install 'knapray[wandb]'``)."""
    mlflow_tracking_uri: str = ""
    """Also log the step metrics to this MLflow tracking server or store ("": the
    ``MLFLOW_TRACKING_URI`` environment variable when set, else no MLflow); needs the
    ``mlflow`` package (``pip install 'knapray[mlflow]'``)."""
    mlflow_experiment: str = "knapray"
    """The MLflow experiment that holds the run (named ``run.name``)."""
    profile_steps: tuple[int, int] = field(default=(0, 0), metadata={"ge": 0, "le": MAX_STEPS})
    """Profile steps [a, b) with torch.profiler on every rank: ``profile/rank<r>.trace.json``
    (Chrome trace) and ``profile/rank<r>.txt`` (device busy time, kernel time by kind, the
    heaviest kernels) in the run directory. [0, 0]: no profiling."""
    validation: ValidationSection = field(default_factory=ValidationSection)
    """Samples while training (``every`` > 0)."""

    def __post_init__(self) -> None:
        a, b = self.profile_steps
        if (a, b) != (0, 0) and not a < b:
            raise ValueError(f"profile_steps [{a}, {b}] is empty: the first step must be below the second "
                             "([0, 0]: no profiling)")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The run config: one field per section."""

    model: DiTConfig = field(default_factory=MMDiTConfig)
    data: DataSection = field(default_factory=DataSection)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    optim: OptimSection = field(default_factory=OptimSection)
    flow: FlowSection = field(default_factory=FlowSection)
    run: RunSection = field(default_factory=RunSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def run_dir(self) -> str:
        return os.path.abspath(os.path.join(self.run.storage, self.run.name))

    def __post_init__(self) -> None:
        gpn, scaling = self.balance.gpus_per_node, self.scaling
        if scaling.min_workers and gpn and (scaling.min_workers % gpn or scaling.num_workers % gpn):
            raise ValueError(
                f"an elastic run on nodes of balance.gpus_per_node={gpn} workers grows and shrinks by whole nodes: "
                f"scaling.min_workers={scaling.min_workers} and scaling.num_workers={scaling.num_workers} must be multiples of {gpn}, "
                f"e.g. scaling.min_workers={-(-scaling.min_workers // gpn) * gpn} "
                f"scaling.num_workers={-(-scaling.num_workers // gpn) * gpn}")
        if not self.data.epochs and not self.run.max_steps:
            raise ValueError("data.epochs=0 trains run.max_steps steps, as many epochs as they take: set "
                             "run.max_steps to the steps to train (or data.epochs to the passes over the corpus)")
        if self.flow.first_frame_share and not getattr(self.model, "expand_timesteps", False):
            raise ValueError(f"flow.first_frame_share={self.flow.first_frame_share} keeps image-conditioned clips' "
                             "first frame clean, which needs a model with a time per token: set "
                             "model.expand_timesteps=true (Wan 2.2 TI2V-5B) or flow.first_frame_share=0")
        if self.metrics.validation.every and self.flow.expert_boundary:
            raise ValueError("metrics.validation samples one model; a run of two experts (flow.expert_boundary="
                             f"{self.flow.expert_boundary}) has none to validate alone: set metrics.validation.every=0 "
                             "and sample the run with knapray sample")
        if self.metrics.validation.every:
            from knapray.models.families import check_samples

            check_samples(self.model, "metrics.validation.every > 0: validation samples of")

    def world_sizes(self) -> list[int]:
        """Every world size the Ray launcher may start this run with: ``scaling.num_workers``, or
        with ``scaling.min_workers`` > 0 (elastic) every size Ray Train may pick in between.
        Pre-flight checks the config against each of them.

        Ray Train 2.60 picks an elastic size as the sum over nodes of how many workers each
        node's reserved resources fit, capped at ``max_workers``
        (``ElasticScalingPolicy._count_possible_workers``); it can be given no step size
        (only TPU slices get one). So with ``balance.gpus_per_node`` set (nodes of that
        many worker slots, the range a multiple of it) the sizes are the whole-node ones;
        a partly free node (another job holding some of its GPUs) can still give another
        size, which the trainer re-plans for, or refuses in one line when the run needs
        whole nodes (``parallel.fsdp: hybrid``)."""
        lo, hi, gpn = self.scaling.min_workers or self.scaling.num_workers, self.scaling.num_workers, self.balance.gpus_per_node
        step = gpn if self.scaling.min_workers and gpn else 1
        return list(range(lo, hi + 1, step))

    def samples_per_rank(self, world_size: int) -> int:
        """Samples each rank draws per step in a world of ``world_size``."""
        g = self.data.global_batch
        if not g:
            return self.data.samples_per_step
        if g % world_size:
            divisors = [w for w in range(1, g + 1) if g % w == 0]
            raise ValueError(f"data.global_batch={g} cannot be split over {world_size} ranks; "
                             f"valid world sizes: {divisors}")
        return g // world_size


# ---- YAML -------------------------------------------------------------------------------


class _YAMLLoader(yaml.SafeLoader):
    """yaml.SafeLoader (it builds no Python objects) with two YAML 1.2 readings: a number in
    exponent form is a float (3e-4, 1E5, -2.5e-3: YAML 1.1 wants a dot and a signed
    exponent, else it gives the string "3e-4"), and only true/false are booleans
    (yes/no/on/off stay strings). An alias (``*name``) is refused where it is met: nine
    levels of nine aliases are 454 bytes that stand for 9^9 values, which anything walking
    the value (an error message's repr, a JSON dump) expands."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.get_event()
            raise yaml.composer.ComposerError(
                None, None, f"an alias (*{str(event.anchor)[:40]}): a run config takes no YAML aliases (they can "
                "stand for more values than memory holds); write the value out", event.start_mark)
        return super().compose_node(parent, index)


_BOOL, _FLOAT = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
_YAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YAMLLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
# SafeLoader's float pattern with the exponent's sign optional and the dot-less "3e-4" added.
_YAMLLoader.add_implicit_resolver(_FLOAT, re.compile(r"""^(?:
     [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.VERBOSE), list("-+0123456789."))


def read_yaml(text: str, where: str) -> Any:
    """``text`` as plain YAML values (see ``_YAMLLoader``); ``where`` names it in errors."""
    try:
        return yaml.load(text, Loader=_YAMLLoader)  # a SafeLoader: no Python objects
    except RecursionError:
        raise ConfigError(f"{where}: not plain YAML: nested too deeply") from None
    except yaml.YAMLError as e:
        problem = "; ".join(p for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p)
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{where}: not plain YAML: {problem or e}{at}") from None


# ---- checks -----------------------------------------------------------------------------

_ATOMS = {bool: "true or false", int: "an int", float: "a number", str: "a string"}
_PLURAL = {int: "ints", float: "numbers", str: "strings", bool: "booleans"}
_BOUNDS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}


class _Mismatch(Exception):
    """A value that is not of its field's annotated type."""


def _describe(typ: Any) -> str:
    """What a value of annotation ``typ`` looks like in YAML."""
    args = get_args(typ)
    if typ in _ATOMS:
        return _ATOMS[typ]
    if get_origin(typ) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list of {_PLURAL[args[0]]}"
    if get_origin(typ) is tuple:
        if len(set(args)) == 1 and args[0] in _PLURAL:
            return f"a list of {len(args)} {_PLURAL[args[0]]}"
        return f"a list ({', '.join(_describe(a) for a in args)})"
    if get_origin(typ) is dict:
        return f"a mapping of {_PLURAL[args[0]]} to {_PLURAL[args[1]]}"
    if typ is dict:
        return "a mapping"
    raise TypeError(f"no config check for annotation {typ!r}")


def _convert(value: Any, typ: Any) -> Any:
    """``value`` as ``typ`` (an int for a float becomes a float, a list a tuple); raises
    _Mismatch if it is not one (a bool is no int)."""
    args = get_args(typ)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, bool):
        raise _Mismatch
    if typ in _ATOMS or typ is dict:
        if not isinstance(value, typ):
            raise _Mismatch
        return value
    if get_origin(typ) is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        return tuple(_convert(v, args[0]) for v in value)
    if get_origin(typ) is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise _Mismatch
        return tuple(_convert(v, a) for v, a in zip(value, args))
    if get_origin(typ) is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        return {_convert(k, args[0]): _convert(v, args[1]) for k, v in value.items()}
    raise TypeError(f"no config check for annotation {typ!r}")


def _range_text(rules: dict, siblings: dict) -> str:
    """``rules``' bounds in words: ">= 1", "in [0, 1)", "in [0, num_workers=4]"."""
    def show(op: str) -> str:
        bound = rules[op]
        if isinstance(bound, str):
            return f"{bound}={siblings[bound]}" if bound in siblings else bound
        return str(bound)

    lo = next((op for op in ("ge", "gt") if op in rules), None)
    hi = next((op for op in ("le", "lt") if op in rules), None)
    if lo and hi:
        return f"in {'[' if lo == 'ge' else '('}{show(lo)}, {show(hi)}{']' if hi == 'le' else ')'}"
    return f"{_BOUNDS[lo or hi][0]} {show(lo or hi)}"


def _expected(typ: Any, rules: Mapping, siblings: dict, *, finite: bool = False) -> str:
    """What a field accepts, in words: "an int >= 1", "a list of 2 numbers, each in [0, 1)"."""
    if "choices" in rules:
        return f"one of {', '.join(map(repr, rules['choices']))}"
    what = "a finite number" if finite else _describe(typ)
    if not any(op in rules for op in _BOUNDS):
        return what
    text = _range_text(rules, siblings)
    return f"{what}, each {text}" if get_origin(typ) is tuple else f"{what} {text}"


def _in_range(x: float, rules: Mapping, siblings: dict) -> bool:
    return math.isfinite(x) and all(
        compare(x, siblings[rules[op]] if isinstance(rules[op], str) else rules[op])
        for op, (_, compare) in _BOUNDS.items() if op in rules
    )


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _build(cls: type, data: Any, path: str) -> Any:
    """``cls`` from the mapping ``data`` (the section at dotted ``path``): every value checked
    against its annotation and its field's rules, defaults for the keys not given."""
    where = f"config {path}" if path else "config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values, {_got(data)}")
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    unknown = sorted(map(str, set(data) - set(names)))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {names}{_elsewhere(unknown, path)}")
    hints = get_type_hints(cls)
    keys = {f.name: f"{path}.{f.name}" if path else f.name for f in fields}
    values: dict[str, Any] = {}
    for f in fields:  # types first: a bound may name another field of the section
        typ, raw = hints[f.name], data.get(f.name)
        if typ is DiTConfig:
            typ = _model_section_class(raw, keys[f.name])
        if dataclasses.is_dataclass(typ):
            values[f.name] = _build(typ, raw, keys[f.name])
        elif f.name not in data:
            values[f.name] = _default(f)
        else:
            if "check" in f.metadata:
                try:
                    f.metadata["check"](raw)
                except ValueError as e:
                    raise ConfigError(f"config {keys[f.name]}: {e}") from None
            try:
                values[f.name] = _convert(raw, typ)
            except _Mismatch:
                raise ConfigError(
                    f"config {keys[f.name]}: expected {_expected(typ, f.metadata, values)}, {_got(raw)}"
                ) from None
    for f in fields:
        rules, value = f.metadata, values[f.name]
        bounded = any(op in rules for op in _BOUNDS)
        elements = value if isinstance(value, tuple) else (value,)
        if ("choices" in rules and value not in rules["choices"]) or (
            bounded and not all(_in_range(x, rules, values) for x in elements)
        ):
            finite = isinstance(value, float) and not math.isfinite(value)
            raise ConfigError(
                f"config {keys[f.name]}: expected {_expected(hints[f.name], rules, values, finite=finite)}, "
                f"{_got(data.get(f.name, value))}"
            )
    try:
        return cls(**values)
    except ValueError as e:  # the section's own checks, e.g. DiTConfig's that relate fields
        raise ConfigError(f"{where}: {e}") from None


def _elsewhere(keys: list[str], path: str) -> str:
    """"; did you mean distributed.timeout_s?" for the first of ``keys`` (unknown in the
    section at ``path``) that another section of the run config holds; "" if none does."""
    sections = {name: typ for name, typ in get_type_hints(TrainConfig).items() if dataclasses.is_dataclass(typ)}
    for key in keys:
        places = [f"{name}.{key}" for name, typ in sections.items()
                  if name != path and key in {f.name for f in dataclasses.fields(typ)}]
        if places:
            return f"; did you mean {' or '.join(places)}?"
    return ""


def _model_section_class(raw: Any, path: str) -> type:
    """The model section's class: the one of its ``family`` (knapray/models/families)."""
    from knapray.models.families import FAMILY_NAMES, config_class

    family = raw.get("family", "mmdit") if isinstance(raw, dict) else "mmdit"
    if family not in FAMILY_NAMES:
        raise ConfigError(f"config {path}.family: expected one of {', '.join(map(repr, FAMILY_NAMES))}, {_got(family)}")
    return config_class(family)


NULLS = ("null", "Null", "NULL", "~")
"""An override's value that removes its key (``--set model.hidden_size=null``)."""


def _apply_override(data: dict, item: str) -> None:
    """Set ``section.key=value`` in ``data``; the path is checked against the sections (a
    dict-valued field such as ``balance.cost`` may be entered too)."""
    where = f"config override {item!r}"
    path, eq, text = item.partition("=")
    parts = path.split(".")
    if not eq or not all(parts):
        raise ConfigError(f"{where}: expected section.key=value, e.g. optim.lr=3e-4")
    node, cls = data, TrainConfig
    for i, part in enumerate(parts[:-1]):
        prefix = ".".join(parts[: i + 1])
        if cls is not None:
            hints = get_type_hints(cls)
            if part not in hints:
                raise ConfigError(f"{where}: unknown key {prefix!r}; valid keys here: {list(hints)}")
            typ = hints[part]
            if not (dataclasses.is_dataclass(typ) or typ is dict or get_origin(typ) is dict):
                raise ConfigError(f"{where}: {prefix} is a value ({_describe(typ)}), not a section")
            cls = typ if dataclasses.is_dataclass(typ) else None
        if node.get(part) is None:  # absent, or an empty section in the file
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: {prefix} is not a section here, it holds {_SHOWN.repr(node)}")
    value = read_yaml(text, where)
    if value is None and text.strip() in NULLS:  # key=null: as if the file left the key out
        node.pop(parts[-1], None)
    else:  # (key= with nothing after it stays a value, which the checks refuse)
        node[parts[-1]] = value


def read_config(path: str | None = None, overrides: list[str] | None = None) -> dict:
    """The YAML file ``path`` (an empty mapping if None) with ``overrides``
    (``section.key=value``) applied, as plain values, unchecked; ConfigError naming a bad
    file or override. It reads that one file and nothing else."""
    data: Any = {}
    if path:
        data = read_yaml(_config_text(path), f"config file {path!r}")
        if data is None:  # an empty file (or only comments) is a mistake: no --config means the defaults
            raise ConfigError(f"config file {path!r}: empty (no sections); give at least one section, e.g. 'run:', "
                              "or leave --config out for the defaults")
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r}: expected a mapping of sections, {_got(data)}")
    for item in overrides or []:
        _apply_override(data, item)
    return data


def load_config(path: str | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """The config in the YAML file ``path`` (defaults if None) with ``overrides`` applied,
    every value checked; raises ConfigError naming the first bad item. No other file is
    read: the model widths a run takes from its corpus and its pretrained checkpoint are
    filled by ``knapray.driver.preflight.load_run_config``."""
    return _build(TrainConfig, read_config(path, overrides), "")


MAX_CONFIG_FILE_BYTES = 1 << 20
"""A YAML run config a user writes is a few KB; a larger file is not one (and is never read
whole). A run directory's saved ``config.json`` has its own bound
(``knapray.driver.run_dir.MAX_SAVED_CONFIG_BYTES``)."""


def _config_text(path: str) -> str:
    """The config file's text: UTF-8, at most ``MAX_CONFIG_FILE_BYTES``; a ConfigError naming
    the file otherwise."""
    return read_text(path, MAX_CONFIG_FILE_BYTES, "config file", ConfigError, advice="is it a run config?")


def config_from_dict(data: dict) -> TrainConfig:
    """The config from plain values (e.g. ``TrainConfig.to_dict()``), checked as at load."""
    return _build(TrainConfig, data, "")
