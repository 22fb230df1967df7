"""FLUX.2's checkpoint layouts against ``Flux2Transformer``'s parameters (no biases: every
linear is a weight alone).

``diffusers``: ``Flux2Transformer2DModel.state_dict()`` (what ``save_pretrained`` writes):
q, k and v of each double-block stream are separate tensors, knapray fuses them in that
row order; ``norm_out.linear`` holds (scale, shift), knapray's final modulation (shift,
scale). ``bfl``: BFL's original single file (``flux2-dev.safetensors``): knapray's layout
under BFL's names, as diffusers' single-file converter reads them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from knapray.models.families.flux2 import Flux2Config
from knapray.models.families.flux_keys import Rule
from knapray.models.families.layout import Layout, build_layout


def _weight(key: str, param: str, src: int = 0, dst: int = 0, rows: int = -1) -> Iterator[Rule]:
    yield f"{key}.weight", f"{param}.weight", src, dst, rows


def _diffusers_rules(cfg: Flux2Config) -> Iterator[Rule]:
    d = cfg.hidden_size
    yield from _weight("x_embedder", "img_in")
    yield from _weight("context_embedder", "txt_in")
    embedders = ["timestep"] + (["guidance"] if cfg.guidance_embeds else [])
    for name in embedders:
        mine = "time_in" if name == "timestep" else "guidance_in"
        yield from _weight(f"time_guidance_embed.{name}_embedder.linear_1", f"{mine}.fc1")
        yield from _weight(f"time_guidance_embed.{name}_embedder.linear_2", f"{mine}.fc2")
    yield from _weight("double_stream_modulation_img.linear", "modulation.img.lin")
    yield from _weight("double_stream_modulation_txt.linear", "modulation.txt.lin")
    yield from _weight("single_stream_modulation.linear", "modulation.single.lin")
    for i in range(cfg.depth_double):
        src, dst = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for stream, qkv, qk_norm, out, ff in (
            ("img", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0", "ff"),
            ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"), "to_add_out",
             "ff_context"),
        ):
            for j, name in enumerate(qkv):  # fused rows (q, k, v): "(K H D)" with K outermost
                yield from _weight(f"{src}.attn.{name}", f"{dst}.{stream}.qkv", 0, j * d, d)
            yield from _weight(f"{src}.attn.{qk_norm[0]}", f"{dst}.{stream}.q_norm")
            yield from _weight(f"{src}.attn.{qk_norm[1]}", f"{dst}.{stream}.k_norm")
            yield from _weight(f"{src}.attn.{out}", f"{dst}.{stream}.proj")
            yield from _weight(f"{src}.{ff}.linear_in", f"{dst}.{stream}.mlp.fc1")
            yield from _weight(f"{src}.{ff}.linear_out", f"{dst}.{stream}.mlp.fc2")
    for i in range(cfg.depth_single):
        src, dst = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        yield from _weight(f"{src}.attn.to_qkv_mlp_proj", f"{dst}.linear1")
        yield from _weight(f"{src}.attn.norm_q", f"{dst}.q_norm")
        yield from _weight(f"{src}.attn.norm_k", f"{dst}.k_norm")
        yield from _weight(f"{src}.attn.to_out", f"{dst}.linear2")
    # AdaLayerNormContinuous chunks (scale, shift); knapray's final modulation (shift, scale).
    yield from _weight("norm_out.linear", "final.mod.lin", 0, d, d)
    yield from _weight("norm_out.linear", "final.mod.lin", d, 0, d)
    yield from _weight("proj_out", "final.linear")


def _bfl_rules(cfg: Flux2Config) -> Iterator[Rule]:
    yield from _weight("img_in", "img_in")
    yield from _weight("txt_in", "txt_in")
    for name in ["time_in"] + (["guidance_in"] if cfg.guidance_embeds else []):
        yield from _weight(f"{name}.in_layer", f"{name}.fc1")
        yield from _weight(f"{name}.out_layer", f"{name}.fc2")
    yield from _weight("double_stream_modulation_img.lin", "modulation.img.lin")
    yield from _weight("double_stream_modulation_txt.lin", "modulation.txt.lin")
    yield from _weight("single_stream_modulation.lin", "modulation.single.lin")
    for i in range(cfg.depth_double):
        src, dst = f"double_blocks.{i}", f"double_blocks.{i}"
        for stream in ("img", "txt"):
            yield from _weight(f"{src}.{stream}_attn.qkv", f"{dst}.{stream}.qkv")
            yield f"{src}.{stream}_attn.norm.query_norm.scale", f"{dst}.{stream}.q_norm.weight", 0, 0, -1
            yield f"{src}.{stream}_attn.norm.key_norm.scale", f"{dst}.{stream}.k_norm.weight", 0, 0, -1
            yield from _weight(f"{src}.{stream}_attn.proj", f"{dst}.{stream}.proj")
            yield from _weight(f"{src}.{stream}_mlp.0", f"{dst}.{stream}.mlp.fc1")
            yield from _weight(f"{src}.{stream}_mlp.2", f"{dst}.{stream}.mlp.fc2")
    for i in range(cfg.depth_single):
        src, dst = f"single_blocks.{i}", f"single_blocks.{i}"
        yield from _weight(f"{src}.linear1", f"{dst}.linear1")
        yield f"{src}.norm.query_norm.scale", f"{dst}.q_norm.weight", 0, 0, -1
        yield f"{src}.norm.key_norm.scale", f"{dst}.k_norm.weight", 0, 0, -1
        yield from _weight(f"{src}.linear2", f"{dst}.linear2")
    yield from _weight("final_layer.adaLN_modulation.1", "final.mod.lin")
    yield from _weight("final_layer.linear", "final.linear")


RULES = {"diffusers": _diffusers_rules, "bfl": _bfl_rules}


def flux2_layout(cfg: Flux2Config, name: str, param_shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """The ``diffusers`` or ``bfl`` layout of a FLUX.2 model with parameters ``param_shapes``."""
    if name not in RULES:
        raise ValueError(f"unknown FLUX.2 checkpoint layout {name!r}; valid: {sorted(RULES)}")
    return build_layout(name, RULES[name](cfg), param_shapes)
