"""Training without Ray, on one machine:

    torchrun --nproc-per-node N -m knapray.train.torchrun --config FILE [--set key=value ...]

The same ``train_loop`` as under Ray Train, with a context that reads each rank's rows
straight from the corpus's parquet shards (``knapray.data.local_rows``: every N-th row)
and keeps checkpoints in ``<run dir>/checkpoints``. There is no coordinator actor, so
every step is planned by the ranks themselves from an all-gather of lengths (the same
solver, the same plans). NCCL when ``run.use_gpu`` is true, gloo otherwise.

It is how the GPU check runs (the GPU machine has torch but no Ray) and how a user
debugs on one box. Run without torchrun, it trains as a world of one.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from knapray.data import local_rows

from .config import TrainConfig, load_config

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
"""Written last into a checkpoint directory: only marked checkpoints are resumed from."""
KEEP_CHECKPOINTS = 2


class TorchrunContext:
    """``TrainContext`` for a torchrun world (the process group is already initialized)."""

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, local_rank: int) -> None:
        self.cfg = cfg
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.checkpoint_root = os.path.join(cfg.run_dir, CHECKPOINTS)

    def device(self, use_gpu: bool) -> torch.device:
        return torch.device("cuda", self.local_rank) if use_gpu else torch.device("cpu")

    def rows(self, epoch: int):
        return local_rows(self.cfg.data.corpus, self.rank, self.world_size,
                          shuffle_seed=self.cfg.data.seed, epoch=epoch)

    def completed_checkpoints(self) -> list[str]:
        """Marked checkpoint directories, oldest first."""
        if not os.path.isdir(self.checkpoint_root):
            return []
        names = sorted(n for n in os.listdir(self.checkpoint_root) if n.startswith("step-"))
        return [os.path.join(self.checkpoint_root, n) for n in names
                if os.path.exists(os.path.join(self.checkpoint_root, n, COMPLETE))]

    def load_checkpoint(self, load: Callable[[str], Any]) -> Any:
        done = self.completed_checkpoints()
        return load(done[-1]) if done else None

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        """Rank 0 moves a finished checkpoint into the run directory, marks it complete
        (the marker last) and keeps the newest ``KEEP_CHECKPOINTS``."""
        if checkpoint_dir is None:
            return
        final = os.path.join(self.checkpoint_root, f"step-{int(metrics['step']):09d}")
        os.makedirs(self.checkpoint_root, exist_ok=True)
        shutil.rmtree(final, ignore_errors=True)  # an unmarked leftover of a crashed save
        shutil.move(checkpoint_dir, final)
        with open(os.path.join(final, COMPLETE), "w") as f:
            f.flush()
            os.fsync(f.fileno())
        for old in self.completed_checkpoints()[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m knapray.train.torchrun",
                                description="knapray training without Ray (launch with torchrun)")
    p.add_argument("--config", required=True, help="YAML config (see jobs/configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set run.max_steps=30")
    return p


def check_launch(cfg: TrainConfig) -> None:
    """What must hold before any rank joins the world (ValueError naming the value)."""
    if not os.path.exists(os.path.join(cfg.data.corpus, "schema.json")):
        raise ValueError(
            f"data.corpus {cfg.data.corpus!r}: no corpus there (no schema.json); build one first, e.g. "
            f"python -m knapray.corpus.synthetic --mix image+video --scale 8 --text-dim 32 --out {cfg.data.corpus}"
        )
    if cfg.run.use_gpu and not torch.cuda.is_available():
        raise ValueError("run.use_gpu is true but CUDA is not available here; set run.use_gpu=false")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        check_launch(cfg)
    except (ValueError, OSError) as e:
        print(f"knapray torchrun: error: {e}", file=sys.stderr)
        return 2
    from knapray.distributed.local import init_from_env, shutdown

    from .loop import train_loop
    from .run_files import clear_stale_run_files, write_run_files

    # No Ray, so no coordinator actor: the ranks plan each step from an all-gather.
    cfg = replace(cfg, balance=replace(cfg.balance, coordinator=False))
    rank_env = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank_env == 0 else logging.WARNING,
                        format=f"[rank {rank_env}] %(message)s")
    if rank_env == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        ctx0 = TorchrunContext(cfg, 0, 1, 0)
        if not ctx0.completed_checkpoints():  # a fresh run: no metrics of an earlier one
            clear_stale_run_files(cfg.run_dir)
    rank, world, local_rank = init_from_env(cfg.run.use_gpu, cfg.run.timeout_s)
    try:
        summary = train_loop(TorchrunContext(cfg, rank, world, local_rank), cfg)
        if rank == 0:
            write_run_files(cfg, summary)
            logger.info("done: %d steps on %d ranks, topology %s; run directory %s",
                        summary["steps"], world, summary["topology"], cfg.run_dir)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
