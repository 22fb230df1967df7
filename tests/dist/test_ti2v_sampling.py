"""Wan 2.2 TI2V (``model.expand_timesteps``) sampled from a conditioning image: ``knapray sample
--image``, on a tiny TI2V Wan (a diffusers ``WanTransformer3DModel`` fine-tuned 2 steps on an
ingested corpus of the tiny ``AutoencoderKLWan``, image-to-video on half its clips):

- the latents are diffusers' ``WanImageToVideoPipeline``'s on the run's export (a pipeline
  folder whose model_index.json says ``expand_timesteps``: ``from_pretrained`` reads it), from
  the same noise, embeddings and image (resized as its ``video_processor`` does), guided, on
  knapray's Euler schedule; the first latent frame is the image's normalized latent;
- without ``--image`` the clip is ``WanPipeline``'s from the same export (every token at t);
- the export of a run without a time per token is a model folder, no model_index.json;
- ``--world-size 2`` (a bag of 2: Ulysses and CFG parallel) is one process's sample;
- the gang's loop is the single-process sampler's with conditioned and plain jobs in one bag;
- ``--image`` is refused in one line for a run without a time per token, for a file that is no
  image, with one latent frame; a served request's ``image`` is base64, checked as the flag is.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

import tiny_encoders as te
from dist_utils import run_distributed
from needs import needs
from test_experts_sampling import _euler_scheduler

pytestmark = [pytest.mark.dist, needs("diffusers")]

SIZE, FRAMES, STEPS, GUIDANCE, SEED = "48x32", 3, 4, 3.0, 5
TI2V = ["model.family=wan", "model.expand_timesteps=true", "flow.first_frame_share=0.5",
        "data.global_batch=2", "run.max_steps=2", "balance.topology=g1n1", "optim.lr=0.003"]


def _train(rank: int, world: int, corpus: str, runs: str, pretrained: str) -> None:
    from dist_utils import local_trainer

    from knapray.driver.run_dir import write_config

    trainer = local_trainer(rank, world, corpus, runs, "ti2v", [*TI2V, f"model.pretrained={pretrained}"])
    write_config(trainer.cfg)  # what a launcher's pre-flight writes: sample and export read it
    trainer.train()


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory):
    """The run, its corpus's VAE, a corpus sample id (``--like``) and a conditioning image of
    another size than the samples' (64x40: resized to 48x32)."""
    import pyarrow.parquet as pq
    from diffusers import WanTransformer3DModel
    from PIL import Image

    from knapray.cli import main
    from knapray.corpus import shard_paths
    from knapray.corpus.unconditional import KEY

    root = tmp_path_factory.mktemp("ti2v")
    vae, media = te.save_wan(root / "vae"), root / "media"
    media.mkdir()
    rng = np.random.default_rng(2)
    for name, frames in (("clip0.tif", 9), ("clip1.tif", 9), ("still.png", 1)):
        images = [Image.fromarray(f) for f in rng.integers(0, 256, size=(frames, 32, 48, 3), dtype=np.uint8)]
        images[0].save(media / name, save_all=frames > 1, append_images=images[1:])
    (media / "metadata.jsonl").write_text("".join(json.dumps({"file_name": n, "text": f"caption {i}"}) + "\n"
                                                  for i, n in enumerate(("clip0.tif", "clip1.tif", "still.png"))))
    corpus = root / "corpus"  # the tiny Wan VAE; the hash text stand-in (16 wide, no pooled vector, padded to 512)
    assert main(["ingest", "--input", str(media), "--out", str(corpus), "--vae", str(vae), "--family", "wan",
                 "--text-dim", "16", "--max-side", "48", "--max-frames", "9", "--device", "cpu", "--quiet"]) == 0
    schema = json.loads((corpus / "schema.json").read_text())  # what --guidance guides against: 3 tokens
    schema[KEY] = {"caption": "", "text": rng.standard_normal((3, 16)).tolist(), "pooled": []}
    (corpus / "schema.json").write_text(json.dumps(schema))
    torch.manual_seed(0)
    pretrained = root / "pretrained"
    WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                          out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2).save_pretrained(pretrained)
    run_distributed(_train, 1, str(corpus), str(root / "runs"), str(pretrained), timeout_s=180)
    like = int(pq.read_table(shard_paths(str(corpus))[0], columns=["sample_id"])["sample_id"][0].as_py())
    y, x = np.mgrid[0:40, 0:64]
    picture = np.stack([x * 4, y * 6, (x + y) * 2], axis=-1).astype(np.uint8)  # smooth: Lanczos rings little
    Image.fromarray(picture).save(root / "first.png")
    return {"run": str(root / "runs" / "ti2v"), "vae": str(vae), "like": like, "image": str(root / "first.png"),
            "root": root}


def _sample(ti2v, out, *extra: str) -> np.ndarray:
    from knapray.cli import main

    out.mkdir()
    assert main(["sample", "--run", ti2v["run"], "--like", str(ti2v["like"]), "--size", SIZE, "--frames", str(FRAMES),
                 "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--seed", str(SEED), "--out",
                 str(out / "grid.png"), "--latents", str(out / "latents.npz"), *extra]) == 0
    return np.load(out / "latents.npz")["request_0"]


def _padded(text: np.ndarray) -> torch.Tensor:
    """(1, 512, 16): the embeddings with WanPipeline's zero rows (the corpus's text_pad_to)."""
    from knapray.models.families.wan import TEXT_LENGTH

    return torch.as_tensor(np.pad(text, ((0, TEXT_LENGTH - len(text)), (0, 0))))[None]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_knapray_sample_from_an_image_is_wan_image_to_video_pipeline(ti2v, tmp_path, capsys):
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline
    from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents
    from PIL import Image

    from knapray.cli import main
    from knapray.corpus.unconditional import unconditional_embeddings
    from knapray.driver.run_dir import read_run_config
    from knapray.inference.conditioning import corpus_text
    from knapray.models.families.wan import SAMPLE_SHIFT
    from knapray.models.sampling import job_noise

    ours = _sample(ti2v, tmp_path / "one", "--image", ti2v["image"], "--json")
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["images"] == [ti2v["image"]] and report["shapes"] == [[1 + 4 * (FRAMES - 1), 32, 48, 3]]
    plain = _sample(ti2v, tmp_path / "plain")

    cfg = read_run_config(ti2v["run"])
    exported = tmp_path / "exported"  # a pipeline folder: transformer/ and model_index.json
    assert main(["export", "--run", ti2v["run"], "--out", str(exported)]) == 0
    assert json.loads((exported / "model_index.json").read_text())["expand_timesteps"] is True
    vae = AutoencoderKLWan.from_pretrained(ti2v["vae"]).eval()
    parts = dict(tokenizer=None, text_encoder=None, vae=vae)
    i2v = WanImageToVideoPipeline.from_pretrained(exported, image_encoder=None, image_processor=None,
                                                  scheduler=_euler_scheduler(SAMPLE_SHIFT), **parts)
    t2v = WanPipeline.from_pretrained(exported, scheduler=_euler_scheduler(SAMPLE_SHIFT), **parts)
    assert i2v.config.expand_timesteps is True and t2v.config.expand_timesteps is True
    assert t2v.config.boundary_ratio is None and t2v.transformer_2 is None
    w, h = (int(v) for v in SIZE.split("x"))
    (noise,) = job_noise(cfg.model, [(FRAMES, h // 8, w // 8)], SEED)
    text, _ = corpus_text(cfg.data.corpus, ti2v["like"], 16, 0)
    uncond, _ = unconditional_embeddings(cfg.data.corpus, 16, 0)
    call = dict(prompt_embeds=_padded(text), negative_prompt_embeds=_padded(uncond),
                guidance_scale=GUIDANCE, height=h, width=w, num_frames=4 * (FRAMES - 1) + 1,
                num_inference_steps=STEPS, latents=torch.as_tensor(noise)[None], output_type="latent")
    image = Image.open(ti2v["image"])
    with torch.no_grad():
        want = i2v(image=image, **call).frames[0].numpy()
        x = i2v.video_processor.preprocess(image, height=h, width=w)[:, :, None]  # (1, 3, 1, H, W)
        z = retrieve_latents(vae.encode(x), sample_mode="argmax")
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
    latent = ((z - mean) / std)[0].numpy()  # (4, 1, h, w): the image's normalized latent
    assert ours.shape == want.shape == noise.shape == (4, FRAMES, h // 8, w // 8)
    err = _rel(ours, want)
    first = float(np.abs(ours[:, :1] - latent).max())
    print(f"knapray sample --image against WanImageToVideoPipeline.from_pretrained(export): {err:.1e} relative; "
          f"first frame against the image's latent: {first:.1e}")
    assert err <= 1e-5, err
    assert first <= 1e-5 and _rel(want[:, :1], latent) <= 1e-6, first  # the pipeline's first frame is its condition
    # what the test tells apart: the image conditions the other frames
    apart = _rel(plain[:, 1:], ours[:, 1:])
    print(f"frames after the first, with the image against without: {apart:.1e} relative")
    assert apart > 100 * max(err, 1e-6), apart

    # without --image every token is at the step's time: WanPipeline's text to video of TI2V
    with torch.no_grad():
        want_plain = t2v(**call).frames[0].numpy()
    plain_err = _rel(plain, want_plain)
    print(f"knapray sample (no image) against WanPipeline.from_pretrained(export): {plain_err:.1e} relative")
    assert plain_err <= 1e-5, plain_err

    gang = _sample(ti2v, tmp_path / "two", "--image", ti2v["image"], "--world-size", "2", "--topology", "g2n1")
    gang_err = _rel(gang, ours)
    print(f"knapray sample --image --world-size 2 against one process: {gang_err:.1e} relative")
    assert gang_err <= 1e-5 and np.array_equal(gang[:, :1], ours[:, :1]), gang_err


def test_a_run_without_a_time_per_token_exports_a_model_folder(ti2v, tmp_path):
    """The run's weights under ``model.expand_timesteps: false`` (how Wan 2.2 T2V calls the
    same transformer): a model folder as ever, no model_index.json saying expand_timesteps;
    its tensors are those of the TI2V export's transformer/."""
    import shutil

    from diffusers import WanTransformer3DModel

    from knapray.cli import main

    run = tmp_path / "runs" / "t2v"
    shutil.copytree(ti2v["run"], run)
    doc = json.loads((run / "config.json").read_text())
    assert doc["model"]["expand_timesteps"] is True
    doc["model"]["expand_timesteps"], doc["flow"]["first_frame_share"] = False, 0.0  # the share needs a time per token
    (run / "config.json").write_text(json.dumps(doc))
    for name, source in (("t2v", run), ("ti2v", ti2v["run"])):
        assert main(["export", "--run", str(source), "--out", str(tmp_path / name), "--json"]) == 0
    assert not (tmp_path / "t2v" / "model_index.json").exists() and (tmp_path / "t2v" / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "ti2v").iterdir()) == ["model_index.json", "transformer"]
    plain = WanTransformer3DModel.from_pretrained(tmp_path / "t2v").state_dict()
    ti2v_weights = WanTransformer3DModel.from_pretrained(tmp_path / "ti2v", subfolder="transformer").state_dict()
    assert plain.keys() == ti2v_weights.keys() and all(torch.equal(plain[k], ti2v_weights[k]) for k in plain)


def test_a_bag_of_conditioned_and_plain_jobs_is_the_single_process_sampler(ti2v):
    """``denoise_local`` (the gang's loop: segments, per-pass first-frame times, held rows)
    against ``sample_latents`` with first frames, guided and not, conditioned and not."""
    from knapray.driver.trained import load_weights, read_run
    from knapray.models.sampling import denoise_job, job_noise, sample_latents
    from knapray.worker.denoise import denoise_local

    cfg, ckpt = read_run(ti2v["run"])
    model, _ = load_weights(cfg, ckpt)
    rng = np.random.default_rng(4)
    jobs, refs = [], []
    for k, (shape, guidance, conditioned) in enumerate((((3, 4, 6), 3.0, True), ((2, 6, 4), 1.0, False),
                                                        ((2, 4, 4), 1.0, True), ((3, 4, 6), 2.0, False))):
        (noise,) = job_noise(cfg.model, [shape], [k])
        cond = (rng.standard_normal((3, 16)).astype(np.float32), np.zeros(0, np.float32))
        uncond = (rng.standard_normal((2, 16)).astype(np.float32), np.zeros(0, np.float32))
        first = rng.standard_normal((4, 1, *shape[1:])).astype(np.float32) if conditioned else None
        jobs.append(denoise_job(cfg.model, noise, cond, steps=2 + k % 2, guidance=guidance, shift=None,
                                unconditional=uncond, first_frame=first))
        (ref,) = sample_latents(model, [cond], [shape], steps=2 + k % 2, seed=k, guidance=guidance, shift=None,
                                unconditional=uncond, first_frames=[first])
        refs.append((ref, first))
    for got, (ref, first) in zip(denoise_local(model, jobs), refs):
        assert _rel(got, ref) <= 1e-5, _rel(got, ref)
        if first is not None:
            assert np.array_equal(got[:, :1], first) and np.array_equal(ref[:, :1], first)


def _one_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_image_refused_in_one_line_before_anything_loads(ti2v, tmp_path, monkeypatch, capsys):
    import knapray.driver.gang as gang
    import knapray.driver.trained as trained
    from dist_utils import sampling_run_dir

    from knapray.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before --image was checked")

    monkeypatch.setattr(gang, "sample_local", refuse)
    monkeypatch.setattr(trained, "load_weights", refuse)
    base = ["sample", "--run", ti2v["run"], "--like", str(ti2v["like"]), "--size", SIZE, "--out",
            str(tmp_path / "g.png")]
    (tmp_path / "t2i").mkdir()
    t2i = sampling_run_dir(tmp_path / "t2i")  # an MMDiT run: one time per sequence
    line = _one_line(capsys, main(["sample", "--run", str(t2i), "--caption", "a", "--frames", "3", "--image",
                                   ti2v["image"], "--out", str(tmp_path / "g.png")]))
    assert "--image" in line and "model.expand_timesteps is false" in line, line
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    for path, words in ((text, "not an image that can be read"), (tmp_path / "missing.png", "cannot be read")):
        line = _one_line(capsys, main([*base, "--frames", "3", "--image", str(path)]))
        assert f"--image {path}" in line and words in line, line
    line = _one_line(capsys, main([*base, "--image", ti2v["image"]]))  # one latent frame: the image alone
    assert "give frames 2 or more" in line, line
    line = _one_line(capsys, main([*base, "--frames", "3", "--like", str(ti2v["like"]), "--like", "0",
                                   "--image", ti2v["image"], "--image", ti2v["image"]]))
    assert "2 --image values and 3 requests" in line, line


def test_a_served_request_takes_a_base64_image(ti2v):
    """``POST /v1/generate``'s ``image``: base64 of a PNG or JPEG, checked as ``--image`` is."""
    from knapray.driver.serving import parse_job
    from knapray.driver.trained import read_run
    from knapray.inference.jobs import RunRules, run_rules

    rules = run_rules(read_run(ti2v["run"])[0])
    assert rules.first_frame and rules.image_encoder
    with open(ti2v["image"], "rb") as f:
        png = f.read()
    body = {"like": ti2v["like"], "size": SIZE, "frames": FRAMES, "image": base64.b64encode(png).decode()}
    job, _ = parse_job(body, rules)
    assert job.image == png and "image" not in repr(job)
    for doc, words in (({**body, "image": "no base64!"}, "image: not base64"),
                       ({**body, "image": base64.b64encode(b"GIF89a").decode()}, "image: not an image that can be read"),
                       ({**body, "image": 7}, "image: a JSON int"),
                       ({**body, "frames": 1}, "image: the image is the first latent frame; give frames 2 or more")):
        with pytest.raises(ValueError, match=words):
            parse_job(doc, rules)
    with pytest.raises(ValueError, match="image: this run's model takes no conditioning image"):
        parse_job(body, RunRules(down=8, patch=(2, 2), text_encoder=False))
