"""GPU tier (``make gpu-check`` runs the ``gpu``-marked tests): NCCL step collectives and
CUDA-event step timing. Skipped without a CUDA device."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from knapray.distributed.local import free_port
from knapray.distributed.step_sync import StepSync
from knapray.timing import StepTimer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def nccl_world():
    """A NCCL-only world of one, as Ray Train gives a GPU worker."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_step_sync_on_a_nccl_only_group(nccl_world):
    sync = StepSync.build(torch.device("cuda", 0))
    loss = torch.tensor(2.5, device="cuda")
    sums, per_rank = sync.sum_over_ranks(summed={"loss": loss, "tokens": 7}, per_rank={"compute_s": 0.5})
    assert sums == {"loss": 2.5, "tokens": 7.0} and per_rank == {"compute_s": [0.5]}
    assert sync.gather_objects(("lens", [3, 4])) == [("lens", [3, 4])]
    assert sync.broadcast_object("g1n1") == "g1n1"
    # What the loop used to do: a CPU tensor on the NCCL group fails.
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.zeros(2), group=dist.group.WORLD)


def test_cuda_step_timer_measures_kernels_not_launches():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()

    def work():
        x = a
        for _ in range(20):
            x = x @ a
        return x

    work()  # warm-up
    ref_start, ref_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ref_start.record()
    work()
    ref_end.record()
    ref_end.synchronize()
    reference = ref_start.elapsed_time(ref_end) / 1e3
    t0 = time.thread_time()
    with StepTimer("cuda") as timer:
        work()
    launch_cpu = time.thread_time() - t0
    took = timer.result()
    assert took.clock == "cuda_events" and took.comm_s == 0.0
    assert took.compute_s == pytest.approx(reference, rel=0.25)
    # The host only launched the kernels: thread time would have measured that.
    assert launch_cpu < 0.5 * took.compute_s
