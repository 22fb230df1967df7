"""Image-to-video training data (Wan 2.1 I2V): corpus rows that hold each clip's conditioning
latent and image tokens, decoded and checked like the other payloads; batches whose image
tokens are the noised latent's features then the condition's; a text-to-video batch as it was."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from knapray.corpus import CorruptSample, decode_row, read_corpus
from knapray.corpus.synthetic import SyntheticConfig, build_synthetic
from knapray.data import StepStream, build_packed_batch, check_model_config, corpus_info, local_rows, sample_generator
from knapray.models.families.wan import WanConfig
from knapray.models.packing import pack_samples, patchify, unpatchify
from knapray.models.timesteps import TimestepDistribution

CORPUS = dict(mix="g1b2i128f9s1,g1b2i64f1s0", steps=2, scale=4, channels=4, text_dim=16, pooled_dim=0, shards=2)
TINY = dict(hidden_size=32, num_heads=2, depth_single=1, text_dim=16, ffn_dim=32, freq_dim=16)


def i2v_config(**changes) -> WanConfig:
    return WanConfig(**{**TINY, "in_channels": 8, "out_channels": 4, "image_dim": 8, "image_tokens": 5,
                        "text_pad_to": 512, **changes})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("i2v")
    build_synthetic(SyntheticConfig(**CORPUS, condition_channels=4, image_dim=8, image_tokens=5), path,
                    progress=False)
    return path


def samples_of(corpus: Path) -> list[dict]:
    stream = StepStream.for_corpus(local_rows(corpus, 0, 1), corpus_info(corpus), samples_per_step=8)
    return [s for step in stream for s in step.samples]


def test_a_corpus_without_conditioning_is_written_as_before(tmp_path: Path) -> None:
    build_synthetic(SyntheticConfig(**CORPUS), tmp_path, progress=False)
    doc = json.loads((tmp_path / "schema.json").read_text())
    assert set(doc["dims"]) == {"channels", "text_dim", "pooled_dim", "vae_downsample", "patch"}
    assert list(doc["columns"])[-1] == "pooled" and "image_dim" not in doc["config"]
    assert "condition" not in read_corpus(tmp_path).column_names
    assert all("condition" not in s and "image_context" not in s for s in samples_of(tmp_path))


def test_conditioned_rows_decode_with_their_shapes(corpus: Path, tmp_path: Path) -> None:
    info = corpus_info(corpus)
    assert (info.condition_channels, info.image_dim, info.image_tokens) == (4, 8, 5)
    samples = samples_of(corpus)
    assert len(samples) == 8
    for s in samples:
        assert s["condition"].shape == (4, *s["latent"].shape[1:]) and s["condition"].dtype == np.float32
        assert s["image_context"].shape == (5, 8)
    # the latent and text values are those of the same corpus without conditioning
    build_synthetic(SyntheticConfig(**CORPUS), tmp_path, progress=False)
    for a, b in zip(samples, samples_of(tmp_path)):
        assert np.array_equal(a["latent"], b["latent"]) and np.array_equal(a["text"], b["text"])


@pytest.mark.parametrize("change, reason", [
    (lambda r: {**r, "condition": r["condition"][:-1]}, "condition_size"),
    (lambda r: {**r, "condition_channels": 3}, "condition_size"),
    (lambda r: {**r, "image_context": r["image_context"][:-8]}, "image_context_size"),
    (lambda r: {**r, "image_tokens": 4}, "image_context_size"),
    (lambda r: {**r, "condition": None}, "missing_payload"),
    (lambda r: {**r, "image_context": None}, "missing_payload"),
    (lambda r: {k: v for k, v in r.items() if k != "condition"}, "missing_column"),
    (lambda r: {**r, "condition": [float("nan")] * len(r["condition"])}, "non_finite"),
])
def test_a_row_whose_conditioning_disagrees_is_corrupt(corpus: Path, change, reason: str) -> None:
    row = read_corpus(corpus).to_pylist()[0]
    decode_row(row, text_dim=16, pooled_dim=0, condition_channels=4, image_dim=8)
    with pytest.raises(CorruptSample) as e:
        decode_row(change(row), text_dim=16, pooled_dim=0, condition_channels=4, image_dim=8)
    assert e.value.reason == reason, e.value


def test_the_model_is_matched_against_the_corpus_conditioning_in_one_line(corpus: Path) -> None:
    info = corpus_info(corpus)
    check_model_config(info, i2v_config())
    check_model_config(info, WanConfig(**TINY, in_channels=4, text_pad_to=0))  # text-to-video: conditioning unread
    for bad in (i2v_config(in_channels=12, out_channels=4), i2v_config(image_dim=16), i2v_config(image_tokens=6),
                i2v_config(out_channels=0, in_channels=8, image_dim=8)):
        with pytest.raises(ValueError, match="image-to-video conditioning: corpus latent channels 4 \\+ condition "
                                             "channels 4 = 8, image_dim 8 \\(5 tokens\\); model in_channels") as e:
            check_model_config(info, bad)
        assert "\n" not in str(e.value)


def test_a_run_config_takes_in_channels_from_the_corpus_with_its_condition(corpus: Path, tmp_path: Path) -> None:
    from knapray.driver.preflight import load_run_config

    sets = [f"data.corpus={corpus}", f"run.storage={tmp_path}", "model.family=wan", *(
        f"model.{k}={v}" for k, v in TINY.items() if k != "text_dim")]
    assert load_run_config(None, sets).model.in_channels == 4
    i2v = load_run_config(None, [*sets, "model.image_dim=8", "model.image_tokens=5", "model.out_channels=4"])
    assert (i2v.model.in_channels, i2v.model.text_dim) == (8, 16)
    check_model_config(corpus_info(corpus), i2v.model)


def _t2v_as_before(samples, cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A text-to-video batch as build_packed_batch made it before conditioning: per sample its
    time then its noise (n, patch_dim) from its generator, x_t = (1-t)·x0 + t·noise."""
    packed, noises = [], []
    for s in samples:
        gen = sample_generator(seed, 0, s["sample_id"])
        latent = torch.from_numpy(np.array(s["latent"]))
        tokens = patchify(latent, cfg.patch_size)[0]
        t = float(TimestepDistribution().sample(1, generator=gen, image_tokens=tokens.shape[0])[0])
        noises.append(torch.randn(tokens.shape, generator=gen))
        packed.append({"latent": latent, "text": torch.from_numpy(np.array(s["text"])), "timestep": t})
    clean = pack_samples(packed, cfg)
    noise = torch.cat(noises)
    t = clean.timesteps[clean.image_seq_index][:, None]
    return (1 - t) * clean.x_img + t * noise, noise - clean.x_img, clean.timesteps


def test_x_img_is_the_patchified_noised_latent_then_condition_and_t2v_is_unchanged(corpus: Path) -> None:
    samples = samples_of(corpus)
    t2v_cfg = WanConfig(**TINY, in_channels=4, text_pad_to=0)
    t2v = build_packed_batch(samples, t2v_cfg, seed=7)
    x_t, target, times = _t2v_as_before(samples, t2v_cfg, seed=7)
    assert torch.equal(t2v.x_img, x_t) and torch.equal(t2v.targets, target) and torch.equal(t2v.timesteps, times)
    assert t2v.image_context is None

    cfg = i2v_config()
    i2v = build_packed_batch(samples, cfg, seed=7)
    assert i2v.x_img.shape == (t2v.x_img.shape[0], cfg.patch_dim) and i2v.targets.shape[1] == cfg.out_patch_dim == 16
    assert torch.equal(i2v.targets, t2v.targets) and torch.equal(i2v.timesteps, t2v.timesteps)
    assert i2v.image_context.shape == (8, 5, 8)
    img_seq = i2v.image_seq_index
    for i, s in enumerate(samples):
        grid = i2v.grids[i]
        noised = unpatchify(t2v.x_img[img_seq == i], grid, cfg.patch_size, 4)  # (4, T, H, W)
        whole = torch.cat((noised, torch.from_numpy(np.array(s["condition"]))))  # (8, T, H, W)
        assert torch.equal(i2v.x_img[img_seq == i], patchify(whole, cfg.patch_size)[0])
        assert torch.equal(i2v.image_context[i], torch.from_numpy(np.array(s["image_context"])))


def test_an_empty_i2v_batch_carries_an_empty_image_context() -> None:
    cfg = i2v_config()
    batch = build_packed_batch([], cfg, seed=0)
    assert batch.image_context.shape == (0, 5, 8)
    assert batch.x_img.shape == (0, cfg.patch_dim) and batch.targets.shape == (0, cfg.out_patch_dim)


def test_a_sample_without_the_conditioning_the_model_needs_is_named(corpus: Path) -> None:
    sample = samples_of(corpus)[0]
    with pytest.raises(ValueError, match="no conditioning latent"):
        build_packed_batch([{k: v for k, v in sample.items() if k != "condition"}], i2v_config(), seed=0)
    with pytest.raises(ValueError, match="image tokens"):
        build_packed_batch([{k: v for k, v in sample.items() if k != "image_context"}], i2v_config(), seed=0)


def test_schema_json_conditioning_dims_are_checked_and_shards_must_hold_their_columns(corpus: Path,
                                                                                     tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from knapray.corpus.schema import schema_doc_problem
    from knapray.data import check_shards

    doc = json.loads((corpus / "schema.json").read_text())
    assert schema_doc_problem(doc) is None
    for dims, needle in (({"image_tokens": None}, "dims.image_tokens is null"),
                         ({"condition_channels": "4"}, "dims.condition_channels is a str"),
                         ({"image_dim": 0}, "not both given")):
        assert needle in schema_doc_problem({**doc, "dims": {**doc["dims"], **dims}})
    # a shard without the condition columns that schema.json records is left out, named
    for shard in sorted(corpus.glob("part-*.parquet")):
        pq.write_table(pq.read_table(shard).drop_columns(["condition_channels", "condition"]), tmp_path / shard.name)
    (tmp_path / "schema.json").write_text(json.dumps(doc))
    good, bad = check_shards(tmp_path)
    assert not good and all("condition" in b.reason for b in bad)
