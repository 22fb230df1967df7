"""Write a run's trained (or EMA) weights as a diffusers model directory.

The run's newest complete DCP checkpoint (or the one named) is read through the run
directory's safe reader (``knapray.worker.checkpoint.safe_load``: no unrestricted unpickling)
in one process without a process group. Output tensors are grouped into shard files of
at most ``max_shard_bytes`` in the model's parameter order; for each shard, the parameters
its tensors come from are read from the checkpoint a few at a time (at most
``read_bytes`` of fp32 per read, or one parameter if larger: DCP reads those byte ranges of
its per-rank files), copied through the family's layout (the same pieces that load it)
into the shard's tensors and dropped; the shard is written and dropped before the next.
So the process holds one output shard plus at most one read's parameters. The directory gets
``config.json``, the shard files and, for several shards, the index, as
``save_pretrained`` writes them; it is built in ``<out>.partial`` and renamed when done.

What the family's pipeline needs to call the transformer as it was trained, beyond its
config.json, goes in a pipeline folder: two experts' boundary (``boundary_ratio``), a time
per token (``expand_timesteps``, Wan 2.2 TI2V); the weights then go to ``transformer/``
(and ``transformer_2/``) beside a ``model_index.json`` that says it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time

import torch

from knapray.models.families import checkpoint_layout, get_family
from knapray.models.timesteps import EXPERT_NAMES
from knapray.quiet_imports import load_torchao_quietly
from knapray.weights.load import peak_host_bytes
from knapray.weights.source import DIFFUSERS_INDEX, DIFFUSERS_WEIGHTS
from knapray.worker.experts import part_suffix

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 10 * 2**30
"""diffusers' default ``max_shard_size`` ("10GB")."""
DEFAULT_READ_BYTES = 2**30
"""fp32 parameter bytes read from the checkpoint at once."""


@dataclasses.dataclass(frozen=True)
class ExportReport:
    out: str
    checkpoint: str
    step: int
    """The checkpoint's step: the index of the last step it holds, counted from 0 (``trainer.json``)."""
    steps: int
    """Steps trained into the weights (``step + 1``): what the run's progress bar and summary counted."""
    ema: bool
    family: str
    dtype: str
    tensors: int
    shards: list[str]
    total_bytes: int
    largest_shard_bytes: int
    largest_read_bytes: int
    """Most checkpoint bytes read at once (fp32 parameters)."""
    seconds: float
    peak_host_bytes: int
    experts: list[str] = dataclasses.field(default_factory=list)
    """A run of two experts: the subfolders written (``transformer``, ``transformer_2``)."""
    expand_timesteps: bool = False
    """A model with a time per token (Wan 2.2 TI2V): written as a pipeline folder, its
    ``transformer/`` beside a model_index.json with ``expand_timesteps: true``."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    """``safetensors.torch.save_file`` with the file readable as any other this process writes
    (0644 under a umask of 022): safetensors creates its files 0600, which another user (a
    serving account, a shared model store) cannot read."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _shard_plan(layout, dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    """Checkpoint keys in layout order, cut into shards of at most ``max_bytes`` (a tensor
    larger than that gets a shard of its own)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for key in layout.keys:
        nbytes = math.prod(layout.shapes[key]) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _reads(params: list[str], sizes: dict[str, int], budget: int) -> list[list[str]]:
    """``params`` in order, cut into reads of at most ``budget`` bytes (a larger one alone)."""
    reads: list[list[str]] = [[]]
    total = 0
    for name in params:
        if reads[-1] and total + sizes[name] > budget:
            reads.append([])
            total = 0
        reads[-1].append(name)
        total += sizes[name]
    return [r for r in reads if r]


def export_run(run_dir: str, out: str, *, ema: bool = False, checkpoint: str | None = None, dtype: str = "fp32",
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, read_bytes: int = DEFAULT_READ_BYTES) -> ExportReport:
    """Export ``run_dir``'s weights to the new directory ``out``; ValueError (one line) for a
    run, checkpoint or output that cannot be exported. A run of two experts
    (``flow.expert_boundary``) is written as a pipeline folder's part: ``transformer/``,
    ``transformer_2/`` and a ``model_index.json`` with the boundary (``boundary_ratio``),
    which the family's pipeline loads given its other components; so is a model with a time
    per token (``model.expand_timesteps``, Wan 2.2 TI2V): ``transformer/`` and a
    ``model_index.json`` with ``expand_timesteps: true``, without which the pipeline would
    call it with one time per sequence."""
    from knapray.worker.checkpoint import read_trainer_state, saved_keys
    from knapray.driver.run_dir import read_run_config, run_checkpoint

    t0 = time.perf_counter()
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: valid: {', '.join(DTYPES)}")
    if max_shard_bytes < 1 or read_bytes < 1:
        raise ValueError(f"shard and read sizes must be >= 1 byte, got {max_shard_bytes} and {read_bytes}")
    run_cfg = read_run_config(run_dir)
    cfg = run_cfg.model
    if cfg.lora.enabled:
        raise ValueError(f"run {run_dir} trained LoRA adapters (model.lora.rank {cfg.lora.rank}): export them with "
                         "--lora; the base is model.pretrained, unchanged")
    family = get_family(cfg.family)
    layout = checkpoint_layout(cfg)  # ValueError for a family without a checkpoint format
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--out {out}: exists and is not an empty directory; choose a new one")
    path = run_checkpoint(run_dir, checkpoint, "export")
    boundary = run_cfg.flow.expert_boundary
    expand = bool(getattr(cfg, "expand_timesteps", False))  # a pipeline's flag, not in config.json
    # (subfolder, checkpoint prefix) of each model written: one (in a pipeline folder's
    # transformer/ when model_index.json has something to say), or the two experts'
    experts = EXPERT_NAMES if boundary else EXPERT_NAMES[:1] if expand else ("",)
    targets = [(name, ("ema" if ema else "model") + part_suffix(i)) for i, name in enumerate(experts)]
    saved = set(saved_keys(path))
    if ema and not any(k.startswith("ema.") for k in saved):
        raise ValueError(f"--ema: checkpoint {path} holds no EMA weights (the run had optim.ema_decay 0)")
    for _, prefix in targets:
        missing = [p.param for p in layout.pieces if f"{prefix}.{p.param}" not in saved]
        if missing:
            raise ValueError(f"checkpoint {path} has no {prefix}.{missing[0]}: not a {cfg.family} run of this shape")
    step = read_trainer_state(path)["step"]

    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    shards, tensors, total, largest, largest_read = [], 0, 0, 0, 0
    for sub, prefix in targets:
        written = _write_model(path, layout, prefix, os.path.join(partial, sub), family.to_diffusers(cfg),
                               DTYPES[dtype], max_shard_bytes, read_bytes)
        shards += [os.path.join(sub, n) if sub else n for n in written["shards"]]
        tensors, total = tensors + written["tensors"], total + written["total"]
        largest, largest_read = max(largest, written["largest"]), max(largest_read, written["largest_read"])
    if boundary or expand:
        index = {"_class_name": family.encoders.pipeline or "DiffusionPipeline",
                 **({"boundary_ratio": boundary} if boundary else {}),
                 # the family's pipeline reads it (WanPipeline's config), false where the model has the switch off
                 **({"expand_timesteps": expand} if hasattr(cfg, "expand_timesteps") else {}),
                 **{name: ["diffusers", family.diffusers_class] for name in experts}}
        with open(os.path.join(partial, "model_index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    if os.path.isdir(out):
        os.rmdir(out)  # empty, checked above
    os.rename(partial, out)
    return ExportReport(out=out, checkpoint=path, step=step, steps=step + 1, ema=ema, family=cfg.family, dtype=dtype,
                        tensors=tensors, shards=shards, total_bytes=total, largest_shard_bytes=largest,
                        largest_read_bytes=largest_read, seconds=time.perf_counter() - t0,
                        peak_host_bytes=peak_host_bytes(), experts=list(experts) if boundary else [],
                        expand_timesteps=expand)


def _write_model(path: str, layout, prefix: str, directory: str, config: dict, torch_dtype: torch.dtype,
                 max_shard_bytes: int, read_bytes: int) -> dict:
    """One diffusers model directory ``directory`` from the checkpoint ``path``'s parameters
    under ``prefix`` (``model``, ``ema``, ``model_2``...): its shards, config.json and index."""
    from knapray.worker.checkpoint import safe_load

    os.makedirs(directory, exist_ok=True)
    plan = _shard_plan(layout, torch_dtype, max_shard_bytes)
    names = [DIFFUSERS_WEIGHTS] if len(plan) == 1 else [
        f"diffusion_pytorch_model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    weight_map, total, largest, largest_read = {}, 0, 0, 0
    shapes = {p.param: _param_shape(layout, p.param) for p in layout.pieces}
    sizes = {n: 4 * math.prod(shape) for n, shape in shapes.items()}  # fp32 in the checkpoint
    for keys, name in zip(plan, names):
        pieces = [p for key in keys for p in layout.pieces_of(key)]
        tensors = {key: torch.empty(layout.shapes[key], dtype=torch_dtype) for key in keys}
        for read in _reads(list(dict.fromkeys(p.param for p in pieces)), sizes, read_bytes):
            state = {prefix: {n: torch.empty(shapes[n], dtype=torch.float32) for n in read}}
            safe_load(state, path)  # reads only these parameters' byte ranges
            for p in pieces:
                if p.param in state[prefix]:
                    tensors[p.key][p.src : p.src + p.rows].copy_(state[prefix][p.param][p.dst : p.dst + p.rows])
            largest_read = max(largest_read, sum(sizes[n] for n in read))
            del state
        save_safetensors(tensors, os.path.join(directory, name))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total, largest = total + nbytes, max(largest, nbytes)
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    config = dict(config)
    try:
        load_torchao_quietly()
        import diffusers

        config["_diffusers_version"] = diffusers.__version__
    except ImportError:
        pass
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if len(plan) > 1:
        with open(os.path.join(directory, DIFFUSERS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return {"shards": names, "tensors": len(weight_map), "total": total, "largest": largest,
            "largest_read": largest_read}


def _param_shape(layout, param: str) -> tuple[int, ...]:
    """A parameter's full shape from the layout: rows from its pieces, trailing dims from
    any of its checkpoint tensors."""
    pieces = [p for p in layout.pieces if p.param == param]
    rows = max(p.dst + p.rows for p in pieces)
    return (rows, *layout.shapes[pieces[0].key][1:])
