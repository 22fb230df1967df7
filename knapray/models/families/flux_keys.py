"""Flux.1's checkpoint layouts against ``FluxTransformer``'s parameters.

``diffusers``: ``FluxTransformer2DModel.state_dict()`` (what ``save_pretrained`` writes):
q, k and v (and the single block's ``proj_mlp``) are separate tensors, knapray fuses them
in that row order; ``norm_out.linear`` holds (scale, shift), knapray's final modulation
(shift, scale). ``bfl``: the original ``flux1-dev.safetensors`` / ``flux1-schnell``
single file: knapray's layout under BFL's names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from knapray.models.families.flux import FluxConfig
from knapray.models.families.layout import Layout, build_layout

Rule = tuple[str, str, int, int, int]


def _linear(key: str, param: str, src: int = 0, dst: int = 0, rows: int = -1) -> Iterator[Rule]:
    """weight and bias of a linear (or a part of its output rows)."""
    for suffix in ("weight", "bias"):
        yield f"{key}.{suffix}", f"{param}.{suffix}", src, dst, rows


def _diffusers_rules(cfg: FluxConfig) -> Iterator[Rule]:
    d, m = cfg.hidden_size, cfg.mlp_hidden
    yield from _linear("x_embedder", "img_in")
    yield from _linear("context_embedder", "txt_in")
    yield from _linear("time_text_embed.timestep_embedder.linear_1", "time_in.fc1")
    yield from _linear("time_text_embed.timestep_embedder.linear_2", "time_in.fc2")
    if cfg.guidance_embeds:
        yield from _linear("time_text_embed.guidance_embedder.linear_1", "guidance_in.fc1")
        yield from _linear("time_text_embed.guidance_embedder.linear_2", "guidance_in.fc2")
    yield from _linear("time_text_embed.text_embedder.linear_1", "vector_in.fc1")
    yield from _linear("time_text_embed.text_embedder.linear_2", "vector_in.fc2")
    for i in range(cfg.depth_double):
        src, dst = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for stream, norm, qkv, qk_norm, out, ff in (
            ("img", "norm1", ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"), "to_out.0", "ff"),
            ("txt", "norm1_context", ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k"),
             "to_add_out", "ff_context"),
        ):
            yield from _linear(f"{src}.{norm}.linear", f"{dst}.{stream}.mod.lin")
            for j, name in enumerate(qkv):  # fused rows (q, k, v): "(K H D)" with K outermost
                yield from _linear(f"{src}.attn.{name}", f"{dst}.{stream}.qkv", 0, j * d, d)
            yield f"{src}.attn.{qk_norm[0]}.weight", f"{dst}.{stream}.q_norm.weight", 0, 0, -1
            yield f"{src}.attn.{qk_norm[1]}.weight", f"{dst}.{stream}.k_norm.weight", 0, 0, -1
            yield from _linear(f"{src}.attn.{out}", f"{dst}.{stream}.proj")
            yield from _linear(f"{src}.{ff}.net.0.proj", f"{dst}.{stream}.mlp.fc1")
            yield from _linear(f"{src}.{ff}.net.2", f"{dst}.{stream}.mlp.fc2")
    for i in range(cfg.depth_single):
        src, dst = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        yield from _linear(f"{src}.norm.linear", f"{dst}.mod.lin")
        for j, name in enumerate(("to_q", "to_k", "to_v")):
            yield from _linear(f"{src}.attn.{name}", f"{dst}.linear1", 0, j * d, d)
        yield from _linear(f"{src}.proj_mlp", f"{dst}.linear1", 0, 3 * d, m)
        yield f"{src}.attn.norm_q.weight", f"{dst}.q_norm.weight", 0, 0, -1
        yield f"{src}.attn.norm_k.weight", f"{dst}.k_norm.weight", 0, 0, -1
        yield from _linear(f"{src}.proj_out", f"{dst}.linear2")
    # AdaLayerNormContinuous chunks (scale, shift); FinalLayer's Modulation (shift, scale).
    yield from _linear("norm_out.linear", "final.mod.lin", 0, d, d)
    yield from _linear("norm_out.linear", "final.mod.lin", d, 0, d)
    yield from _linear("proj_out", "final.linear")


def _bfl_rules(cfg: FluxConfig) -> Iterator[Rule]:
    yield from _linear("img_in", "img_in")
    yield from _linear("txt_in", "txt_in")
    embedders = ["time_in", "vector_in"] + (["guidance_in"] if cfg.guidance_embeds else [])
    for name in embedders:
        yield from _linear(f"{name}.in_layer", f"{name}.fc1")
        yield from _linear(f"{name}.out_layer", f"{name}.fc2")
    for i in range(cfg.depth_double):
        src, dst = f"double_blocks.{i}", f"double_blocks.{i}"
        for stream in ("img", "txt"):
            yield from _linear(f"{src}.{stream}_mod.lin", f"{dst}.{stream}.mod.lin")
            yield from _linear(f"{src}.{stream}_attn.qkv", f"{dst}.{stream}.qkv")
            yield f"{src}.{stream}_attn.norm.query_norm.scale", f"{dst}.{stream}.q_norm.weight", 0, 0, -1
            yield f"{src}.{stream}_attn.norm.key_norm.scale", f"{dst}.{stream}.k_norm.weight", 0, 0, -1
            yield from _linear(f"{src}.{stream}_attn.proj", f"{dst}.{stream}.proj")
            yield from _linear(f"{src}.{stream}_mlp.0", f"{dst}.{stream}.mlp.fc1")
            yield from _linear(f"{src}.{stream}_mlp.2", f"{dst}.{stream}.mlp.fc2")
    for i in range(cfg.depth_single):
        src, dst = f"single_blocks.{i}", f"single_blocks.{i}"
        yield from _linear(f"{src}.modulation.lin", f"{dst}.mod.lin")
        yield from _linear(f"{src}.linear1", f"{dst}.linear1")
        yield f"{src}.norm.query_norm.scale", f"{dst}.q_norm.weight", 0, 0, -1
        yield f"{src}.norm.key_norm.scale", f"{dst}.k_norm.weight", 0, 0, -1
        yield from _linear(f"{src}.linear2", f"{dst}.linear2")
    yield from _linear("final_layer.adaLN_modulation.1", "final.mod.lin")
    yield from _linear("final_layer.linear", "final.linear")


RULES = {"diffusers": _diffusers_rules, "bfl": _bfl_rules}


def flux_layout(cfg: FluxConfig, name: str, param_shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """The ``diffusers`` or ``bfl`` layout of a Flux model with parameters ``param_shapes``
    (``{name: shape}`` of the unwrapped ``FluxTransformer(cfg)``)."""
    if name not in RULES:
        raise ValueError(f"unknown Flux checkpoint layout {name!r}; valid: {sorted(RULES)}")
    return build_layout(name, RULES[name](cfg), param_shapes)
