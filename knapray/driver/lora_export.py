"""``knapray export --lora``: a LoRA run's adapters as the file diffusers loads.

The adapters (``lora_A`` r x in, ``lora_B`` out x r on a knapray linear layer) are read from
the run's checkpoint (the safe reader; only those tensors) and mapped through the family's
checkpoint layout, the same pieces that load the base: a knapray layer that fuses several
diffusers layers (Flux's q, k, v in one ``qkv``; a single block's q, k, v and MLP input in
``linear1``) gives each of them the shared ``lora_A`` and its own rows of ``lora_B``, which
is exact (``delta W`` restricted to those rows is ``B[rows] A``). peft's scale
``alpha / r`` is folded into ``lora_B``, since diffusers reads a plain peft state dict with
scale 1. Written: ``<out>/pytorch_lora_weights.safetensors`` with keys
``transformer.<diffusers module>.lora_A.weight`` / ``lora_B.weight``, what
``FluxPipeline.load_lora_weights(out)`` and ``WanPipeline.load_lora_weights(out)`` read.

The community's formats (``--format``), for a family with an ``original_layout`` (Flux.1
and FLUX.2: BFL's names; Qwen-Image: its released names), through that layout's pieces:

- ``kohya``: ``lora_unet_<module, dots as underscores>.lora_down.weight`` / ``lora_up.weight``
  and ``.alpha`` (``alpha / r`` is the scale: ``lora_up`` unscaled), what kohya's
  sd-scripts write and ComfyUI and diffusers' kohya converters read; ``<out>/lora_kohya.safetensors``;
- ``comfyui``: ``diffusion_model.<module>.lora_A.weight`` / ``lora_B.weight`` (the scale
  folded in), the names ComfyUI gives the model's own tensors (ai-toolkit's files);
  ``<out>/lora_comfyui.safetensors``.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from knapray.models.families import FAMILIES, checkpoint_layout, get_family, param_shapes
from knapray.models.lora import ADAPTER

LORA_FILE = "pytorch_lora_weights.safetensors"
"""diffusers' name for a saved LoRA (``LORA_WEIGHT_NAME_SAFE``)."""
FORMATS = {"diffusers": LORA_FILE, "kohya": "lora_kohya.safetensors", "comfyui": "lora_comfyui.safetensors"}
"""``export --lora --format``: the file each writes (module doc)."""


@dataclasses.dataclass(frozen=True)
class LoraExportReport:
    out: str
    checkpoint: str
    step: int
    """The checkpoint's step: the index of the last step it holds, counted from 0 (``trainer.json``)."""
    steps: int
    """Steps trained into the adapters (``step + 1``): what the run's progress bar and summary counted."""
    ema: bool
    format: str
    """``diffusers``, ``kohya`` or ``comfyui`` (``FORMATS``)."""
    file: str
    """The file written."""
    family: str
    rank: int
    scale: float
    layers: int
    """knapray layers with an adapter."""
    tensors: int
    """Tensors written (two per layer of the format's names; kohya: three, with its alpha)."""
    seconds: float
    experts: list[str] = dataclasses.field(default_factory=list)
    """A run of two experts: the folders written (``transformer``, ``transformer_2``), a file each."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def format_layout(cfg, fmt: str):
    """The checkpoint layout whose names LoRA format ``fmt`` writes for ``cfg``'s family;
    ValueError (one line) for a format it has none for."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: not a LoRA format; valid: {', '.join(FORMATS)}")
    if fmt == "diffusers":
        return checkpoint_layout(cfg)
    fam = get_family(cfg.family)
    if fam.original_layout is None:
        with_names = [f.title for f in FAMILIES.values() if f.original_layout is not None]
        raise ValueError(f"--format {fmt}: {fam.title} adapters are written in diffusers' format only (--format "
                         f"diffusers); {fmt} names exist for {', '.join(with_names)}")
    return checkpoint_layout(cfg, fam.original_layout)


def lora_tensors(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], cfg, scale: float, fmt: str = "diffusers"
                 ) -> dict[str, torch.Tensor]:
    """{key of format ``fmt``: tensor} from {knapray module name: (lora_A, lora_B)}."""
    layout = format_layout(cfg, fmt)
    out: dict[str, torch.Tensor] = {}
    for module, (a, b) in adapters.items():
        pieces = [p for p in layout.pieces if p.param == f"{module}.weight"]
        if not pieces:
            raise ValueError(f"layer {module!r} has no weight in the {layout.name} layout")
        for key in dict.fromkeys(p.key for p in pieces):
            owners = {p.param for p in layout.pieces_of(key)}
            if owners != {f"{module}.weight"}:
                raise ValueError(f"{key} is made of {sorted(owners)}: an adapter on {module!r} alone cannot be "
                                 "written for it")
            folded = 1.0 if fmt == "kohya" else scale  # kohya keeps it as alpha / r
            rows = torch.zeros(layout.shapes[key][0], b.shape[1], dtype=torch.float32)
            for p in layout.pieces_of(key):
                rows[p.src : p.src + p.rows] = b[p.dst : p.dst + p.rows].float() * folded
            module_key = key.removesuffix(".weight")
            if fmt == "kohya":
                name = "lora_unet_" + module_key.replace(".", "_")
                out[f"{name}.lora_down.weight"] = a.float().clone().contiguous()
                out[f"{name}.lora_up.weight"] = rows
                out[f"{name}.alpha"] = torch.tensor(scale * a.shape[0], dtype=torch.float32)
                continue
            name = f"{'transformer' if fmt == 'diffusers' else 'diffusion_model'}.{module_key}"
            out[f"{name}.lora_A.weight"] = a.float().clone().contiguous()
            out[f"{name}.lora_B.weight"] = rows
    return out


def export_lora(run_dir: str, out: str, *, ema: bool = False, checkpoint: str | None = None,
                fmt: str = "diffusers") -> LoraExportReport:
    """Write ``run_dir``'s adapters to the new directory ``out`` in format ``fmt`` (module
    doc); ValueError (one line) for a run that trained no adapters, a checkpoint without
    them, or a format its family has no names for. A run of two experts
    (``flow.expert_boundary``) writes each expert's file in its folder, ``transformer/`` and
    ``transformer_2/``: diffusers' Wan 2.2 pipelines load the second with
    ``load_lora_weights(..., load_into_transformer_2=True)``."""
    from knapray.driver.export import save_safetensors
    from knapray.worker.checkpoint import read_trainer_state
    from knapray.worker.experts import part_suffix
    from knapray.driver.run_dir import read_run_config, run_checkpoint
    from knapray.models.timesteps import EXPERT_NAMES

    t0 = time.perf_counter()
    run_cfg = read_run_config(run_dir)
    cfg = run_cfg.model
    if not cfg.lora.enabled:
        raise ValueError(f"--lora: run {run_dir} trained every weight (model.lora.rank is 0); export it without --lora")
    format_layout(cfg, fmt)  # a format the family has names for, before anything is read
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--out {out}: exists and is not an empty directory; choose a new one")
    path = run_checkpoint(run_dir, checkpoint, "export")
    base = "ema" if ema else "model"
    # (subfolder, checkpoint prefix) of each expert's adapters: one, or the two experts'
    targets = [("", base)] if not run_cfg.flow.expert_boundary else [
        (name, base + part_suffix(i)) for i, name in enumerate(EXPERT_NAMES)]
    adapters = [_adapters(path, prefix, cfg, ema) for _, prefix in targets]
    written = [(sub, lora_tensors(a, cfg, cfg.lora.scale, fmt)) for (sub, _), a in zip(targets, adapters)]
    partial = out + ".partial"
    os.makedirs(partial, exist_ok=True)
    for sub, tensors in written:
        os.makedirs(os.path.join(partial, sub), exist_ok=True)
        save_safetensors(tensors, os.path.join(partial, sub, FORMATS[fmt]))
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(partial, out)
    step = read_trainer_state(path)["step"]
    return LoraExportReport(out=out, checkpoint=path, step=step, steps=step + 1, ema=ema, format=fmt,
                            file=os.path.join(out, targets[0][0], FORMATS[fmt]),
                            family=cfg.family, rank=cfg.lora.rank, scale=cfg.lora.scale,
                            layers=sum(len(a) for a in adapters),
                            tensors=sum(len(t) for _, t in written), seconds=time.perf_counter() - t0,
                            experts=[sub for sub, _ in targets if sub])


def _modules_of(path: str, prefix: str) -> list[str]:
    """The knapray modules with an adapter under ``prefix`` in checkpoint ``path``."""
    from knapray.worker.checkpoint import saved_keys

    return sorted({k[len(prefix) + 1:].split(".lora_A.")[0] for k in saved_keys(path)
                   if k.startswith(prefix + ".") and ".lora_A." in k})


def _adapters(path: str, prefix: str, cfg, ema: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{knapray module: (lora_A, lora_B)} of checkpoint ``path``'s adapters under ``prefix``
    (``model``, ``ema``, ``model_2``...), read alone through the safe reader."""
    from knapray.worker.checkpoint import safe_load

    modules = _modules_of(path, prefix)
    if not modules:
        raise ValueError(f"checkpoint {path} holds no {'EMA ' if ema else ''}adapters ({prefix}.*.lora_A.*)"
                         + (": the run had optim.ema_decay 0" if ema else ""))
    shapes = param_shapes(cfg)
    r = cfg.lora.rank
    state = {prefix: {}}
    for m in modules:
        rows, cols = shapes[f"{m}.weight"]
        state[prefix][f"{m}.lora_A.{ADAPTER}.weight"] = torch.empty(r, cols)
        state[prefix][f"{m}.lora_B.{ADAPTER}.weight"] = torch.empty(rows, r)
    safe_load(state, path)
    return {m: (state[prefix][f"{m}.lora_A.{ADAPTER}.weight"], state[prefix][f"{m}.lora_B.{ADAPTER}.weight"])
            for m in modules}
