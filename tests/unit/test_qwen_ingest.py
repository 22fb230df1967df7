"""knapray ingest for Qwen-Image with its own models (tiny random ones saved here, as its
pipeline folder holds them): the text features are what ``QwenImagePipeline.encode_prompt``
computes (its chat template around the caption, the template's 34 tokens dropped, Qwen2.5-VL's
last hidden states; the empty caption too), the latents what its VAE and normalization give,
and ``knapray ingest --family qwen_image`` writes a corpus that records both."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="needs diffusers (the test extra)")
pytest.importorskip("transformers", reason="needs transformers (the test extra)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flux_utils import save_tiny_qwen_encoders  # noqa: E402

CAPTIONS = ["a red bicycle", "", "a street at night, a red bicycle on a street at night, and more words"]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_tiny_qwen_encoders(tmp_path_factory.mktemp("qwen-encoders"))


def _pipeline(encoders: dict[str, Path]):
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=AutoencoderKLQwenImage.from_pretrained(encoders["vae"]),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(encoders["text_encoder"]),
        tokenizer=AutoTokenizer.from_pretrained(encoders["text_encoder"]),
        transformer=QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                                attention_head_dim=16, num_attention_heads=2,
                                                joint_attention_dim=32, axes_dims_rope=(4, 6, 6)))


def test_text_features_are_the_pipelines(encoders: dict[str, Path]) -> None:
    from knapray.corpus.hf import HFTextEncoder
    from knapray.models.families import get_family

    pipe = _pipeline(encoders)
    ours = HFTextEncoder(str(encoders["text_encoder"]), pooled_vector=False,
                         prompt=get_family("qwen_image").encoders.prompt).encode_many(CAPTIONS, max_tokens=512)
    for caption, (text, pooled) in zip(CAPTIONS, ours):
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt(caption, device="cpu", max_sequence_length=512)
        want = (embeds[0] if mask is None else embeds[0][mask[0].bool()]).numpy()  # None: every token counts
        assert text.shape == want.shape and pooled.shape == (0,), (caption, text.shape, want.shape)
        assert np.abs(text - want).max() <= 1e-5 * np.abs(want).max(), caption
    assert len(ours[1][0]) > 0  # the empty caption: the template's tail after it, as the pipeline's
    # at most max_tokens after the template's head, the pipeline's first ones
    short = HFTextEncoder(str(encoders["text_encoder"]), pooled_vector=False,
                          prompt=get_family("qwen_image").encoders.prompt).encode(CAPTIONS[2], max_tokens=5)[0]
    assert short.shape[0] == 5 and np.abs(short - ours[2][0][:5]).max() <= 1e-5 * np.abs(short).max()


def test_latents_are_its_vaes_normalized_as_the_pipeline(encoders: dict[str, Path]) -> None:
    from knapray.corpus.hf import DiffusersVAE

    pixels = np.random.default_rng(0).integers(0, 256, size=(1, 32, 48, 3), dtype=np.uint8)
    ours = DiffusersVAE(str(encoders["vae"])).encode(pixels)  # (C, 1, 4, 6)
    vae = _pipeline(encoders).vae
    x = torch.from_numpy(pixels).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0  # (1, 3, 1, H, W)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    want = ((z - mean) * inv_std)[0].numpy()  # QwenImage's img2img pipeline's normalization
    assert ours.shape == want.shape == (4, 1, 4, 6)
    assert np.abs(ours - want).max() <= 1e-5 * np.abs(want).max()


def test_knapray_ingest_writes_a_qwen_image_corpus(encoders: dict[str, Path], tmp_path: Path, capsys) -> None:
    image = pytest.importorskip("PIL.Image")
    from knapray.cli import main
    from knapray.corpus import read_corpus

    media = tmp_path / "media"
    media.mkdir()
    rng = np.random.default_rng(1)
    for name, (h, w) in {"a.png": (32, 48), "b.png": (64, 32)}.items():
        image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(media / name)
        (media / name).with_suffix(".txt").write_text(f"picture {name}")
    out = tmp_path / "corpus"
    assert main(["ingest", "--input", str(media), "--out", str(out), "--family", "qwen_image", "--vae",
                 str(encoders["vae"]), "--text-encoder", str(encoders["text_encoder"]), "--quiet"]) == 0
    doc = json.loads((out / "schema.json").read_text())
    assert doc["family"] == "qwen_image" and doc["dims"]["text_dim"] == 32 and doc["dims"]["pooled_dim"] == 0
    text = doc["encoders"]["text"]
    assert text["prompt_drop"] == 34 and text["prompt_template"].startswith("<|im_start|>system")
    assert text["text"]["class"] == "Qwen2_5_VLForConditionalGeneration"
    assert doc["encoders"]["latent"]["class"] == "AutoencoderKLQwenImage" and doc["dims"]["channels"] == 4
    rows = read_corpus(out).to_pylist()
    assert sorted((r["height"], r["width"]) for r in rows) == [(4, 6), (8, 4)]
    assert all(r["text_tokens"] > 0 for r in rows)
    # A Qwen2.5-VL given without the family it is read for: one line naming what to add
    assert main(["ingest", "--input", str(media), "--out", str(tmp_path / "c2"), "--text-encoder",
                 str(encoders["text_encoder"]), "--quiet"]) == 2
    assert "give the family it is for (--family qwen_image or flux2)" in capsys.readouterr().err


QWEN_SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9,
                  "shift": 1.0, "shift_terminal": 0.02, "time_shift_type": "exponential",
                  "use_dynamic_shifting": True}
"""Qwen-Image's scheduler_config.json (the values of the released pipeline folder)."""


@pytest.mark.parametrize("steps, scale, size", [(3, 4.0, (64, 96)), (4, 1.0, (96, 64))])
def test_sampled_latents_are_the_pipelines(encoders: dict[str, Path], tmp_path: Path, steps, scale, size) -> None:
    """knapray's sampler on a tiny Qwen-Image from its folder against ``QwenImagePipeline``
    (its scheduler as released: a dynamic shift from the image tokens, stretched to end at
    0.02; true classifier-free guidance against the empty caption, rescaled to the
    conditional prediction's norm) from the same noise: the same latents."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    from knapray.corpus.hf import HFTextEncoder
    from knapray.models.families import get_family
    from knapray.models.sampling import job_noise, sample_latents
    from knapray.testing.reference import load_model

    torch.manual_seed(5)
    QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)
                                ).save_pretrained(tmp_path / "transformer")
    model, cfg, _, _ = load_model(str(tmp_path / "transformer"), None)
    pipe = _pipeline(encoders)
    pipe.transformer = QwenImageTransformer2DModel.from_pretrained(tmp_path / "transformer")
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    height, width = size
    shape = (1, height // 8, width // 8)
    text = HFTextEncoder(str(encoders["text_encoder"]), pooled_vector=False,
                         prompt=get_family("qwen_image").encoders.prompt)
    cond, uncond = text.encode("a red bicycle", 512), text.encode("", 512)
    ours = sample_latents(model, [cond], [shape], steps=steps, seed=7, guidance=scale, shift=None,
                          unconditional=uncond)[0]
    noise = torch.from_numpy(job_noise(cfg, [shape], 7)[0])  # (C, 1, h, w), as sample_latents draws it
    packed = pipe._pack_latents(noise[None, :, 0], 1, 4, shape[1], shape[2])
    with torch.no_grad():
        out = pipe(prompt="a red bicycle", negative_prompt="" if scale > 1 else None, true_cfg_scale=scale,
                   height=height, width=width, num_inference_steps=steps, latents=packed, output_type="latent").images
    want = pipe._unpack_latents(out, height, width, pipe.vae_scale_factor)[0].numpy()  # (C, 1, h, w)
    assert ours.shape == want.shape
    assert np.abs(ours - want).max() <= 1e-4 * np.abs(want).max(), np.abs(ours - want).max()
