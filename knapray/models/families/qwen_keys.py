"""Qwen-Image's checkpoint layout against ``QwenImageTransformer``'s parameters.

``diffusers``: ``QwenImageTransformer2DModel.state_dict()`` (what ``save_pretrained``
writes): q, k and v of each stream are separate tensors, knapray fuses them in that row
order; ``norm_out.linear`` holds (scale, shift), knapray's final modulation (shift, scale).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from knapray.models.families.flux_keys import Rule, _linear
from knapray.models.families.layout import Layout, build_layout
from knapray.models.families.qwen_image import QwenImageConfig


def _diffusers_rules(cfg: QwenImageConfig) -> Iterator[Rule]:
    d = cfg.hidden_size
    yield from _linear("img_in", "img_in")
    yield "txt_norm.weight", "txt_norm.weight", 0, 0, -1
    yield from _linear("txt_in", "txt_in")
    yield from _linear("time_text_embed.timestep_embedder.linear_1", "time_in.fc1")
    yield from _linear("time_text_embed.timestep_embedder.linear_2", "time_in.fc2")
    for i in range(cfg.depth_double):
        src, dst = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for stream, qkv, qk_norm, out in (
            ("img", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0"),
            ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"), "to_add_out"),
        ):
            yield from _linear(f"{src}.{stream}_mod.1", f"{dst}.{stream}.mod.lin")
            for j, name in enumerate(qkv):  # fused rows (q, k, v): "(K H D)" with K outermost
                yield from _linear(f"{src}.attn.{name}", f"{dst}.{stream}.qkv", 0, j * d, d)
            yield f"{src}.attn.{qk_norm[0]}.weight", f"{dst}.{stream}.q_norm.weight", 0, 0, -1
            yield f"{src}.attn.{qk_norm[1]}.weight", f"{dst}.{stream}.k_norm.weight", 0, 0, -1
            yield from _linear(f"{src}.attn.{out}", f"{dst}.{stream}.proj")
            yield from _linear(f"{src}.{stream}_mlp.net.0.proj", f"{dst}.{stream}.mlp.fc1")
            yield from _linear(f"{src}.{stream}_mlp.net.2", f"{dst}.{stream}.mlp.fc2")
    # AdaLayerNormContinuous chunks (scale, shift); FinalLayer's Modulation (shift, scale).
    yield from _linear("norm_out.linear", "final.mod.lin", 0, d, d)
    yield from _linear("norm_out.linear", "final.mod.lin", d, 0, d)
    yield from _linear("proj_out", "final.linear")


def qwen_image_layout(cfg: QwenImageConfig, name: str, param_shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """The ``diffusers`` layout of a Qwen-Image model with parameters ``param_shapes``."""
    if name != "diffusers":
        raise ValueError(f"unknown Qwen-Image checkpoint layout {name!r}; valid: ['diffusers']")
    return build_layout(name, _diffusers_rules(cfg), param_shapes)
