"""Wan 2.1 I2V (``model.image_dim``) sampled from a conditioning image: ``knapray sample --image``,
on a tiny I2V Wan (a diffusers ``WanTransformer3DModel`` with image_dim, fine-tuned 1 step on a
corpus ingested with the tiny ``AutoencoderKLWan`` and ``CLIPVisionModel`` of a pipeline folder:
vae/, image_encoder/, image_processor/, transformer/):

- the latents are diffusers' ``WanImageToVideoPipeline``'s on the run's export, from the same
  noise, embeddings and image (another size than the sample's: resized for the VAE, as given
  to CLIP), guided, on knapray's Euler schedule; the image encoder the corpus records, or
  ``--image-encoder`` / ``--image-processor``;
- ``--world-size 2`` (a bag of 2: Ulysses and CFG parallel) is one process's sample;
- the gang's loop is the single-process sampler's with guided and plain jobs in one bag;
- no ``--image`` for an I2V run, ``--image`` for a text-only run, an unreadable image, an
  unknown or unfit image encoder: one line, exit 2, before anything loads; a served request
  without ``image`` is refused as the flag is.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import tiny_encoders as te
from dist_utils import run_distributed
from needs import needs
from test_experts_sampling import _euler_scheduler
from test_ti2v_sampling import _one_line, _padded

pytestmark = [pytest.mark.dist, needs("diffusers", "transformers")]

SIZE, FRAMES, STEPS, GUIDANCE, SEED = "48x32", 2, 3, 3.0, 5
ATOL = 1e-5
I2V = ["model.family=wan", "model.image_tokens=5", "data.global_batch=2", "run.max_steps=1",
       "balance.topology=g1n1", "optim.lr=0.003"]


def _train(rank: int, world: int, corpus: str, runs: str, pretrained: str) -> None:
    from dist_utils import local_trainer

    from knapray.driver.run_dir import write_config

    trainer = local_trainer(rank, world, corpus, runs, "i2v", [*I2V, f"model.pretrained={pretrained}"])
    assert (trainer.cfg.model.in_channels, trainer.cfg.model.image_dim) == (12, 8)  # 4 latent + 4 mask + 4 image
    write_config(trainer.cfg)  # what a launcher's pre-flight writes: sample and export read it
    trainer.train()


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    """The run, its pipeline folder, a corpus sample id (``--like``) and a conditioning image
    of another size than the samples' (64x40: resized to 48x32 for the VAE)."""
    import pyarrow.parquet as pq
    from diffusers import WanTransformer3DModel
    from PIL import Image

    from knapray.cli import main
    from knapray.corpus import shard_paths
    from knapray.corpus.unconditional import KEY

    root = tmp_path_factory.mktemp("i2v")
    pipe = root / "pipe"  # the layout of Wan2.1-I2V-14B-480P-Diffusers
    te.save_wan(pipe / "vae")
    te.save_clip_vision(pipe / "image_encoder")
    (pipe / "image_processor").mkdir()
    shutil.move(pipe / "image_encoder" / "preprocessor_config.json", pipe / "image_processor")
    torch.manual_seed(0)
    WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=12,
                          out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, image_dim=8,
                          added_kv_proj_dim=32).save_pretrained(pipe / "transformer")
    media = root / "media"
    media.mkdir()
    rng = np.random.default_rng(2)
    for name, frames in (("clip0.tif", 5), ("clip1.tif", 5)):
        images = [Image.fromarray(f) for f in rng.integers(0, 256, size=(frames, 32, 48, 3), dtype=np.uint8)]
        images[0].save(media / name, save_all=True, append_images=images[1:])
    (media / "metadata.jsonl").write_text("".join(json.dumps({"file_name": n, "text": f"caption {i}"}) + "\n"
                                                  for i, n in enumerate(("clip0.tif", "clip1.tif"))))
    corpus = root / "corpus"  # the hash text stand-in (16 wide, no pooled vector, padded to 512)
    assert main(["ingest", "--input", str(media), "--out", str(corpus), "--vae", str(pipe / "vae"), "--family", "wan",
                 "--text-dim", "16", "--max-side", "48", "--max-frames", "5", "--device", "cpu", "--quiet",
                 "--image-encoder", str(pipe / "image_encoder"),
                 "--image-processor", str(pipe / "image_processor")]) == 0
    schema = json.loads((corpus / "schema.json").read_text())  # what --guidance guides against: 3 tokens
    schema[KEY] = {"caption": "", "text": rng.standard_normal((3, 16)).tolist(), "pooled": []}
    (corpus / "schema.json").write_text(json.dumps(schema))
    run_distributed(_train, 1, str(corpus), str(root / "runs"), str(pipe / "transformer"), timeout_s=180)
    like = int(pq.read_table(shard_paths(str(corpus))[0], columns=["sample_id"])["sample_id"][0].as_py())
    y, x = np.mgrid[0:40, 0:64]
    picture = np.stack([x * 4, y * 6, (x + y) * 2], axis=-1).astype(np.uint8)  # smooth: Lanczos rings little
    Image.fromarray(picture).save(root / "first.png")
    return {"run": str(root / "runs" / "i2v"), "pipe": pipe, "corpus": corpus, "like": like,
            "image": str(root / "first.png"), "root": root}


def _sample(i2v, out, *extra: str) -> np.ndarray:
    from knapray.cli import main

    out.mkdir()
    assert main(["sample", "--run", i2v["run"], "--like", str(i2v["like"]), "--size", SIZE, "--frames", str(FRAMES),
                 "--steps", str(STEPS), "--guidance", str(GUIDANCE), "--seed", str(SEED), "--out",
                 str(out / "grid.png"), "--latents", str(out / "latents.npz"), *extra]) == 0
    return np.load(out / "latents.npz")["request_0"]


def _gap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def test_knapray_sample_from_an_image_is_wan_image_to_video_pipeline(i2v, tmp_path, capsys):
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPVisionModel

    from knapray.cli import main
    from knapray.corpus.unconditional import unconditional_embeddings
    from knapray.driver.run_dir import read_run_config
    from knapray.inference.conditioning import corpus_text
    from knapray.models.families.wan import SAMPLE_SHIFT
    from knapray.models.sampling import job_noise

    ours = _sample(i2v, tmp_path / "one", "--image", i2v["image"], "--json")
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["images"] == [i2v["image"]] and report["shapes"] == [[1 + 4 * (FRAMES - 1), 32, 48, 3]]

    cfg = read_run_config(i2v["run"])
    assert main(["export", "--run", i2v["run"], "--out", str(tmp_path / "exported")]) == 0
    pipe = i2v["pipe"]
    i2v_pipe = WanImageToVideoPipeline(
        tokenizer=None, text_encoder=None, scheduler=_euler_scheduler(SAMPLE_SHIFT),
        transformer=WanTransformer3DModel.from_pretrained(tmp_path / "exported"),
        vae=AutoencoderKLWan.from_pretrained(pipe / "vae").eval(),
        image_encoder=CLIPVisionModel.from_pretrained(pipe / "image_encoder").eval(),
        image_processor=CLIPImageProcessor.from_pretrained(pipe / "image_processor"))
    w, h = (int(v) for v in SIZE.split("x"))
    (noise,) = job_noise(cfg.model, [(FRAMES, h // 8, w // 8)], SEED)
    text, _ = corpus_text(cfg.data.corpus, i2v["like"], 16, 0)
    uncond, _ = unconditional_embeddings(cfg.data.corpus, 16, 0)
    with torch.no_grad():
        want = i2v_pipe(image=Image.open(i2v["image"]), prompt_embeds=_padded(text),
                        negative_prompt_embeds=_padded(uncond), guidance_scale=GUIDANCE, height=h, width=w,
                        num_frames=4 * (FRAMES - 1) + 1, num_inference_steps=STEPS,
                        latents=torch.as_tensor(noise)[None], output_type="latent").frames[0].numpy()
    assert ours.shape == want.shape == noise.shape == (4, FRAMES, h // 8, w // 8)
    err = _gap(ours, want)
    print(f"knapray sample --image (Wan 2.1 I2V) against WanImageToVideoPipeline: {err:.1e} max abs "
          f"(latents up to {np.abs(want).max():.1f})")
    assert err <= ATOL, err
    # what the test tells apart: the image conditions the sample
    other = tmp_path / "other.png"
    Image.fromarray(np.asarray(Image.open(i2v["image"]))[::-1].copy()).save(other)
    flipped = _sample(i2v, tmp_path / "flipped", "--image", str(other))
    print(f"the image flipped upside down moves the sample by {_gap(flipped, ours):.1e}")
    assert _gap(flipped, ours) > 100 * max(err, 1e-7)

    # the encoder given by flag (here the same as the corpus's record): the same sample
    flagged = _sample(i2v, tmp_path / "flag", "--image", i2v["image"], "--image-encoder", str(pipe / "image_encoder"),
                      "--image-processor", str(pipe / "image_processor"))
    assert np.array_equal(flagged, ours)

    gang = _sample(i2v, tmp_path / "two", "--image", i2v["image"], "--world-size", "2", "--topology", "g2n1")
    gang_err, gang_want = _gap(gang, ours), _gap(gang, want)
    print(f"knapray sample --image --world-size 2 against one process: {gang_err:.1e} max abs; against "
          f"WanImageToVideoPipeline: {gang_want:.1e}")
    assert gang_err <= ATOL and gang_want <= ATOL, (gang_err, gang_want)


def test_a_bag_of_guided_and_plain_i2v_jobs_is_the_single_process_sampler(i2v):
    """``denoise_local`` (the gang's loop: condition features after the latent rows on every
    pass, image tokens on both guided passes) against ``sample_latents`` with conditions."""
    from knapray.driver.trained import load_weights, read_run
    from knapray.models.sampling import denoise_job, job_noise, sample_latents
    from knapray.worker.denoise import denoise_local

    cfg, ckpt = read_run(i2v["run"])
    model, _ = load_weights(cfg, ckpt)
    rng = np.random.default_rng(4)
    jobs, refs = [], []
    for k, (shape, guidance) in enumerate((((2, 4, 6), 3.0), ((1, 6, 4), 1.0), ((3, 4, 4), 2.0))):
        (noise,) = job_noise(cfg.model, [shape], [k])
        cond = (rng.standard_normal((3, 16)).astype(np.float32), np.zeros(0, np.float32))
        uncond = (rng.standard_normal((2, 16)).astype(np.float32), np.zeros(0, np.float32))
        given = (rng.standard_normal((8, *shape)).astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32))
        jobs.append(denoise_job(cfg.model, noise, cond, steps=2 + k % 2, guidance=guidance, shift=None,
                                unconditional=uncond, condition=given[0], image_context=given[1]))
        (ref,) = sample_latents(model, [cond], [shape], steps=2 + k % 2, seed=k, guidance=guidance, shift=None,
                                unconditional=uncond, conditions=[given])
        refs.append(ref)
    worst = max(_gap(got, ref) for got, ref in zip(denoise_local(model, jobs), refs))
    print(f"the bag loop against sample_latents, 3 I2V jobs (2 guided): {worst:.1e} max abs")
    assert worst <= ATOL, worst
    with pytest.raises(ValueError, match="conditioning channels"):
        denoise_job(cfg.model, noise, cond, steps=2, guidance=1.0, shift=None, unconditional=None)


def test_bad_input_refused_in_one_line_before_anything_loads(i2v, tmp_path, monkeypatch, capsys):
    import knapray.driver.gang as gang
    import knapray.driver.trained as trained
    from dist_utils import sampling_run_dir

    from knapray.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the arguments were checked")

    monkeypatch.setattr(gang, "sample_local", refuse)
    monkeypatch.setattr(trained, "load_weights", refuse)
    base = ["sample", "--run", i2v["run"], "--like", str(i2v["like"]), "--size", SIZE, "--frames", str(FRAMES),
            "--out", str(tmp_path / "g.png")]
    line = _one_line(capsys, main(base))
    assert "--image" in line and "samples from a conditioning image" in line, line
    (tmp_path / "t2i").mkdir()
    t2i = sampling_run_dir(tmp_path / "t2i")  # an MMDiT run: no image
    line = _one_line(capsys, main(["sample", "--run", str(t2i), "--caption", "a", "--frames", "3", "--image",
                                   i2v["image"], "--out", str(tmp_path / "g.png")]))
    assert "--image" in line and "takes no conditioning image" in line, line
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    for path, words in ((text, "not an image that can be read"), (tmp_path / "missing.png", "cannot be read")):
        line = _one_line(capsys, main([*base, "--image", str(path)]))
        assert f"--image {path}" in line and words in line, line
    vae = str(i2v["pipe"] / "vae")
    line = _one_line(capsys, main([*base, "--image", i2v["image"], "--image-encoder", vae]))
    assert f"--image-encoder {vae}" in line and "is not a CLIP vision model" in line, line
    encoder = str(i2v["pipe"] / "image_encoder")
    line = _one_line(capsys, main([*base, "--image", i2v["image"], "--image-encoder", encoder]))
    assert f"--image-encoder {encoder}" in line and "--image-processor" in line, line  # the processor is apart

    # a corpus that records no image encoder: the flag, or one line naming it
    corpus = tmp_path / "bare_corpus"
    shutil.copytree(i2v["corpus"], corpus)
    schema = json.loads((corpus / "schema.json").read_text())
    del schema["encoders"]["image"]
    (corpus / "schema.json").write_text(json.dumps(schema))
    run = tmp_path / "bare_run"
    shutil.copytree(i2v["run"], run)
    config = json.loads((run / "config.json").read_text())
    config["data"]["corpus"] = str(corpus)
    (run / "config.json").write_text(json.dumps(config))
    line = _one_line(capsys, main(["sample", "--run", str(run), *base[3:], "--image", i2v["image"]]))
    assert "--image" in line and "records no image encoder" in line and "--image-encoder DIR" in line, line


def test_a_served_request_needs_an_image(i2v):
    """``POST /v1/generate`` for an I2V run: ``image`` is required, checked as ``--image`` is."""
    import base64

    from knapray.driver.serving import parse_job
    from knapray.driver.trained import read_run
    from knapray.inference.jobs import run_rules

    rules = run_rules(read_run(i2v["run"])[0])
    assert rules.condition and rules.vision_encoder and rules.image_encoder
    with open(i2v["image"], "rb") as f:
        png = f.read()
    body = {"like": i2v["like"], "size": SIZE, "frames": 1, "image": base64.b64encode(png).decode()}
    job, _ = parse_job(body, rules)  # one latent frame: the image and the model's frame from it
    assert job.image == png
    with pytest.raises(ValueError, match="image: this run's model \\(Wan 2.1 I2V"):
        parse_job({k: v for k, v in body.items() if k != "image"}, rules)
