"""Wan 2.2 TI2V-5B trained image-to-video on clips' own first frames
(``flow.first_frame_share``), balanced on 2 gloo ranks: the same losses as one rank, step for
step (the clean first frames out of the loss on either), and not the text-to-video run's."""

from __future__ import annotations


import pytest

from dist_utils import run_distributed, run_metrics

pytestmark = pytest.mark.dist

TI2V = ["model.family=wan", "model.hidden_size=32", "model.num_heads=2", "model.depth_single=2", "model.text_dim=16",
        "model.ffn_dim=32", "model.freq_dim=16", "model.text_pad_to=0", "model.expand_timesteps=true",
        "data.global_batch=4", "run.max_steps=3", "balance.topology=bags_of:2"]


def _run(rank: int, world: int, corpus: str, runs: str, name: str, share: float) -> None:
    from dist_utils import local_trainer

    local_trainer(rank, world, corpus, runs, name, [*TI2V, f"flow.first_frame_share={share}"]).train()


def _losses(run_dir) -> list[float]:
    return [m["loss"] for m in run_metrics(run_dir)]


def test_ti2v_first_frames_balanced_as_one_rank(tmp_path):
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    corpus = tmp_path / "corpus"  # clips of 2 latent frames beside images
    build_synthetic(SyntheticConfig(mix="g1b2i128f9s1,g1b2i64f1s0", steps=4, scale=4, channels=4, text_dim=16,
                                    pooled_dim=0, shards=2, seed=3), corpus, progress=False)
    runs = str(tmp_path / "runs")
    run_distributed(_run, 2, str(corpus), runs, "two", 1.0, timeout_s=180)
    run_distributed(_run, 1, str(corpus), runs, "one", 1.0, timeout_s=180)
    run_distributed(_run, 1, str(corpus), runs, "t2v", 0.0, timeout_s=180)
    two, one, t2v = (_losses(tmp_path / "runs" / n) for n in ("two", "one", "t2v"))
    assert len(two) == len(one) == 3
    for a, b in zip(two, one):
        assert abs(a - b) <= 1e-5 * abs(b), (two, one)
    assert all(abs(a - b) > 1e-4 * abs(b) for a, b in zip(one, t2v)), (one, t2v)
