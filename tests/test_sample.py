"""From a user's own images to samples: ingest real images (matplotlib's) through a tiny
AutoencoderKL + T5 + CLIP, train 4 steps with the model's widths read from the corpus,
then sample a grid of two captions at two resolutions from the checkpoint, decoded by
the same VAE."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import tiny_encoders as te  # noqa: E402
from knapray.sample import add_arguments, flow_timesteps, parse_size, run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from knapray.corpus.ingest import IngestConfig, ingest
    from knapray.corpus.stages import EncoderSpec

    root = tmp_path_factory.mktemp("real")
    vae, t5, clip = te.save_vae(root / "vae"), te.save_t5(root / "t5"), te.save_clip(root / "clip", projection=False)
    images = te.sample_images(root / "images")
    spec = EncoderSpec(vae=str(vae), text_encoder=str(t5), pooled_encoder=str(clip))
    ingest(images, root / "corpus", IngestConfig(max_side=64), encoders=spec, progress=False)
    # No in_channels / text_dim / pooled_dim here: they come from the corpus's schema.json.
    (root / "train.yaml").write_text(
        "model: {hidden_size: 32, num_heads: 4, rope_axes_dim: [2, 2, 4], depth_double: 1, depth_single: 1}\n"
        f"data: {{corpus: {root / 'corpus'}, samples_per_step: 1, epochs: 2}}\n"
        f"balance: {{topology: g1n1}}\nrun: {{name: real, storage: {root / 'runs'}, max_steps: 4}}\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "knapray.train.torchrun", "--config", str(root / "train.yaml")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return root


def test_training_read_the_model_widths_from_the_corpus(trained):
    cfg = json.loads((trained / "runs" / "real" / "config.json").read_text())
    assert (cfg["model"]["in_channels"], cfg["model"]["text_dim"], cfg["model"]["pooled_dim"]) == (4, 16, 12)
    steps = [json.loads(x)["step"] for x in (trained / "runs" / "real" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]


def test_sample_a_grid_of_two_captions_at_two_resolutions(trained, tmp_path):
    from knapray.sample import main

    out = tmp_path / "grid.png"
    argv = ["--run", str(trained / "runs" / "real"), "--caption", "a blue present pack", "--caption",
            "the matplotlib logo", "--size", "32x32", "--size", "48x24", "--steps", "3", "--out", str(out), "--json"]
    assert main(argv) == 0
    from PIL import Image

    with Image.open(out) as im:
        assert im.size[0] > 100 and im.size[1] > 100
    # The latents were decoded by the corpus's VAE (downsample 2) at the asked sizes
    # (WIDTHxHEIGHT: 48x24 is an image 48 wide and 24 high, (frames, height, width, 3)).
    p = argparse.ArgumentParser()
    add_arguments(p)
    report = run(p.parse_args(argv))
    assert report["decoder"] == "DiffusersVAE" and report["shapes"] == [[1, 32, 32, 3], [1, 24, 48, 3]]
    again = run(p.parse_args(argv))
    assert again["shapes"] == report["shapes"]


def test_sizes_and_time_grid():
    assert parse_size("768x512") == (768, 512)  # (width, height)
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_size("big")
    ts = flow_timesteps(4)
    assert ts[0] == 1.0 and ts[-1] == 0.0 and np.all(np.diff(ts) < 0)
    shifted = flow_timesteps(4, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0 and shifted[2] > ts[2]
