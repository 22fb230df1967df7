"""Qwen-Image from its checkpoint: pictures ingested with its own (tiny) Qwen2.5-VL and VAE
(``knapray ingest --family qwen_image``), a tiny diffusers model (``save_pretrained``) fine-tuned by
knapray on them on 2 gloo ranks with sequences split over a bag of two and whole on either rank
(``model.pretrained``, balanced, FSDP full), exported with ``knapray export``, loaded back by
diffusers, and the exported folder exact against diffusers' own math (``knapray reference``);
``knapray sample`` draws from the run with its pipeline's schedule and guidance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers", reason="needs diffusers (the test extra)")

from dist_utils import run_distributed  # noqa: E402

pytestmark = pytest.mark.dist


def _save(path: Path) -> Path:
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(11)
    QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)
                                ).save_pretrained(path)
    return path


def _finetune(rank: int, world: int, corpus: str, runs: str, pretrained: str) -> list[float]:
    from dist_utils import local_trainer

    from knapray.driver.run_dir import write_config

    trainer = local_trainer(rank, world, corpus, runs, "qwen", [
        f"model.pretrained={pretrained}", "parallel.fsdp=full", "run.max_steps=4", "balance.topology=g2n1",
        "balance.planner=cost", "balance.overlap=true", "balance.cost={d_model: 3072}", "balance.live_fit=false",
        "optim.lr=0.003", "data.epochs=4",
    ])
    if rank == 0:
        write_config(trainer.cfg)  # what a launcher's pre-flight writes: export reads it
    summary = trainer.train()
    return [r["loss"] for r in summary["records"]]


def test_finetuned_from_its_checkpoint_exported_and_loaded_by_diffusers(tmp_path: Path, capsys) -> None:
    from diffusers import QwenImageTransformer2DModel

    import numpy as np
    from flux_utils import save_tiny_qwen_encoders
    from PIL import Image

    from knapray.cli import main
    from knapray.testing.reference import run_reference

    pretrained = _save(tmp_path / "transformer")
    encoders = save_tiny_qwen_encoders(tmp_path / "pipeline")
    media, corpus = tmp_path / "pictures", tmp_path / "corpus"
    media.mkdir()
    rng = np.random.default_rng(3)
    for i, (h, w) in enumerate([(64, 64), (64, 128), (128, 64), (96, 96)] * 2):
        Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(media / f"{i}.png")
        (media / f"{i}.txt").write_text(f"picture number {i} of a red bicycle")
    assert main(["ingest", "--input", str(media), "--out", str(corpus), "--family", "qwen_image", "--vae",
                 str(encoders["vae"]), "--text-encoder", str(encoders["text_encoder"]), "--shards", "2",
                 "--quiet"]) == 0
    losses = run_distributed(_finetune, 2, str(corpus), str(tmp_path / "runs"), str(pretrained), timeout_s=300)
    assert losses[0] == losses[1] and len(losses[0]) == 4  # every rank saw the same summed losses
    assert losses[0][-1] < losses[0][0], losses[0]

    run, out = tmp_path / "runs" / "qwen", tmp_path / "exported"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["_class_name"] == "QwenImageTransformer2DModel" and config["num_layers"] == 2
    initial = QwenImageTransformer2DModel.from_pretrained(pretrained).state_dict()
    tuned = QwenImageTransformer2DModel.from_pretrained(out).state_dict()
    assert set(tuned) == set(initial)
    changed = {k for k, v in tuned.items() if not torch.equal(v, initial[k])}
    # The last block's text queries and its text stream after attention feed no output (its
    # text tokens are never read): no gradient, so AdamW leaves them; every other tensor trained.
    unused = ("attn.add_q_proj.", "attn.norm_added_q.", "attn.to_add_out.", "txt_mlp.")
    frozen = {k for k in initial if k.startswith("transformer_blocks.1.") and any(p in k for p in unused)}
    assert set(initial) - changed == frozen, sorted(set(initial) - changed)
    # Sampled with its pipeline's schedule and guidance (4.0 against the empty caption, renormed),
    # its caption through Qwen2.5-VL and its latents through the corpus's VAE: one picture per request.
    capsys.readouterr()
    assert main(["sample", "--run", str(run), "--caption", "a red bicycle", "--size", "64x96", "--steps", "2",
                 "--out", str(tmp_path / "s")]) == 0, capsys.readouterr().err
    assert (tmp_path / "s" / "request_0.png").is_file() and (tmp_path / "s" / "grid.png").is_file()
    from PIL import Image as _Image

    assert _Image.open(tmp_path / "s" / "request_0.png").size == (64, 96)
    report = run_reference([str(out)], sequences=3, seed=1)  # what knapray wrote, against diffusers' math
    assert report[str(out)]["out_rel"] < 1e-5 and report[str(out)]["grad_rel"] < 1e-5, report
