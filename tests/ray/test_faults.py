"""Faults on real Ray Train runs of gloo workers: a coordinator down for a while, then a
SIGKILLed worker, in one run with planted bad rows; a coordinator gone for good; a mostly-bad
corpus (2 workers each). Every run must end with the ledger holding
every trainable sample exactly once."""

from __future__ import annotations

import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from knapray.corpus import CORPUS_SCHEMA, shard_paths
from knapray.corpus.synthetic import SyntheticConfig, build_synthetic
from knapray.testing.chaos import Chaos, check_exactly_once, check_once_per_epoch
from knapray.config.run import load_config

from dist_utils import run_metrics

pytestmark = pytest.mark.ray

MODEL = [
    "model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[2,2,4]",
    "model.depth_double=1", "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16",
]


def _corpus(out, seed=2, steps=6):
    build_synthetic(
        SyntheticConfig(mix="g1b3i128f1s0,g1b2i64f1s0,g1b5i64f1s0,g1b1i256f1s0", steps=steps, scale=4,
                        channels=4, text_dim=16, pooled_dim=16, shards=4, seed=seed),
        out, progress=False,
    )
    return [r for p in shard_paths(out) for r in pq.read_table(p).to_pylist()]


def _cfg(corpus_dir, storage, name, **kw):
    sets = MODEL + [
        f"data.corpus={corpus_dir}", "data.samples_per_step=2", "balance.topology=g2n2",
        f"run.name={name}", f"run.storage={storage}", "scaling.num_workers=4", "scaling.cpus_per_worker=0.5",
        "checkpoint.every=2", "distributed.timeout_s=60", "balance.coordinator_timeout_s=4",
    ] + [f"{k}={v}" for k, v in kw.items()]
    return load_config(None, sets)


@pytest.fixture(scope="module")
def clean_corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    rows = _corpus(out)
    return str(out), [r["sample_id"] for r in rows]


def _run_with_chaos(cfg, **chaos):
    from knapray.driver.launch import run_training
    from knapray.worker.step_planner import coordinator_name

    os.makedirs(cfg.run_dir, exist_ok=True)
    chaos_thread = Chaos(cfg.run_dir, coordinator_name=coordinator_name(cfg), **chaos)
    chaos_thread.start()
    try:
        summary = run_training(cfg)
    finally:
        chaos_thread.stop()
    return summary, chaos_thread.log.events


def test_coordinator_down_then_a_worker_sigkilled_exactly_once(ray_session, tmp_path_factory, tmp_path):
    """One run, three faults in turn, on a corpus with planted bad rows (quarantined with
    their reasons): the coordinator is killed after step 1 and kept down for 3 steps (its
    node died), so the ranks plan locally meanwhile, then comes back and reloads its state;
    after step 8 a worker is SIGKILLed, and Ray Train restarts the group from the latest
    checkpoint. The ledger holds every trainable sample exactly once."""
    out = tmp_path_factory.mktemp("bad")
    rows = _corpus(out, seed=3, steps=12)  # long enough to see the coordinator come back
    bad = {}
    shard = shard_paths(out)[1]
    table = pq.read_table(shard).to_pylist()
    table[0]["latent"][3] = math.nan;                    bad[table[0]["sample_id"]] = "non_finite"
    table[1]["latent"] = table[1]["latent"][:-5];        bad[table[1]["sample_id"]] = "latent_size"
    table[2]["seq_len"] = -3;                            bad[table[2]["sample_id"]] = "non_positive_length"
    pq.write_table(pa.Table.from_pylist(table, schema=CORPUS_SCHEMA), shard)
    # A memory budget of 40 tokens per GPU on bags of 2: anything over 80 tokens is too long.
    too_long = {r["sample_id"] for r in rows if r["seq_len"] > 80 and r["sample_id"] not in bad}
    assert too_long
    # 2 workers in one bag of 2 (8 samples a step, as 4 workers of 2 would draw): every fault
    # here is one rank's or the coordinator's, and 2 fewer worker processes per attempt.
    cfg = _cfg(str(out), tmp_path, "faults", **{"run.max_failures": 1, "data.max_tokens_per_gpu": 40,
                                                "scaling.num_workers": 2, "balance.topology": "g2n1",
                                                "data.samples_per_step": 4})
    from knapray.coordinator import create_coordinator
    from knapray.worker.ledger_files import ledger_dir
    from knapray.worker.step_planner import coordinator_config, coordinator_name

    # The actor is gone for 3 steps (its node died), then comes back and reloads its state.
    def recreate():
        return create_coordinator(coordinator_name(cfg), config=coordinator_config(cfg, state_dir=ledger_dir(cfg.run_dir)))

    summary, events = _run_with_chaos(cfg, kill_coordinator_at=1, coordinator_down_steps=3,
                                      recreate_coordinator=recreate, kill_worker_at=8, worker_rank=1)
    assert [e["event"] for e in events] == ["coordinator_killed", "coordinator_recreated", "worker_sigkill"], events
    # Every step's row, the first attempt's kept up to the checkpoint the restart resumed from.
    planned_by = [m["planned_by"] for m in run_metrics(cfg.run_dir)]
    assert "local" in planned_by, planned_by  # ranks planned without it for a while...
    assert planned_by[-1] == "coordinator", (planned_by, events)  # ...and went back to it once it was restarted
    expected = {r["sample_id"] for r in rows} - set(bad) - too_long
    check = check_exactly_once(os.path.join(cfg.run_dir, "ledger.jsonl"), expected)
    assert check["ok"], check
    assert check["attempts"][-1] >= 1  # the restart re-trained some steps as a new attempt
    # The restarted group resumed from a checkpoint, not from scratch.
    steps = [r["step"] for r in summary["records"]]
    assert 0 < steps[0] <= events[-1]["after_step"] + 1 and steps == list(range(steps[0], steps[0] + len(steps)))
    quarantine = [json.loads(l) for l in open(os.path.join(cfg.run_dir, "quarantine.jsonl"))]
    reasons = {q["sample_id"]: q["reason"] for q in quarantine}
    assert {k: reasons.get(k) for k in bad} == bad
    assert {k for k, v in reasons.items() if v == "too_long"} == too_long


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("small")
    rows = _corpus(out, steps=3)  # 33 samples: 5 steps of 8 an epoch
    return str(out), [r["sample_id"] for r in rows]


@pytest.mark.parametrize("kill_after", [1, 4], ids=["mid-epoch-at-a-checkpoint", "at-the-epoch-boundary"])
def test_a_coordinator_gone_for_good_loses_no_ledger_row(ray_session, small_corpus, tmp_path, kill_after):
    """``ray.kill(coordinator)`` without a restart: the ranks plan locally to the end, the
    final checkpoint carries the rows nobody took, and the driver records them: every
    sample once per epoch in both epochs (20 of 176 rows were left before). Killed right
    after step 1's line, while its checkpoint is taken (checkpoint.every=2), or after step
    4, the last of the first epoch (33 samples, 8 a step: 2 workers of 4, an odd one left
    at the end of each epoch)."""
    corpus_dir, ids = small_corpus
    cfg = _cfg(corpus_dir, tmp_path, f"gone{kill_after}", **{"run.max_failures": 0, "data.epochs": 2,
                                                              "scaling.num_workers": 2, "balance.topology": "g2n1",
                                                              "data.samples_per_step": 4})
    summary, events = _run_with_chaos(cfg, kill_coordinator_at=kill_after, coordinator_gone=True)
    assert [e["event"] for e in events] == ["coordinator_killed"], events
    planned_by = [r["planned_by"] for r in summary["records"]]
    assert planned_by[-1] == "local" and "coordinator" in planned_by
    check = check_once_per_epoch(os.path.join(cfg.run_dir, "ledger.jsonl"), ids, epochs=2)
    assert check["ok"], check
    assert summary["run"]["ledger_missing_steps"] == []
    assert summary["run"]["ledger_rows"] == 2 * len(ids)


def test_mostly_bad_corpus_stops_with_a_clear_error(ray_session, tmp_path_factory, tmp_path):
    from ray.train import WorkerGroupError

    from knapray.driver.launch import run_training

    out = tmp_path_factory.mktemp("mostly_bad")
    _corpus(out, seed=4)
    for shard in shard_paths(out):
        table = pq.read_table(shard).to_pylist()
        for i, row in enumerate(table):
            if i % 4:  # three rows in four
                row["latent"][0] = math.inf
        pq.write_table(pa.Table.from_pylist(table, schema=CORPUS_SCHEMA), shard)
    # Two workers are enough: the bad rows are counted over every rank's reads.
    cfg = _cfg(str(out), tmp_path, "mostlybad", **{"run.max_failures": 0, "scaling.num_workers": 2,
                                                   "balance.topology": "g2n1"})
    with pytest.raises(WorkerGroupError, match="is mostly bad"):
        run_training(cfg)
