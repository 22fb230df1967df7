"""Wan 2.1 I2V trained from a corpus that holds each clip's conditioning latent and image
tokens (``SyntheticConfig.condition_channels`` / ``image_dim``), balanced on 2 gloo ranks: the
same losses as one rank, step for step."""

from __future__ import annotations

import math

import pytest

from dist_utils import run_distributed, run_metrics

pytestmark = pytest.mark.dist

# in_channels (4 latent + 4 condition) comes from the corpus; text padded to 512 rows as I2V needs
I2V = ["model.family=wan", "model.hidden_size=32", "model.num_heads=2", "model.depth_single=2", "model.ffn_dim=32",
       "model.freq_dim=16", "model.text_pad_to=512", "model.image_dim=8", "model.image_tokens=5",
       "model.out_channels=4", "data.global_batch=4", "run.max_steps=3", "balance.topology=bags_of:2"]


def _run(rank: int, world: int, corpus: str, runs: str, name: str) -> None:
    from dist_utils import local_trainer

    trainer = local_trainer(rank, world, corpus, runs, name, I2V)
    assert (trainer.cfg.model.in_channels, trainer.cfg.model.out_patch_dim) == (8, 16)
    trainer.train()


def _losses(run_dir) -> list[float]:
    return [m["loss"] for m in run_metrics(run_dir)]


def test_i2v_from_conditioned_corpus_balanced_as_one_rank(tmp_path):
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    corpus = tmp_path / "corpus"  # clips of 2 latent frames beside images
    build_synthetic(SyntheticConfig(mix="g1b2i128f9s1,g1b2i64f1s0", steps=4, scale=4, channels=4, text_dim=16,
                                    pooled_dim=0, shards=2, seed=3, condition_channels=4, image_dim=8,
                                    image_tokens=5), corpus, progress=False)
    runs = str(tmp_path / "runs")
    run_distributed(_run, 2, str(corpus), runs, "two", timeout_s=180)
    run_distributed(_run, 1, str(corpus), runs, "one", timeout_s=180)
    two, one = (_losses(tmp_path / "runs" / n) for n in ("two", "one"))
    assert len(two) == len(one) == 3 and all(math.isfinite(x) for x in one)
    for a, b in zip(two, one):
        assert abs(a - b) <= 1e-5 * abs(b), (two, one)
    print(f"I2V losses, 1 rank: {one}; largest relative difference on 2 ranks: "
          f"{max(abs(a - b) / abs(b) for a, b in zip(two, one)):.1e}")
