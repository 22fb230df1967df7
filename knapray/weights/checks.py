"""Which family a pretrained checkpoint is, the model section it implies, and whether its
tensors are exactly what that model needs: from config.json and headers only, so a bad
checkpoint is refused (one line naming the first bad key) before any worker starts."""

from __future__ import annotations

from typing import Any

from knapray.models.config import DiTConfig
from knapray.models.families import (
    FAMILIES,
    OTHER_DIFFUSERS_CLASSES,
    checkpoint_layout,
    family_of_class,
    get_family,
)
from knapray.models.lora import base_fingerprint
from knapray.weights.source import FLOAT_DTYPES, PretrainedSource


def _describe_class(name: str | None) -> str:
    if name is None:
        return "a checkpoint whose config.json names no _class_name"
    other = OTHER_DIFFUSERS_CLASSES.get(name)
    return f"a {name} checkpoint" + (f" ({other})" if other else "")


def checkpoint_family(source: PretrainedSource, forced: str | None = None) -> str:
    """The family of ``source`` (its config's ``_class_name``), or ``forced`` if given and
    it agrees; ValueError in one line otherwise."""
    found = family_of_class(source.class_name) if source.class_name else None
    if forced is not None:
        fam = get_family(forced)
        if not fam.has_checkpoints:
            readable = [f.name for f in FAMILIES.values() if f.has_checkpoints]
            raise ValueError(f"family {forced} has no checkpoint format (it is knapray's own); pretrained weights "
                             f"are read for: {', '.join(readable)}")
        if found != forced:
            raise ValueError(f"{source.path} is {_describe_class(source.class_name)}, not family {forced}'s "
                             f"{fam.diffusers_class}")
        return forced
    if found is None:
        readable = ", ".join(f"{f.name} ({f.diffusers_class})" for f in FAMILIES.values() if f.has_checkpoints)
        raise ValueError(f"{source.path} is {_describe_class(source.class_name)}, which no knapray family reads; "
                         f"families with checkpoints: {readable}")
    return found


def section_values(source: PretrainedSource, family: str) -> dict[str, Any]:
    """The model-section values (knapray's names, ``family`` included) the checkpoint's
    config gives; ValueError naming the config key Flux.1 (etc.) cannot have."""
    values = get_family(family).section_from_diffusers(source.config, f"{source.path} config")
    return {"family": family, **values}


def section_mismatch(cfg: DiTConfig, values: dict[str, Any]) -> str | None:
    """The first model field whose value differs from the checkpoint's, as ``key=x but
    the checkpoint has y``; None if all agree."""
    for key, value in values.items():
        mine = getattr(cfg, key, None)
        if (tuple(mine) if isinstance(mine, (list, tuple)) else mine) != value:
            return f"model.{key}={mine!r} but the checkpoint's config gives {value!r}"
    return None


def check_tensors(source: PretrainedSource, cfg: DiTConfig) -> None:
    """Every tensor the model of ``cfg`` needs is in ``source`` with its shape and a float
    dtype, and nothing else; ValueError naming the first bad key."""
    layout = checkpoint_layout(cfg, source.layout)
    problem = layout.first_mismatch({k: t.shape for k, t in source.tensors.items()})
    if problem:
        raise ValueError(f"{source.path} ({source.layout} layout): {problem}")
    for key in layout.keys:
        if source.tensors[key].dtype not in FLOAT_DTYPES:
            raise ValueError(f"{source.path}: tensor {key!r} has dtype {source.tensors[key].dtype}, not a float "
                             f"dtype ({', '.join(FLOAT_DTYPES)})")


def check_pretrained(cfg: DiTConfig) -> PretrainedSource:
    """The whole pre-flight of ``model.pretrained``: readable, of ``cfg``'s family, the same
    architecture, the exact tensors. Returns the source; ValueError in one line."""
    from knapray.weights.source import open_pretrained

    source = open_pretrained(cfg.pretrained)
    family = checkpoint_family(source, cfg.family)
    mismatch = section_mismatch(cfg, section_values(source, family))
    if mismatch:
        raise ValueError(f"model.pretrained {source.path}: {mismatch}")
    check_tensors(source, cfg)
    return source


def base_record(model_cfg) -> dict | None:
    """What a LoRA run records of its base (``model.pretrained``): the path and the
    fingerprint of its safetensors files; None without a pretrained base."""
    if not model_cfg.pretrained:
        return None
    return {"path": model_cfg.pretrained, "fingerprint": base_fingerprint(check_pretrained(model_cfg).files)}
