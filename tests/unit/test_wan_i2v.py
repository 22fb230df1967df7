"""Wan 2.1 I2V and Wan 2.2 TI2V-5B (model.family: wan) against diffusers' WanTransformer3DModel.

Tiny random diffusers models saved by diffusers and loaded by knapray through the family's
layout (knapray/weights/load), several sequences of different frame counts, resolutions
and text lengths packed into one batch, each against its own diffusers call; in float64,
outputs and parameter gradients within 1e-6 relative (as tests/dist/test_wan.py's float64
check: diffusers keeps its RoPE tables in fp32 even in a float64 model). I2V: 12 channels
in, 4 out, 257 image-context tokens of 24 features, text padded to 512 as the pipeline
pads it. TI2V: a 2-D timestep per token, some sequences image-conditioned (first latent
frame at time 0), some not. Plus the config round trip and the full-size key maps of
Wan2.1-I2V-14B and Wan2.2-TI2V-5B built on the meta device."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from knapray.models.families import build_model, checkpoint_layout, param_shapes  # noqa: E402
from knapray.models.families.wan import TEXT_LENGTH, WanConfig, diffusers_call, section_from_diffusers  # noqa: E402
from knapray.models.flow import flow_loss  # noqa: E402
from knapray.testing.reference import Inputs, _grads_as_checkpoint, _pack, _split  # noqa: E402

TINY = {
    # head_dim 16: RoPE split (8, 4, 4); 2 blocks; the image embedder 24 -> 32, attn2's added k/v 32 -> 32
    "i2v": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=12, out_channels=4,
                text_dim=8, freq_dim=16, ffn_dim=48, num_layers=2, cross_attn_norm=True, image_dim=24,
                added_kv_proj_dim=32),
    # TI2V-5B's shape in small: in = out channels, no image context, no cross-attention norm
    "ti2v": dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=12, in_channels=6, out_channels=6,
                 text_dim=10, freq_dim=16, ffn_dim=40, num_layers=2, cross_attn_norm=False),
}
TOL = 1e-6

I2V_14B = dict(patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=36, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=1280, added_kv_proj_dim=5120,
               rope_max_seq_len=1024, pos_embed_seq_len=None)
"""Wan-AI/Wan2.1-I2V-14B-480P-Diffusers transformer/config.json."""
TI2V_5B = dict(patch_size=[1, 2, 2], num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
               text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
               rope_max_seq_len=1024, pos_embed_seq_len=None)
"""Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from diffusers import WanTransformer3DModel

    out = {}
    for i, (name, config) in enumerate(TINY.items()):
        torch.manual_seed(11 + i)
        model = WanTransformer3DModel(**config)
        with torch.no_grad():  # non-degenerate norms, so their gradients are tested too
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(0.1 * torch.randn_like(p))
        out[name] = str(tmp_path_factory.mktemp(f"wan-{name}"))
        model.save_pretrained(out[name])
    return out


def _load(path: str, **extra) -> tuple[torch.nn.Module, WanConfig]:
    """knapray's model of the checkpoint at ``path`` as training builds it (meta, then
    allocated and filled through the layout), in float64."""
    from knapray.weights.checks import section_values
    from knapray.weights.load import load_pretrained
    from knapray.weights.source import open_pretrained

    source = open_pretrained(path)
    cfg = WanConfig(**section_values(source, "wan"), pretrained=source.path, **extra)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    load_pretrained(model, cfg)
    return model.double(), cfg


def _inputs(cfg: WanConfig, seed: int) -> list[Inputs]:
    """Four clips (1 to 3 frames; captions of 0, 3, 12, 7 tokens), each with an image
    context (I2V) or a first-frame time (TI2V: sequences 0 and 2 conditioned, time 0)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (grid, n_txt) in enumerate(zip([(1, 2, 2), (2, 3, 2), (3, 2, 3), (2, 2, 2)], [0, 3, 12, 7])):
        latent = torch.randn(cfg.in_channels, *(g * p for g, p in zip(grid, cfg.patch_size)), generator=gen,
                             dtype=torch.float64)
        t = 0.2 + 0.2 * i
        out.append(Inputs(
            latent=latent, text=torch.randn(n_txt, cfg.text_dim, generator=gen, dtype=torch.float64),
            pooled=torch.zeros(0), timestep=t, guidance=None,
            target=torch.randn(math.prod(grid), cfg.out_patch_dim, generator=gen, dtype=torch.float64),
            image_context=(torch.randn(cfg.image_tokens, cfg.image_dim, generator=gen, dtype=torch.float64)
                           if cfg.image_dim else None),
            first_frame_timestep=(0.0 if i % 2 == 0 else t) if cfg.expand_timesteps else None))
    return out


def _compare(path: str, model: torch.nn.Module, cfg: WanConfig, inputs: list[Inputs]) -> tuple[float, float, str]:
    """(output, gradient) largest relative errors of knapray's packed batch against
    diffusers' per-sequence calls (float64), and the tensor of the worst gradient."""
    from diffusers import WanTransformer3DModel

    batch = _pack(cfg, inputs)
    out = model(batch)
    flow_loss(out, batch.targets, batch.x_img.shape[0]).backward()
    ours = _grads_as_checkpoint(cfg, {n: p.grad for n, p in model.named_parameters()})

    ref = WanTransformer3DModel.from_pretrained(path, torch_dtype=torch.float64)
    total = sum(s.target.numel() for s in inputs)
    ref_outs = []
    for s in inputs:
        o = diffusers_call(ref, cfg, s)
        ((o - s.target).pow(2).sum() / total).backward()
        ref_outs.append(o.detach())
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    out_rel = max(rel(a, b) for a, b in zip(_split(out.detach(), inputs), ref_outs))
    grads = {name: rel(ours[name], p.grad) for name, p in ref.named_parameters()}
    assert set(grads) == set(ours)
    worst = max(grads, key=grads.get)
    return out_rel, grads[worst], worst


def test_i2v_matches_diffusers_with_image_tokens_in_float64(checkpoints):
    """Text padded to 512 rows (one embedded zero row weighted by the missing count, an empty
    caption included) and 257 image-context tokens per sequence; 16 of the model's 48 input
    features out (4 of 12 channels)."""
    model, cfg = _load(checkpoints["i2v"])
    assert (cfg.image_dim, cfg.out_channels, cfg.text_pad_to, cfg.image_tokens) == (24, 4, TEXT_LENGTH, 257)
    assert (cfg.patch_dim, cfg.out_patch_dim) == (48, 16)
    out_rel, grad_rel, worst = _compare(checkpoints["i2v"], model, cfg, _inputs(cfg, seed=5))
    print(f"\nWan I2V float64: outputs {out_rel:.1e}, gradients {grad_rel:.1e} ({worst})")
    assert out_rel < TOL and grad_rel < TOL, (out_rel, grad_rel, worst)


def test_ti2v_matches_diffusers_with_per_token_timesteps_in_float64(checkpoints):
    """diffusers called with a 2-D timestep (1, tokens) as ``WanPipeline`` with
    ``expand_timesteps`` gives it: the first latent frame of sequences 0 and 2 at time 0 (an
    image conditions them; sequence 0 has one frame only), every other token at its
    sequence's time."""
    model, cfg = _load(checkpoints["ti2v"], expand_timesteps=True)
    assert cfg.condition_dim == 14 * cfg.hidden_size and cfg.out_patch_dim == cfg.patch_dim
    out_rel, grad_rel, worst = _compare(checkpoints["ti2v"], model, cfg, _inputs(cfg, seed=6))
    print(f"\nWan TI2V float64: outputs {out_rel:.1e}, gradients {grad_rel:.1e} ({worst})")
    assert out_rel < TOL and grad_rel < TOL, (out_rel, grad_rel, worst)


def test_ti2v_without_conditioned_sequences_is_the_t2v_model(checkpoints):
    """Every first frame at its sequence's time: per-token times change nothing."""
    model, cfg = _load(checkpoints["ti2v"], expand_timesteps=True)
    plain = build_model(dataclasses.replace(cfg, expand_timesteps=False)).double()
    plain.load_state_dict(model.state_dict())
    inputs = [dataclasses.replace(s, first_frame_timestep=s.timestep) for s in _inputs(cfg, seed=7)]
    batch = _pack(cfg, inputs)
    with torch.no_grad():
        assert torch.equal(model(batch), plain(dataclasses.replace(batch, first_frame_timesteps=None)))


@pytest.mark.parametrize("name", sorted(TINY))
def test_the_config_round_trips_through_diffusers(name):
    """knapray's config -> diffusers' config.json -> knapray's section: the same values, and
    a diffusers model built from it has exactly the layout's tensors."""
    from diffusers import WanTransformer3DModel

    cfg = WanConfig(**section_from_diffusers(TINY[name], "tiny/config.json"))
    exported = cfg.to_diffusers()
    assert exported["out_channels"] == TINY[name]["out_channels"]
    assert exported["image_dim"] == TINY[name].get("image_dim")
    assert exported["added_kv_proj_dim"] == TINY[name].get("added_kv_proj_dim")
    assert WanConfig(**section_from_diffusers(exported, "exported/config.json")) == cfg
    with torch.device("meta"):
        ref = WanTransformer3DModel(**{k: v for k, v in exported.items() if not k.startswith("_")})
    shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert checkpoint_layout(cfg).first_mismatch(shapes) is None


@pytest.mark.parametrize("change, words", [
    ({"pos_embed_seq_len": 514}, "first-last-frame (FLF2V)"),
    ({"added_kv_proj_dim": None}, "an I2V Wan has both"),
    ({"added_kv_proj_dim": 24}, "differs from the model width 32"),
    ({"image_dim": 0}, "image_dim=0 is not a valid size"),
])
def test_what_knapray_cannot_read_is_refused_in_one_line(change, words):
    with pytest.raises(ValueError) as e:
        section_from_diffusers({**TINY["i2v"], **change}, "ckpt/config.json")
    assert str(e.value).startswith("ckpt/config.json: ") and words in str(e.value) and "\n" not in str(e.value)


def test_i2v_needs_its_text_padded_to_512():
    values = section_from_diffusers(TINY["i2v"], "tiny/config.json")
    for pad in (0, 8):
        with pytest.raises(ValueError, match=r"^family wan: image_dim 24 \(I2V\) needs text_pad_to 512, got "):
            WanConfig(**values, text_pad_to=pad)
    with pytest.raises(ValueError, match="expand_timesteps .* needs a temporal patch of 1"):
        WanConfig(**{**section_from_diffusers(TINY["ti2v"], "x"), "patch_size": (2, 2, 2)}, expand_timesteps=True)


def test_the_conditioning_inputs_are_checked(checkpoints):
    """``condition`` takes exactly the inputs the config declares; the TI2V head needs the
    tokens' positions. (Balanced, both run on a bag's attentions: tests/dist/test_wan_dist.py.)"""
    model, cfg = _load(checkpoints["i2v"])
    batch = _pack(cfg, _inputs(cfg, seed=8))
    t = batch.timesteps.double()
    with pytest.raises(ValueError, match="Wan needs image_context with model.image_dim 24"):
        model.condition(t)
    with pytest.raises(ValueError, match="Wan takes no first_frame_timesteps with model.expand_timesteps False"):
        model.condition(t, first_frame_timesteps=t, image_context=batch.image_context.double())
    vec = model.condition(t, image_context=batch.image_context.double())
    assert vec.shape == (4, cfg.condition_dim) == (4, (7 + 257) * 32)
    # a caption over 512 tokens: diffusers would read its last rows as the image's
    long = _inputs(cfg, seed=8)
    long[1] = dataclasses.replace(long[1], text=torch.randn(TEXT_LENGTH + 1, cfg.text_dim, dtype=torch.float64))
    with pytest.raises(ValueError, match="a sequence has 513 text tokens, more than 512"):
        model(_pack(cfg, long))

    ti2v, cfg = _load(checkpoints["ti2v"], expand_timesteps=True)
    batch = _pack(cfg, _inputs(cfg, seed=8))
    vec = ti2v.condition(batch.timesteps.double(), first_frame_timesteps=batch.first_frame_timesteps.double())
    h = ti2v.embed(batch.x_txt.double(), batch.x_img.double(), batch.is_text)
    with pytest.raises(ValueError, match="expand_timesteps picks each token's time by its frame: give the tokens' pos"):
        ti2v.head(h, vec, batch.seq_index, batch.is_text)


@pytest.mark.parametrize("config, params, tensors", [(I2V_14B, 16_394_878_784, 1303), (TI2V_5B, 4_999_787_712, 825)],
                         ids=["wan2.1-i2v-14b", "wan2.2-ti2v-5b"])
def test_the_full_size_layouts_are_the_released_models(config, params, tensors):
    """The released transformers' shapes (diffusers' model built on the meta device from
    their config.json: names and shapes only, as a checkpoint's headers give them): every
    tensor mapped with its shape, none left over, and knapray's model of the same size, as
    the memory model counts it."""
    from diffusers import WanTransformer3DModel

    from knapray.planning.costs.memory import ModelShape

    with torch.device("meta"):
        ref = WanTransformer3DModel(**config)
    cfg = WanConfig(**section_from_diffusers(dict(ref.config), "Wan-AI/transformer/config.json"))
    shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    layout = checkpoint_layout(cfg, "diffusers")
    assert layout.first_mismatch(shapes) is None and len(layout.keys) == len(shapes)
    total = sum(math.prod(s) for s in shapes.values())
    ours = param_shapes(cfg)
    print(f"\n{cfg.depth_single} blocks, width {cfg.hidden_size}, {cfg.in_channels} -> {cfg.output_channels} channels, "
          f"image_dim {cfg.image_dim}: {total:,} parameters in {len(shapes)} tensors")
    assert (total, len(shapes)) == (params, tensors)
    assert sum(math.prod(s) for s in ours.values()) == total
    model = ModelShape.of(cfg)
    assert (model.num_params, model.num_param_tensors) == (total, len(ours))


def test_a_ti2v_pipeline_folder_says_its_transformer_takes_a_time_per_token(tmp_path):
    """``expand_timesteps`` is in a pipeline's model_index.json, not in its transformer's
    config.json: a pipeline folder gives it to the model section; a bare transformer folder
    leaves the config's own value (the checkpoint does not say)."""
    import json

    from diffusers import WanTransformer3DModel

    from knapray.weights.checks import section_values
    from knapray.weights.source import open_pretrained

    WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                          out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1).save_pretrained(
        tmp_path / "ti2v" / "transformer")
    (tmp_path / "ti2v" / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline",
                                                                    "expand_timesteps": True}))
    assert section_values(open_pretrained(str(tmp_path / "ti2v")), "wan")["expand_timesteps"] is True
    assert "expand_timesteps" not in section_values(open_pretrained(str(tmp_path / "ti2v" / "transformer")), "wan")
    from knapray.driver.preflight import _arch_from_pretrained

    data = {"model": {"family": "wan", "pretrained": str(tmp_path / "ti2v")}}
    _arch_from_pretrained(data)  # what the launchers' config loading does with model.pretrained
    assert data["model"]["expand_timesteps"] is True and data["model"]["in_channels"] == 4
    # knapray reference on the pipeline folder compares per-token times (every other sequence
    # image-conditioned) with diffusers' transformer given them
    from knapray.testing.reference import passed, run_reference

    report = run_reference([str(tmp_path / "ti2v")], sequences=4)
    assert passed(report), report
