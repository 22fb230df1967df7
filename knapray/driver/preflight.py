"""Pre-flight: everything a training run checks before any worker starts, for every
launcher (the Ray driver of ``knapray train`` / ``jobs/train.py``, and rank 0 of the
torchrun launcher), each input file read once.

    pre = check_file(config_file, overrides)  # config (unpinned widths from the corpus), corpus,
                                              # model vs corpus, world sizes: no side effects
    print("\\n".join(pre.summary()))           # what --check prints (with the run directory's decision)
    start, lock = prepare(pre)                # the run directory: lock, fresh or resume, config.json

A failed check raises ``ConfigError`` (the config), ``RunError`` (corpus, world sizes, run
directory) or ``BadCorpus`` (too many unreadable shards): one line naming the value and
what is valid, which the launchers print with exit code 2.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from knapray.corpus.schema import MAX_SCHEMA_BYTES, SCHEMA_FILE, SchemaFileError
from knapray.corpus.schema import load_schema_json as read_schema_json  # every field's type checked
from knapray.data import BadShard, CorpusInfo, DuplicateId, FamilyMismatch, check_model_config, check_shards, corpus_info, duplicate_ids
from knapray.files import read_json

from knapray.worker.checkpoint import completed_checkpoints
from knapray.config.run import ConfigError, DataSection, TrainConfig, config_from_dict, read_config
from knapray.worker.guard import check_bad_shards, check_duplicates, write_duplicate_quarantine, write_shard_quarantine
from knapray.worker.metrics import truncate_metrics
from knapray.driver.report import run_length_note, steps_line
from knapray.driver.run_dir import (
    RunError,
    RunLock,
    RunStart,
    check_world,
    check_writable,
    clear_stale_run_files,
    decide_start,
    inside_ray_upload,
    resolve_paths,
    write_config,
)
from knapray.run_files import RunDir


def load_run_config(config_file: str | None = None, overrides: list[str] | None = None, *,
                    corpus_dims: Callable[[str], Mapping[str, Any] | None] | None = None) -> TrainConfig:
    """The run config as a run trains it: ``load_config``'s file and overrides, with the
    model fields it leaves out taken from the files the run reads: ``model.pretrained``'s
    config (family and architecture; a field given with another value is a ConfigError)
    and the corpus's ``schema.json`` (in_channels, text_dim, pooled_dim). Both launchers
    (every rank of torchrun) and the tools that build a run's model (``knapray memory``,
    ``calibrate --config``, ``dryrun``) load a config this way; ``load_config`` reads
    nothing but the YAML. ``corpus_dims(corpus)``: the dims of the corpus's schema.json or
    None (default: ``read_corpus_dims``; pre-flight passes its reader, so schema.json is
    read once)."""
    data = read_config(config_file, overrides)
    _arch_from_pretrained(data)
    _dims_from_corpus(data, corpus_dims or read_corpus_dims)
    return config_from_dict(data)


CORPUS_DIMS = {"in_channels": "channels", "text_dim": "text_dim", "pooled_dim": "pooled_dim"}
"""Model fields that default to the corpus's ``schema.json`` dims (what its encoders made)."""


def read_corpus_dims(corpus: str) -> Mapping[str, Any] | None:
    """The ``dims`` of ``<corpus>/schema.json``, or None when it cannot be read (no corpus
    yet: the launcher names the path)."""
    try:
        dims = read_json(os.path.join(corpus, SCHEMA_FILE), MAX_SCHEMA_BYTES, "corpus file", missing={}).get("dims")
    except ValueError:
        return None
    return dims if isinstance(dims, dict) else None


def _dims_from_corpus(data: dict, corpus_dims: Callable[[str], Mapping[str, Any] | None]) -> None:
    """Fill ``model.in_channels`` / ``text_dim`` / ``pooled_dim`` the config leaves out from
    the corpus's schema.json (in_channels: the latent's channels, and the conditioning
    latent's for a model with ``image_dim``), when the corpus is there (pre-flight checks the model
    against the corpus either way, so a pinned width that differs is one error line)."""
    data_section = data.get("data") if isinstance(data.get("data"), dict) else {}
    corpus = data_section.get("corpus", DataSection().corpus)
    model = data.setdefault("model", {}) if isinstance(data.get("model", {}), dict) else None
    if model is None or not isinstance(corpus, str) or all(k in model for k in CORPUS_DIMS):
        return
    dims = corpus_dims(corpus)
    if dims is None:
        return  # no corpus (yet): the model keeps its defaults, and the launcher names the path
    take_channels = "in_channels" not in model
    for field_name, dim in CORPUS_DIMS.items():
        if field_name not in model and isinstance(dims.get(dim), int):
            model[field_name] = dims[dim]
    # A model with an image context (Wan 2.1 I2V) takes the conditioning latent's channels after the latent's.
    extra = dims.get("condition_channels")
    image_dim = model.get("image_dim")
    if take_channels and isinstance(image_dim, int) and image_dim > 0 and isinstance(extra, int) \
            and isinstance(model.get("in_channels"), int):
        model["in_channels"] += extra


def _arch_from_pretrained(data: dict) -> None:
    """With ``model.pretrained`` naming a checkpoint that is there, its family and
    architecture fill the model fields the config leaves out; a field given with another
    value is a ConfigError naming both. A path that is not there is left to the launcher's
    pre-flight (which names it), so a config with a placeholder path still loads."""
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("pretrained"), str) or not model["pretrained"]:
        return
    if not os.path.exists(os.path.expanduser(model["pretrained"])):
        return
    from knapray.weights.checks import checkpoint_family, section_values
    from knapray.weights.source import open_pretrained

    try:
        source = open_pretrained(model["pretrained"])
        values = section_values(source, checkpoint_family(source, model.get("family")))
    except ValueError as e:
        raise ConfigError(f"config model.pretrained: {e}") from None
    for key, value in values.items():
        given = model.get(key, value)
        if (tuple(given) if isinstance(given, list) else given) != value:
            raise ConfigError(f"config model.{key}: {given!r} disagrees with model.pretrained {source.path}, "
                              f"whose config gives {value!r}; leave it out to take the checkpoint's")
        model.setdefault(key, list(value) if isinstance(value, tuple) else value)


class _SchemaReader:
    """Reads a corpus's schema.json at most once: for the model widths while the config
    loads, then for the corpus check."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.doc: dict | None = None
        self.error: Exception | None = None

    def read(self, corpus: str) -> dict | None:
        path = os.path.abspath(corpus)
        if path != self.path:
            self.path, self.doc, self.error = path, None, None
            try:
                self.doc = read_schema_json(path)
            except (OSError, ValueError) as e:  # missing, unreadable, not JSON, another format, wrong types
                self.error = e
        return self.doc

    def dims(self, corpus: str) -> Mapping[str, Any] | None:
        doc = self.read(corpus)
        dims = doc.get("dims") if doc is not None else None
        return dims if isinstance(dims, dict) else None


def check_file(config_file: str | None, overrides: list[str] | None = None,
               worlds: Iterable[int] | None = None) -> Preflight:
    """Load the run config (absolute paths; the model's in_channels / text_dim / pooled_dim
    the config leaves out come from the corpus's schema.json) and ``check`` it for
    ``worlds`` (default: every world size the Ray launcher may start with), reading
    schema.json once for both."""
    reader = _SchemaReader()
    cfg = load_run_config(config_file, overrides, corpus_dims=reader.dims)
    return check(cfg, cfg.world_sizes() if worlds is None else worlds, schema=reader)  # resolves the paths


@dataclass(frozen=True)
class CorpusCheck:
    """The corpus as pre-flight found it."""

    info: CorpusInfo
    good_shards: tuple[Path, ...]
    """Shards whose parquet footers read (what the run reads)."""
    bad_shards: tuple[BadShard, ...]
    """Shards left out, quarantined when the run starts."""
    duplicates: tuple[DuplicateId, ...] = ()
    """Sample ids several rows carry (``data.duplicate_ids: quarantine``: left out, quarantined)."""


@dataclass(frozen=True)
class Preflight:
    """A config that passed every check that needs no run directory."""

    cfg: TrainConfig
    worlds: tuple[int, ...]
    corpus: CorpusCheck

    def run_dir_decision(self) -> RunStart:
        """Fresh run or resume, and whether a live run holds the directory, without taking
        the lock or writing anything (``--check``); ``RunError`` as the run would give."""
        check_writable(self.cfg.run_dir)
        RunLock(self.cfg.run_dir).check_free()
        return decide_start(self.cfg, completed_checkpoints(os.path.join(self.cfg.run_dir, "checkpoints")))

    def summary(self, config_file: str | None = None, start: RunStart | None = None) -> list[str]:
        """What was checked, for ``--check`` (the run directory's decision included:
        ``start``, or ``run_dir_decision()`` when not given)."""
        cfg, info, m = self.cfg, self.corpus.info, self.cfg.model
        start = start if start is not None else self.run_dir_decision()
        bad = self.corpus.bad_shards
        dups = self.corpus.duplicates
        shards = (f"{len(self.corpus.good_shards)} shards readable"
                  + (f", {len(bad)} unreadable ({sum(b.rows or 0 for b in bad)} rows) left out and quarantined"
                     if bad else "")
                  + (f", {len(dups)} duplicated sample id(s) left out and quarantined" if dups else ""))
        return [
            f"config {config_file or '(defaults)'}: valid; model {m.hidden_size} wide, {m.num_heads} heads, "
            f"{m.depth_double}+{m.depth_single} blocks, in_channels {m.in_channels}, text_dim {m.text_dim}, "
            f"pooled_dim {m.pooled_dim}",
            f"corpus {info.path}: {info.num_samples} samples, {shards}; channels {info.channels}, text_dim "
            f"{info.text_dim}, pooled_dim {info.pooled_dim}, patch {tuple(info.patch)}{_conditioning_text(info)}: "
            "the model fits it",
            f"world sizes: {_worlds_text(self.worlds, cfg)}: the global batch, topology "
            f"{cfg.balance.topology!r} and heads fit each",
            f"steps: {steps_line(cfg, info.num_samples)}",
            f"run directory: {_would(start.message)}",
        ] + ([f"run directory: {start.torn_metrics.replace('dropped', 'would drop', 1)}"] if start.torn_metrics else []) \
          + ([f"note: {cap}"] if (cap := run_length_note(cfg, info.num_samples)) else [])


def _conditioning_text(info: CorpusInfo) -> str:
    """The corpus's image-to-video conditioning, for the summary ("" when it holds none)."""
    parts = ([f"condition channels {info.condition_channels}"] if info.condition_channels else []) + \
            ([f"image tokens {info.image_tokens} x {info.image_dim}"] if info.image_dim else [])
    return "".join(f", {p}" for p in parts)


_WOULD = {"starting": "would start", "resuming": "would resume"}


def _would(message: str) -> str:
    """``RunStart.message`` ("starting run ...", "resuming run ...") as what a run would do."""
    verb, _, rest = message.partition(" ")
    return f"{_WOULD.get(verb, verb)} {rest}"


def _worlds_text(worlds: tuple[int, ...], cfg: TrainConfig) -> str:
    if len(worlds) == 1:
        return f"{worlds[0]} (scaling.num_workers)" if worlds[0] == cfg.scaling.num_workers else str(worlds[0])
    return f"{worlds[0]}..{worlds[-1]} ({len(worlds)} sizes: elastic, scaling.min_workers..scaling.num_workers)"


def check(cfg: TrainConfig, worlds: Iterable[int], *, corpus: CorpusCheck | None = None,
          schema: _SchemaReader | None = None) -> Preflight:
    """Every check that needs no run directory: the config fits every world size the run
    may have (``worlds``), the corpus exists, its shards' footers read (or few enough are
    bad) and the model fits its widths and patch. ``corpus``: a check of the same corpus
    done already (``--compare-unbalanced`` trains a second run on it); ``schema``: the
    reader that loaded the config, holding schema.json read already."""
    cfg = resolve_paths(cfg)
    worlds = tuple(int(w) for w in worlds)
    for world in worlds:
        check_world(cfg, world)
    check_model_size(cfg)
    check_pretrained(cfg)
    check_lora(cfg)
    check_fp8(cfg)
    if corpus is None:
        corpus = check_corpus(cfg, schema)
    try:
        check_model_config(corpus.info, cfg.model)
    except FamilyMismatch as e:
        raise RunError(str(e)) from None
    except ValueError as e:
        raise RunError(f"{e}; leave model.in_channels / text_dim / pooled_dim out of the config to take the "
                       "corpus's, or use a corpus made with the encoders the config expects") from None
    check_lengths(cfg, corpus, worlds)
    return Preflight(cfg=cfg, worlds=worlds, corpus=corpus)


def largest_bag(cfg: TrainConfig, world: int) -> int:
    """The largest bag any topology of the run may use on ``world`` ranks: a divisor of the
    head count (Ulysses splits heads), inside a node (``balance.gpus_per_node``)."""
    cap = min(world, cfg.balance.gpus_per_node or world)
    return max(g for g in range(1, cap + 1) if cfg.model.num_heads % g == 0)


def check_lengths(cfg: TrainConfig, corpus: CorpusCheck, worlds: tuple[int, ...]) -> None:
    """With ``data.max_tokens_per_gpu``, a sample longer than the budget times the largest
    bag the run may use is quarantined as ``too_long`` when read, and a run whose corpus is
    more than ``data.max_bad_fraction`` such samples stops as mostly bad: refused here, from
    the corpus's seq_len column, before any worker starts."""
    budget = cfg.data.max_tokens_per_gpu
    if not budget or not corpus.good_shards:
        return
    import pyarrow.parquet as pq

    limit = budget * largest_bag(cfg, max(worlds))
    lens = np.concatenate([pq.read_table(f, columns=["seq_len"]).column("seq_len").to_numpy()
                           for f in corpus.good_shards])
    too_long = int(np.count_nonzero(lens > limit))
    if lens.size and too_long > cfg.data.max_bad_fraction * lens.size:
        raise RunError(f"data.max_tokens_per_gpu={budget}: {too_long} of the corpus's {lens.size} samples are longer "
                       f"than {limit} tokens (the budget times the largest bag, {limit // budget} GPUs, of "
                       f"{max(worlds)} ranks and {cfg.model.num_heads} heads; longest {int(lens.max())}), more than "
                       f"data.max_bad_fraction={cfg.data.max_bad_fraction}: they would all be quarantined; raise "
                       "the budget or shorten the samples")


def check_model_size(cfg: TrainConfig) -> None:
    """The model's parameter count (exact, from its config: ``ModelShape``) is within
    ``MAX_MODEL_PARAMS``: each width and depth is bounded on its own, their product too, so
    that a typo never has workers build a model no memory holds."""
    from knapray.limits import MAX_MODEL_PARAMS
    from knapray.planning.costs.memory import ModelShape

    params = ModelShape.of(cfg.model).num_params
    if params > MAX_MODEL_PARAMS:
        m = cfg.model
        raise RunError(f"model: {params:.3g} parameters (hidden_size={m.hidden_size}, depth_double={m.depth_double}, "
                       f"depth_single={m.depth_single}, mlp_ratio={m.mlp_ratio:g}); at most {MAX_MODEL_PARAMS:.3g}")


def check_pretrained(cfg: TrainConfig) -> None:
    """``model.pretrained`` (if set) is a checkpoint of the model's family and shape with
    exactly its tensors: from config.json and the safetensors headers (each worker then
    reads only its shard of the data). A pipeline folder of two experts (``transformer_2/``,
    Wan 2.2 A14B) needs ``flow.expert_boundary``, and its two transformers one architecture."""
    if not cfg.model.pretrained:
        return
    from knapray.weights.checks import check_experts, check_pretrained as check

    try:
        check_experts(cfg.model, cfg.flow.expert_boundary, check(cfg.model))
    except ValueError as e:
        raise RunError(f"model.pretrained: {e}") from None


def check_lora(cfg: TrainConfig) -> None:
    """``model.lora`` (rank > 0): peft is installed, the targets select linear layers of
    this model (built on the meta device: nothing allocated) and a base is given."""
    lora = cfg.model.lora
    if not lora.enabled:
        return
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise RunError("model.lora.rank > 0 needs the peft package on the driver and every worker: "
                       "pip install 'knapray[lora]'")
    if not cfg.model.pretrained:
        raise RunError("model.lora trains adapters on a pretrained base: set model.pretrained (a diffusers "
                       "transformer directory or a BFL file), or set model.lora.rank=0 to train every weight")
    if lora.base_dtype == "fp8" and cfg.parallel.precision == "fp32":
        raise RunError("model.lora.base_dtype=fp8 turns the base back into bf16 in each matrix product: "
                       "set parallel.precision to bf16 (or auto, bf16 on a GPU), not fp32")
    import torch

    from knapray.models.families import build_model

    try:
        with torch.device("meta"):
            build_model(cfg.model)
    except ValueError as e:
        raise RunError(str(e)) from None


def check_fp8(cfg: TrainConfig) -> None:
    """``parallel.fp8``: bf16 compute (``auto`` is fp32 on a CPU run), no LoRA, torchao
    importable, and at least one block layer it can run in float8."""
    par = cfg.parallel
    if not par.fp8:
        return
    if par.precision == "fp32" or (par.precision == "auto" and not cfg.scaling.use_gpu):
        raise RunError(f"parallel.fp8 computes beside bf16: parallel.precision={par.precision} is fp32 on this run "
                       "(scaling.use_gpu=false); set parallel.precision=bf16")
    if cfg.model.lora.enabled:
        raise RunError("parallel.fp8 trains every block weight in float8; a LoRA run trains adapters only: hold its "
                       "frozen base in float8 with model.lora.base_dtype=fp8 instead")
    from knapray.worker.float8 import check_available, float8_layers

    missing = check_available()
    if missing:
        raise RunError(missing)
    import torch

    from knapray.models.families import build_model

    with torch.device("meta"):
        model = build_model(cfg.model)
    if not float8_layers(model):
        raise RunError(f"parallel.fp8: no block linear layer of this {cfg.model.family} has both sizes a multiple "
                       "of 16 (model.hidden_size and the MLP width); nothing would run in float8")


def check_corpus(cfg: TrainConfig, schema: _SchemaReader | None = None) -> CorpusCheck:
    """The corpus must exist before any worker starts (it is never built or replaced
    implicitly) and enough of its shards must be readable (parquet footers only)."""
    path = cfg.data.corpus
    reader = schema or _SchemaReader()
    doc = reader.read(path)
    if doc is None:
        if not os.path.exists(os.path.join(path, "schema.json")):
            hint = ""
            if inside_ray_upload(path):
                hint = ("; this job runs in the folder ray job submit uploaded, which holds no gitignored data: "
                        "give data.corpus as an absolute path on storage every node reads")
            raise RunError(f"data.corpus {path!r}: no corpus there (no schema.json){hint}; build one with "
                           "knapray synthetic or knapray ingest")
        if isinstance(reader.error, SchemaFileError):  # names the file already
            raise RunError(f"data.corpus: {reader.error}")
        raise RunError(f"data.corpus {path!r}: {reader.error}")
    try:
        info = corpus_info(path, doc)
        good, bad = check_shards(path, info)
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else str(e)
        raise RunError(f"data.corpus {path!r}: {what or type(e).__name__}") from None
    check_bad_shards(path, info.num_samples, good, bad, cfg.data.max_bad_fraction)
    try:
        dups = duplicate_ids(good)
    except (OSError, ValueError, KeyError) as e:
        raise RunError(f"data.corpus {path!r}: its sample_id column cannot be read ({type(e).__name__}: {e})") from None
    check_duplicates(path, dups, cfg.data.duplicate_ids)
    return CorpusCheck(info=info, good_shards=tuple(good), bad_shards=tuple(bad), duplicates=tuple(dups))


def prepare(pre: Preflight) -> tuple[RunStart, RunLock]:
    """The run directory, once every check passed: take its lock, decide fresh run or
    resume under it (``checkpoint.resume``), clear what an unfinished fresh run left (or cut a
    resumed run's torn last metrics line, with a warning), write the config and the
    quarantined shards. The caller releases the lock at the end of the run."""
    cfg = pre.cfg
    check_writable(cfg.run_dir)  # again, now: a link planted since --check is refused before any write
    lock = RunLock(cfg.run_dir).acquire()
    try:
        start = decide_start(cfg, completed_checkpoints(RunDir(cfg.run_dir).checkpoints))
        if start.resume_from is None:
            clear_stale_run_files(cfg.run_dir)
        else:
            # The steps after the checkpoint are trained again: their old lines (and a torn
            # last line) go now, before the driver's progress tail reads the file, as rank 0
            # would drop them after loading the checkpoint.
            truncate_metrics(cfg.run_dir, int(os.path.basename(os.path.normpath(start.resume_from)).split("-")[1]) + 1)
            if start.torn_metrics:
                print(f"[knapray] warning: {start.torn_metrics}", file=sys.stderr, flush=True)
        write_config(cfg)
        write_shard_quarantine(cfg.run_dir, list(pre.corpus.bad_shards))
        write_duplicate_quarantine(cfg.run_dir, list(pre.corpus.duplicates))
    except BaseException:
        lock.release()
        raise
    return start, lock
