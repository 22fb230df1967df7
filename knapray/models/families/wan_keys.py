"""Wan's diffusers checkpoint layout (2.1 T2V and I2V, 2.2 TI2V-5B) against
``WanTransformer``'s parameters.

``WanTransformer3DModel.state_dict()`` (what ``save_pretrained`` writes): names differ, and
``proj_out``'s rows are ordered (pt, ph, pw, C) where knapray's are (C, pt, ph, pw) (the
patch feature order of ``knapray.models.packing.patchify``, C the output channels): one
single-row piece per output feature. The Conv3d ``patch_embedding.weight`` keeps its shape
in knapray. I2V adds the image embedder (``condition_embedder.image_embedder``: two
LayerNorms, a GELU FFN) and per block attn2's ``add_k_proj``, ``add_v_proj`` and
``norm_added_k``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from knapray.models.families.layout import Layout, build_layout
from knapray.models.families.wan import WanConfig

Rule = tuple[str, str, int, int, int]


def _linear(key: str, param: str) -> Iterator[Rule]:
    for suffix in ("weight", "bias"):
        yield f"{key}.{suffix}", f"{param}.{suffix}", 0, 0, -1


def _diffusers_rules(cfg: WanConfig) -> Iterator[Rule]:
    yield from _linear("patch_embedding", "img_in")
    yield from _linear("condition_embedder.time_embedder.linear_1", "time_in.fc1")
    yield from _linear("condition_embedder.time_embedder.linear_2", "time_in.fc2")
    yield from _linear("condition_embedder.time_proj", "time_in.proj")
    yield from _linear("condition_embedder.text_embedder.linear_1", "txt_in.fc1")
    yield from _linear("condition_embedder.text_embedder.linear_2", "txt_in.fc2")
    if cfg.image_dim:
        src = "condition_embedder.image_embedder"
        yield from _linear(f"{src}.norm1", "image_in.norm1")
        yield from _linear(f"{src}.ff.net.0.proj", "image_in.fc1")
        yield from _linear(f"{src}.ff.net.2", "image_in.fc2")
        yield from _linear(f"{src}.norm2", "image_in.norm2")
    for i in range(cfg.depth_single):
        src, dst = f"blocks.{i}", f"single_blocks.{i}"
        for attn in ("attn1", "attn2"):
            for name in ("to_q", "to_k", "to_v"):
                yield from _linear(f"{src}.{attn}.{name}", f"{dst}.{attn}.{name}")
            yield from _linear(f"{src}.{attn}.to_out.0", f"{dst}.{attn}.to_out")
            yield f"{src}.{attn}.norm_q.weight", f"{dst}.{attn}.norm_q", 0, 0, -1
            yield f"{src}.{attn}.norm_k.weight", f"{dst}.{attn}.norm_k", 0, 0, -1
        if cfg.image_dim:
            yield from _linear(f"{src}.attn2.add_k_proj", f"{dst}.attn2.to_k_img")
            yield from _linear(f"{src}.attn2.add_v_proj", f"{dst}.attn2.to_v_img")
            yield f"{src}.attn2.norm_added_k.weight", f"{dst}.attn2.norm_k_img", 0, 0, -1
        if cfg.cross_attn_norm:
            yield from _linear(f"{src}.norm2", f"{dst}.norm2")
        yield from _linear(f"{src}.ffn.net.0.proj", f"{dst}.ffn.fc1")
        yield from _linear(f"{src}.ffn.net.2", f"{dst}.ffn.fc2")
        yield f"{src}.scale_shift_table", f"{dst}.scale_shift_table", 0, 0, -1
    yield "scale_shift_table", "final.scale_shift_table", 0, 0, -1
    c, p = cfg.output_channels, math.prod(cfg.patch_size)
    for ci in range(c):
        for pi in range(p):  # diffusers row (pt, ph, pw, C) -> knapray row (C, pt, ph, pw)
            for suffix in ("weight", "bias"):
                yield f"proj_out.{suffix}", f"final.linear.{suffix}", pi * c + ci, ci * p + pi, 1


def wan_layout(cfg: WanConfig, name: str, param_shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """The ``diffusers`` layout of a Wan model with parameters ``param_shapes``."""
    if name != "diffusers":
        raise ValueError(f"unknown Wan checkpoint layout {name!r}; valid: ['diffusers']")
    return build_layout(name, _diffusers_rules(cfg), param_shapes)
