"""Training without Ray, on one machine:

    torchrun --nproc-per-node N -m knapray.commands.torchrun --config FILE [--set key=value ...]

The same ``Trainer`` as under Ray Train, with a context that reads each rank's rows
straight from the corpus's parquet shards (``knapray.data.local_rows``: every N-th row)
and the same run directory (checkpoints, ledger, metrics). There is no coordinator actor, so
every step is planned by the ranks themselves from an all-gather of lengths (the same
solver, the same plans). NCCL when ``scaling.use_gpu`` is true, gloo otherwise.

It is how the GPU check runs (the GPU machine has torch but no Ray) and how a user
debugs on one box. Run without torchrun, it trains as a world of one.

What stops a rank is one line, never a rank's traceback: a file-system error names the file
and what was done to it (``rank 0: appending to the ledger journal <path>: No space left on
device``); SIGINT or SIGTERM (torchrun passes both on to every rank) closes the ledger and
the lock, rank 0 says where the run stopped, exit 130 or 143; a rank whose collective broke
because another rank stopped says so in one line (the other rank's line says why).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from dataclasses import replace

import torch

from knapray.config.run import TrainConfig
from knapray.file_errors import FileError
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
    local, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count() if cfg.scaling.use_gpu else 0
    if cfg.scaling.use_gpu and local > gpus:
        # each rank binds the GPU of its local rank: more ranks than GPUs on the node failed
        # each extra rank at an invalid device ordinal, after the world had been formed
        raise ValueError(f"scaling.use_gpu: torchrun starts {local} ranks on this node (--nproc-per-node), each on "
                         f"a GPU of its own, and it has {gpus}; --nproc-per-node {gpus} or fewer")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from knapray.driver import preflight
    from knapray.driver.report import run_length_note
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
            cap = run_length_note(cfg, pre.corpus.info.num_samples)
            if cap:
                print(f"[knapray] note: {cap}", flush=True)
    except (ValueError, OSError) as e:
        print(f"knapray torchrun: error: {e}", file=sys.stderr)
        return 2
    from knapray.distributed.local import init_from_env, shutdown
    from knapray.planning.search.rules import PER_STEP

    from knapray.stopping import stop_on_signals
    from knapray.driver.report import ledger_line, prediction_line, stopped_early_line, write_run_files
    from knapray.worker.trainer import Trainer

    # No Ray, so no coordinator actor: the ranks plan each step from an all-gather.
    cfg = replace(cfg, balance=replace(cfg.balance, coordinator=False))
    logging.basicConfig(level=logging.INFO if rank_env == 0 else logging.WARNING,
                        format=f"[rank {rank_env}] %(message)s")
    if cfg.distributed.gloo_socket_ifname:  # a CPU run's default group is gloo too
        os.environ["GLOO_SOCKET_IFNAME"] = cfg.distributed.gloo_socket_ifname
    rank = rank_env
    try:
        summary, failure, stops = None, None, None
        try:
            with stop_on_signals() as stops:
                trainer = None
                try:
                    rank, world, local_rank = init_from_env(cfg.scaling.use_gpu, cfg.distributed.timeout_s)
                    trainer = Trainer(TorchrunContext(cfg, rank, world, local_rank), cfg)
                    summary = trainer.train()
                except (Exception, KeyboardInterrupt) as e:
                    failure = e
                    if trainer is not None:
                        with contextlib.suppress(Exception):  # what stopped the rank says why, not this
                            trainer.close()  # the ledger journal, the metric sinks
        except KeyboardInterrupt as e:  # a signal while the failure above was being handled
            failure = failure or e
        if failure is not None:
            return _stopped(failure, rank, cfg, stops)
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


def _stopped(failure: BaseException, rank: int, cfg: TrainConfig, stops) -> int:
    """One line (or none) for what stopped this rank, and its exit code; anything else is
    raised, its traceback worth reading."""
    from knapray.driver.launch import interrupted_line
    from knapray.stopping import exit_code, signal_name
    from knapray.worker.checkpoint import StorageFull, no_space
    from knapray.worker.guard import BadCorpus

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if isinstance(failure, KeyboardInterrupt):  # SIGINT or SIGTERM: rank 0 says where the run stopped
        if rank == 0:
            say(f"knapray torchrun: stopped by {signal_name(failure, stops)}: {interrupted_line(cfg)}")
        return exit_code(failure, stops)
    if isinstance(failure, BadCorpus):  # every rank raises it together, from the same sums: rank 0 says it once
        if rank == 0:
            say(f"knapray torchrun: error: training failed: {failure}")
        return 1
    if isinstance(failure, OSError):  # the environment, not the inputs: the file and the operation
        full = failure if isinstance(failure, StorageFull) else None
        if full is None and not isinstance(failure, FileError):
            full = no_space(failure, cfg.run_dir)
        say(f"knapray torchrun: error: rank {rank}: {full.strerror if full is not None else failure}; "
            f"{interrupted_line(cfg)}")
        return 1
    if collective_failed(failure):
        if stops is None or not stops.count:  # torchrun stopping this rank (SIGTERM) is no news
            say(f"knapray torchrun: rank {rank} stopped: a collective failed ({_first_line(failure)}), as it does "
                "when another rank stops first: that rank's line says why")
        return 1
    raise failure


def collective_failed(error: BaseException) -> bool:
    """Whether ``error`` is a broken collective (a peer gone, a timeout): torch's own
    distributed errors, and gloo's, which are plain RuntimeErrors."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("gloo/transport" in text or "Connection closed by peer" in text
                                                or "ProcessGroupGloo" in text or "NCCL" in text)


def _first_line(error: BaseException) -> str:
    """The error's type and first sentence, without gloo's source location."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", lines[0] if lines else "")
    text = f"{type(error).__name__}: {text.split('. ')[0]}"
    return text if len(text) <= 300 else text[:297] + "..."


if __name__ == "__main__":
    from knapray.stopping import run_main

    run_main(main)
