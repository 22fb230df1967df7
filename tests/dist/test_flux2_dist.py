"""FLUX.2 from its checkpoint: pictures ingested with its own (tiny) Mistral3 text encoder and VAE
(``knapray ingest --family flux2``), a tiny diffusers model ([dev]: guidance embedded;
``save_pretrained``) fine-tuned by knapray on them on 2 gloo ranks with sequences split over a bag of two and whole on either
rank (``model.pretrained``, balanced, FSDP full, overlapping groups), exported with ``knapray
export``, loaded back by diffusers with every tensor trained, and the exported folder exact
against diffusers' own math (``knapray reference``); ``knapray sample`` draws from the run with its
pipeline's shift and guidance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers", reason="needs diffusers (the test extra)")

from dist_utils import run_distributed  # noqa: E402

pytestmark = pytest.mark.dist


def _save(path: Path) -> Path:
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(11)
    Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 4, 4, 4)
                            ).save_pretrained(path)
    return path


def _finetune(rank: int, world: int, corpus: str, runs: str, pretrained: str) -> list[float]:
    from dist_utils import local_trainer

    from knapray.driver.run_dir import write_config

    trainer = local_trainer(rank, world, corpus, runs, "flux2", [
        f"model.pretrained={pretrained}", "parallel.fsdp=full", "run.max_steps=4", "balance.topology=g2n1",
        "balance.planner=cost", "balance.overlap=true", "balance.cost={d_model: 6144}", "balance.live_fit=false",
        "optim.lr=0.003", "data.epochs=4", "flow.guidance=4.0",
    ])
    if rank == 0:
        write_config(trainer.cfg)  # what a launcher's pre-flight writes: export reads it
    summary = trainer.train()
    return [r["loss"] for r in summary["records"]]


def test_finetuned_from_its_checkpoint_exported_and_loaded_by_diffusers(tmp_path: Path, capsys) -> None:
    from diffusers import Flux2Transformer2DModel

    import numpy as np
    from diffusers import AutoencoderKLFlux2
    from flux_utils import save_tiny_flux2_text_encoder
    from PIL import Image

    from knapray.cli import main
    from knapray.testing.reference import run_reference

    pretrained = _save(tmp_path / "transformer")
    text_encoder = save_tiny_flux2_text_encoder(tmp_path / "pipeline")  # a Mistral3: text 3 x 8 wide
    torch.manual_seed(0)
    AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                       up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                       layers_per_block=1).save_pretrained(tmp_path / "pipeline" / "vae")
    media, corpus = tmp_path / "pictures", tmp_path / "corpus"
    media.mkdir()
    rng = np.random.default_rng(3)
    for i, (h, w) in enumerate([(32, 32), (32, 64), (64, 32), (48, 48)] * 2):
        Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(media / f"{i}.png")
        (media / f"{i}.txt").write_text(f"picture number {i} of a red bicycle")
    assert main(["ingest", "--input", str(media), "--out", str(corpus), "--family", "flux2", "--vae",
                 str(tmp_path / "pipeline" / "vae"), "--text-encoder", str(text_encoder), "--shards", "2",
                 "--quiet"]) == 0
    losses = run_distributed(_finetune, 2, str(corpus), str(tmp_path / "runs"), str(pretrained), timeout_s=300)
    assert losses[0] == losses[1] and len(losses[0]) == 4  # every rank saw the same summed losses
    assert losses[0][-1] < losses[0][0], losses[0]

    run, out = tmp_path / "runs" / "flux2", tmp_path / "exported"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["_class_name"] == "Flux2Transformer2DModel" and config["num_single_layers"] == 2
    assert config["guidance_embeds"] is True and config["axes_dims_rope"] == [4, 4, 4, 4]
    initial = Flux2Transformer2DModel.from_pretrained(pretrained).state_dict()
    tuned = Flux2Transformer2DModel.from_pretrained(out).state_dict()
    assert set(tuned) == set(initial)
    unchanged = sorted(k for k, v in tuned.items() if torch.equal(v, initial[k]))
    assert not unchanged, unchanged  # every tensor feeds the image tokens' output: all trained
    # Sampled with its pipeline's schedule (the empirical shift) and guidance input (4.0 by default),
    # its caption through the Mistral chat, its latents through FLUX.2's VAE
    capsys.readouterr()
    assert main(["sample", "--run", str(run), "--caption", "a red bicycle", "--size", "64x32", "--steps", "2",
                 "--out", str(tmp_path / "s"), "--json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["family"] == "flux2" and report["guidance"] == 4.0 and report["requests"] == 1
    from knapray.models.families.flux2 import sample_shift_of

    # 64 x 32 pixels: a 32 x 16 latent (the VAE halves), 16 x 8 = 128 tokens of 2x2 patches
    assert report["shapes"] == [[1, 32, 64, 3]] and report["shifts"] == [pytest.approx(sample_shift_of(128, 2))]
    report = run_reference([str(out)], sequences=3, seed=1)  # what knapray wrote, against diffusers' math
    assert report[str(out)]["out_rel"] < 1e-5 and report[str(out)]["grad_rel"] < 1e-5, report
