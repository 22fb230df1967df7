"""Training on Ray Train end to end (2 gloo workers, a bag each): several epochs in one run,
uneven shards at the end of an epoch, a finished run left alone, a resume with more epochs
from its final checkpoint, and every sample trained exactly once per epoch."""

from __future__ import annotations

import json
import os
from collections import Counter

import pyarrow.parquet as pq
import pytest

from knapray.corpus import shard_paths
from knapray.corpus.synthetic import SyntheticConfig, build_synthetic
from knapray.config.run import load_config

pytestmark = pytest.mark.ray

MODEL = [
    "model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[2,2,4]",
    "model.depth_double=1", "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    # 33 samples: 2 ranks x 4 per step do not divide it, so shards run dry unevenly.
    build_synthetic(
        SyntheticConfig(mix="g1b3i128f1s0,g1b2i64f1s0,g1b5i64f1s0,g1b1i256f1s0", steps=3, scale=4,
                        channels=4, text_dim=16, pooled_dim=16, shards=3, seed=1),
        out, progress=False,
    )
    ids = [i for p in shard_paths(out) for i in pq.read_table(p, columns=["sample_id"])["sample_id"].to_pylist()]
    return str(out), ids


def _sets(corpus_dir, run_root, max_steps, epochs=1):
    return MODEL + [
        f"data.corpus={corpus_dir}", "data.samples_per_step=4", f"data.epochs={epochs}",
        "balance.topology=g1n2", "run.name=resume", f"run.storage={run_root}",
        "scaling.num_workers=2", "scaling.cpus_per_worker=0.5", f"run.max_steps={max_steps}",
        "checkpoint.every=2", "run.max_failures=0", "distributed.timeout_s=60",
        "balance.coordinator_timeout_s=20",
    ]


def _cfg(*args, **kwargs):
    return load_config(None, _sets(*args, **kwargs))


def _ledger(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(tmp_path, "resume", "ledger.jsonl"))]


def _exactly_once_per_epoch(rows, all_ids, epochs):
    for epoch in range(epochs):
        counts = Counter(r["sample_id"] for r in rows if r["epoch"] == epoch)
        assert sorted(counts) == sorted(all_ids) and set(counts.values()) == {1}, epoch
    assert {r["epoch"] for r in rows} == set(range(epochs))


def test_two_epochs_then_one_more_on_the_finished_run_exactly_once(ray_session, corpus, tmp_path, capsys):
    """Two epochs in one run, the same run again (complete: nothing trained), then a third
    epoch on the finished run. (A resume in the middle of an epoch under Ray is
    test_faults' SIGKILLed worker; under torchrun, test_runs.)"""
    from knapray.driver.launch import run_training

    corpus_dir, all_ids = corpus
    # Two epochs: epoch 1 starts at the step number epoch 0 ended at (its end step trained
    # nothing), so the steps stay contiguous; every sample once per epoch.
    first = run_training(_cfg(corpus_dir, tmp_path, max_steps=0, epochs=2))
    steps = [r["step"] for r in first["records"]]
    assert steps == list(range(len(steps))) and first["new_steps"] == len(steps)
    epochs = [r["epoch"] for r in first["records"]]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1}
    for r in first["records"]:
        assert abs(sum(r["rank_work"]) - sum(r["baseline_rank_work"])) <= 1e-6 * sum(r["rank_work"])
    rows = _ledger(tmp_path)
    _exactly_once_per_epoch(rows, all_ids, 2)
    assert {r["step"] for r in rows} == set(steps)
    # Uneven shards: some ranks ran dry before others, yet the epoch ended for all together.
    dry = [r for r in first["records"] if min(r["baseline_rank_work"]) == 0]
    assert dry, "expected a step where a rank had no samples of its own"
    assert all(max(r["rank_work"]) > 0 for r in dry)

    # The same run again (checkpoint.resume=auto): its checkpoint says it is complete, so nothing
    # is trained and no worker starts.
    again = run_training(_cfg(corpus_dir, tmp_path, max_steps=0, epochs=2))
    assert (again["new_steps"], again["records"], again["resumed_from_step"]) == (0, [], steps[-1])
    assert _ledger(tmp_path) == rows
    # ... and `knapray train` says so before it starts Ray, with no unbalanced run either;
    # a run whose driver was stopped after its last checkpoint, before its run files (a
    # signal in between), gets them now: its ledger's rows as they were, its summary, its plot.
    from knapray.commands import train as job

    run_dir = tmp_path / "resume"
    summary = json.loads((run_dir / "summary.json").read_text())
    for name in ("summary.json", "ledger.jsonl", "rank_work.png"):
        (run_dir / name).unlink()

    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    argv = ["--config", str(empty), "--compare-unbalanced"]
    assert job.main(argv + [f"--set={x}" for x in _sets(corpus_dir, tmp_path, max_steps=0, epochs=2)]) == 0
    out = capsys.readouterr().out
    assert f"nothing trained: run 'resume' was already complete (its checkpoint at step {steps[-1]}" in out
    assert "0 new steps" in out and "balanced run" not in out
    assert not (tmp_path / "resume-unbalanced").exists()
    assert f"wrote the run files its stopped driver had not: summary.json, ledger.jsonl ({len(rows)} rows)" in out
    assert _ledger(tmp_path) == rows and (run_dir / "rank_work.png").stat().st_size > 0
    again_summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("summary", "topology", "world_size", "ledger_rows", "ledger_missing_steps"):
        assert again_summary[key] == summary[key], key

    # One more epoch on the finished run: epoch 2 is trained, from the next step on, as a
    # new attempt; no step is written twice.
    third = run_training(_cfg(corpus_dir, tmp_path, max_steps=0, epochs=3))
    steps3 = [r["step"] for r in third["records"]]
    assert steps3 == list(range(steps[-1] + 1, steps[-1] + 1 + len(steps3))) and third["new_steps"] == len(steps3)
    assert {r["epoch"] for r in third["records"]} == {2}
    rows = _ledger(tmp_path)
    _exactly_once_per_epoch(rows, all_ids, 3)
    assert min(r["attempt"] for r in rows if r["epoch"] == 2) > max(r["attempt"] for r in rows if r["epoch"] < 2)
    metrics = [json.loads(line) for line in open(os.path.join(tmp_path, "resume", "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(len(metrics)))
