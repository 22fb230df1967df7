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
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from knapray.models.families import checkpoint_layout, param_shapes
from knapray.models.lora import ADAPTER

LORA_FILE = "pytorch_lora_weights.safetensors"
"""diffusers' name for a saved LoRA (``LORA_WEIGHT_NAME_SAFE``)."""


@dataclasses.dataclass(frozen=True)
class LoraExportReport:
    out: str
    checkpoint: str
    step: int
    """The checkpoint's step: the index of the last step it holds, counted from 0 (``trainer.json``)."""
    steps: int
    """Steps trained into the adapters (``step + 1``): what the run's progress bar and summary counted."""
    ema: bool
    family: str
    rank: int
    scale: float
    layers: int
    """knapray layers with an adapter."""
    tensors: int
    """Tensors written (two per diffusers layer)."""
    seconds: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def lora_tensors(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], cfg, scale: float
                 ) -> dict[str, torch.Tensor]:
    """{diffusers key: tensor} from {knapray module name: (lora_A, lora_B)}."""
    layout = checkpoint_layout(cfg)
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
            rows = torch.zeros(layout.shapes[key][0], b.shape[1], dtype=torch.float32)
            for p in layout.pieces_of(key):
                rows[p.src : p.src + p.rows] = b[p.dst : p.dst + p.rows].float() * scale
            name = f"transformer.{key.removesuffix('.weight')}"
            out[f"{name}.lora_A.weight"] = a.float().clone().contiguous()
            out[f"{name}.lora_B.weight"] = rows
    return out


def export_lora(run_dir: str, out: str, *, ema: bool = False, checkpoint: str | None = None) -> LoraExportReport:
    """Write ``run_dir``'s adapters to the new directory ``out``; ValueError (one line) for a
    run that trained no adapters or a checkpoint without them."""
    from knapray.driver.export import save_safetensors
    from knapray.worker.checkpoint import read_trainer_state, safe_load, saved_keys
    from knapray.driver.run_dir import read_run_config, run_checkpoint

    t0 = time.perf_counter()
    cfg = read_run_config(run_dir).model
    if not cfg.lora.enabled:
        raise ValueError(f"--lora: run {run_dir} trained every weight (model.lora.rank is 0); export it without --lora")
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"--out {out}: exists and is not an empty directory; choose a new one")
    path = run_checkpoint(run_dir, checkpoint, "export")
    prefix = "ema" if ema else "model"
    saved = saved_keys(path)
    modules = sorted({k[len(prefix) + 1:].split(".lora_A.")[0] for k in saved
                      if k.startswith(prefix + ".") and ".lora_A." in k})
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
    adapters = {m: (state[prefix][f"{m}.lora_A.{ADAPTER}.weight"], state[prefix][f"{m}.lora_B.{ADAPTER}.weight"])
                for m in modules}
    tensors = lora_tensors(adapters, cfg, cfg.lora.scale)
    partial = out + ".partial"
    os.makedirs(partial, exist_ok=True)
    save_safetensors(tensors, os.path.join(partial, LORA_FILE))
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(partial, out)
    step = read_trainer_state(path)["step"]
    return LoraExportReport(out=out, checkpoint=path, step=step, steps=step + 1, ema=ema,
                            family=cfg.family, rank=r, scale=cfg.lora.scale, layers=len(modules),
                            tensors=len(tensors), seconds=time.perf_counter() - t0)
