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
from knapray.worker.timing import StepTimer

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


# ---- issue 19's fixes, confirmed where a GPU is (each also has a CPU test) ----------------


def test_torch_varlen_kernel_takes_a_scale_on_this_torch():
    """The installed torch's varlen_attn (2.10: no ``scale``; 2.11+: keyword) through the
    binding, against the fp32 reference, at a scale other than 1/sqrt(D)."""
    from knapray.attention import available_backends, reference_attention, varlen_attention

    if "torch_varlen" not in available_backends("cuda"):
        pytest.skip("this torch has no torch.nn.attention.varlen")
    lens = [128, 7, 300]
    cu = torch.tensor([0, 128, 135, 435], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(435, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = varlen_attention(q, k, v, cu, max(lens), backend="torch_varlen", scale=0.05)
    ref = reference_attention(q.float(), k.float(), v.float(), cu, scale=0.05)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_a_training_step_never_waits_for_the_device():
    """The trainer's timed region (forward + backward with a prepared StepLayout) under
    ``torch.cuda.set_sync_debug_mode("error")``: any .item(), nonzero, mask or blocking copy raises."""
    from knapray.models import MMDiT, flow_loss
    from knapray.testing.parity import parity_config
    from knapray.planning import Topology, WorkloadModel, plan_balance
    from knapray.testing.batches import mix_batches
    from knapray.worker.balanced import balanced_forward, prepare_step

    cfg = parity_config()
    host = mix_batches("g1b2i256f1s0,g1b1i128f2s0", cfg, scale=4, seed=1, world_size=None, max_text_tokens=20)[0]
    plan = plan_balance([host.seq_lens.tolist()], Topology.parse("g1n1"), WorkloadModel(d_model=cfg.hidden_size))
    model = MMDiT(cfg).cuda()
    batch = host.to("cuda")
    layout = prepare_step(host, plan, 0, host.text_tokens_per_sequence(), "cuda", bag_group=None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = balanced_forward(model, batch, plan, 0, bag_group=None, layout=layout)
            loss = flow_loss(out, batch.targets, host.x_img.shape[0])
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_meta_init_on_the_gpu_equals_the_cpu_built_model():
    from knapray.models import MMDiT
    from knapray.testing.parity import parity_config
    from knapray.worker.parallelize import materialize, parallelize

    torch.manual_seed(5)
    ref = MMDiT(parity_config())
    torch.manual_seed(5)
    with torch.device("meta"):
        model = MMDiT(parity_config())
    parallelize(model)
    materialize(model, "cuda")
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.device.type == "cuda" and torch.equal(p.cpu(), r), n


def test_fsdp_step_on_nccl_without_set_reduce_scatter_unused_params(nccl_world, monkeypatch):
    """As on torch 2.10 / 2.11: FSDP applies and trains with the method absent."""
    from torch.distributed.fsdp import FSDPModule

    from knapray.models import MMDiT, flow_loss
    from knapray.testing.parity import parity_config
    from knapray.testing.batches import mix_batches
    from knapray.distributed.parallel_dims import ParallelDims
    from knapray.config.parallel import ParallelConfig
    from knapray.worker.parallelize import parallelize

    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    cfg = parity_config()
    batch = mix_batches("g1b2i256f1s0", cfg, scale=4, seed=1, world_size=None, max_text_tokens=0)[0].to("cuda")
    model = MMDiT(cfg).cuda()
    par = parallelize(model, ParallelConfig(fsdp="full"), ParallelDims(world_size=1, device_type="cuda"),
                      compute_dtype=torch.bfloat16)
    flow_loss(model(batch), batch.targets, batch.x_img.shape[0]).backward()  # no text: text weights unused
    assert torch.isfinite(par.clip_grad_norm_(1.0))


def test_qk_norm_saves_what_the_memory_model_counts_on_cuda():
    from knapray.testing.memory_check import saved_activation_bytes
    from knapray.models.layers import RMSNorm
    from knapray.planning.costs.memory import ModelShape

    norm = RMSNorm(128).cuda()
    q = torch.randn(1000, 24, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _, saved = saved_activation_bytes(lambda: norm(q), exclude=[*norm.parameters(), q])
    shape = ModelShape(hidden_size=3072, num_heads=24, depth_double=0, depth_single=1, mlp_hidden=12288, patch_dim=64)
    assert 2 * saved == 1000 * shape._qk_norm(2)  # q's half of QK-norm


# ---- issue 28: gradient truth and step hygiene, where a GPU is ------------------------------


def test_gather_rows_sums_in_fp32_on_cuda_where_bf16_index_select_does_not():
    """CUDA's eager bf16 ``index_select`` backward (an ``index_add`` with bf16 atomics) and
    ``knapray.indexing.gather_rows`` on 4 sequences x 4,096 tokens of positive gradients."""
    from knapray.indexing import gather_rows

    index = torch.arange(4, device="cuda").repeat_interleave(4096)
    grad = (torch.rand(index.numel(), 64, device="cuda") + 0.5).to(torch.bfloat16)
    truth = grad.double().reshape(4, 4096, 64).sum(1)
    ours = torch.zeros(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gather_rows(ours, index).backward(grad)
    assert float((ours.grad.double() - truth).norm() / truth.norm()) < 4e-3


def test_optimizer_is_fused_on_cuda():
    from knapray.config.run import OptimSection
    from knapray.worker.optim import build_optimizer

    model = torch.nn.Linear(8, 8).cuda()
    opt = build_optimizer(model, OptimSection())
    assert opt.defaults.get("fused") is True


def test_attention_choice_on_this_gpu():
    """A few long equal-length sequences take cuDNN SDPA, many lengths the fused varlen
    kernel (or FA3/FA4 where torch's flash kernels are routed there)."""
    from knapray.attention import choose_backend, flash_impl

    cuda = torch.device("cuda")
    long = choose_backend([4292] * 4, cuda, torch.bfloat16, 24, 128, remember=False)
    many = choose_backend([256 * (1 + i % 6) for i in range(24)], cuda, torch.bfloat16, 24, 128, remember=False)
    if flash_impl() is None:
        assert long.backend == "sdpa" and many.backend in ("flash", "torch_varlen")
    else:
        assert long.backend == many.backend == "torch_varlen"
