"""Local multi-process worlds (gloo on 127.0.0.1) for parity checks and benchmarks."""

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


def init_local_gloo(rank: int, world_size: int, port: int, timeout_s: float = 120.0) -> None:
    """Join a gloo world on this machine, one thread per process (ranks share cores)."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
