"""``knapray ingest --family wan``: clips (multi-frame TIFFs, lossless) and an image through a
tiny ``AutoencoderKLWan`` and a tiny ``UMT5EncoderModel``, checked against diffusers' Wan
pipeline math on the same input; the corpus records its family, has no pooled vector, and
pre-flight matches it with a Wan model and refuses a Flux one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from needs import needs  # noqa: E402
import tiny_encoders as te
from knapray.cli import main
from knapray.corpus.schema import FAMILIES, WAN_TEXT_LENGTH, decode_row, schema_doc_problem
from knapray.corpus.writer import read_corpus

pytestmark = needs("diffusers", "transformers")

ATOL = 1e-5
CAPTIONS = {
    "clip9.tif": "a red fox jumps  over the lazy dog",  # two spaces: WanPipeline's prompt_clean collapses them
    "clip6.tif": "a blue box",
    "still.png": "",
}
FRAMES = {"clip9.tif": 9, "clip6.tif": 6, "still.png": 1}
LATENT_FRAMES = {"clip9.tif": 3, "clip6.tif": 2, "still.png": 1}  # 9 -> 1 + 2*4; 6 -> 5 kept -> 1 + 1


@pytest.fixture(scope="module")
def wan_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    vae, umt5, media = te.save_wan(root / "vae"), te.save_umt5(root / "umt5"), root / "media"
    pixels = te.write_media(media, FRAMES, CAPTIONS)
    out = root / "corpus"
    code = main(["ingest", "--input", str(media), "--out", str(out), "--vae", str(vae), "--text-encoder", str(umt5),
                 "--family", "wan", "--max-side", "48", "--max-frames", "9", "--device", "cpu", "--quiet"])
    assert code == 0
    return {"root": root, "vae": vae, "umt5": umt5, "corpus": out, "pixels": pixels}


def _rows(corpus: Path) -> dict[str, dict]:
    return {r["source"]: decode_row(r, text_dim=16, pooled_dim=0) for r in read_corpus(corpus).to_pylist()}


def test_schema_records_family_text_length_and_no_pooled_vector(wan_corpus):
    doc = json.loads((wan_corpus["corpus"] / "schema.json").read_text())
    assert doc["family"] == "wan" and doc["text_pad_to"] == WAN_TEXT_LENGTH
    assert doc["dims"]["pooled_dim"] == 0 and doc["dims"]["text_dim"] == 16 and doc["dims"]["channels"] == 4
    assert doc["encoders"]["text"]["pooled"] is None and doc["config"]["max_text_tokens"] == WAN_TEXT_LENGTH
    assert schema_doc_problem(doc) is None
    assert "family" in schema_doc_problem({**doc, "family": "sd3"})
    assert "pooled_dim" in schema_doc_problem({**doc, "dims": {**doc["dims"], "pooled_dim": -1}})


def test_families_match_the_models():
    from knapray.models.families import FAMILY_NAMES

    assert set(FAMILIES) == set(FAMILY_NAMES)


def test_latents_are_the_wan_pipelines(wan_corpus):
    """Temporal compression 1 + 4k -> 1 + k, and (mean - latents_mean) * (1 / latents_std) as
    the Wan I2V pipeline normalizes ``retrieve_latents(vae.encode(x), sample_mode="argmax")``."""
    from diffusers import AutoencoderKLWan
    from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents

    vae = AutoencoderKLWan.from_pretrained(wan_corpus["vae"], local_files_only=True).eval()
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
    rows = _rows(wan_corpus["corpus"])
    for name, t in LATENT_FRAMES.items():
        row = rows[name]
        assert row["kind"] == ("image" if name == "still.png" else "video"), row["kind"]
        assert row["latent"].shape == (4, t, 4, 6) and row["pooled"].shape == (0,)
        kept = 1 + (FRAMES[name] - 1) // 4 * 4
        x = torch.from_numpy(wan_corpus["pixels"][name][:kept]).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
        with torch.inference_mode():
            want = (retrieve_latents(vae.encode(x), sample_mode="argmax") - mean) * inv_std
        np.testing.assert_allclose(row["latent"], want[0].numpy(), atol=ATOL)


def test_text_is_the_wan_pipelines_unpadded(wan_corpus):
    """The rows hold WanPipeline's prompt embeddings (its cleaning, its tokenizer call at
    max_sequence_length 512) up to its zero padding; the empty caption has 0 tokens."""
    from diffusers import WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    pipe = WanPipeline(
        tokenizer=AutoTokenizer.from_pretrained(wan_corpus["umt5"], local_files_only=True),
        text_encoder=UMT5EncoderModel.from_pretrained(wan_corpus["umt5"], local_files_only=True).eval(),
        transformer=None, vae=None, scheduler=None,
    )
    rows = _rows(wan_corpus["corpus"])
    for name in ("clip9.tif", "clip6.tif"):
        with torch.inference_mode():
            want = pipe._get_t5_prompt_embeds(CAPTIONS[name], max_sequence_length=WAN_TEXT_LENGTH,
                                              device=torch.device("cpu"))[0]
        text = rows[name]["text"]
        n = len(CAPTIONS[name].split()) + 1  # words and </s>
        assert text.shape == (n, 16) and want.shape == (WAN_TEXT_LENGTH, 16)
        np.testing.assert_allclose(text, want[:n].numpy(), atol=ATOL)
        assert not want[n:].any()  # what the corpus leaves out is the pipeline's zero padding
    assert rows["still.png"]["text"].shape == (0, 16)


def _wan_config(tmp_path: Path, corpus: Path, family: str = "wan") -> str:
    import yaml

    model = ({"family": "wan", "patch_size": [1, 2, 2], "hidden_size": 32, "num_heads": 2, "depth_single": 1,
              "in_channels": 4, "text_dim": 16, "ffn_dim": 48, "freq_dim": 32} if family == "wan" else
             {"family": "flux", "hidden_size": 32, "num_heads": 2, "rope_axes_dim": [4, 6, 6], "depth_double": 1,
              "depth_single": 1, "in_channels": 4, "text_dim": 16, "pooled_dim": 8})
    cfg = {"model": model, "data": {"corpus": str(corpus), "samples_per_step": 2},
           "balance": {"topology": "g1n1"}, "run": {"name": family, "storage": str(tmp_path / "runs")},
           "scaling": {"num_workers": 1}, "parallel": {"precision": "fp32"}}
    path = tmp_path / f"{family}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_preflight_matches_wan_and_refuses_another_family(wan_corpus, tmp_path, capsys):
    code = main(["train", "--config", _wan_config(tmp_path, wan_corpus["corpus"]), "--check"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "pooled_dim 0" in out.out
    code = main(["train", "--config", _wan_config(tmp_path, wan_corpus["corpus"], "flux"), "--check"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "made for model family wan" in err[0] and "model.family flux" in err[0], err
    # The model pads the text as the corpus was made for (512), or the check says both.
    code = main(["train", "--config", _wan_config(tmp_path, wan_corpus["corpus"]), "--set",
                 "model.text_pad_to=77", "--check"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "corpus text_pad_to=512" in err[0] and "model text_pad_to=77" in err[0], err


def test_family_wan_refuses_a_pooled_encoder_and_long_text(wan_corpus, tmp_path, capsys):
    media = wan_corpus["root"] / "media"
    base = ["ingest", "--input", str(media), "--family", "wan", "--quiet"]
    for extra, words in ((["--text-encoder", str(wan_corpus["umt5"]), "--pooled-encoder", str(wan_corpus["umt5"])],
                          "pooled"),
                         (["--max-text-tokens", "600"], "Wan's text length")):
        code = main([*base, "--out", str(tmp_path / words.replace(" ", "_")), *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and words in err[-1], err


@pytest.mark.dist
def test_one_rank_trains_two_steps_on_the_wan_corpus(wan_corpus, tmp_path):
    """The torchrun launcher (a gloo group of one, in its own process: ~20 s), 2 steps of the
    tiny Wan model on the ingested corpus."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "knapray.commands.torchrun", "--config", _wan_config(tmp_path, wan_corpus["corpus"]),
           "--set", "run.max_steps=2"]
    out = subprocess.run(cmd, cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "runs" / "wan" / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f if line.strip()]
    losses = [m["loss"] for m in steps if "loss" in m]
    assert len(losses) == 2 and all(np.isfinite(losses)), steps


def _finetune(rank: int, world: int, corpus: str, run_root: str, pretrained: str) -> list[float]:
    from dist_utils import local_trainer

    from knapray.driver.run_dir import write_config

    trainer = local_trainer(rank, world, corpus, run_root, "wan4", [
        f"model.pretrained={pretrained}", "parallel.fsdp=full", "run.max_steps=5", "balance.topology=g1n2+g2n1",
        "data.samples_per_step=1", "data.epochs=5", "optim.lr=0.003",
    ])
    if rank == 0:
        write_config(trainer.cfg)  # what a launcher's pre-flight writes: export reads it
    return [r["loss"] for r in trainer.train()["records"]]


def _lora_finetune(rank: int, world: int, corpus: str, run_root: str, pretrained: str) -> dict:
    from dist_utils import local_trainer
    from torch.distributed.tensor import DTensor

    from knapray.driver.run_dir import write_config

    trainer = local_trainer(rank, world, corpus, run_root, "wan4-lora", [
        f"model.pretrained={pretrained}", "parallel.fsdp=full", "run.max_steps=6", "balance.topology=g1n2+g2n1",
        "data.samples_per_step=1", "data.epochs=6", "optim.lr=0.03", "model.lora.rank=4",
        "model.lora.targets=[attention]",
    ])
    if rank == 0:
        write_config(trainer.cfg)

    def full():
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()
                for n, p in trainer.model.named_parameters()}

    before = full()
    losses = [r["loss_rel"] for r in trainer.train()["records"]]
    after = full()
    return {"losses": losses, "changed": sorted(n for n in before if not np.array_equal(before[n], after[n])),
            "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)}


@pytest.mark.dist
def test_finetuned_balanced_on_4_ranks_exported_and_loaded_by_diffusers(wan_corpus, tmp_path, capsys):
    """A tiny Wan saved by diffusers, fine-tuned 5 steps on 4 gloo ranks, balanced (bags of 1
    and 2: Ulysses over image queries and text keys), FSDP full, on an ingested corpus of
    clips of 5, 9 and 13 frames and still images; the loss falls; ``knapray export`` writes
    diffusers' layout, which ``WanTransformer3DModel.from_pretrained`` loads with every
    tensor trained; ``knapray sample`` makes clips of the run (Wan's shift, the Wan VAE)."""
    from diffusers import WanTransformer3DModel
    from PIL import Image

    import pyarrow.parquet as pq
    from dist_utils import run_distributed

    from knapray.corpus.writer import shard_paths

    media = tmp_path / "media"
    media.mkdir()
    rng = np.random.default_rng(1)
    items = {f"clip{i}.tif": (frames, size) for i, (frames, size) in
             enumerate([(5, (32, 48)), (9, (48, 32)), (13, (32, 32)), (9, (32, 48)), (5, (48, 48))])}
    items.update({f"still{i}.png": (1, size) for i, size in enumerate([(32, 48), (48, 32), (32, 32)])})
    for name, (frames, (h, w)) in items.items():
        images = [Image.fromarray(f) for f in rng.integers(0, 256, size=(frames, h, w, 3), dtype=np.uint8)]
        images[0].save(media / name, save_all=frames > 1, append_images=images[1:])
    (media / "metadata.jsonl").write_text("".join(json.dumps({"file_name": n, "text": f"caption {i} " * (i % 4)}) + "\n"
                                                  for i, n in enumerate(items)))
    corpus = tmp_path / "corpus"
    assert main(["ingest", "--input", str(media), "--out", str(corpus), "--vae", str(wan_corpus["vae"]),
                 "--text-encoder", str(wan_corpus["umt5"]), "--family", "wan", "--max-side", "48",
                 "--max-frames", "13", "--device", "cpu", "--quiet"]) == 0

    torch.manual_seed(0)
    pretrained = tmp_path / "pretrained"
    WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                          out_channels=4, text_dim=16, freq_dim=32, ffn_dim=48, num_layers=2).save_pretrained(pretrained)

    losses = run_distributed(_finetune, 4, str(corpus), str(tmp_path / "runs"), str(pretrained), timeout_s=300)
    print("wan 4-rank losses", losses[0])
    assert all(r == losses[0] for r in losses) and len(losses[0]) == 5, losses  # one summed loss on every rank
    assert losses[0][-1] < losses[0][0], losses[0]

    # knapray sample on the Wan run: a caption through the corpus's umT5 (cleaned as WanPipeline
    # does) and a corpus sample's text; 3 latent frames decoded by the Wan VAE into 1 + 2·4 frames.
    like = int(pq.read_table(shard_paths(corpus)[0], columns=["sample_id"])["sample_id"][0].as_py())
    capsys.readouterr()
    assert main(["sample", "--run", str(tmp_path / "runs" / "wan4"), "--caption", "caption 3 caption 3", "--like",
                 str(like), "--size", "48x32", "--frames", "3", "--steps", "2", "--out", str(tmp_path / "wan.png"),
                 "--json"]) == 0
    sampled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sampled["family"] == "wan" and sampled["shifts"] == [5.0, 5.0] and sampled["decoder"] == "DiffusersVAE"
    assert sampled["shapes"] == [[9, 32, 48, 3]] * 2 and (tmp_path / "wan.png").stat().st_size > 0

    out = tmp_path / "exported"
    assert main(["export", "--run", str(tmp_path / "runs" / "wan4"), "--out", str(out)]) == 0
    initial = WanTransformer3DModel.from_pretrained(pretrained).state_dict()
    tuned = WanTransformer3DModel.from_pretrained(out)
    changed = [k for k, v in tuned.state_dict().items() if not torch.equal(v, initial[k])]
    assert sorted(changed) == sorted(initial)  # every tensor was trained and came back

    # LoRA on the same corpus and base, 4 ranks, balanced, FSDP: only the adapters change,
    # and the exported adapters load into diffusers' Wan and change its output.
    lora = run_distributed(_lora_finetune, 4, str(corpus), str(tmp_path / "runs"), str(pretrained), timeout_s=300)[0]
    assert lora["trainable"] and all(".lora_" in n for n in lora["trainable"])
    assert set(lora["changed"]) <= set(lora["trainable"]) and any(".lora_B." in n for n in lora["changed"])
    assert np.mean(lora["losses"][-2:]) < np.mean(lora["losses"][:2]), lora["losses"]
    adapters = tmp_path / "wan-lora"
    assert main(["export", "--run", str(tmp_path / "runs" / "wan4-lora"), "--out", str(adapters), "--lora"]) == 0
    from safetensors.torch import load_file

    with_lora = WanTransformer3DModel.from_pretrained(pretrained)
    with_lora.load_lora_adapter(load_file(str(adapters / "pytorch_lora_weights.safetensors")), prefix="transformer")
    base = WanTransformer3DModel.from_pretrained(pretrained)
    x = torch.randn(1, 4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    text = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outs = [m(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)[0]
                for m in (with_lora, base)]
    assert not torch.allclose(outs[0], outs[1])
