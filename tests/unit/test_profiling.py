"""metrics.profile_steps and knapray bench kernels: the pure summary, the config rule, the bench
on CPU (the GPU numbers are in docs/gpu.md, from the GPU check's machine)."""

from __future__ import annotations

import json

import pytest
import torch

from knapray.testing.kernels import matmul_shapes, report, run
from knapray.config.run import ConfigError, load_config
from knapray.worker.profiling import Interval, StepProfiler, busy_us, kind_of, summarize


def test_busy_time_counts_overlapping_kernels_once():
    ivs = [Interval("a", 0, 10), Interval("b", 5, 15), Interval("c", 20, 30), Interval("d", 22, 25)]
    assert busy_us(ivs) == 25.0
    assert busy_us([]) == 0.0


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_192x208_64x4_2x1_v_bz_coopB_NNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
    ("aten::addmm", "matmul"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("ncclDevKernel_AllGather_RING_LL", "communication"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("triton_red_fused__to_copy_add_mul_0", "compiled"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise/other"),
    ("aten::mul", "elementwise/other"),
])
def test_kernel_kinds(name, kind):
    assert kind_of(name) == kind


def test_summary_shares_add_up_and_name_the_heaviest():
    kernels = [Interval("nvjet_gemm", 0, 60), Interval("flash_fwd_kernel", 60, 90), Interval("triton_poi_fused", 95, 100)]
    text = summarize(kernels, wall_us=200.0, steps=2)
    assert "device busy: 0.1 ms = 47.5% of the wall time" in text  # 95 of 200 us busy
    assert "matmul" in text and "63.2%" in text  # 60 of 95 us of kernels
    assert text.splitlines()[-3].strip().endswith("nvjet_gemm")  # first of the top list
    assert summarize([], 100.0, 1).endswith("no kernels recorded")


def test_profile_steps_must_be_a_window():
    assert load_config(None, ["metrics.profile_steps=[2, 5]"]).metrics.profile_steps == (2, 5)
    assert load_config(None, []).metrics.profile_steps == (0, 0)
    with pytest.raises(ConfigError, match=r"profile_steps \[3, 3\] is empty"):
        load_config(None, ["metrics.profile_steps=[3, 3]"])
    with pytest.raises(ConfigError, match="metrics.profile_steps"):
        load_config(None, ["metrics.profile_steps=[-1, 2]"])


def test_profiler_writes_a_trace_and_a_summary_for_its_window_only(tmp_path):
    prof = StepProfiler(str(tmp_path), 0, (1, 3), torch.device("cpu"))
    w = torch.randn(64, 64, requires_grad=True)
    for step in range(5):
        with prof.step(step):
            (torch.randn(32, 64) @ w).square().sum().backward()
    prof.close()
    text = (tmp_path / "profile" / "rank0.txt").read_text()
    assert text.startswith("profiled steps: 2,")
    assert "matmul" in text and "aten::mm" in text
    assert (tmp_path / "profile" / "rank0.trace.json").stat().st_size > 0


def test_profile_counts_the_host_syncs_of_each_step(tmp_path):
    """A step that reads a value back (``.item()``) counts it; one that does not counts 0."""
    prof = StepProfiler(str(tmp_path), 0, (1, 4), torch.device("cpu"))
    w = torch.randn(16, 16, requires_grad=True)
    for step in range(5):
        with prof.step(step):
            loss = (torch.randn(8, 16) @ w).square().sum()
            loss.backward()
            if step == 2:
                loss.item(), bool(loss > 0)
    prof.close()
    numbers = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    assert numbers["host_syncs_per_step"] == [0, 2, 0] and numbers["first_step"] == 1
    assert "host syncs per step: step 1: 0, step 2: 2, step 3: 0" in (tmp_path / "profile" / "rank0.txt").read_text()


def test_profiler_off_profiles_nothing(tmp_path):
    prof = StepProfiler(str(tmp_path), 0, None, torch.device("cpu"))
    with prof.step(0):
        pass
    prof.close()
    assert not (tmp_path / "profile").exists()


def test_kernel_bench_on_cpu_prices_every_piece():
    r = run(hidden=64, heads=2, lengths=(40, 24), dtype=torch.float32, device="cpu", warmup=0, repeat=1)
    pieces = [p["piece"].split(" (")[0] for p in r["pieces"]]
    assert pieces == ["matmul qkv", "matmul out", "matmul mlp_up", "matmul mlp_down", "attention sdpa"]
    # the block's forward matmul FLOPs are 24*N*d^2 (models.flops)
    assert sum(2 * k * n for _, k, n in matmul_shapes(64)) == 24 * 64 * 64
    assert r["ceiling_tflops"] > 0 and r["best_attention"] == "sdpa"
    assert "ceiling:" in report(r)
    with pytest.raises(ValueError, match="not a multiple"):
        run(hidden=64, heads=3, device="cpu")


def test_kernel_bench_bad_flag_is_one_line_and_exit_2(capsys):
    from knapray.cli import main

    assert main(["bench", "kernels", "--hidden", "64", "--heads", "3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "knapray bench kernels: error: --hidden 64 is not a multiple of --heads 3"
    assert main(["bench", "kernels", "--repeat", "5000", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == "knapray bench kernels: error: --repeat 5000: at most 1000"


def test_kernel_bench_command_on_cpu(capsys):
    from knapray.cli import main

    assert main(["bench", "kernels", "--device", "cpu", "--hidden", "32", "--heads", "2", "--seq-lens", "8,8",
                 "--warmup", "0", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "kernel ceiling on cpu" in out and "float32" in out and "ceiling:" in out


def test_kernel_bench_fp8_times_bf16_and_both_scalings(capsys):
    """``knapray bench kernels --fp8``: the block's four matmuls compiled in bf16 and in float8
    (each scaling, as parallel.fp8 configures them), ratios printed; on CPU the chain only."""
    pytest.importorskip("torchao.float8")
    from knapray.cli import main

    assert main(["bench", "kernels", "--fp8", "--hidden", "64", "--seq-lens", "96", "--device", "cpu", "--warmup",
                 "0", "--repeat", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["seconds"]) == {"bf16", "tensorwise", "rowwise"} and all(t > 0 for t in r["seconds"].values())
    assert r["tokens"] == 96 and r["model_flops"] == 3 * 24 * 96 * 64 * 64  # 24*N*d^2 forward, x3
    assert r["speedup"]["tensorwise"] == pytest.approx(r["seconds"]["bf16"] / r["seconds"]["tensorwise"])


def test_each_step_is_counted_once_where_the_device_timeline_repeats_its_range():
    """On CUDA a ``record_function`` range is also an event of the device's timeline: the H200's
    3 profiled steps came out as 6 (host syncs "per step" for steps 5-10) with a wall time holding
    both. Only the host's ranges are steps."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from knapray.worker.profiling import _intervals, host_syncs_per_step

    def event(name, start, end, device=DeviceType.CPU):
        return NS(name=name, device_type=device, self_cpu_time_total=0,
                  time_range=NS(start=start, end=end, elapsed_us=lambda: end - start))

    events = [event("knapray_step", 0, 100), event("knapray_step", 100, 200),
              event("knapray_step", 40, 150, DeviceType.CUDA), event("knapray_step", 150, 260, DeviceType.CUDA),
              event("aten::_local_scalar_dense", 120, 121), event("cudaStreamSynchronize", 130, 140),
              event("nvjet_gemm", 50, 140, DeviceType.CUDA)]
    prof = NS(events=lambda: events)
    assert host_syncs_per_step(prof) == [0, 2]
    kernels, wall = _intervals(prof, "cuda")
    assert wall == 200 and [k.name for k in kernels] == ["nvjet_gemm"]
