"""Duplicate sample ids in a corpus are found before training: the run stops naming the
shards and rows (``data.duplicate_ids: error``, the default), or every row of such an id
is left out and listed in quarantine (``quarantine``); never trained twice or silently."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from dist_utils import build_tiny_corpus, local_trainer
from knapray.data import duplicate_ids, shard_paths
from knapray.config.run import load_config
from knapray.worker.guard import BadCorpus
from knapray.worker.ledger_files import read_ledger
from knapray.driver import preflight
from knapray.driver.run_dir import resolve_paths

TINY = ["model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[2,2,4]", "model.depth_double=1",
        "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16"]


def _set_id(shard, row: int, sample_id: int) -> None:
    table = pq.read_table(shard)
    ids = table.column("sample_id").to_numpy().copy()
    ids[row] = sample_id
    i = table.schema.get_field_index("sample_id")
    table = table.set_column(i, table.schema.field(i), [ids.astype(table.schema.field(i).type.to_pandas_dtype())])
    pq.write_table(table, shard)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A two-shard corpus where one id is carried by a row of each shard and another by two rows of one shard."""
    path = build_tiny_corpus(tmp_path_factory.mktemp("dup") / "corpus", "g2b2i64f1s0", steps=4, shards=2)
    a, b = shard_paths(path)
    ids_a = pq.read_table(a, columns=["sample_id"]).column("sample_id").to_pylist()
    ids_b = pq.read_table(b, columns=["sample_id"]).column("sample_id").to_pylist()
    _set_id(b, 1, ids_a[0])  # across shards
    _set_id(b, 3, ids_b[2])  # within a shard
    return path, ids_a[0], ids_b[2], a.name, b.name


def test_duplicate_ids_are_found_with_their_shards_and_rows(corpus):
    path, across, within, a, b = corpus
    found = {d.sample_id: d.rows for d in duplicate_ids(shard_paths(path))}
    assert found == {across: ((a, 0), (b, 1)), within: ((b, 2), (b, 3))}


def test_a_corpus_without_duplicates_has_none(tmp_path):
    path = build_tiny_corpus(tmp_path / "c", "g2b2i64f1s0", steps=2, shards=2)
    assert duplicate_ids(shard_paths(path)) == []


def _cfg(path, run_root, *more):
    return resolve_paths(load_config(None, [f"data.corpus={path}", f"run.storage={run_root}", "run.name=dup",
                                            "balance.topology=g1n1", *TINY, *more]))


def test_duplicates_stop_the_run_before_workers_start(corpus, tmp_path):
    path, across, _, a, b = corpus
    with pytest.raises(BadCorpus) as err:
        preflight.check(_cfg(path, tmp_path), [1])
    msg = str(err.value)
    assert "\n" not in msg and f"sample_id {across}" in msg and f"{a} row 0" in msg and f"{b} row 1" in msg
    assert "1 more id" in msg and "data.duplicate_ids=quarantine" in msg


def test_quarantined_duplicates_are_never_trained_and_are_listed(corpus, tmp_path):
    path, across, within, _, _ = corpus
    cfg = _cfg(path, tmp_path, "data.duplicate_ids=quarantine")
    _, lock = preflight.prepare(preflight.check(cfg, [1]))
    lock.release()
    trainer = local_trainer(0, 1, path, str(tmp_path), "dup",
                            TINY + ["data.duplicate_ids=quarantine", "balance.topology=g1n1"])
    trainer.train()
    ids = read_ledger(cfg.run_dir).columns()["sample_id"]
    all_ids = np.concatenate([pq.read_table(s, columns=["sample_id"]).column("sample_id").to_numpy()
                              for s in shard_paths(path)])
    expected = set(all_ids.tolist()) - {across, within}
    assert sorted(ids.tolist()) == sorted(expected)  # every other id exactly once, these never
    with open(os.path.join(cfg.run_dir, "quarantine-duplicates.jsonl")) as f:
        listed = {r["sample_id"]: r for r in map(json.loads, f)}
    assert set(listed) == {across, within} and all(r["reason"] == "duplicate_id" for r in listed.values())
