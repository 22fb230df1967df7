"""Varlen attention backends against a plain per-sequence softmax reference."""

from __future__ import annotations

import pytest
import torch

from knapray.attention import (
    LocalAttention,
    available_backends,
    reference_attention,
    varlen_attention,
)

CPU_BACKENDS = available_backends("cpu")
LENGTH_CASES = {
    "one": [7],
    "mixed": [5, 1, 9, 5, 3, 1, 12, 5],
    "length_one": [1, 1, 1],
    "with_empty_sequence": [4, 0, 3],
}


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _qkv(n: int, heads: int = 3, dim: int = 8, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, heads, dim, generator=gen, dtype=torch.float64).float().requires_grad_() for _ in range(3)]


def test_cpu_backends_are_sdpa_only() -> None:
    assert CPU_BACKENDS == ["sdpa"]


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["auto"])
@pytest.mark.parametrize("case", sorted(LENGTH_CASES))
def test_forward_and_grad_match_reference(backend: str, case: str) -> None:
    lens = LENGTH_CASES[case]
    cu = _cu(lens)
    q, k, v = _qkv(sum(lens))
    out = varlen_attention(q, k, v, cu, max(lens), backend=backend)
    ref = reference_attention(q, k, v, cu)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)

    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    # Gradients are compared at the project's fp32 parity bound (1e-5). They may not be held
    # tighter: a length-one sequence's dK is an exact cancellation (P = 1, so dS = dO.v - dO.o
    # = 0) that fp32 leaves at ~1e-6, and how much depends on the CPU's SIMD width (CI saw
    # 1.06e-6 where this machine sees less).
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-5)


def test_sequences_do_not_attend_across_boundaries() -> None:
    lens = [4, 6]
    q, k, v = (x.detach() for x in _qkv(10))
    out = varlen_attention(q, k, v, _cu(lens), 6, backend="sdpa")
    v2 = v.clone()
    v2[4:] += 100.0  # change only the second sequence's values
    out2 = varlen_attention(q, k, v2, _cu(lens), 6, backend="sdpa")
    torch.testing.assert_close(out[:4], out2[:4], rtol=0, atol=0)
    assert not torch.allclose(out[4:], out2[4:])


def test_custom_scale_matches_reference() -> None:
    lens = [3, 5]
    q, k, v = _qkv(8)
    out = varlen_attention(q, k, v, _cu(lens), 5, backend="sdpa", scale=0.3)
    torch.testing.assert_close(out, reference_attention(q, k, v, _cu(lens), scale=0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["auto"])
def test_zero_tokens_returns_empty_and_keeps_graph(backend: str) -> None:
    q, k, v = _qkv(0)
    out = varlen_attention(q, k, v, torch.zeros(1, dtype=torch.int32), 0, backend=backend)
    assert out.shape == (0, 3, 8)
    assert out.requires_grad
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g.shape == (0, 3, 8) for g in grads)


def test_bf16_sdpa_close_to_fp32_reference() -> None:
    lens = [6, 2, 6]
    q, k, v = (x.detach() for x in _qkv(14))
    out = varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), _cu(lens), 6, backend="sdpa")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference_attention(q, k, v, _cu(lens)), rtol=2e-2, atol=2e-2)


def test_unknown_backend_names_it_and_lists_valid() -> None:
    q, k, v = _qkv(4)
    with pytest.raises(ValueError, match=r"'nope'.*sdpa"):
        varlen_attention(q, k, v, _cu([4]), 4, backend="nope")
    with pytest.raises(ValueError, match="nope"):
        LocalAttention(_cu([4]), 4, backend="nope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal of CUDA-only kernels")
@pytest.mark.parametrize("backend", ["flash", "torch_varlen"])
def test_cuda_only_backends_refuse_cpu_tensors(backend: str) -> None:
    q, k, v = _qkv(4)
    with pytest.raises(RuntimeError, match=backend):
        varlen_attention(q, k, v, _cu([4]), 4, backend=backend)


@pytest.mark.parametrize(
    "bad",
    [[1, 4], [0, 5], [0, 3, 2, 4]],
    ids=["not_from_zero", "wrong_total", "decreasing"],
)
def test_bad_cu_seqlens_rejected(bad: list[int]) -> None:
    q, k, v = _qkv(4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention(q, k, v, torch.tensor(bad, dtype=torch.int32), 4, backend="sdpa")


def test_mismatched_qkv_shapes_rejected() -> None:
    q, k, _ = _qkv(4)
    with pytest.raises(ValueError, match=r"\(N, H, D\)"):
        varlen_attention(q, k, k[:3], _cu([4]), 4, backend="sdpa")


def test_local_attention_callable_matches_function() -> None:
    lens = [2, 5]
    q, k, v = _qkv(7)
    attn = LocalAttention(_cu(lens), 5, backend="sdpa")
    torch.testing.assert_close(attn(q, k, v), varlen_attention(q, k, v, _cu(lens), 5, backend="sdpa"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", [b for b in available_backends("cuda") if b != "sdpa"])
def test_cuda_kernels_match_reference(backend: str) -> None:
    lens = LENGTH_CASES["mixed"]
    q, k, v = (x.detach().cuda().bfloat16().requires_grad_() for x in _qkv(sum(lens), dim=64))
    cu = _cu(lens).cuda()
    out = varlen_attention(q, k, v, cu, max(lens), backend=backend)
    ref = reference_attention(q, k, v, cu)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.float().sum(), (q, k, v))
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), rg.float(), rtol=5e-2, atol=5e-2)


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's ``varlen_attn`` signature (no scale: always 1/sqrt(D)), computed by the reference."""
    assert not is_causal and return_aux is None
    return reference_attention(query, key, value, cu_seq_q)


def _varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1)):
    """torch 2.11's ``varlen_attn`` signature (keyword-only scale)."""
    assert return_aux is None and tuple(window_size) == (-1, -1)
    return reference_attention(query, key, value, cu_seq_q, scale=scale)


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("fn", [_varlen_2_10, _varlen_2_11], ids=["torch-2.10", "torch-2.11"])
def test_torch_varlen_binds_the_2_10_and_2_11_signatures(monkeypatch, fn, scale):
    """The torch_varlen backend on both signatures of torch's varlen_attn (2.10 has no
    ``scale``): forward and backward equal the reference at the requested scale."""
    import knapray.attention as attention

    monkeypatch.setattr(attention, "_torch_varlen", fn)
    monkeypatch.setattr(attention, "_kernel_usable", lambda q: True)  # the stand-ins run on CPU
    lens = [3, 5, 1]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(9, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    out = varlen_attention(q, k, v, _cu(lens), 5, backend="torch_varlen", scale=scale)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = reference_attention(q, k, v, _cu(lens), scale=scale)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


# ---- the kernel chosen per step -------------------------------------------------------------


@pytest.fixture
def fresh_shapes(monkeypatch):
    from knapray import attention

    monkeypatch.setattr(attention, "_SEEN_SHAPES", set())
    return attention


def test_step_takes_sdpa_on_few_long_runs_and_varlen_on_many_lengths(fresh_shapes) -> None:
    """The H100's numbers (docs/gpu.md): cuDNN SDPA 429 vs FA2 varlen 250 model TFLOP/s on
    4 x 4292 tokens, 52 vs 214 on 24 sequences of 256-1536."""
    from knapray.attention import choose_backend

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    fused = "flash" if "flash" in fresh_shapes.available_backends("cuda") else "torch_varlen"
    long = choose_backend([4292] * 4, cuda, bf16, 24, 128)
    assert long.backend == "sdpa" and "1 runs of equal length carry 100%" in long.reason
    mixed = [256 * (1 + i % 6) for i in range(24)]
    many = choose_backend(mixed, cuda, bf16, 24, 128)
    assert many.backend == fused and "24 runs" in many.reason
    # A long video beside many small images: the video's run carries most of sum(L^2), but
    # 5 runs are too many calls.
    assert choose_backend([32760, 256, 512, 256, 1024], cuda, bf16, 24, 128).backend == fused
    # Two long runs, both new: varlen; the same shapes again: sdpa (cuDNN's graphs repeat).
    first = choose_backend([8192, 4096, 4096], cuda, bf16, 24, 128)
    assert first.backend == fused and first.reason.startswith("2 new shapes")
    assert choose_backend([8192, 4096, 4096], cuda, bf16, 24, 128).backend == "sdpa"
    assert choose_backend([4096, 4096, 8192], cuda, bf16, 24, 128).backend == "sdpa"  # the same two calls
    # Short sequences, one of each length: no run carries the work.
    short = choose_backend([300, 400], cuda, bf16, 24, 128)
    assert short.backend == fused and "carry 0%" in short.reason
    # No fused kernel for fp32 or off CUDA.
    assert choose_backend([4292] * 4, cuda, torch.float32, 24, 128).backend == "sdpa"
    assert choose_backend([4292] * 4, torch.device("cpu"), bf16, 24, 128).reason == "no fused kernel for cpu bfloat16"


def test_an_activated_flash_impl_takes_every_step(fresh_shapes, monkeypatch) -> None:
    monkeypatch.setattr(fresh_shapes, "flash_impl", lambda: "FA3")
    choice = fresh_shapes.choose_backend([4292] * 4, torch.device("cuda"), torch.bfloat16, 24, 128)
    assert choice == fresh_shapes.AttentionChoice("torch_varlen", "FA3 (activate_flash_attention_impl)")
    assert fresh_shapes.activate_flash_impl("cpu") is None  # nothing to route off CUDA


def test_a_flash_impl_that_does_not_load_leaves_fa2_and_says_why(monkeypatch, caplog) -> None:
    """FA4 installed but broken (on the H200: its cutlass DSL without the compiler library,
    "No CTK flavor installed"; any error, an OSError of a shared library too) never stops a
    run: torch's FA2 stays, and the reason is kept and logged once."""
    import importlib.util
    import logging

    import torch.nn.attention as nn_attention

    import knapray.attention as attention

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(nn_attention, "list_flash_attention_impls", lambda: ["FA3", "FA4"], raising=False)
    monkeypatch.setattr(nn_attention, "current_flash_attention_impl", lambda: None, raising=False)
    monkeypatch.setattr(attention, "FLASH_UNUSABLE", {})

    def find_spec(name, *args):
        if name == "flash_attn_interface":
            return None  # FA3 not installed
        raise OSError("libcute_dsl_runtime.so: cannot open shared object file")

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with caplog.at_level(logging.WARNING, logger="knapray.attention"):
        assert attention.activate_flash_impl("cuda:0") is None
        assert attention.activate_flash_impl("cuda:0") is None
    assert attention.FLASH_UNUSABLE == {"FA4": "OSError: libcute_dsl_runtime.so: cannot open shared object file"}
    assert [r.getMessage() for r in caplog.records] == [
        "FA4 is installed but does not load here (OSError: libcute_dsl_runtime.so: cannot open shared object "
        "file): torch's FA2 stays"]


def test_ulysses_attention_records_its_choice() -> None:
    from knapray.distributed import UlyssesAttention
    from knapray.planning import Topology, WorkloadModel, plan_balance

    plan = plan_balance([[5, 7]], Topology.parse("g1n1"), WorkloadModel(d_model=8))
    attn = UlyssesAttention(plan, 0, None)
    q = torch.randn(12, 2, 4)
    attn(q, q, q)
    assert attn.choice.backend == "sdpa" and attn.choice.reason == "no fused kernel for cpu float32"
    fixed = UlyssesAttention(plan, 0, None, backend="sdpa")
    fixed(q, q, q)
    assert fixed.choice.reason == "set by the caller"


def test_the_gpu_extra_brings_fa4_where_it_has_wheels_and_nothing_elsewhere():
    """``pip install -e '.[gpu]'``: flash-attn-4 (the package of ``FLASH_IMPLS['FA4']``'s
    module) on Linux x86_64/aarch64, where nvidia-cutlass-dsl has wheels; nothing to build
    anywhere (FA2's source build is the separate ``fa2`` extra)."""
    import pathlib
    import tomllib

    from packaging.requirements import Requirement

    from knapray.attention import FLASH_IMPLS

    extras = tomllib.loads((pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    (gpu,) = (Requirement(r) for r in extras["gpu"])
    assert gpu.name == "flash-attn-4" and FLASH_IMPLS["FA4"][0].startswith("flash_attn.cute")
    assert gpu.specifier.contains("4.0.0b36", prereleases=True)
    linux = {"sys_platform": "linux", "platform_machine": "x86_64"}
    assert gpu.marker.evaluate(linux) and gpu.marker.evaluate({**linux, "platform_machine": "aarch64"})
    assert not gpu.marker.evaluate({"sys_platform": "darwin", "platform_machine": "arm64"})
    assert [Requirement(r).name for r in extras["fa2"]] == ["flash-attn"]
