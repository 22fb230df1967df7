"""Runs a user can trust, without Ray (the torchrun launcher, gloo): epochs, resume
(auto / never / must), the run lock, the final checkpoint, bad shards, the ledger exactly
once, no code execution from a run directory, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections import Counter

import pyarrow.parquet as pq
import pytest

from knapray.corpus import shard_paths
from dist_utils import build_tiny_corpus, run_metrics
from knapray.data import BadShard, local_rows
from knapray.config.run import load_config
from knapray.driver.preflight import check_corpus
from knapray.driver.run_dir import (
    RunError,
    RunLock,
    decide_start,
    resolve_paths,
    write_config,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = ["model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[2,2,4]", "model.depth_double=1",
         "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    build_tiny_corpus(out, "g1b3i128f1s0,g1b2i64f1s0,g1b1i256f2s0", steps=3, shards=3)
    ids = [i for p in shard_paths(out) for i in pq.read_table(p, columns=["sample_id"])["sample_id"].to_pylist()]
    return str(out), ids


def _overrides(corpus_dir: str, storage, *extra: str) -> list[str]:
    return MODEL + [f"data.corpus={corpus_dir}", "data.samples_per_step=2", "balance.topology=g1n1",
                    f"run.storage={storage}", "run.name=r", "parallel.precision=fp32", *extra]


def _train(corpus_dir, storage, *extra, nproc: int = 1) -> subprocess.CompletedProcess:
    args = [f"--set={o}" for o in _overrides(corpus_dir, storage, *extra)]
    cfg = pathlib.Path(storage) / "empty.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text("{}\n")
    # torchrun's own logs in the test's folder (by default a torchelastic_* folder in /tmp, never removed)
    launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                 f"--log-dir={pathlib.Path(storage) / 'torchrun-logs'}"] if nproc > 1 else [])
    cmd = [sys.executable, *launcher, "-m", "knapray.commands.torchrun", "--config", str(cfg), *args]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _ledger(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "ledger.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]



# ---- epochs, resume, final checkpoint, exactly once -----------------------------------------


@pytest.mark.dist
def test_two_epochs_train_every_sample_once_per_epoch(corpus, tmp_path):
    corpus_dir, ids = corpus
    out = _train(corpus_dir, tmp_path, "data.epochs=2", "balance.topology=g1n2", nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _ledger(tmp_path / "r")
    for epoch in (0, 1):
        counts = Counter(r["sample_id"] for r in rows if r["epoch"] == epoch)
        assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}, epoch
    epochs = [m["epoch"] for m in run_metrics(tmp_path / "r")]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1}
    # What `tensorboard --logdir runs/` shows: every step's scalars.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"loss", "loss_rel", "lr", "tokens_per_s", "imbalance_planned", "model_tflops"} <= set(tags), tags
    assert [e.step for e in acc.Scalars("loss")] == list(range(len(epochs)))


def test_resume_continues_at_the_checkpoint_and_trains_each_sample_once(corpus, tmp_path):
    corpus_dir, ids = corpus
    first = _train(corpus_dir, tmp_path, "run.max_steps=3", "checkpoint.every=2")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = sorted(os.listdir(tmp_path / "r" / "checkpoints"))
    # every checkpoint.every steps, and a final one: the last steps of a run are kept
    assert ckpts == ["step-000000001", "step-000000002"]
    assert "starting run 'r'" in first.stdout
    second = _train(corpus_dir, tmp_path, "run.max_steps=0", "checkpoint.every=2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming run 'r' from" in second.stdout and "run.max_steps: 3 -> 0" in second.stdout
    steps = [m["step"] for m in run_metrics(tmp_path / "r")]
    assert steps == list(range(len(steps))) and len(steps) > 3  # no step twice, none missing
    rows = _ledger(tmp_path / "r")
    counts = Counter(r["sample_id"] for r in rows)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}
    assert {r["attempt"] for r in rows if r["step"] >= 3} == {1} and {r["attempt"] for r in rows if r["step"] < 3} == {0}


def test_resume_refuses_an_incompatible_config_in_one_line(corpus, tmp_path):
    corpus_dir, _ = corpus
    assert _train(corpus_dir, tmp_path, "run.max_steps=2").returncode == 0
    out = _train(corpus_dir, tmp_path, "run.max_steps=4", "model.depth_single=2")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.depth_single: 1 -> 2" in lines[0] and "another run.name" in lines[0]


def test_resume_never_refuses_an_existing_run_directory(corpus, tmp_path):
    corpus_dir, _ = corpus
    assert _train(corpus_dir, tmp_path, "run.max_steps=1").returncode == 0
    out = _train(corpus_dir, tmp_path, "run.max_steps=1", "checkpoint.resume=never")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "r") in lines[0] and "checkpoint.resume=never" in lines[0]


def test_decide_start_modes(corpus, tmp_path):
    corpus_dir, _ = corpus
    cfg = resolve_paths(load_config(None, _overrides(corpus_dir, tmp_path, "checkpoint.resume=must")))
    with pytest.raises(RunError, match="no complete checkpoint"):
        decide_start(cfg, [])
    auto = resolve_paths(load_config(None, _overrides(corpus_dir, tmp_path)))
    assert decide_start(auto, []).resume_from is None
    write_config(auto)
    # auto with a checkpoint resumes it, after checking what the resume reads (the resume
    # itself is test_resume_*'s): a checkpoint without its trainer state is one line.
    ck = tmp_path / "r" / "checkpoints" / "step-000000004"
    ck.mkdir(parents=True)
    with pytest.raises(RunError, match=r"step-000000004/trainer.json cannot be read"):
        decide_start(auto, [str(ck)])


# ---- the lock ----------------------------------------------------------------------------


def test_lock_refuses_a_second_live_run(tmp_path):
    with RunLock(str(tmp_path)):
        with pytest.raises(RunError, match="in use by a live run"):
            RunLock(str(tmp_path)).acquire()
    with RunLock(str(tmp_path)):  # released: the next run gets it
        pass


def test_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    (tmp_path / "RUNNING.lock").write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    with RunLock(str(tmp_path)) as lock:
        assert json.loads((tmp_path / "RUNNING.lock").read_text())["pid"] == os.getpid() and lock.held


def test_a_live_lock_stops_the_launcher_with_exit_2(corpus, tmp_path):
    corpus_dir, _ = corpus
    with RunLock(str(tmp_path / "r")):
        out = _train(corpus_dir, tmp_path, "run.max_steps=1")
    assert out.returncode == 2 and "in use by a live run" in out.stderr and len(out.stderr.strip().splitlines()) == 1


# ---- bad data ----------------------------------------------------------------------------


def _copy_corpus(src: str, dst: pathlib.Path) -> pathlib.Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_an_unreadable_shard_is_quarantined_with_its_rows_and_training_goes_on(corpus, tmp_path):
    corpus_dir, ids = corpus
    bad = _copy_corpus(corpus_dir, tmp_path / "corpus")
    victim = shard_paths(bad)[1]
    lost = pq.read_metadata(victim).num_rows
    victim.write_bytes(victim.read_bytes()[: 200])  # truncated: no footer
    out = _train(str(bad), tmp_path, "data.max_bad_fraction=0.5")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 quarantined" in out.stdout
    records = [json.loads(x) for x in (tmp_path / "r" / "quarantine.jsonl").read_text().splitlines()]
    assert records[0]["shard"] == victim.name and records[0]["rows"] == lost and "unreadable" in records[0]["reason"]
    trained = Counter(r["sample_id"] for r in _ledger(tmp_path / "r"))
    assert len(trained) == len(ids) - lost and set(trained.values()) == {1}


def test_a_mostly_unreadable_corpus_stops_before_training_naming_the_shards(corpus, tmp_path):
    corpus_dir, _ = corpus
    bad = _copy_corpus(corpus_dir, tmp_path / "corpus")
    names = []
    for victim in shard_paths(bad)[:2]:
        victim.write_bytes(b"garbage" * 10)
        names.append(victim.name)
    out = _train(str(bad), tmp_path, "data.max_bad_fraction=0.5")
    assert out.returncode == 2
    line = out.stderr.strip()
    assert len(line.splitlines()) == 1 and all(n in line for n in names) and "max_bad_fraction" in line


def test_a_shard_that_breaks_part_way_reports_the_rows_it_lost(corpus, tmp_path):
    corpus_dir, _ = corpus
    bad = _copy_corpus(corpus_dir, tmp_path / "corpus")
    victim = shard_paths(bad)[0]
    data = bytearray(victim.read_bytes())
    meta = pq.read_metadata(victim)
    # Overwrite the data pages of the second row group onward, keep the footer: the file
    # opens, the first rows read, then decoding fails.
    start = meta.row_group(0).column(0).file_offset
    end = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    for i in range(start + (end - start) // 3, end):
        data[i] = 0xAB
    victim.write_bytes(bytes(data))
    seen: list[BadShard] = []
    rows = sum(b.num_rows for b in local_rows(str(bad), 0, 1, read_rows=1, on_bad_shard=seen.append))
    assert len(seen) == 1 and seen[0].shard == victim.name
    assert seen[0].rows is not None and seen[0].rows > 0 and rows < 18


# ---- no code from a run directory; paths ---------------------------------------------------


def test_nothing_in_knapray_unpickles_or_loads_weights_unsafely():
    hits = []
    for path in (REPO / "knapray").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            bad = [b for b in ("pickle.load(", "pickle.loads(", "weights_only=False", "allow_pickle=True") if b in line]
            if "np.load(" in line and "allow_pickle=False" not in line:
                bad.append("np.load without allow_pickle=False")
            hits += [f"{path.relative_to(REPO)}:{n}: {b}" for b in bad]
    assert not hits, hits


def test_relative_storage_inside_the_ray_upload_folder_goes_elsewhere(tmp_path, monkeypatch):
    upload = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    upload.mkdir(parents=True)
    monkeypatch.chdir(upload)
    monkeypatch.setenv("KNAPRAY_STORAGE", str(tmp_path / "shared"))
    cfg = resolve_paths(load_config(None, ["run.storage=runs", "data.corpus=datasets/generated/demo"]))
    assert cfg.run.storage == str(tmp_path / "shared" / "runs")
    with pytest.raises(RunError, match="holds no gitignored data"):
        check_corpus(cfg)


# ---- resume at another world size (the elastic restart path) -------------------------------


@pytest.fixture(scope="module")
def corpus60(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus60"), "g1b3i128f1s0,g1b2i64f1s0,g1b1i256f2s0",
                             steps=10, shards=3, seed=2)


@pytest.mark.dist
def test_resume_at_another_world_size_continues_the_same_loss_curve(corpus60, tmp_path):
    """4 ranks train steps 0-2 with FSDP (sharded over the world, every block checkpointed)
    and save a sharded checkpoint; 3 ranks resume it and train 3-5. With a global batch each
    step trains the same samples with the same noise at any world size, so the losses match
    an uninterrupted, unsharded one-process run's step for step, up to fp32 reassociation."""
    common = ["data.global_batch=12", "data.epochs=2"]
    whole = _train(corpus60, tmp_path / "whole", *common, "run.max_steps=6", nproc=1)
    assert whole.returncode == 0, whole.stderr[-3000:]
    sharded = ["parallel.fsdp=full", "parallel.activation_checkpointing=full"]
    bags = "balance.topology=bags_of:2"
    first = _train(corpus60, tmp_path / "split", *common, bags, *sharded, "run.max_steps=3", "checkpoint.every=0",
                   nproc=4)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(corpus60, tmp_path / "split", *common, bags, *sharded, "run.max_steps=6", nproc=3)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming run 'r'" in second.stdout
    ref = run_metrics(tmp_path / "whole" / "r")
    got = run_metrics(tmp_path / "split" / "r")
    assert [m["step"] for m in got] == [m["step"] for m in ref] == list(range(6))
    assert [m["world_size"] for m in got] == [4, 4, 4, 3, 3, 3]
    for a, b in zip(got, ref):
        assert a["tokens"] == b["tokens"]  # the same samples
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
    rows = _ledger(tmp_path / "split" / "r")
    for epoch in (0, 1):
        counts = Counter(r["sample_id"] for r in rows if r["epoch"] == epoch)
        assert set(counts.values()) == {1}
