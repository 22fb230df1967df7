"""Training without Ray, on one machine:

    torchrun --nproc-per-node N -m knapray.commands.torchrun --config FILE [--set key=value ...]

The same ``Trainer`` as under Ray Train, with a context that reads each rank's rows
straight from the corpus's parquet shards (``knapray.data.local_rows``: every N-th row)
and the same run directory (checkpoints, ledger, metrics). There is no coordinator actor, so
every step is planned by the ranks themselves from an all-gather of lengths (the same
solver, the same plans). NCCL when ``scaling.use_gpu`` is true, gloo otherwise.

It is how the GPU check runs (the GPU machine has torch but no Ray) and how a user
debugs on one box. Run without torchrun, it trains as a world of one.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace

import torch

from knapray.config.run import TrainConfig
from knapray.worker.context import TorchrunContext

def build_parser() -> argparse.ArgumentParser:
    from knapray.commands.flags import Parser, add_config

    p = Parser(prog="python -m knapray.commands.torchrun",
               description="knapray training without Ray (launch with torchrun)")
    add_config(p, required=True)
    p.add_argument("--check", action="store_true",
                   help="run the pre-flight checks for this world ($WORLD_SIZE, else 1), print what was checked "
                   "and exit (0, or one line and 2) without joining the world or training")
    return p


def check_launch(cfg: TrainConfig) -> None:
    """What must hold before any rank joins the world (ValueError naming the value)."""
    if cfg.scaling.use_gpu and not torch.cuda.is_available():
        raise ValueError("scaling.use_gpu is true but CUDA is not available here; set scaling.use_gpu=false")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from knapray.driver import preflight
    from knapray.driver.report import max_steps_cap
    from knapray.driver.run_dir import resolve_paths

    rank_env = int(os.environ.get("RANK", "0"))
    lock = None
    try:
        if rank_env == 0 or args.check:  # rank 0 checks before the others can get past joining the world
            pre = preflight.check_file(args.config, args.set, worlds=[int(os.environ.get("WORLD_SIZE", "1"))])
            cfg = pre.cfg
        else:
            cfg = resolve_paths(preflight.load_run_config(args.config, args.set))  # the widths rank 0's has
        check_launch(cfg)
        if args.check:
            lines = pre.summary(args.config)
            if rank_env == 0:
                print("[knapray] pre-flight passed (nothing was started):\n" + "\n".join(f"  {x}" for x in lines))
            return 0
        if rank_env == 0:
            start, lock = preflight.prepare(pre)
            print(f"[knapray] {start.message}", flush=True)
            cap = max_steps_cap(cfg, pre.corpus.info.num_samples)
            if cap:
                print(f"[knapray] note: {cap}", flush=True)
    except (ValueError, OSError) as e:
        print(f"knapray torchrun: error: {e}", file=sys.stderr)
        return 2
    from knapray.distributed.local import init_from_env, shutdown
    from knapray.planning.rules import PER_STEP

    from knapray.worker.checkpoint import StorageFull, no_space
    from knapray.worker.guard import BadCorpus
    from knapray.driver.report import ledger_line, prediction_line, stopped_early_line, write_run_files
    from knapray.worker.trainer import Trainer

    # No Ray, so no coordinator actor: the ranks plan each step from an all-gather.
    cfg = replace(cfg, balance=replace(cfg.balance, coordinator=False))
    logging.basicConfig(level=logging.INFO if rank_env == 0 else logging.WARNING,
                        format=f"[rank {rank_env}] %(message)s")
    if cfg.distributed.gloo_socket_ifname:  # a CPU run's default group is gloo too
        os.environ["GLOO_SOCKET_IFNAME"] = cfg.distributed.gloo_socket_ifname
    try:
        rank, world, local_rank = init_from_env(cfg.scaling.use_gpu, cfg.distributed.timeout_s)
        try:
            summary = Trainer(TorchrunContext(cfg, rank, world, local_rank), cfg).train()
        except BadCorpus as e:  # every rank raises it together, from the same sums: rank 0 says it once
            if rank == 0:
                print(f"knapray torchrun: error: training failed: {e}", file=sys.stderr, flush=True)
            return 1
        except OSError as e:  # the environment, not the inputs: a full disk says where
            full = e if isinstance(e, StorageFull) else no_space(e, cfg.run_dir)
            if full is None:
                raise
            print(f"knapray torchrun: error: rank {rank}: {full.strerror}", file=sys.stderr, flush=True)
            return 1
        if rank == 0:
            out = write_run_files(cfg, summary)
            n_q = out["quarantined_samples"] + out["quarantined_shards"]
            per_step = (f" (per-step: {out['summary']['distinct_topologies']} distinct topologies)"
                        if cfg.balance.topology == PER_STEP and out["summary"].get("steps") else "")
            print(f"[knapray] done: {summary['steps']} steps on {world} ranks, topology {summary['topology']}{per_step}; "
                  f"{n_q} quarantined; run directory {cfg.run_dir}", flush=True)
            if "prediction_error_last" in out["summary"]:
                print(f"[knapray] {prediction_line(out['summary'])}", flush=True)
            early = stopped_early_line(cfg, summary)
            if early:
                print(f"[knapray] {early}", flush=True)
            gaps = ledger_line(out)
            if gaps:
                print(f"knapray torchrun: error: {gaps}", file=sys.stderr, flush=True)
                return 1
    finally:
        shutdown()
        if lock is not None:
            lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
