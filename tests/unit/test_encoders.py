"""The diffusers/transformers adapters (knapray.corpus.hf) on tiny randomly initialized
models saved like real checkpoints, and ingestion through them in this process: every
row is compared with the model called directly. No Ray here (tests/ray/test_ingest_ray.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers", reason="needs the encoders extra: pip install 'knapray[encoders]'")
pytest.importorskip("transformers", reason="needs the encoders extra: pip install 'knapray[encoders]'")

import tiny_encoders as te
import torch
from diffusers import AutoencoderKL, AutoencoderKLHunyuanVideo, AutoencoderKLWan
from transformers import (
    AutoTokenizer,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    T5EncoderModel,
)

from knapray.corpus import decode_row, hf, read_corpus, read_schema_json
from knapray.commands.ingest import main
from knapray.corpus.ingest import EncoderSpec, IngestConfig, ingest
from knapray.corpus.media import fit_frames, read_image

ATOL = 2e-5  # fp32; batching and padding reorder float sums


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "vae": te.save_vae(root / "vae"),
        "wan": te.save_wan(root / "wan"),
        "hunyuan": te.save_hunyuan(root / "hunyuan"),
        "t5": te.save_t5(root / "t5"),
        "clip": te.save_clip(root / "clip", projection=False),
        "clip_proj": te.save_clip(root / "clip_proj", projection=True),
        "images": te.sample_images(root / "images"),
    }


def _pixels(path: Path, multiple: int, max_side: int) -> torch.Tensor:
    """The file as ingestion fits it, as (F, 3, H, W) in [-1, 1]."""
    frames = fit_frames(read_image(path, 16, 1), multiple, max_side)
    assert frames is not None
    return torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1.0


@torch.inference_mode()
def _tokens(model_dir: Path, caption: str, max_length: int = 512) -> tuple[list[int], object]:
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok(caption, truncation=True, max_length=max_length)["input_ids"]
    return ids, torch.tensor([ids])


def test_ingest_with_a_vae_t5_and_clip_matches_the_models_called_directly(
    models: dict[str, Path], tmp_path: Path
) -> None:
    spec = EncoderSpec(vae=str(models["vae"]), text_encoder=str(models["t5"]), pooled_encoder=str(models["clip"]))
    report = ingest(models["images"], tmp_path / "c", IngestConfig(max_side=64), encoders=spec, progress=False)
    assert report.written == 3 and report.skipped == {}

    vae = AutoencoderKL.from_pretrained(models["vae"], local_files_only=True).eval()
    t5 = T5EncoderModel.from_pretrained(models["t5"], local_files_only=True).eval()
    clip = CLIPTextModel.from_pretrained(models["clip"], local_files_only=True).eval()
    downsample = 2 ** (len(vae.config.block_out_channels) - 1)
    assert (vae.config.latent_channels, downsample) == (4, 2)

    doc = read_schema_json(tmp_path / "c")
    dims = doc["dims"]
    assert dims["channels"] == 4 and dims["vae_downsample"] == 2
    assert dims["text_dim"] == t5.config.d_model == 16 and dims["pooled_dim"] == clip.config.hidden_size == 12
    rows = {r["source"]: r for r in read_corpus(tmp_path / "c").to_pylist()}
    assert set(rows) == set(te.CAPTIONS)
    for source, caption in te.CAPTIONS.items():
        s = decode_row(rows[source], text_dim=dims["text_dim"], pooled_dim=dims["pooled_dim"])
        x = _pixels(models["images"] / source, downsample * 2, 64)  # (1, 3, H, W)
        assert s["latent"].shape == (4, 1, x.shape[2] // downsample, x.shape[3] // downsample)
        with torch.inference_mode():
            mean = vae.encode(x).latent_dist.mean  # (1, 4, H/2, W/2)
            ids, ids_t = _tokens(models["t5"], caption)
            text = t5(input_ids=ids_t).last_hidden_state[0]
            pooled = clip(input_ids=_tokens(models["clip"], caption)[1]).pooler_output[0]
        want = ((mean - te.VAE_SHIFT) * te.VAE_SCALE).permute(1, 0, 2, 3).numpy()  # (4, 1, H/2, W/2)
        np.testing.assert_allclose(s["latent"], want, atol=ATOL)
        assert not np.allclose(s["latent"], mean.permute(1, 0, 2, 3).numpy(), atol=1e-3)  # factors applied
        # Text tokens are the caption's real tokens (its words and T5's </s>), no padding:
        # the metadata.jsonl caption, not the sidecar beside grace_hopper.jpg.
        assert s["text_tokens"] == len(ids) == len(caption.split()) + 1
        np.testing.assert_allclose(s["text"], text.numpy(), atol=ATOL)
        np.testing.assert_allclose(s["pooled"], pooled.numpy(), atol=ATOL)

    latent = doc["encoders"]["latent"]
    config = json.loads((models["vae"] / "config.json").read_text())
    assert latent["class"] == "AutoencoderKL" and latent["path"] == str(models["vae"].resolve())
    assert latent["config_sha256"] == hf.config_sha256(config)
    assert latent["scaling_factor"] == te.VAE_SCALE and latent["shift"] == [te.VAE_SHIFT]
    assert latent["std"] == [1.0] and latent["latent"] == "posterior mean" and latent["dtype"] == "fp32"
    text = doc["encoders"]["text"]
    assert text["text"]["class"] == "T5EncoderModel" and text["text"]["path"] == str(models["t5"].resolve())
    assert text["pooled"]["class"] == "CLIPTextModel" and text["pooled"]["pooled"] == "pooler_output"
    assert doc["encoder"] == "AutoencoderKL" and doc["text_encoder"] == "HFTextEncoder"
    assert doc["captions"] == {"column": "text", "metadata": 3, "sidecar": 0, "none": 0}
    # The empty caption's conditioning, recorded for caption dropout and sampling: no text
    # tokens, and CLIP's pooled vector of "" (the model called directly).
    with torch.inference_mode():
        empty = clip(input_ids=_tokens(models["clip"], "")[1]).pooler_output[0]
    assert doc["unconditional"]["caption"] == "" and doc["unconditional"]["text"] == []
    np.testing.assert_allclose(doc["unconditional"]["pooled"], empty.numpy(), atol=ATOL)


def test_text_encoder_drops_padding_caps_tokens_and_pools_with_clip(models: dict[str, Path]) -> None:
    enc = hf.HFTextEncoder(str(models["t5"]), pooled=str(models["clip_proj"]))
    assert (enc.dim, enc.pooled_dim) == (16, 10)  # CLIPTextModelWithProjection: projection_dim
    long = "a red fox jumps over the lazy dog"
    (empty, empty_pooled), (capped, _), (short, short_pooled) = enc.encode_many(["", long, "dog"], max_tokens=4)
    t5 = T5EncoderModel.from_pretrained(models["t5"], local_files_only=True).eval()
    clip = CLIPTextModelWithProjection.from_pretrained(models["clip_proj"], local_files_only=True).eval()
    with torch.inference_mode():
        ids, ids_t = _tokens(models["t5"], long, max_length=4)
        want_capped = t5(input_ids=ids_t).last_hidden_state[0].numpy()
        want_empty_pooled = clip(input_ids=_tokens(models["clip_proj"], "")[1]).text_embeds[0].numpy()
    assert empty.shape == (0, 16)  # no caption, no tokens; but CLIP's pooled vector of ""
    np.testing.assert_allclose(empty_pooled, want_empty_pooled, atol=ATOL)
    assert capped.shape == (4, 16) and ids[-1] == 1  # truncated to 4, </s> kept
    np.testing.assert_allclose(capped, want_capped, atol=ATOL)
    alone, alone_pooled = enc.encode("dog", max_tokens=4)  # no padding in its batch
    assert short.shape == (2, 16)  # "dog" </s>: the padding of the batch is dropped
    np.testing.assert_allclose(short, alone, atol=ATOL)
    np.testing.assert_allclose(short_pooled, alone_pooled, atol=ATOL)
    none, none_pooled = enc.encode("a red fox", max_tokens=0)
    assert none.shape == (0, 16) and none_pooled.shape == (10,)


def test_loading_the_text_models_draws_no_bars(models: dict[str, Path], capfd: pytest.CaptureFixture) -> None:
    """transformers draws a "Loading weights" bar per model (two for T5 + CLIP) in every
    command that loads them; knapray's own bars say what it does."""
    from transformers.utils import logging as hf_logging

    hf.HFTextEncoder(str(models["t5"]), pooled=str(models["clip_proj"]))
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # transformers' switch as it was


def test_t5_alone_pools_by_mean_and_clip_alone_gives_tokens_and_pooled(models: dict[str, Path]) -> None:
    t5_only = hf.HFTextEncoder(str(models["t5"]))
    text, pooled = t5_only.encode("a blue box", max_tokens=10)
    assert text.shape == (4, 16) and t5_only.pooled_dim == 16
    np.testing.assert_allclose(pooled, text.mean(axis=0), rtol=1e-6)
    clip_only = hf.HFTextEncoder(str(models["clip"]))
    assert (clip_only.dim, clip_only.pooled_dim) == (12, 12)
    assert clip_only.text.limit(392) == 77  # CLIP's positions cap the tokens
    text, pooled = clip_only.encode("a blue box", max_tokens=10)
    clip = CLIPTextModel.from_pretrained(models["clip"], local_files_only=True).eval()
    with torch.inference_mode():
        out = clip(input_ids=_tokens(models["clip"], "a blue box")[1])
    assert text.shape == (5, 12)  # start, 3 words, end
    np.testing.assert_allclose(text, out.last_hidden_state[0].numpy(), atol=ATOL)
    np.testing.assert_allclose(pooled, out.pooler_output[0].numpy(), atol=ATOL)


def test_wan_video_vae_compresses_time_and_normalizes_per_channel(models: dict[str, Path]) -> None:
    info = hf.vae_info(models["wan"])
    assert (info.cls, info.channels, info.downsample, info.temporal_downsample) == ("AutoencoderKLWan", 4, 8, 4)
    assert info.shift == (0.1, -0.2, 0.3, 0.0) and info.std == (2.0, 1.5, 0.5, 1.0)
    enc = hf.DiffusersVAE(str(models["wan"]), batch_frames=16)
    rng = np.random.default_rng(0)
    clip = rng.integers(0, 256, size=(7, 32, 48, 3), dtype=np.uint8)
    image = rng.integers(0, 256, size=(1, 16, 24, 3), dtype=np.uint8)
    clip_latent, image_latent = enc.encode_many([clip, image])
    assert clip_latent.shape == (4, 2, 4, 6)  # 7 frames -> 5 kept (1 + 4) -> 2 latent frames
    assert image_latent.shape == (4, 1, 2, 3)
    wan = AutoencoderKLWan.from_pretrained(models["wan"], local_files_only=True).eval()
    with torch.inference_mode():
        x = torch.from_numpy(clip[:5]).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0  # (1, 3, 5, H, W)
        z = wan.encode(x).latent_dist.mean[0]  # (4, 2, 4, 6)
    mean = torch.tensor(info.shift).reshape(4, 1, 1, 1)
    std = torch.tensor(info.std).reshape(4, 1, 1, 1)
    np.testing.assert_allclose(clip_latent, ((z - mean) / std).numpy(), atol=ATOL)


def test_a_video_vae_decodes_and_encodes_at_once_as_it_does_alone(models: dict[str, Path]) -> None:
    """A serving rank decodes one request's latent while it encodes another's conditioning
    image with the same VAE. diffusers' AutoencoderKLWan keeps its causal caches on the module
    and empties them when a call starts: run together without the lock (``hf.model_lock``),
    every one of 20 tries here gave 6 frames for 3 latent frames, not 9, and the encode 6 latent
    frames for 9. Each call now has the model alone: the same frames as a decode alone."""
    import threading

    enc = hf.DiffusersVAE(str(models["wan"]))
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    pixels = rng.integers(0, 256, size=(9, 64, 64, 3), dtype=np.uint8)
    alone, first_alone = enc.decode(latent), enc.encode_first_frames([pixels])[0]
    assert alone.shape == (9, 64, 64, 3)
    for _ in range(3):
        got: dict[str, np.ndarray] = {}
        threads = [threading.Thread(target=lambda: got.update(d=enc.decode(latent))),
                   threading.Thread(target=lambda: got.update(e=enc.encode_first_frames([pixels])[0]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert np.array_equal(got["d"], alone) and np.array_equal(got["e"], first_alone)


def test_hunyuan_video_vae_compresses_time_and_scales(models: dict[str, Path]) -> None:
    info = hf.vae_info(models["hunyuan"])
    assert (info.channels, info.downsample, info.temporal_downsample, info.scaling_factor) == (4, 4, 4, 0.5)
    clip = np.random.default_rng(2).integers(0, 256, size=(10, 16, 24, 3), dtype=np.uint8)
    latent = hf.DiffusersVAE(str(models["hunyuan"])).encode(clip)
    assert latent.shape == (4, 3, 4, 6)  # 10 frames -> 9 kept (1 + 2 * 4) -> 3 latent frames
    vae = AutoencoderKLHunyuanVideo.from_pretrained(models["hunyuan"], local_files_only=True).eval()
    with torch.inference_mode():
        x = torch.from_numpy(clip[:9]).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0  # (1, 3, 9, H, W)
        want = vae.encode(x).latent_dist.mean[0] * 0.5
    np.testing.assert_allclose(latent, want.numpy(), atol=ATOL)


def test_video_through_an_image_vae_is_encoded_frame_by_frame(models: dict[str, Path], tmp_path: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(1)
    frames = [rng.integers(0, 256, size=(24, 40, 3), dtype=np.uint8) for _ in range(3)]
    (tmp_path / "in").mkdir()
    Image.fromarray(frames[0]).save(tmp_path / "in" / "clip.gif", save_all=True,
                                    append_images=[Image.fromarray(f) for f in frames[1:]], duration=40)
    spec = EncoderSpec(vae=str(models["vae"]), vae_batch=2)  # 3 frames over two VAE calls
    ingest(tmp_path / "in", tmp_path / "c", encoders=spec, progress=False)
    row = read_corpus(tmp_path / "c").to_pylist()[0]
    s = decode_row(row)
    assert row["kind"] == "video" and s["latent"].shape == (4, 3, 12, 20)
    vae = AutoencoderKL.from_pretrained(models["vae"], local_files_only=True).eval()
    with torch.inference_mode():
        x = _pixels(tmp_path / "in" / "clip.gif", 4, 512)  # (3, 3, 24, 40), GIF palette applied
        want = ((vae.encode(x).latent_dist.mean - te.VAE_SHIFT) * te.VAE_SCALE).permute(1, 0, 2, 3)
    np.testing.assert_allclose(s["latent"], want.numpy(), atol=ATOL)


def test_cli_with_clip_as_the_text_encoder(models: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c"
    assert main(["--input", str(models["images"]), "--out", str(out), "--vae", str(models["vae"]),
                 "--text-encoder", str(models["clip"]), "--max-side", "32", "--quiet"]) == 0
    assert "3 samples" in capsys.readouterr().out
    doc = read_schema_json(out)
    assert doc["dims"]["text_dim"] == 12 and doc["dims"]["pooled_dim"] == 12
    assert doc["encoders"]["text"]["text"]["class"] == "CLIPTextModel"
    rows = read_corpus(out).to_pylist()
    caption = {r["source"]: r["text_tokens"] for r in rows}
    assert caption["sub/logo2.png"] == len(te.CAPTIONS["sub/logo2.png"].split()) + 2  # start and end


def _error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1, err
    return err[0]


def test_bad_model_paths_are_one_line_errors_naming_them(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--input", str(models["images"]), "--out", str(tmp_path / "never")]
    missing = str(tmp_path / "no" / "vae")
    assert f"--vae {missing}: no such directory" in _error_line(base + ["--vae", missing], capsys)
    assert "no config.json" in _error_line(base + ["--vae", str(tmp_path)], capsys)
    (tmp_path / "model_index.json").write_text("{}")  # a whole diffusers pipeline, as downloaded
    assert "pass the model's sub folder (vae/" in _error_line(base + ["--vae", str(tmp_path)], capsys)
    line = _error_line(base + ["--vae", str(models["t5"])], capsys)
    assert "is not a supported VAE" in line and "AutoencoderKLWan" in line
    line = _error_line(base + ["--text-encoder", str(models["vae"])], capsys)
    assert "is not a supported text encoder" in line
    line = _error_line(base + ["--text-encoder", str(models["t5"]), "--pooled-encoder", str(models["t5"])], capsys)
    assert "--pooled-encoder" in line and "CLIP" in line
    bare = tmp_path / "t5_without_tokenizer"
    shutil.copytree(models["t5"], bare, ignore=shutil.ignore_patterns("tokenizer*"))
    line = _error_line(base + ["--text-encoder", str(bare)], capsys)
    assert "no tokenizer files" in line and "--text-tokenizer" in line
    assert "without text_encoder" in _error_line(base + ["--pooled-encoder", str(models["clip"])], capsys)
    # With the tokenizer given apart (as in a Flux checkpoint's tokenizer_2/) it loads.
    assert main(base[:-1] + [str(tmp_path / "ok"), "--text-encoder", str(bare), "--text-tokenizer",
                             str(models["t5"]), "--max-side", "128", "--quiet"]) == 0
    assert not (tmp_path / "never").exists()
