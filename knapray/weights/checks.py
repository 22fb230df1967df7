"""Which family a pretrained checkpoint is, the model section it implies, and whether its
tensors are exactly what that model needs: from config.json and headers only, so a bad
checkpoint is refused (one line naming the first bad key) before any worker starts."""

from __future__ import annotations

import os
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


def check_experts(cfg: DiTConfig, boundary: float, first: PretrainedSource | None = None) -> None:
    """``model.pretrained`` as a run with ``flow.expert_boundary`` = ``boundary`` reads it. A
    pipeline folder holding ``transformer_2/`` beside ``transformer/`` (Wan 2.2 A14B's low- and
    high-noise experts) is two experts: trained both in one run only with a boundary
    (``knapray.worker.experts``), and then its two transformers must be one architecture, the
    same config.json values and the same tensors (names and shapes): the run builds one model
    twice. ``first``: ``transformer/`` opened already. ValueError in one line otherwise; any
    other checkpoint passes (both experts start from it)."""
    from knapray.weights.source import boundary_ratio, expert_path, open_pretrained

    second = expert_path(cfg.pretrained, 1)
    if second == cfg.pretrained:
        return
    pipeline = os.path.dirname(second)
    if not boundary:
        ratio = boundary_ratio(pipeline)
        setting = f"flow.expert_boundary={ratio:g} (its model_index.json's boundary_ratio)" if ratio else \
            "flow.expert_boundary (where they switch: Wan 2.2 T2V A14B's is 0.875)"
        raise ValueError(f"{pipeline} is a pipeline of two experts (transformer/ and transformer_2/): set {setting} "
                         f"to train both in one run, or point model.pretrained at {os.path.join(pipeline, 'transformer')}"
                         f" or {second} to train one")
    first = first if first is not None else open_pretrained(pipeline)
    other = open_pretrained(second)
    problem = _architecture_difference(first, other)
    if problem:
        raise ValueError(f"{pipeline}: transformer_2/ is not the architecture of transformer/ ({problem}); the two "
                         "experts of one run are one model built twice")
    check_tensors(other, cfg)  # their dtypes


_ABSENT = object()


def _architecture_difference(first: PretrainedSource, second: PretrainedSource) -> str | None:
    """The first config key (diffusers' name; its bookkeeping keys, ``_diffusers_version``
    and the like, left out) or tensor (name, then shape) in which ``second`` differs from
    ``first``, in sorted order, as ``what: A in transformer/, B in transformer_2/``."""

    def architecture(config: dict) -> dict:
        return {k: v for k, v in config.items() if not k.startswith("_") or k == "_class_name"}

    def shown(value) -> str:
        return "absent" if value is _ABSENT else repr(value)

    a, b = architecture(first.config), architecture(second.config)
    for key in sorted(a.keys() | b.keys()):
        if a.get(key, _ABSENT) != b.get(key, _ABSENT):
            return f"config {key}: {shown(a.get(key, _ABSENT))} in transformer/, {shown(b.get(key, _ABSENT))} in " \
                   "transformer_2/"
    for key in sorted(first.tensors.keys() | second.tensors.keys()):
        shapes = [list(s.tensors[key].shape) if key in s.tensors else _ABSENT for s in (first, second)]
        if shapes[0] != shapes[1]:
            return f"tensor {key!r}: {shown(shapes[0])} in transformer/, {shown(shapes[1])} in transformer_2/"
    return None


def base_record(model_cfg) -> dict | None:
    """What a LoRA run records of its base (``model.pretrained``): the path and the
    fingerprint of its safetensors files; None without a pretrained base."""
    if not model_cfg.pretrained:
        return None
    return {"path": model_cfg.pretrained, "fingerprint": base_fingerprint(check_pretrained(model_cfg).files)}
