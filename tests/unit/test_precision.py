"""bf16 on every path: q, k, v reach attention in one dtype, the model trains in both bf16
modes, mixed dtypes are refused, and ``auto`` picks a fused kernel for half precision.

The two bf16 modes:
- ``autocast``: fp32 parameters under ``torch.autocast(..., dtype=torch.bfloat16)``;
- ``bf16_params``: parameters cast to bf16, no autocast (what FSDP2's
  ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` hands the forward).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import pytest
import torch

from knapray import attention
from knapray.attention import LocalAttention, available_backends, reference_attention, varlen_attention
from knapray.distributed import UlyssesAttention
from knapray.models import MMDiT, MMDiTConfig, PackedBatch, add_noise, dit_config, flow_loss, pack_samples
from knapray.models.layers import LayerNorm, RMSNorm, apply_rope, rope_frequencies
from knapray.planning import identity_plan
from test_models import SMALL, SPECS, _model, _samples

MODES = ("fp32", "autocast", "bf16_params")
BF16_MODES = ("autocast", "bf16_params")
KINDS = ("mmdit", "dit")
# Relative (norm-wise) error of the bf16 model against the fp32 model, same weights and
# batch. Measured on CPU over 4 seeds, both kinds, both modes, sdpa and Ulysses: output
# <= 0.009, loss <= 0.0011, gradient (all parameters as one vector) <= 0.011, i.e. about two
# bf16 roundings (2**-8 each). Tolerances leave ~3x margin; a broken path (a skipped block,
# attention across sequences) is off by O(1).
OUT_RTOL, LOSS_RTOL, GRAD_RTOL = 3e-2, 1e-2, 4e-2


def _cfg(kind: str, **kw) -> MMDiTConfig:
    if kind == "mmdit":
        return MMDiTConfig(**{**SMALL, **kw})  # depth_double=2, depth_single=2, text tokens
    return dit_config(**{**{k: v for k, v in SMALL.items() if k != "text_dim"}, **kw})


def _batch(cfg: MMDiTConfig, seed: int = 0) -> PackedBatch:
    specs = SPECS if cfg.text_dim else [(0, t, h, w) for _, t, h, w in SPECS]
    batch = pack_samples(_samples(cfg, specs, seed), cfg)
    return add_noise(batch, torch.randn(batch.x_img.shape, generator=torch.Generator().manual_seed(seed + 1)))


@contextlib.contextmanager
def _in_mode(model: MMDiT, mode: str) -> Iterator[MMDiT]:
    """The model to run in ``mode`` (a bf16 copy for bf16_params), inside its autocast context."""
    if mode == "bf16_params":
        yield copy.deepcopy(model).to(torch.bfloat16)
    elif mode == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield model
    else:
        yield model


class DtypeSpy:
    """Wraps an attn callable; records the dtypes of q, k, v at every call."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner
        self.dtypes: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.dtypes.append((q.dtype, k.dtype, v.dtype))
        return self.inner(q, k, v)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _grads(model: MMDiT) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


# --- norms and RoPE return the compute dtype -------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_norms_and_rope_return_input_dtype(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 16, generator=gen)
    cos, sin = rope_frequencies(torch.randint(0, 9, (5, 3), generator=gen), (4, 6, 6), 10000.0)
    rms, ln = RMSNorm(16), LayerNorm(16)
    with torch.no_grad():
        rms.weight.add_(torch.randn(16, generator=gen) * 0.1)
    if mode != "fp32":
        x = x.bfloat16()
    if mode == "bf16_params":
        rms = rms.to(torch.bfloat16)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    with ctx:
        outs = rms(x), ln(x), apply_rope(x, cos, sin)
    assert [o.dtype for o in outs] == [x.dtype] * 3
    # fp32 math, one rounding to the output dtype
    x64 = x.double()
    rms_ref = x64 * (x64.pow(2).mean(-1, keepdim=True) + rms.eps).rsqrt() * rms.weight.double()
    ln_ref = torch.nn.functional.layer_norm(x64, (16,), eps=ln.eps)
    tol = {"rtol": 1e-5, "atol": 1e-5} if mode == "fp32" else {"rtol": 2**-8, "atol": 2**-8}
    torch.testing.assert_close(outs[0].double(), rms_ref, **tol)
    torch.testing.assert_close(outs[1].double(), ln_ref, **tol)


def test_layer_norm_in_fp32_is_torch_layer_norm() -> None:
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(0))
    ref = torch.nn.LayerNorm(32, elementwise_affine=False, eps=1e-6)
    assert torch.equal(LayerNorm(32)(x), ref(x))


# --- q, k, v arrive in one dtype ------------------------------------------------------------


@pytest.mark.parametrize("entry", ["forward", "stages"])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_attention_receives_one_dtype(mode: str, kind: str, qk_norm: bool, entry: str) -> None:
    cfg = _cfg(kind, qk_norm=qk_norm)
    batch = _batch(cfg)
    spy = DtypeSpy(LocalAttention(batch.cu_seqlens, batch.max_seqlen, backend="sdpa"))
    with _in_mode(_model(cfg), mode) as model:
        if entry == "forward":
            out = model(batch, spy)
        else:  # the stages as the balanced executor calls them
            vec = model.condition(batch.timesteps, batch.pooled)
            h = model.embed(batch.x_txt, batch.x_img, batch.is_text)
            h = model.blocks(h, vec, batch.seq_index, batch.pos, batch.is_text, spy)
            out = model.head(h, vec, batch.seq_index, batch.is_text)
    expected = torch.float32 if mode == "fp32" else torch.bfloat16
    assert len(spy.dtypes) == cfg.depth_double + cfg.depth_single
    assert set(spy.dtypes) == {(expected,) * 3}
    assert out.dtype == expected


# --- the whole model in bf16, forward and backward -----------------------------------------


def _attn_for(name: str, batch: PackedBatch) -> Callable:
    if name == "ulysses_bag_of_one":  # runs without a process group
        return UlyssesAttention(identity_plan([batch.seq_lens.tolist()]), 0, None)
    return LocalAttention(batch.cu_seqlens, batch.max_seqlen, backend=name)


@pytest.mark.parametrize("attn_name", ["sdpa", "auto", "ulysses_bag_of_one"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", BF16_MODES)
def test_bf16_forward_backward_close_to_fp32(mode: str, kind: str, attn_name: str) -> None:
    cfg = _cfg(kind)
    batch = _batch(cfg)
    fp32 = _model(cfg)
    ref_out = fp32(batch, _attn_for(attn_name, batch))
    ref_loss = flow_loss(ref_out, batch.targets, batch.x_img.shape[0])
    ref_loss.backward()

    spy = DtypeSpy(_attn_for(attn_name, batch))
    with _in_mode(_model(cfg), mode) as model:
        out = model(batch, spy)
        loss = flow_loss(out, batch.targets, batch.x_img.shape[0])
    loss.backward()

    assert set(spy.dtypes) == {(torch.bfloat16,) * 3}
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert torch.isfinite(loss)
    param_dtype = torch.float32 if mode == "autocast" else torch.bfloat16
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == param_dtype, name
        assert torch.isfinite(p.grad).all(), name
    assert _rel(out, ref_out) < OUT_RTOL
    assert abs(loss.item() - ref_loss.item()) < LOSS_RTOL * ref_loss.item()
    assert _rel(_grads(model), _grads(fp32)) < GRAD_RTOL


def test_flow_loss_is_fp32_for_bf16_prediction() -> None:
    gen = torch.Generator().manual_seed(0)
    pred = torch.randn(300, 16, generator=gen).bfloat16().requires_grad_()
    target = torch.randn(300, 16, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = flow_loss(pred, target, 500)
    exact = (pred.detach().double() - target.double()).pow(2).sum() / (500 * 16)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), exact, rtol=1e-6, atol=0)
    loss.backward()
    assert pred.grad.dtype == torch.bfloat16


# --- varlen_attention refuses mixed inputs ---------------------------------------------------


def _qkv(n: int = 6, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, 2, 8, generator=gen).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("odd", [0, 1, 2], ids=["q", "k", "v"])
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_mixed_dtypes_raise_naming_all_three(backend: str, odd: int) -> None:
    qkv = _qkv()
    qkv[odd] = qkv[odd].bfloat16()
    names = ["torch.float32"] * 3
    names[odd] = "torch.bfloat16"
    match = rf"one dtype, got q {names[0]}, k {names[1]}, v {names[2]}"
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        varlen_attention(*qkv, cu, 6, backend=backend)
    with pytest.raises(ValueError, match=match):
        LocalAttention(cu, 6, backend=backend)(*qkv)
    with pytest.raises(ValueError, match=match):  # refused before any exchange
        UlyssesAttention(identity_plan([[6]]), 0, None)(*qkv)


def test_non_float_and_mixed_device_inputs_raise() -> None:
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="floating point, got torch.int64"):
        varlen_attention(*(torch.ones(6, 2, 8, dtype=torch.long) for _ in range(3)), cu, 6)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="one device, got q cpu, k cpu, v meta"):
        varlen_attention(q, k, v.to("meta"), cu, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_sdpa_backend_takes_any_single_float_dtype(dtype: torch.dtype) -> None:
    lens = [2, 4, 2, 3]  # two sequences of one length: exercises the gather and scatter back
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q, k, v = (x.requires_grad_() for x in _qkv(sum(lens), dtype))
    out = varlen_attention(q, k, v, cu, max(lens), backend="sdpa")
    assert out.dtype == dtype
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2
    torch.testing.assert_close(out.float(), reference_attention(q, k, v, cu).float(), rtol=tol, atol=tol)
    out.float().sum().backward()
    assert all(x.grad.dtype == dtype for x in (q, k, v))


# --- auto picks a fused kernel for half precision --------------------------------------------


def _fake_kernel(calls: list, name: str) -> Callable:
    """Stands in for a fused CUDA kernel: checks the arguments it gets, computes with sdpa."""

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and type(max_q) is int and max_q == max_k
        if name == "flash":
            assert kw["causal"] is False and kw["dropout_p"] == 0.0
        calls.append((name, q.dtype, k.dtype, v.dtype))
        return attention._sdpa_varlen(q, k, v, cu_q, kw["softmax_scale" if name == "flash" else "scale"])

    return kernel


def test_kernel_usable_for_cuda_half_only() -> None:
    class FakeTensor:  # what _kernel_usable reads of a tensor; no CUDA here
        def __init__(self, is_cuda: bool, dtype: torch.dtype) -> None:
            self.is_cuda, self.dtype = is_cuda, dtype

    assert attention._kernel_usable(FakeTensor(True, torch.bfloat16))
    assert attention._kernel_usable(FakeTensor(True, torch.float16))
    assert not attention._kernel_usable(FakeTensor(True, torch.float32))
    assert not attention._kernel_usable(FakeTensor(False, torch.bfloat16))


@pytest.mark.parametrize(
    "flash, torch_varlen, expected",
    [(True, True, "flash"), (False, True, "torch_varlen"), (True, False, "flash"), (False, False, "sdpa")],
)
def test_auto_prefers_flash_then_torch_varlen(
    monkeypatch: pytest.MonkeyPatch, flash: bool, torch_varlen: bool, expected: str
) -> None:
    calls: list = []
    monkeypatch.setattr(attention, "_kernel_usable", lambda q: True)
    monkeypatch.setattr(attention, "_flash_varlen", _fake_kernel(calls, "flash") if flash else None)
    monkeypatch.setattr(attention, "_torch_varlen", _fake_kernel(calls, "torch_varlen") if torch_varlen else None)
    q, k, v = _qkv(dtype=torch.bfloat16)
    assert attention._resolve_backend("auto", q) == expected
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, 4)
    torch.testing.assert_close(out, reference_attention(q, k, v, cu), rtol=2e-2, atol=2e-2)
    assert calls == ([] if expected == "sdpa" else [(expected,) + (torch.bfloat16,) * 3])
    monkeypatch.setattr(attention, "_kernel_usable", lambda q: False)
    assert attention._resolve_backend("auto", q) == "sdpa"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", BF16_MODES)
def test_bf16_model_reaches_fused_kernel(monkeypatch: pytest.MonkeyPatch, mode: str, kind: str) -> None:
    """With the kernel's CUDA requirement lifted, a bf16 run of the model under ``auto`` sends
    every block's attention to the fused kernel (with fp32 q, k it silently took sdpa)."""
    calls: list = []
    monkeypatch.setattr(attention, "_kernel_usable", lambda q: q.dtype in attention._HALF_DTYPES)
    monkeypatch.setattr(attention, "_flash_varlen", None)
    monkeypatch.setattr(attention, "_torch_varlen", _fake_kernel(calls, "torch_varlen"))
    cfg = _cfg(kind)
    batch = _batch(cfg)
    with _in_mode(_model(cfg), mode) as model:
        out = model(batch, LocalAttention(batch.cu_seqlens, batch.max_seqlen, backend="auto"))
    out.float().square().sum().backward()
    assert calls == [("torch_varlen",) + (torch.bfloat16,) * 3] * (cfg.depth_double + cfg.depth_single)


# --- on a GPU ---------------------------------------------------------------------------------

FUSED_CUDA = [b for b in available_backends("cuda") if b != "sdpa"] if torch.cuda.is_available() else []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_autocast_bf16_uses_fused_kernel_and_matches_sdpa(kind: str) -> None:
    if not FUSED_CUDA:
        pytest.skip("no fused varlen kernel (flash_attn or torch varlen_attn) in this environment")
    # head_dim 64, as in real models: within every fused kernel's supported head dims.
    cfg = _cfg(kind, hidden_size=128, num_heads=2, rope_axes_dim=(16, 24, 24))
    batch = _batch(cfg).to("cuda")
    resolved: list[str] = []

    def run(backend: str) -> tuple[torch.Tensor, torch.Tensor, DtypeSpy]:
        model = _model(cfg).cuda()
        inner = LocalAttention(batch.cu_seqlens, batch.max_seqlen, backend=backend)

        def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            resolved.append(attention._resolve_backend(backend, q))
            return inner(q, k, v)

        spy = DtypeSpy(attn)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(batch, spy)
            loss = flow_loss(out, batch.targets, batch.x_img.shape[0])
        loss.backward()
        assert out.dtype == torch.bfloat16 and torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        return out.detach(), _grads(model), spy

    out, grads, spy = run("auto")
    assert set(spy.dtypes) == {(torch.bfloat16,) * 3}
    assert set(resolved) == {FUSED_CUDA[0]}  # flash if installed, else torch_varlen
    resolved.clear()
    ref_out, ref_grads, _ = run("sdpa")
    assert set(resolved) == {"sdpa"}
    # Both runs are bf16 and differ only in the attention kernel. On CPU, two bf16 attention
    # implementations (sdpa vs reference_attention under autocast) in this model differ by
    # <= 0.009 (output) and <= 0.012 (gradients) over 3 seeds: the shared tolerances hold.
    assert _rel(out, ref_out) < OUT_RTOL
    assert _rel(grads, ref_grads) < GRAD_RTOL
