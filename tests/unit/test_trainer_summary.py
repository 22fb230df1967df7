"""What ``Trainer.train`` hands the driver: the newest ``RECORDS_RETURNED`` step records
(metrics.jsonl keeps every step's; summary.json is computed from it), and the steps per
topology over the whole run, so nothing the trainer holds grows with a run's length."""

from __future__ import annotations

import json

from dist_utils import TINY_MMDIT, build_tiny_corpus, local_trainer


def test_train_returns_the_newest_records_and_counts_every_step(tmp_path, monkeypatch):
    import knapray.worker.trainer as trainer_module

    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b2i64f1s0", steps=5, seed=3)
    monkeypatch.setattr(trainer_module, "RECORDS_RETURNED", 2)
    trainer = local_trainer(0, 1, corpus, str(tmp_path / "runs"), "summary",
                            [*TINY_MMDIT, "balance.topology=g1n1", "run.max_steps=5"])
    summary = trainer.train()
    assert [r["step"] for r in summary["records"]] == [3, 4]  # the newest two
    assert summary["steps"] == 5 and summary["step_topologies"] == {"g1n1": 5}  # every step counted
    with open(trainer.run_dir + "/metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f if line.strip()] == [0, 1, 2, 3, 4]


def test_the_progress_tail_of_a_resumed_run_counts_only_its_own_steps(tmp_path, capsys):
    """Resumed after Ctrl-C: the steps before the checkpoint are in metrics.jsonl, the
    interrupted attempt's later ones were dropped by pre-flight; the bar counts only new
    steps and says nothing of a restart. A real restart (the file rewritten shorter after a
    new step) is said once."""
    import json
    import time

    from knapray.worker.metrics import truncate_metrics
    from knapray.driver.report import ProgressTail

    path = tmp_path / "metrics.jsonl"
    line = lambda step: json.dumps({"step": step, "epoch": 0, "loss": 1.0, "baseline_imbalance_planned": 1.0,  # noqa: E731
                                    "imbalance_planned": 1.0, "compute_max_over_mean": 1.0, "tokens_per_s": 1.0})
    path.write_text("".join(line(s) + "\n" for s in range(9)))  # steps 0..8; the checkpoint covers 0..4
    truncate_metrics(str(tmp_path), 5)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2, 3, 4]
    size = path.stat().st_size
    truncate_metrics(str(tmp_path), 5)  # the trainer's own cut after loading: nothing left to drop
    assert path.stat().st_size == size
    tail = ProgressTail(str(path), total=4, name="r", start_step=5)
    with tail:
        with open(path, "a") as f:
            f.write(line(5) + "\n" + line(6) + "\n")
        time.sleep(1.2)
        path.write_text("".join(line(s) + "\n" for s in range(6)))  # a restart back to step 5
        time.sleep(1.2)
        with open(path, "a") as f:
            f.write(line(6) + "\n" + line(7) + "\n")
        time.sleep(1.2)
    captured = capsys.readouterr()
    text = captured.out + captured.err  # tqdm writes its lines to stdout, the bar to stderr
    assert "waiting for step 5" in text
    assert text.count("workers restarted from the last checkpoint") == 1, text
