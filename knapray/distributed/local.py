"""Joining a process group outside Ray: local gloo worlds (127.0.0.1) for parity checks
and benchmarks, and the world a torchrun launch describes."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` for a local world (parity checks,
    benchmarks, the reference check): each rank is forked from a fork server that imported
    torch and ``fn``'s module once, not a fresh interpreter importing them again (about 2 s
    of CPU a rank). The server starts at the first call in this process and never touches
    CUDA; a rank that uses a GPU initializes it after the fork, as under spawn."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", fn.__module__])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def init_local_gloo(rank: int, world_size: int, port: int, timeout_s: float = 120.0) -> None:
    """Join a gloo world on this machine, one thread per process (ranks share cores)."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def init_from_env(use_gpu: bool, timeout_s: float) -> tuple[int, int, int]:
    """Join the world torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT); without them, a world of one on a free local port. NCCL for GPU runs
    (after binding this process to its GPU), gloo otherwise. Returns (rank, world, local_rank)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_gpu:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return rank, world, local_rank


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
