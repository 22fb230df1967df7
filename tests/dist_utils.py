"""Run a function on N local gloo processes (CPU) and collect what every rank returns.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initializes a
gloo process group over a free TCP port on 127.0.0.1 with a 60 s timeout, calls
``fn(rank, world_size, *args)`` on each, and returns the results in rank order. ``fn`` must
be picklable (a module-level function) and return picklable values. If a rank raises,
the remaining ranks are stopped and a RuntimeError carries every failing rank's traceback.
"""

from __future__ import annotations

import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOO_TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=GLOO_TIMEOUT,
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


PRELOAD = ["torch", "torch.distributed", "numpy", "dist_utils", "knapray.worker.trainer"]
"""What the rank processes' fork server imports once: each rank is forked from it with these
loaded, instead of a fresh interpreter importing torch and knapray again (2 s of CPU a
rank, for hundreds of ranks in the suite). The server starts at the first run, from this
process's environment and ``sys.path``; a test that changes the environment for its ranks
passes it as an argument instead."""


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0
) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    first_error_at: float | None = None
    try:
        while len(outputs) + len(errors) < world_size:
            now = time.monotonic()
            # After a failure, give the others a moment to report, then stop them.
            if now > deadline or (first_error_at is not None and now > first_error_at + 5.0):
                break
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    reported = r in outputs or r in errors
                    if not reported and p.exitcode not in (None, 0):
                        errors[r] = f"process exited with code {p.exitcode} without reporting"
                        first_error_at = first_error_at or time.monotonic()
                continue
            if ok:
                outputs[rank] = value
            else:
                errors[rank] = value
                first_error_at = first_error_at or time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    missing = [r for r in range(world_size) if r not in outputs and r not in errors]
    if errors or missing:
        parts = [f"--- rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            parts.append(f"--- ranks {missing} did not report (stopped or timed out)")
        raise RuntimeError(f"distributed run of {fn.__name__} failed:\n" + "\n".join(parts))
    return [outputs[r] for r in range(world_size)]


TINY_MMDIT = ["model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[4,2,2]", "model.depth_double=1",
              "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16"]
"""Config overrides for the smallest MMDiT the trainer tests use (text/pooled dims of the
tiny synthetic corpora)."""


def local_config(corpus: str, run_root: str, name: str, overrides: list[str]):
    """The config ``local_trainer`` runs: no coordinator, fp32, no checkpoints unless
    ``overrides`` ask for them; the widths it leaves out from the corpus and
    ``model.pretrained``, as the launchers load it)."""
    from knapray.driver.preflight import load_run_config

    return load_run_config(None, [
        f"data.corpus={corpus}", "data.samples_per_step=2", "balance.coordinator=false", f"run.name={name}",
        f"run.storage={run_root}", "checkpoint.every=0", "parallel.precision=fp32", *overrides,
    ])


def local_trainer(rank: int, world: int, corpus: str, run_root: str, name: str, overrides: list[str]):
    """A ``Trainer`` over a ``LocalContext`` on this gloo rank: the corpus's shards read
    locally (``local_config``)."""
    from knapray.data import local_rows
    from knapray.worker.context import LocalContext
    from knapray.worker.trainer import Trainer

    cfg = local_config(corpus, run_root, name, overrides)
    ctx = LocalContext(shards=[list(local_rows(corpus, r, world)) for r in range(world)], rank=rank, world_size=world)
    return Trainer(ctx, cfg)


def build_tiny_corpus(out, mix: str, steps: int, scale: int = 4, shards: int = 2, seed: int = 1) -> str:
    """A synthetic corpus for the tiny models (4 latent channels, text and pooled width 16)."""
    from knapray.corpus.synthetic import SyntheticConfig, build_synthetic

    build_synthetic(SyntheticConfig(mix=mix, steps=steps, scale=scale, channels=4, text_dim=16, pooled_dim=16,
                                    shards=shards, seed=seed), out, progress=False)
    return str(out)


def _train_one_step(rank: int, world: int, corpus: str, runs: str, name: str) -> None:
    from knapray.driver.run_dir import write_config

    trainer = local_trainer(rank, world, corpus, runs, name, [*TINY_MMDIT, "checkpoint.every=1", "run.max_steps=1",
                                                              "balance.topology=g1n1"])
    write_config(trainer.cfg)  # what a launcher's pre-flight writes: sample and serve read it
    trainer.train()


def trained_tiny_run(tmp_path, name: str) -> tuple[str, list[int]]:
    """(run directory, the corpus's first sample ids): the tiny MMDiT (4 heads) trained one
    step by one gloo rank on a synthetic corpus without a text encoder (requests borrow a
    sample's text with ``like``), its checkpoint and config.json written as a run's are."""
    import pyarrow.parquet as pq

    from knapray.corpus import shard_paths

    corpus = build_tiny_corpus(tmp_path / "corpus", "g2b2i256f1s0,g2b1i512f1s0", steps=2)
    run_distributed(_train_one_step, 1, corpus, str(tmp_path / "runs"), name, timeout_s=120)
    ids = pq.read_table(shard_paths(corpus)[0], columns=["sample_id"])["sample_id"].to_pylist()
    return str(tmp_path / "runs" / name), ids


def sampling_run_dir(tmp_path):
    """A run directory as far as ``knapray sample`` reads it before loading weights:
    config.json, a marked checkpoint, the corpus's schema.json (a VAE of downsample 8, a T5
    record; the model's 2x2 patches). Returns the run directory."""
    import json

    from knapray.corpus.writer import FORMAT_VERSION
    from knapray.worker.checkpoint import COMPLETE
    from knapray.config.run import load_config
    from knapray.driver.run_dir import RUN_FORMAT

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "schema.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION,
        "dims": {"channels": 16, "text_dim": 16, "pooled_dim": 12, "vae_downsample": 8, "patch": [1, 2, 2]},
        "payload": False, "counts": {"samples": 0, "seq_len": {"max": 0}}, "shards": [],
        "encoders": {"text": {"class": "HFTextEncoder"}, "latent": {"path": "/models/vae"}}}))
    run = tmp_path / "runs" / "r"
    step = run / "checkpoints" / "step-000000003"
    step.mkdir(parents=True)
    (step / COMPLETE).write_text("")
    (step / ".metadata").write_text("")
    cfg = load_config(None, [f"data.corpus={corpus}", "model.in_channels=16", "model.text_dim=16",
                             "model.pooled_dim=12"])
    (run / "config.json").write_text(json.dumps({"format_version": RUN_FORMAT, **cfg.to_dict()}))
    return run


def run_metrics(run_dir) -> list[dict]:
    """A run's ``metrics.jsonl`` rows, in order."""
    import json
    import os

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
