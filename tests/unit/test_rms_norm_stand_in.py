"""The dry run's stand-in of CUDA's fused RMSNorm (``knapray.testing.fakes.fused_rms_norm``):
the numbers of ``F.rms_norm`` on real CPU tensors, forward and both gradients, and on fake
tensors only what the fused kernel keeps (the input and a per-row fp32 rstd)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from knapray.testing.fakes import RMSNormStandIn, fused_rms_norm, kernel_rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [1e-6, None])
def test_stand_in_computes_what_rms_norm_computes(dtype, eps):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64, dtype=dtype) * 3
    w = (torch.randn(64) + 1).to(dtype)
    g = torch.randn(3, 5, 64, dtype=dtype)
    results = []
    for norm in (F.rms_norm, fused_rms_norm):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = norm(xx, (64,), ww, eps)
        out.backward(g)
        results.append((out.detach(), xx.grad, ww.grad))
    # fp32: the same formula up to the order of its sums; bf16: both compute in fp32 and round
    # once (torch's default bf16 tolerance, one ulp)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    for ref, got, what in zip(results[0], results[1], ("output", "input's gradient", "gain's gradient")):
        assert got.dtype == ref.dtype == dtype, what
        torch.testing.assert_close(got, ref, **tol, msg=what)


def test_stand_in_normalizes_over_several_trailing_dims_and_without_gain():
    torch.manual_seed(1)
    x = torch.randn(4, 6, 8, dtype=torch.float32)
    g = torch.randn(4, 6, 8)
    grads = []
    for norm in (F.rms_norm, fused_rms_norm):
        xx = x.clone().requires_grad_()
        norm(xx, (6, 8), None, 1e-5).backward(g)
        grads.append(xx.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


def test_stand_in_saves_the_input_and_a_per_row_rstd_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(100, 64, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(64, dtype=torch.bfloat16, requires_grad=True)
        out = fused_rms_norm(x * 1, (64,), w, 1e-6)  # x * 1: a non-leaf input, as a linear's output is
        saved = [(tuple(t.shape), t.dtype) for t in out.grad_fn.saved_tensors]
        out.backward(torch.empty_like(out))
        assert type(out.grad_fn).__name__ == RMSNormStandIn.__name__ + "Backward"
        assert out.dtype == torch.bfloat16
        # the input in its dtype, rstd (rows, 1) in fp32, the gain (the parameter itself)
        assert saved == [((100, 64), torch.bfloat16), ((100, 1), torch.float32), ((64,), torch.bfloat16)]
        assert (x.grad.shape, x.grad.dtype, w.grad.shape, w.grad.dtype) == \
            ((100, 64), torch.bfloat16, (64,), torch.bfloat16)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_a_gain_of_another_dtype_keeps_torchs_composite_and_the_patch_is_undone():
    x = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(8, dtype=torch.float32, requires_grad=True)
    with kernel_rms_norm():
        assert F.rms_norm is fused_rms_norm
        out = F.rms_norm(x, (8,), w, 1e-6)  # CUDA too runs the composite here
        assert "StandIn" not in type(out.grad_fn).__name__
    assert F.rms_norm is not fused_rms_norm
