"""Model families: each family's facts on one ``Family`` object, looked up by name
(``get_family``). Code outside this package asks the family what it needs (its config
class, its model, how its corpus is encoded, how it samples, how it is calibrated and
checked) and never which family it is: a family added to ``FAMILIES`` is picked up by
every caller.

Every family's model is architecture only and offers the stage interface the balanced
executor calls (knapray/worker/balanced.py; ``knapray.models.interface.StageModel``):

    vec = model.condition(**condition_inputs(model, batch))   # (S, cfg.condition_dim), per sequence
    h = model.embed(x_txt, x_img, is_text)                     # (N, d), per token
    h = model.blocks(h, vec_loc, seq_index_loc, pos, is_text, attn)
    out_img = model.head(h_home, vec, seq_index, is_text, pos=pos_home)  # routed home again

and declares the modules ``parallelize`` shards, compiles and checkpoints
(``model.fsdp_units()``: embedders, blocks, final). Its config class (a
``knapray.models.config.DiTConfig``) carries the architecture's own facts (``attention_kind``,
``condition_dim``); the ``Family`` the rest: which ``PackedBatch`` fields its ``condition``
takes, what its corpus holds (``encoders``), its sampling shift, how calibration and the
gradient check build it, and, when it has a reference implementation, the diffusers class
of its checkpoints, the layouts (``diffusers``, ``bfl``) that map their tensors onto its
parameters and how diffusers' pipeline calls that class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from knapray.corpus.hf import PromptFormat
from knapray.corpus.stages import FamilyEncoding
from knapray.models.config import DiTConfig, MMDiTConfig
from knapray.models.families.layout import Layout
from knapray.models.mmdit import MMDiT
from knapray.models.timesteps import ResolutionShift

Sized = Callable[[int, int, int, int], DiTConfig]
"""(hidden, heads, depth_double, depth_single) -> a config of that size."""
DiffusersCall = Callable[[nn.Module, Any, Any], torch.Tensor]
"""(diffusers model, cfg, one sequence: ``knapray.testing.reference.Inputs``) -> its output
as knapray's image tokens (their patch features, in knapray's token order)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """Everything knapray knows about a model family besides its architecture."""

    name: str
    title: str
    """How messages name its architecture (``Wan's text length``)."""
    config_cls: type[DiTConfig]
    """Its model section (``model.family`` selects it); carries ``attention_kind``."""
    model_cls: type[nn.Module]
    """Its model (``knapray.models.interface.StageModel``), built from a ``config_cls``."""
    condition_fields: Callable[[Any], tuple[str, ...]]
    """The ``PackedBatch`` fields ``model.condition`` takes as keywords, for a config."""
    exact_against: str
    """What the family's math is checked against (docs, ``knapray reference``)."""
    encoders: FamilyEncoding
    """What its corpus holds: how its pipeline encodes captions (``knapray ingest --family``)."""
    video: bool
    """Its latents may have frames (clips as well as images); False: single images."""
    sample_shift: Callable[[Any], float | None]
    """``knapray sample``'s default timestep shift for a config: one for every request, or
    None: each request's own from its image tokens (``knapray.models.timesteps.ResolutionShift``)."""
    zero_init: bool = True
    """Its default init zeroes the modulation and output layers (adaLN-Zero: many gradients
    exactly zero at init), so timing and gradient checks re-draw it with
    ``model.init_weights(std=...)``; False: its init is already random everywhere."""
    sized_config: Sized | None = None
    """Calibration's model of a size (``knapray calibrate``); None: timed as ``calibrate_as``."""
    calibrate_as: str | None = None
    """The family whose blocks calibration times for this one (its blocks are that family's)."""
    small_config: Callable[[int], DiTConfig] | None = None
    """Its real blocks at a small width (heads of 32 channels), for the bf16 gradient check
    (knapray/testing/grad_truth.py); None: not checked there."""
    diffusers_class: str | None = None
    """The diffusers model class whose checkpoints hold this family (None: no checkpoint format)."""
    diffusers_call: DiffusersCall | None = None
    """How its diffusers pipeline calls ``diffusers_class`` on one sequence (``knapray reference``)."""
    reference_needs_text: bool = False
    """Its diffusers model cannot run a sequence without text tokens (Qwen-Image's RoPE over
    no text fails; its pipeline never makes one): the reference gives each at least one."""
    reference_overrides: Callable[[Mapping[str, Any]], Mapping[str, Any]] = lambda values: {}
    """The checkpoint's model-section values -> config values under which knapray's model
    computes what ``diffusers_call`` does (Wan T2V: ``text_pad_to`` 0, no pipeline padding;
    Wan I2V keeps its 512: diffusers reads the image's rows before the text's last 512)."""
    layouts: tuple[str, ...] = ()
    """Checkpoint layouts it reads (the first is the one ``knapray export`` writes)."""
    layout: Callable[[Any, str, Mapping[str, tuple[int, ...]]], Layout] | None = None
    section_from_diffusers: Callable[[dict, str], dict] | None = None
    """config.json -> model-section values (knapray's field names); ValueError naming the key."""
    to_diffusers: Callable[[Any], dict] | None = None
    """A config -> the diffusers config.json it exports with."""
    lora_presets: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """``model.lora.targets`` preset name -> regular expressions over module names."""
    original_layout: str | None = None
    """The layout (one of ``layouts``) whose tensor names the community's LoRA files follow
    (kohya's ``lora_unet_*``, ComfyUI's ``diffusion_model.*``: BFL's for Flux.1 and FLUX.2,
    the released diffusers names for Qwen-Image); None: ``export --lora`` writes diffusers'
    format only."""
    resolution_shift: ResolutionShift = dataclasses.field(default_factory=ResolutionShift)
    """The per-request shift from its image tokens where ``sample_shift`` gives None (FLUX.1's
    by default; Qwen-Image's pipeline: 0.5 at 256 tokens to 0.9 at 8,192)."""
    step_shift: Callable[[int, int], float] | None = None
    """(image tokens, steps) -> the shift, where the pipeline's depends on the step count too
    (FLUX.2's empirical one); None: ``resolution_shift``."""
    guidance_input_default: float = 3.5
    """``knapray sample --guidance``'s default for a model that embeds guidance (FLUX.1-dev's
    pipeline 3.5; FLUX.2 [dev]'s 4.0)."""
    sample_terminal: float | None = None
    """The schedule stretched so that its last time before 0 is this (diffusers'
    ``shift_terminal``: Qwen-Image 0.02); None: as shifted."""
    cfg_renorm: bool = False
    """Classifier-free guidance rescaled, token by token, to the conditional prediction's norm
    (Qwen-Image's pipeline: ``comb * |v_c| / |comb|``)."""
    cfg_default: float = 1.0
    """``knapray sample --guidance``'s default for a model without embedded guidance: its
    pipeline's classifier-free guidance scale (Qwen-Image: 4.0), 1 for off."""
    not_sampled: str = ""
    """Why knapray cannot sample it yet ("": it can): ``knapray sample``, ``knapray serve``
    and validation samples refuse its runs in one line saying so (``check_samples``)."""

    def __post_init__(self) -> None:
        """What a registration must hold together (checked when the registry is built)."""
        if (self.encoders.family, self.encoders.model) != (self.name, self.title):
            raise ValueError(f"family {self.name}: its encoders name {self.encoders.family!r} ({self.encoders.model!r})")
        if (self.sized_config is None) == (self.calibrate_as is None):
            raise ValueError(f"family {self.name}: give sized_config or calibrate_as, one of them")
        if (self.diffusers_call is None) != (self.diffusers_class is None):
            raise ValueError(f"family {self.name}: a diffusers_class comes with its diffusers_call")
        if self.original_layout is not None and self.original_layout not in self.layouts:
            raise ValueError(f"family {self.name}: original_layout {self.original_layout!r} is not one of its layouts")

    @property
    def has_checkpoints(self) -> bool:
        return self.diffusers_class is not None

    @property
    def attention(self) -> str:
        """``joint`` or ``cross``: its config class's ``attention_kind``."""
        return self.config_cls.attention_kind

    @property
    def calibrated_as(self) -> str:
        """The family whose blocks calibration times for this one: itself, or ``calibrate_as``."""
        return self.calibrate_as or self.name


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


def _mmdit_sized(hidden: int, heads: int, depth_double: int, depth_single: int) -> MMDiTConfig:
    """An MMDiT of the given size with RoPE channels split over (t, h, w): what calibration times."""
    head_dim = hidden // heads
    side = (head_dim * 3 // 8) // 2 * 2
    return MMDiTConfig(
        in_channels=4, patch_size=(1, 2, 2), hidden_size=hidden, num_heads=heads,
        depth_double=depth_double, depth_single=depth_single, text_dim=16, pooled_dim=16,
        rope_axes_dim=(head_dim - 2 * side, side, side),
    )


def _mmdit() -> Family:
    return Family(
        name="mmdit", title="MMDiT", config_cls=MMDiTConfig, model_cls=MMDiT,
        condition_fields=lambda cfg: ("timesteps", "pooled"),
        exact_against="itself: balanced == single-process (knapray parity); no external reference",
        encoders=FamilyEncoding(family="mmdit", model="MMDiT"), video=True, sample_shift=lambda cfg: 1.0,
        sized_config=_mmdit_sized, lora_presets=MMDIT_LORA,
    )


def _flux() -> Family:
    from knapray.models.families import flux, flux_keys

    return Family(
        name="flux", title="Flux.1", config_cls=flux.FluxConfig, model_cls=flux.FluxTransformer,
        condition_fields=flux.condition_fields,
        exact_against="diffusers 0.42 FluxTransformer2DModel (fp32, 1e-5 relative, outputs and gradients)",
        encoders=FamilyEncoding(family="flux", model="Flux.1", pipeline="FluxPipeline",
                                text_models=flux.TEXT_MODELS, vae=flux.VAE), video=False,
        sample_shift=flux.sample_shift,
        calibrate_as="mmdit", small_config=flux.small_config,
        diffusers_class=flux.DIFFUSERS_CLASS, diffusers_call=flux.diffusers_call,
        layouts=("diffusers", "bfl"), layout=flux_keys.flux_layout,
        section_from_diffusers=flux.section_from_diffusers, to_diffusers=lambda cfg: cfg.to_diffusers(),
        lora_presets=MMDIT_LORA, original_layout="bfl",
    )


def _wan() -> Family:
    from knapray.models.families import wan, wan_keys

    return Family(
        name="wan", title="Wan", config_cls=wan.WanConfig, model_cls=wan.WanTransformer,
        condition_fields=wan.condition_fields,
        exact_against="diffusers 0.42 WanTransformer3DModel (fp32, 1e-5 relative, outputs and gradients; one rank)",
        encoders=FamilyEncoding(family="wan", model="Wan", pooled=False, text_length=wan.TEXT_LENGTH,
                                pipeline="WanPipeline", clean_prompts=True, text_models=wan.TEXT_MODELS,
                                vae=wan.VAE, image_pipeline="WanImageToVideoPipeline"), video=True,
        sample_shift=wan.sample_shift, zero_init=False, sized_config=wan.sized_config, small_config=wan.small_config,
        diffusers_class=wan.DIFFUSERS_CLASS, diffusers_call=wan.diffusers_call,
        reference_overrides=wan.reference_overrides,
        layouts=("diffusers",), layout=wan_keys.wan_layout,
        section_from_diffusers=wan.section_from_diffusers, to_diffusers=lambda cfg: cfg.to_diffusers(),
        lora_presets=WAN_LORA,
    )


def _qwen_image() -> Family:
    from knapray.models.families import qwen_image, qwen_keys

    return Family(
        name="qwen_image", title="Qwen-Image", config_cls=qwen_image.QwenImageConfig,
        model_cls=qwen_image.QwenImageTransformer, condition_fields=qwen_image.condition_fields,
        exact_against="diffusers 0.42 QwenImageTransformer2DModel (fp32, 1e-5 relative, outputs and gradients)",
        encoders=FamilyEncoding(family="qwen_image", model="Qwen-Image", pooled=False, pipeline="QwenImagePipeline",
                                prompt=PromptFormat(qwen_image.PROMPT_TEMPLATE, qwen_image.PROMPT_DROP),
                                text_models=(qwen_image.TEXT_MODEL,), vae=qwen_image.VAE), video=False,
        sample_shift=lambda cfg: None, sized_config=qwen_image.sized_config, small_config=qwen_image.small_config,
        diffusers_class=qwen_image.DIFFUSERS_CLASS, diffusers_call=qwen_image.diffusers_call,
        reference_needs_text=True, layouts=("diffusers",), layout=qwen_keys.qwen_image_layout,
        resolution_shift=ResolutionShift(base_tokens=256, max_tokens=8192, base_shift=0.5, max_shift=0.9),
        sample_terminal=0.02, cfg_renorm=True, cfg_default=4.0,
        section_from_diffusers=qwen_image.section_from_diffusers, to_diffusers=lambda cfg: cfg.to_diffusers(),
        lora_presets=MMDIT_LORA, original_layout="diffusers",
    )


def _flux2() -> Family:
    from knapray.models.families import flux2, flux2_keys

    return Family(
        name="flux2", title="FLUX.2", config_cls=flux2.Flux2Config, model_cls=flux2.Flux2Transformer,
        condition_fields=flux2.condition_fields,
        exact_against="diffusers 0.42 Flux2Transformer2DModel (fp32, 1e-5 relative, outputs and gradients)",
        encoders=FamilyEncoding(family="flux2", model="FLUX.2", pooled=False, pipeline="Flux2Pipeline",
                                prompt=PromptFormat(system=flux2.SYSTEM_MESSAGE, layers=flux2.TEXT_LAYERS,
                                                    pad_to=flux2.TEXT_TOKENS),
                                text_models=(flux2.TEXT_MODEL,), vae=flux2.VAE), video=False,
        sample_shift=lambda cfg: None, sized_config=flux2.sized_config, small_config=flux2.small_config,
        diffusers_class=flux2.DIFFUSERS_CLASS, diffusers_call=flux2.diffusers_call,
        layouts=("diffusers", "bfl"), layout=flux2_keys.flux2_layout,
        step_shift=flux2.sample_shift_of, guidance_input_default=4.0,
        section_from_diffusers=flux2.section_from_diffusers, to_diffusers=lambda cfg: cfg.to_diffusers(),
        lora_presets=MMDIT_LORA, original_layout="bfl",
    )


FAMILIES: dict[str, Family] = {"mmdit": _mmdit(), "flux": _flux(), "wan": _wan(), "qwen_image": _qwen_image(),
                               "flux2": _flux2()}
FAMILY_NAMES = tuple(FAMILIES)

OTHER_DIFFUSERS_CLASSES = {
    "SD3Transformer2DModel": "Stable Diffusion 3",
    "HunyuanVideoTransformer3DModel": "HunyuanVideo", "CogVideoXTransformer3DModel": "CogVideoX",
    "LTXVideoTransformer3DModel": "LTX-Video", "SanaTransformer2DModel": "Sana", "PixArtTransformer2DModel": "PixArt",
    "AuraFlowTransformer2DModel": "AuraFlow",
    "HiDreamImageTransformer2DModel": "HiDream", "ChromaTransformer2DModel": "Chroma",
}
"""Transformer checkpoints knapray recognizes but has no family for (named in errors)."""


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(FAMILY_NAMES)}")
    return FAMILIES[name]


def config_class(family: str) -> type[DiTConfig]:
    """The model-section class of ``family`` (what ``model.family`` selects in a run config)."""
    return get_family(family).config_cls


def family_of_class(diffusers_class: str) -> str | None:
    """The family whose checkpoints are ``diffusers_class`` (config.json's ``_class_name``)."""
    return next((f.name for f in FAMILIES.values() if f.diffusers_class == diffusers_class), None)


def build_model(cfg: DiTConfig) -> nn.Module:
    """The model of ``cfg``'s family (on the current default device: build under
    ``torch.device("meta")`` to allocate nothing), with its LoRA adapters injected and the
    base frozen when ``cfg.lora.rank`` > 0 (``init_adapters`` gives them values)."""
    family = get_family(cfg.family)
    model = family.model_cls(cfg)
    if cfg.lora.enabled:
        from knapray.models.lora import inject

        inject(model, cfg.lora, dict(family.lora_presets))
    return model


def fp8_base_layers(cfg: DiTConfig) -> tuple[str, ...]:
    """Module-name patterns of the layers ``model.lora.base_dtype: fp8`` holds in float8: the
    family's ``all-linear`` LoRA preset (every linear layer of its blocks); () otherwise."""
    if not cfg.lora.enabled or cfg.lora.base_dtype != "fp8":
        return ()
    return tuple(get_family(cfg.family).lora_presets["all-linear"])


def check_samples(model_cfg: Any, what: str = "sampling") -> None:
    """ValueError (one line) if ``model_cfg``'s family cannot be sampled by knapray yet."""
    fam = get_family(model_cfg.family)
    if fam.not_sampled:
        raise ValueError(f"{what} a {fam.title} model (model.family {fam.name}): not supported yet; {fam.not_sampled}")


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


def cross_text_pad(cfg: DiTConfig) -> int | None:
    """For a family whose text is cross-attended (keys only: Wan), the text rows every
    sequence attends to, padding included (``text_pad_to``; 0: its tokens alone); None for
    joint attention. The balanced executor builds the bag's attentions by it."""
    return int(cfg.text_pad_to) if cfg.attention_kind == "cross" else None


def param_shapes(cfg: DiTConfig) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` of ``cfg``'s model (without LoRA adapters: the base a
    checkpoint holds), built on the meta device (no memory)."""
    with torch.device("meta"):
        model = get_family(cfg.family).model_cls(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def checkpoint_layout(cfg: DiTConfig, name: str | None = None) -> Layout:
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


def adapter_counts(model_cfg) -> tuple[int, int] | None:
    """(parameters, tensors) of ``model_cfg``'s adapters (its model built on the meta
    device: nothing allocated); None without ``model.lora``. What the memory model counts
    gradients and AdamW state for."""
    if not model_cfg.lora.enabled:
        return None
    from knapray.models.lora import is_adapter

    with torch.device("meta"):
        model = build_model(model_cfg)
    adapters = [p for n, p in model.named_parameters() if is_adapter(n)]
    return sum(p.numel() for p in adapters), len(adapters)


__all__ = [
    "FAMILIES", "FAMILY_NAMES", "Family", "adapter_counts", "build_model", "check_samples", "checkpoint_layout",
    "condition_inputs",
    "config_class", "cross_text_pad", "family_of_class", "get_family", "param_shapes",
]
