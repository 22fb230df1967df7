"""The qwen_image family against diffusers' QwenImageTransformer2DModel: tiny random models
saved with ``save_pretrained``, loaded by knapray from their folders, outputs and gradients
of mixed-resolution batches (one process, and balanced over 4 gloo ranks with sequences
split over bags and whole on ranks of bags of two); RoPE positions as the pipeline's; the
diffusers layout is the model's state dict; the config round-trips; variants refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="needs diffusers (the test extra)")
pytest.importorskip("safetensors", reason="needs safetensors (the test extra)")

from knapray.models.families import checkpoint_layout  # noqa: E402
from knapray.models.families.qwen_image import QwenImageConfig, qwen_positions, section_from_diffusers  # noqa: E402
from knapray.testing.reference import run_reference  # noqa: E402

TINY = {  # name: (heads, head_dim, rope axes, layers, text width)
    "h2": (2, 16, (4, 6, 6), 2, 24),
    "h4": (4, 8, (2, 2, 4), 1, 16),
}


def _save(path: Path, heads: int, head_dim: int, axes, layers: int, text_dim: int) -> Path:
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(heads * 100 + layers)
    ref = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=layers,
                                      attention_head_dim=head_dim, num_attention_heads=heads,
                                      joint_attention_dim=text_dim, axes_dims_rope=axes)
    with torch.no_grad():  # every RMSNorm gain away from its init of 1, so that a swapped one shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.05 * torch.randn_like(p))
    ref.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen")
    return {name: _save(root / name, *spec) for name, spec in TINY.items()}


def _cfg(path: Path) -> QwenImageConfig:
    return QwenImageConfig(**section_from_diffusers(json.loads((path / "config.json").read_text()), str(path)),
                           pretrained=str(path))


def test_every_tiny_qwen_image_matches_diffusers_outputs_and_gradients(tiny: dict[str, Path]) -> None:
    report = run_reference([str(p) for p in tiny.values()], sequences=4, seed=3)
    for name, path in tiny.items():
        r = report[str(path)]
        print(name, r["out_rel"], r["grad_rel"])
        assert r["out_rel"] < 1e-5 and r["grad_rel"] < 1e-5, (name, r)
        assert r["num_grads"] == len(checkpoint_layout(_cfg(path)).keys)  # every tensor compared
        assert r["family"] == "qwen_image" and r["heads"] == TINY[name][0]


@pytest.mark.dist
def test_balanced_on_4_ranks_matches_diffusers(tiny: dict[str, Path]) -> None:
    """g1n2+g2n1: sequences whole on ranks 0 and 1, split over the bag of ranks 2..3 (Ulysses,
    the RoPE ids derived at home before the tokens leave)."""
    report = run_reference([str(tiny["h2"])], world_size=4, topology="g1n2+g2n1", sequences=6, seed=5)
    r = report[str(tiny["h2"])]
    print("balanced", r["out_rel"], r["grad_rel"])
    assert r["out_rel"] < 1e-5 and r["grad_rel"] < 1e-5, r


def test_rope_ids_are_the_pipelines():
    """diffusers' QwenEmbedRope for a 3 x 4 token grid and 2 text tokens, against knapray's
    ids through knapray's angles: the same cos and sin."""
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    from knapray.models.families.qwen_image import qwen_rope
    from knapray.models.packing import grid_positions

    axes = (4, 6, 6)
    img, txt = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)([(1, 3, 4)], max_txt_seq_len=2,
                                                                                device=torch.device("cpu"))
    pos = torch.cat((torch.zeros(2, 3, dtype=torch.int64), grid_positions((1, 3, 4))))
    ids = qwen_positions(pos, torch.zeros(14, dtype=torch.int64), torch.arange(14) < 2)
    assert ids[:2].tolist() == [[2, 2, 2], [3, 3, 3]]  # after the image: max(3 // 2, 4 // 2) = 2
    assert ids[2].tolist() == [0, -2, -2] and ids[-1].tolist() == [0, 0, 1]  # centred: -ceil(3/2), -ceil(4/2)
    cos, sin = qwen_rope(ids, axes)
    want = torch.cat((txt, img))
    # the same float32 angles; torch.polar's cos and sin may round the last bit otherwise
    assert (cos - want.real).abs().max() <= 2e-7 and (sin - want.imag).abs().max() <= 2e-7


def test_diffusers_layout_is_diffusers_state_dict_and_the_config_round_trips() -> None:
    from diffusers import QwenImageTransformer2DModel

    ref = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                      attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
                                      axes_dims_rope=(2, 2, 4))
    cfg = QwenImageConfig(**section_from_diffusers(dict(ref.config), "test"))
    assert (cfg.in_channels, cfg.depth_double, cfg.depth_single, cfg.pooled_dim) == (16, 2, 0, 0)
    layout = checkpoint_layout(cfg, "diffusers")
    assert layout.first_mismatch({k: v.shape for k, v in ref.state_dict().items()}) is None
    mine = cfg.to_diffusers()
    assert {k: v for k, v in mine.items() if k != "_class_name"} == {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in ref.config.items() if not k.startswith("_")}


@pytest.mark.parametrize("key, value, words", [
    ("zero_cond_t", True, "zero_cond_t=True (Qwen-Image-Edit-2511's zero_cond_t)"),
    ("use_layer3d_rope", True, "use_layer3d_rope=True (Qwen-Image-Layered's 3D RoPE)"),
    ("in_channels", 128, "in_channels=128 is not out_channels=16 latent channels x 2 x 2"),
    ("patch_size", 1, "patch_size=1; Qwen-Image packs 2x2 latent patches"),
    ("pooled_projection_dim", 768, "keys ['pooled_projection_dim'] are not QwenImageTransformer2DModel's"),
])
def test_variants_it_does_not_train_are_refused_in_one_line(key, value, words) -> None:
    with pytest.raises(ValueError) as e:
        section_from_diffusers({key: value}, "ckpt/config.json")
    assert str(e.value).startswith("ckpt/config.json: ") and words in str(e.value) and "\n" not in str(e.value)


def test_the_full_size_layout_is_qwen_images_own():
    """Qwen-Image's 20B shape (diffusers' defaults, built on the meta device: names and shapes
    only, as a checkpoint's headers give them): every tensor mapped, none left over."""
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        ref = QwenImageTransformer2DModel()
    cfg = QwenImageConfig(**section_from_diffusers(dict(ref.config), "Qwen/Qwen-Image/transformer"))
    assert (cfg.hidden_size, cfg.num_heads, cfg.depth_double, cfg.text_dim) == (3072, 24, 60, 3584)
    shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    layout = checkpoint_layout(cfg, "diffusers")
    assert layout.first_mismatch(shapes) is None and len(layout.keys) == len(shapes) == 1933
    assert sum(math.prod(s) for s in shapes.values()) / 1e9 == pytest.approx(20.43, abs=0.01)


def test_qwen_image_samples_with_its_pipelines_schedule_and_guidance() -> None:
    """Its schedule: the pipeline's dynamic shift from the image tokens (0.5 at 256, 0.9 at
    8,192), then stretched so that the last time before 0 is 0.02; guidance 4.0 by default,
    rescaled to the conditional prediction's norm; validation samples of a run load."""
    import math

    from knapray.config.run import load_config
    from knapray.inference.prepare import default_guidance
    from knapray.models.sampling import config_shifts, denoise_job, flow_timesteps

    cfg = QwenImageConfig(hidden_size=64, num_heads=2, depth_double=1, in_channels=4, text_dim=16,
                          rope_axes_dim=(8, 12, 12))
    (shift,) = config_shifts(cfg, [(1, 64, 64)], None)  # 32 x 32 = 1,024 image tokens
    assert shift == pytest.approx(math.exp(0.5 + (0.9 - 0.5) * (1024 - 256) / (8192 - 256)))
    job = denoise_job(cfg, np.zeros((4, 1, 64, 64), np.float32), (np.zeros((3, 16), np.float32), np.zeros(0)),
                      steps=4, guidance=default_guidance(cfg), shift=None, unconditional=None)
    assert job.times[0] == pytest.approx(1.0) and job.times[-2] == pytest.approx(0.02) and job.times[-1] == 0.0
    assert job.times[1:-1] != tuple(flow_timesteps(4, shift)[1:-1])  # stretched
    assert job.cfg_scale == 4.0 and job.cfg_renorm
    base = ["model.family=qwen_image", "model.hidden_size=64", "model.num_heads=2", "model.depth_double=1",
            "model.text_dim=16", "model.rope_axes_dim=[8,12,12]"]
    assert load_config(None, [*base, "metrics.validation.every=5", "metrics.validation.captions=[a fox]"]
                       ).metrics.validation.every == 5
