"""What a GPU cluster's torch and Ray need, checked without a GPU: the declared torch floor,
the Ray worker's device, the collective timeout and the gloo interface."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_declared_torch_floor_is_the_oldest_torch_whose_sources_were_checked():
    """torch 2.5 lacks get_total_norm, clip_grads_with_norm_ and torch.distributed.fsdp's
    fully_shard; every API knapray calls was checked in the 2.10 and 2.11 sources
    (docs/gpu.md lists the newer ones it guards)."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if re.match(r"torch\b", d)]
    floor = tuple(int(x) for x in re.search(r">=\s*([\d.]+)", torch_dep).group(1).split("."))
    assert floor[:2] == (2, 10), torch_dep
    assert "torch>=2.10" in (REPO / "docs" / "gpu.md").read_text()


def test_ray_worker_device_comes_from_ray_train_get_device(monkeypatch):
    """Ray maps a worker's GPU through CUDA_VISIBLE_DEVICES; the local rank need not be it."""
    import ray.train.torch

    from knapray.driver.launch import RayTrainContext

    bound = []
    monkeypatch.setattr(ray.train.torch, "get_device", lambda: torch.device("cuda", 2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    ctx = object.__new__(RayTrainContext)
    ctx.local_rank = 0  # what the old code bound: not the GPU Ray gave this worker
    assert ctx.device(True) == torch.device("cuda", 2) and bound == [torch.device("cuda", 2)]
    assert ctx.device(False) == torch.device("cpu")


def test_collective_timeout_outlasts_cold_compiles():
    from knapray.config.run import DistributedSection

    assert DistributedSection().timeout_s >= 1800  # torch's NCCL default; compiles take minutes per rank


def test_gloo_interface_is_settable_and_used_by_the_step_groups(monkeypatch, tmp_path):
    """``distributed.gloo_socket_ifname`` reaches GLOO_SOCKET_IFNAME before StepSync creates its gloo
    group: a name no interface has makes that creation fail, naming it."""
    import torch.distributed as dist

    from knapray.distributed.step_sync import StepSync
    from knapray.config.run import load_config

    assert load_config(None, ["distributed.gloo_socket_ifname=ens5"]).distributed.gloo_socket_ifname == "ens5"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    StepSync.build("cpu", gloo_socket_ifname="lo")  # no process group: a world of one
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="knapray0"):
            StepSync.build("cpu", gloo_socket_ifname="knapray0")
        sync = StepSync.build("cpu", gloo_socket_ifname="lo")
        assert sync.gather_objects("x") == ["x"]
    finally:
        dist.destroy_process_group()


def test_gpu_check_checkpointed_bar_follows_from_the_plain_one():
    """Model TFLOP/s count 3 passes per step; full checkpointing runs 4. At the same device
    throughput the checkpointed run reaches 3/4 of the plain run's model TFLOP/s, so its bar
    is the plain bar times 3/4 (a bar of 350 needed the plain run above 466.7)."""
    from knapray.models.flops import hardware_passes, model_tflops_bar
    from knapray.testing.gpu_check import FSDP_COMPILE_BAR, GPU_CHECKS

    bars = {c.name: c.min_tflops for c in GPU_CHECKS}
    assert bars["fsdp-compile"] == FSDP_COMPILE_BAR == 450.0
    assert bars["fsdp-compile-ac"] == pytest.approx(450.0 * 3 / 4)
    # The device work per second both bars demand is the same: bar x passes executed / 3.
    assert bars["fsdp-compile-ac"] * hardware_passes(1.0) / 3 == pytest.approx(bars["fsdp-compile"])
    assert model_tflops_bar(450.0, 0.5) == pytest.approx(450.0 * 3 / 3.5)  # every_2: half the blocks
