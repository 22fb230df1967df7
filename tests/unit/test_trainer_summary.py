"""What ``Trainer.train`` hands the driver: the newest ``RECORDS_RETURNED`` step records
(metrics.jsonl keeps every step's; summary.json is computed from it), and the steps per
topology over the whole run, so nothing the trainer holds grows with a run's length."""

from __future__ import annotations

import json

from dist_utils import TINY_MMDIT, build_tiny_corpus, local_trainer


def test_train_returns_the_newest_records_and_counts_every_step(tmp_path, monkeypatch):
    import knapray.train.trainer as trainer_module

    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b2i64f1s0", steps=5, seed=3)
    monkeypatch.setattr(trainer_module, "RECORDS_RETURNED", 2)
    trainer = local_trainer(0, 1, corpus, str(tmp_path / "runs"), "summary",
                            [*TINY_MMDIT, "balance.topology=g1n1", "run.max_steps=5"])
    summary = trainer.train()
    assert [r["step"] for r in summary["records"]] == [3, 4]  # the newest two
    assert summary["steps"] == 5 and summary["step_topologies"] == {"g1n1": 5}  # every step counted
    with open(trainer.run_dir + "/metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f if line.strip()] == [0, 1, 2, 3, 4]
