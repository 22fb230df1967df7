"""A non-finite loss or gradient is caught at its step (issue 43, item 10): one finite but huge
latent value (3e38) in a corpus made the loss NaN from its step to the end of the run, which
reported done. Now that step's update is not applied and its samples are quarantined with
the reason, training goes on from the weights before it; a model that keeps producing
non-finite losses stops in one line. Caught from the numbers the step gathers to the host
anyway (no host sync of its own)."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dist_utils import TINY_MMDIT, build_tiny_corpus, local_trainer
from knapray.corpus import shard_paths

SETS = [*TINY_MMDIT, "balance.topology=g1n1", "run.max_steps=6"]


def _plant(corpus: str, value: float, every: bool = False) -> int:
    """``value`` as one latent entry of the first sample of the first shard (of every sample
    with ``every``); returns the first sample's id."""
    path = shard_paths(corpus)[0]
    table = pq.read_table(path)
    latents = table.column("latent").to_pylist()
    for i in range(len(latents) if every else 1):
        latents[i] = [value] + latents[i][1:]
    col = pa.array(latents, type=table.schema.field("latent").type)
    pq.write_table(table.set_column(table.schema.get_field_index("latent"), "latent", col), path)
    return int(table.column("sample_id")[0].as_py())


def _records(run_dir: str) -> list[dict]:
    with open(run_dir + "/metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_a_huge_latent_skips_its_step_and_quarantines_its_samples(tmp_path):
    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b4i64f1s0", steps=4, shards=2, seed=5)
    bad_id = _plant(corpus, 3e38)
    trainer = local_trainer(0, 1, corpus, str(tmp_path / "runs"), "huge", SETS)
    summary = trainer.train()
    assert summary["steps"] == 6
    records = _records(trainer.run_dir)
    bad = [r for r in records if r.get("nonfinite")]
    assert len(bad) == 1, [(r["step"], r["loss"]) for r in records]
    assert all(math.isfinite(r["loss"]) for r in records if r is not bad[0]), [r["loss"] for r in records]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    with open(trainer.run_dir + "/quarantine-rank0.jsonl") as f:
        quarantined = [json.loads(line) for line in f]
    reasons = {q["sample_id"]: q["reason"] for q in quarantined}
    assert reasons.get(bad_id) == "non_finite_loss", quarantined
    assert all(q.get("step") == bad[0]["step"] for q in quarantined if q["reason"] == "non_finite_loss")


def test_a_model_whose_loss_stays_non_finite_stops_in_one_line(tmp_path):
    from knapray.worker.guard import BadCorpus, NonFiniteSteps

    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b4i64f1s0", steps=4, shards=1, seed=5)
    _plant(corpus, 3e38, every=True)
    trainer = local_trainer(0, 1, corpus, str(tmp_path / "runs"), "diverged", SETS)
    with pytest.raises(NonFiniteSteps) as e:
        trainer.train()
    msg = str(e.value)
    assert isinstance(e.value, BadCorpus) and "\n" not in msg and "steps 0, 1, 2" in msg and "quarantine" in msg, msg
    assert not [p for p in (tmp_path / "runs" / "diverged" / "checkpoints").glob("step-*")]


def test_nonfinite_gradients_is_a_device_flag_of_this_ranks_gradients():
    """Loss finite, gradients not (an overflow in backward): caught too, by a local check whose
    answer rides in the step's gather (no collective, no host sync of its own)."""
    from knapray.config.parallel import ParallelConfig
    from knapray.worker.parallelize import ParallelModel

    model = torch.nn.Linear(3, 2)
    par = ParallelModel(model=model, config=ParallelConfig())
    assert float(par.nonfinite_gradients()) == 0.0  # no gradients yet
    model.weight.grad = torch.ones(2, 3)
    model.bias.grad = torch.zeros(2)
    assert float(par.nonfinite_gradients()) == 0.0
    for bad in (float("inf"), float("nan"), 3e38):  # 3e38: finite, but the norm overflows
        model.bias.grad = torch.tensor([0.0, bad])
        flag = par.nonfinite_gradients()
        assert flag.shape == () and float(flag) == 1.0, bad


def test_a_resumed_epoch_counts_the_rows_it_skips_as_read(tmp_path):
    """A resumed epoch skips the good rows its checkpoint trained but reads its bad rows
    before the checkpoint again: the skipped rows count as read, so the fraction is the
    corpus's and not the bad rows' alone (a run resumed after a worker failure stopped as
    "mostly bad" on a corpus whose bad rows were a third)."""
    from knapray.data import StreamStats
    from knapray.worker.guard import BadCorpus, BadDataGuard

    guard = BadDataGuard(str(tmp_path), rank=0, corpus="c", max_bad_fraction=0.5)
    counts = guard.step_counts(StreamStats(samples=4, skipped=20, corrupt=12))
    assert counts == {"bad_rows": 12, "rows": 36}
    guard.check(counts, step=3)  # 12 of 36 read: not mostly bad (12 of 16 without the skipped)
    more = guard.step_counts(StreamStats(samples=4, skipped=20, corrupt=40))  # 28 more rows, all bad
    assert more == {"bad_rows": 28, "rows": 28}
    with pytest.raises(BadCorpus, match="40 of 64 rows"):
        guard.check(more, step=4)
