"""Model families: name -> config class, model class, checkpoint layouts, condition inputs.

Every family's model is architecture only and offers the stage interface the balanced
executor calls (knapray/train/balanced.py):

    vec = model.condition(**condition_inputs(model, batch))   # (S, d), per sequence
    h = model.embed(x_txt, x_img, is_text)                     # (N, d), per token
    h = model.blocks(h, vec_loc, seq_index_loc, pos, is_text, attn)
    out_img = model.head(h, vec_loc, seq_index_loc, is_text)

with the submodules ``parallelize`` shards (embedders, ``double_blocks``, ``single_blocks``,
``final``). A family declares which ``PackedBatch`` fields its ``condition`` takes, and,
when it has a reference implementation, the diffusers class of its checkpoints and the
layouts (``diffusers``, ``bfl``) that map their tensors onto its parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from knapray.models.config import MMDiTConfig
from knapray.models.families.layout import Layout
from knapray.models.mmdit import MMDiT


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_cls: type[MMDiTConfig]
    model_cls: type[nn.Module]
    condition_fields: Callable[[Any], tuple[str, ...]]
    """The ``PackedBatch`` fields ``model.condition`` takes as keywords, for a config."""
    exact_against: str
    """What the family's math is checked against (docs, ``knapray reference``)."""
    diffusers_class: str | None = None
    """The diffusers model class whose checkpoints hold this family (None: no checkpoint format)."""
    layouts: tuple[str, ...] = ()
    """Checkpoint layouts it reads (the first is the one ``knapray export`` writes)."""
    layout: Callable[[Any, str, Mapping[str, tuple[int, ...]]], Layout] | None = None
    section_from_diffusers: Callable[[dict, str], dict] | None = None
    """config.json -> model-section values (knapray's field names); ValueError naming the key."""
    to_diffusers: Callable[[Any], dict] | None = None
    """A config -> the diffusers config.json it exports with."""
    lora_presets: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """``model.lora.targets`` preset name -> regular expressions over module names."""

    @property
    def has_checkpoints(self) -> bool:
        return self.diffusers_class is not None


MMDIT_LORA = {
    # the attention projections (diffusers' Flux LoRA scripts: to_q/k/v and to_out; knapray's
    # single blocks fuse q, k, v with the MLP's input in linear1 and the outputs in linear2)
    "attention": (r"double_blocks\.\d+\.(img|txt)\.(qkv|proj)", r"single_blocks\.\d+\.linear[12]"),
    "all-linear": (r"double_blocks\..+", r"single_blocks\..+"),
}
WAN_LORA = {
    "attention": (r"single_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out)",),
    "all-linear": (r"single_blocks\..+",),
}


def _flux() -> Family:
    from knapray.models.families import flux, flux_keys

    return Family(
        name="flux", config_cls=flux.FluxConfig, model_cls=flux.FluxTransformer,
        condition_fields=flux.condition_fields,
        exact_against="diffusers 0.42 FluxTransformer2DModel (fp32, 1e-5 relative, outputs and gradients)",
        diffusers_class=flux.DIFFUSERS_CLASS, layouts=("diffusers", "bfl"), layout=flux_keys.flux_layout,
        section_from_diffusers=flux.section_from_diffusers, to_diffusers=lambda cfg: cfg.to_diffusers(),
        lora_presets=MMDIT_LORA,
    )


def _wan() -> Family:
    from knapray.models.families import wan, wan_keys

    return Family(
        name="wan", config_cls=wan.WanConfig, model_cls=wan.WanTransformer,
        condition_fields=wan.condition_fields,
        exact_against="diffusers 0.42 WanTransformer3DModel (fp32, 1e-5 relative, outputs and gradients; one rank)",
        diffusers_class=wan.DIFFUSERS_CLASS, layouts=("diffusers",), layout=wan_keys.wan_layout,
        section_from_diffusers=wan.section_from_diffusers, to_diffusers=lambda cfg: cfg.to_diffusers(),
        lora_presets=WAN_LORA,
    )


FAMILIES: dict[str, Family] = {
    "mmdit": Family(
        name="mmdit", config_cls=MMDiTConfig, model_cls=MMDiT, condition_fields=lambda cfg: ("timesteps", "pooled"),
        exact_against="itself: balanced == single-process (knapray parity); no external reference",
        lora_presets=MMDIT_LORA,
    ),
    "flux": _flux(),
    "wan": _wan(),
}
FAMILY_NAMES = tuple(FAMILIES)

OTHER_DIFFUSERS_CLASSES = {
    "SD3Transformer2DModel": "Stable Diffusion 3",
    "HunyuanVideoTransformer3DModel": "HunyuanVideo", "CogVideoXTransformer3DModel": "CogVideoX",
    "LTXVideoTransformer3DModel": "LTX-Video", "SanaTransformer2DModel": "Sana", "PixArtTransformer2DModel": "PixArt",
    "AuraFlowTransformer2DModel": "AuraFlow", "QwenImageTransformer2DModel": "Qwen-Image",
    "HiDreamImageTransformer2DModel": "HiDream", "ChromaTransformer2DModel": "Chroma",
}
"""Transformer checkpoints knapray recognizes but has no family for (named in errors)."""


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(FAMILY_NAMES)}")
    return FAMILIES[name]


def config_class(family: str) -> type[MMDiTConfig]:
    """The model-section class of ``family`` (what ``model.family`` selects in a run config)."""
    return get_family(family).config_cls


def family_of_class(diffusers_class: str) -> str | None:
    """The family whose checkpoints are ``diffusers_class`` (config.json's ``_class_name``)."""
    return next((f.name for f in FAMILIES.values() if f.diffusers_class == diffusers_class), None)


def build_model(cfg: MMDiTConfig) -> nn.Module:
    """The model of ``cfg``'s family (on the current default device: build under
    ``torch.device("meta")`` to allocate nothing), with its LoRA adapters injected and the
    base frozen when ``cfg.lora.rank`` > 0 (``init_adapters`` gives them values)."""
    family = get_family(cfg.family)
    model = family.model_cls(cfg)
    if cfg.lora.enabled:
        from knapray.models.lora import inject

        inject(model, cfg.lora, dict(family.lora_presets))
    return model


def condition_inputs(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """The keywords of ``model.condition`` from a ``PackedBatch``; ValueError naming a field
    the family needs that the batch lacks (e.g. guidance for FLUX.1-dev)."""
    cfg = model.cfg
    out = {}
    for name in get_family(cfg.family).condition_fields(cfg):
        value = getattr(batch, name)
        if value is None:
            raise ValueError(f"family {cfg.family} ({type(model).__name__}) conditions on {name!r} per sequence, "
                             f"but the batch has none" + (" (set flow.guidance)" if name == "guidance" else ""))
        out[name] = value
    return out


def cross_text_pad(cfg: MMDiTConfig) -> int | None:
    """For a family whose text is cross-attended (keys only: Wan), the text rows every
    sequence attends to, padding included (0: its tokens alone); None for joint attention.
    The balanced executor builds the bag's attentions by it."""
    return int(cfg.text_pad_to) if cfg.family == "wan" else None


def param_shapes(cfg: MMDiTConfig) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` of ``cfg``'s model (without LoRA adapters: the base a
    checkpoint holds), built on the meta device (no memory)."""
    with torch.device("meta"):
        model = get_family(cfg.family).model_cls(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def checkpoint_layout(cfg: MMDiTConfig, name: str | None = None) -> Layout:
    """The checkpoint layout ``name`` (default: the family's first, what export writes) of
    ``cfg``'s model; ValueError for a family without checkpoints."""
    fam = get_family(cfg.family)
    if not fam.has_checkpoints:
        raise ValueError(f"family {fam.name} has no checkpoint format (it is knapray's own); "
                         f"pretrained weights and export need one of: "
                         f"{', '.join(f.name for f in FAMILIES.values() if f.has_checkpoints)}")
    name = name or fam.layouts[0]
    if name not in fam.layouts:
        raise ValueError(f"family {fam.name} has no checkpoint layout {name!r}; valid: {', '.join(fam.layouts)}")
    return fam.layout(cfg, name, param_shapes(cfg))


__all__ = [
    "FAMILIES", "FAMILY_NAMES", "Family", "build_model", "checkpoint_layout", "condition_inputs", "config_class",
    "cross_text_pad",
    "family_of_class", "get_family", "param_shapes",
]
