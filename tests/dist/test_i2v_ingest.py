"""``knapray ingest --family wan --image-encoder``: two clips (multi-frame TIFFs, lossless) and an
image through a tiny ``AutoencoderKLWan``, a tiny ``UMT5EncoderModel`` and a tiny
``CLIPVisionModel``; each row's ``condition`` and ``image_context`` are what
``WanImageToVideoPipeline`` computes from the same first frame (``prepare_latents``,
``encode_image``), the corpus records the image encoder and the conditioning widths, bad
flags are refused in one line, and a Wan 2.1 I2V model trains on the corpus."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from needs import needs  # noqa: E402
import tiny_encoders as te
from knapray.cli import main
from knapray.corpus.schema import decode_row, schema_doc_problem
from knapray.corpus.writer import read_corpus

pytestmark = needs("diffusers", "transformers")

ATOL = 1e-5
FRAMES = {"clip9.tif": 9, "clip5.tif": 5, "still.png": 1}
CAPTIONS = {"clip9.tif": "a red fox jumps", "clip5.tif": "a blue box", "still.png": "the dog"}
DIMS = {"condition_channels": 8, "image_dim": 8, "image_tokens": 5}  # 4 mask + 4 latent; CLIP 28/14: 2x2 + 1


@pytest.fixture(scope="module")
def i2v_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("i2v")
    vae, umt5, clip = te.save_wan(root / "vae"), te.save_umt5(root / "umt5"), te.save_clip_vision(root / "clip")
    media = root / "media"
    pixels = te.write_media(media, FRAMES, CAPTIONS)
    out = root / "corpus"
    base = ["ingest", "--input", str(media), "--vae", str(vae), "--text-encoder", str(umt5), "--max-side", "48",
            "--max-frames", "9", "--device", "cpu", "--quiet"]
    assert main([*base, "--out", str(out), "--family", "wan", "--image-encoder", str(clip)]) == 0
    return {"root": root, "vae": vae, "clip": clip, "corpus": out, "pixels": pixels, "base": base}


def test_schema_records_the_image_encoder_and_conditioning_widths(i2v_corpus):
    doc = json.loads((i2v_corpus["corpus"] / "schema.json").read_text())
    assert {k: doc["dims"][k] for k in DIMS} == DIMS and schema_doc_problem(doc) is None
    image = doc["encoders"]["image"]
    assert image["path"] == str(i2v_corpus["clip"].resolve()) == image["processor"]
    assert image["class"] == doc["image_encoder"] == "CLIPVisionModel"
    assert image["pipeline"] == "WanImageToVideoPipeline" and image["condition_channels"] == 8
    assert {"condition", "image_context", "condition_channels", "image_tokens"} <= set(doc["columns"])


def test_conditioning_is_the_wan_i2v_pipelines(i2v_corpus):
    """Per row: cat(mask, (z - latents_mean) / latents_std) of [first frame, zero frames]
    (``prepare_latents``, num_frames the clip's kept frames; an image num_frames=1), and the
    CLIP vision model's hidden_states[-2] of the first frame (``encode_image``)."""
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPVisionModel

    clip = i2v_corpus["clip"]
    pipe = WanImageToVideoPipeline(
        tokenizer=None, text_encoder=None, transformer=None, scheduler=None,
        vae=AutoencoderKLWan.from_pretrained(i2v_corpus["vae"], local_files_only=True).eval(),
        image_encoder=CLIPVisionModel.from_pretrained(clip, local_files_only=True).eval(),
        image_processor=CLIPImageProcessor.from_pretrained(clip, local_files_only=True),
    )
    rows = {r["source"]: decode_row(r, text_dim=16, pooled_dim=0, condition_channels=8, image_dim=8)
            for r in read_corpus(i2v_corpus["corpus"]).to_pylist()}
    worst = {"condition": 0.0, "image_context": 0.0}
    for name, frames in FRAMES.items():
        row, first = rows[name], i2v_corpus["pixels"][name][0]
        kept = 1 + (frames - 1) // 4 * 4
        image = torch.from_numpy(first).permute(2, 0, 1)[None].float() / 127.5 - 1.0  # (1, 3, H, W)
        with torch.inference_mode():
            _, condition = pipe.prepare_latents(image, 1, 4, 32, 48, kept, torch.float32, torch.device("cpu"))
            tokens = pipe.encode_image(Image.fromarray(first), torch.device("cpu"))
        t = 1 + (kept - 1) // 4
        assert condition.shape == (1, 8, t, 4, 6) and row["condition"].shape == (8, t, 4, 6), row["condition"].shape
        assert tokens.shape == (1, 5, 8) and row["image_context"].shape == (5, 8)
        assert (row["condition"][:4, 0] == 1).all() and not row["condition"][:4, 1:].any()
        np.testing.assert_allclose(row["condition"], condition[0].numpy(), atol=ATOL)
        np.testing.assert_allclose(row["image_context"], tokens[0].numpy(), atol=ATOL)
        worst["condition"] = max(worst["condition"], float(np.abs(row["condition"] - condition[0].numpy()).max()))
        worst["image_context"] = max(worst["image_context"],
                                     float(np.abs(row["image_context"] - tokens[0].numpy()).max()))
    print(f"largest absolute difference from WanImageToVideoPipeline: {worst}")


@pytest.mark.parametrize("family, encoder, words", [
    ("flux", "clip", "it is for a family whose pipeline takes an image (--family wan)"),
    (None, "clip", "given for no --family"),
    ("wan", "umt5", "is not a CLIP vision model"),
])
def test_refused_in_one_line(i2v_corpus, tmp_path, capsys, family, encoder, words):
    flags = ["--image-encoder", str(i2v_corpus["root"] / encoder)] + (["--family", family] if family else [])
    code = main([*i2v_corpus["base"], "--out", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and words in err[-1], err


I2V = ["model.family=wan", "model.hidden_size=32", "model.num_heads=2", "model.depth_single=1", "model.ffn_dim=32",
       "model.freq_dim=16", "model.text_dim=16", "model.text_pad_to=512", "model.image_dim=8", "model.image_tokens=5",
       "model.out_channels=4", "data.samples_per_step=3", "data.epochs=2", "run.max_steps=2", "balance.topology=g1n1"]


def _train(rank: int, world: int, corpus: str, runs: str) -> list[float]:
    from dist_utils import local_trainer

    trainer = local_trainer(rank, world, corpus, runs, "i2v", I2V)
    assert trainer.cfg.model.in_channels == 12  # the latent's 4 channels, then the condition's 8
    return [r["loss"] for r in trainer.train()["records"]]


@pytest.mark.dist
def test_an_i2v_model_trains_on_the_ingested_corpus(i2v_corpus, tmp_path):
    from dist_utils import run_distributed

    losses = run_distributed(_train, 1, str(i2v_corpus["corpus"]), str(tmp_path / "runs"), timeout_s=180)[0]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
