"""``metrics.validation`` on 2 gloo ranks: samples every 2 steps and after the last, with
the EMA's weights, as PNG files in the run directory and as images TensorBoard reads back
(its own event reader), the sampling's seconds logged; a bad validation section is one
line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_utils import TINY_MMDIT, build_tiny_corpus, run_distributed

pytestmark = pytest.mark.dist

VALIDATION = ["metrics.validation.every=2", "metrics.validation.like=[1,2]",
              "metrics.validation.sizes=[32x32,64x32]", "metrics.validation.steps=2", "optim.ema_decay=0.9",
              "run.max_steps=5", "data.epochs=5", "balance.topology=g2n1"]


def _train(rank: int, world: int, corpus: str, run_root: str) -> dict:
    from dist_utils import local_trainer

    trainer = local_trainer(rank, world, corpus, run_root, "val", [*TINY_MMDIT, *VALIDATION])
    summary = trainer.train()
    return {"steps": summary["steps"], "validated": trainer.validator.last_step}


def test_validation_samples_reach_the_run_directory_and_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    corpus = build_tiny_corpus(tmp_path / "corpus", "g2b2i128f1s0,g2b1i64f1s0", steps=4)
    results = run_distributed(_train, 2, corpus, str(tmp_path / "runs"), timeout_s=240)
    assert [r["steps"] for r in results] == [5, 5] and [r["validated"] for r in results] == [4, 4]
    run = tmp_path / "runs" / "val"
    pictures = sorted(p.name for p in (run / "validation").iterdir())
    assert pictures == ["step-000001.png", "step-000003.png", "step-000004.png"]  # every 2, and the last
    assert all((run / "validation" / p).stat().st_size > 0 for p in pictures)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    assert {"validation/0", "validation/1"} <= set(events.Tags()["images"])
    shots = events.Images("validation/1")
    # the synthetic corpus records no decoder: a latent preview, 1/8 of 64x32 per side
    assert [s.step for s in shots] == [1, 3, 4] and all((s.width, s.height) == (8, 4) for s in shots)
    seconds = events.Scalars("validation/seconds")
    assert [s.step for s in seconds] == [1, 3, 4] and all(s.value > 0 for s in seconds)


def test_a_bad_validation_section_is_one_line():
    from knapray.config.run import ConfigError
    from knapray.driver.preflight import load_run_config

    with pytest.raises(ConfigError, match="validation.every > 0 needs prompts"):
        load_run_config(None, ["metrics.validation.every=10"])
    with pytest.raises(ConfigError, match=r"validation.sizes: expected WIDTHxHEIGHT such as 512x512, got 'big'"):
        load_run_config(None, ["metrics.validation.every=10", "metrics.validation.like=[1]",
                               "metrics.validation.sizes=[big]"])
