"""``model.lora.base_dtype: fp8``: a LoRA run's frozen base held in float8 (knapray/models/fp8.py).

- The quantization: power-of-two scales per row, e4m3's rounding and nothing more.
- The layer: forward and input gradient equal to the dequantized weight's in bf16, compiled
  as eager, and what autograd keeps for backward is the float8 weight, not a bf16 copy.
- Per family (tiny diffusers Flux and Wan read through knapray's loader): the loss and the
  adapters' gradients with an fp8 base against a bf16 base, both against an fp32 base, within
  the bound stated in ``FP8_BOUND``; the base's bytes.
- The memory model and the config: FLUX.1-dev's base at about half its bf16 bytes, and an
  fp8 base refused in one line where it cannot run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from knapray.models.config import LoraConfig
from knapray.models.fp8 import FP8, FP8_MAX, Fp8Linear, dequantize, quantize_rows

FP8_BOUND = {"loss": 2e-3, "grads": 6e-2}
"""Relative distance from the fp32-base reference that an fp8 base may add over a bf16
base's own (loss: |a - b| / |b|; gradients: norm of the difference over the norm, all
adapters together). e4m3 rounds each weight by up to 2^-4 of it (bf16: 2^-9); over a
layer's sum of products the errors average out, so the outputs move by about 2^-4 /
sqrt(fan-in) relative, times the depth's growth."""


def test_rows_are_scaled_by_powers_of_two_and_rounded_as_e4m3_rounds():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=g) * torch.tensor([1e-6, 1e-2, 1.0, 3.0, 1e3, 0.0])[:, None]
    values, scale = quantize_rows(w)
    assert values.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
    assert float(values.float().abs().max()) <= FP8_MAX
    rows = w.abs().amax(dim=1)
    assert bool(((values.float().abs().amax(dim=1) >= FP8_MAX / 2) | (rows == 0)).all())  # no range wasted
    back = dequantize(values, scale, torch.float32)
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 of a normal value), subnormals below 2^-6
    # in steps of 2^-9: half a step absolute.
    bound = torch.maximum(w.abs() * 2.0**-4, 2.0**-10 * scale[:, None])
    assert bool(((back - w).abs() <= bound).all())
    assert bool((back[5] == 0).all()) and float(scale[5]) == 1.0
    # bf16 holds the dequantized values exactly (a float8 value times a power of two).
    assert torch.equal(dequantize(values, scale, torch.bfloat16).float(), back)


def _layer(seed: int = 1, out: int = 48, inp: int = 64) -> tuple[torch.nn.Linear, Fp8Linear]:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(inp, out)
    return lin, Fp8Linear.of(lin)


def test_the_layer_computes_what_its_dequantized_weight_computes_in_bf16():
    _, layer = _layer()
    weight = dequantize(layer.weight, layer.weight_scale, torch.bfloat16)
    x = torch.randn(37, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    ref_x = x.detach().clone().requires_grad_(True)
    ref = F.linear(ref_x.to(torch.bfloat16), weight, layer.bias.to(torch.bfloat16))
    assert torch.equal(y, ref)
    grad = torch.randn_like(y)
    y.backward(grad)
    ref.backward(grad)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, ref_x.grad)
    assert all(p.grad is None for p in layer.parameters())  # frozen: nothing accumulates


def test_backward_keeps_the_float8_weight_not_a_bf16_copy():
    _, layer = _layer(out=96, inp=80)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    x = torch.randn(5, 80, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x).sum().backward()
    weights = [d for shape, d in saved if shape == (96, 80)]
    assert weights == [FP8], saved


def test_compiled_as_eager_forward_and_backward_over_varying_sizes():
    """Inductor (dynamic shapes, as ``parallelize`` compiles blocks) computes what eager does."""
    _, layer = _layer(seed=3)
    compiled = torch.compile(layer, dynamic=True)
    for tokens in (29, 57, 130):
        x = torch.randn(tokens, 64, requires_grad=True)
        x2 = x.detach().clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager, got = layer(x), compiled(x2)
        grad = torch.randn_like(eager)
        eager.backward(grad)
        got.backward(grad)
        assert torch.equal(eager, got) and torch.equal(x.grad, x2.grad), tokens


def _tiny(family: str, tmp_path):
    if family == "flux":
        from flux_utils import save_tiny_flux

        return str(save_tiny_flux(tmp_path / "t", 2, 16, (4, 6, 6), 1, 2, True, text_dim=16, pooled_dim=12))
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                          out_channels=4, text_dim=12, freq_dim=32, ffn_dim=48, num_layers=2,
                          cross_attn_norm=True).save_pretrained(tmp_path / "t")
    return str(tmp_path / "t")


def _loss_and_grads(cfg, base: str):
    """The loss of a fixed target and the adapters' gradients, the base held as ``base``
    (fp32, bf16 or fp8) and computed under bf16 autocast (fp32 for the fp32 base)."""
    from knapray.models.families import build_model, fp8_base_layers
    from knapray.models.lora import hold_base_in, is_adapter
    from knapray.testing.reference import _pack, make_inputs
    from knapray.weights.load import load_pretrained

    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, base_dtype="fp8" if base == "fp8" else "compute"))
    with torch.device("meta"):
        model = build_model(cfg)
    dtype = torch.float32 if base == "fp32" else torch.bfloat16
    hold_base_in(model, dtype, fp8_base_layers(cfg))
    model.to_empty(device="cpu")
    load_pretrained(model, cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_adapter(n):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    batch = _pack(cfg, make_inputs(cfg, 2, seed=4))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=base != "fp32"):
        out = model(batch).float()
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    loss = ((out - target) ** 2).mean()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for n, p in sorted(model.named_parameters()) if is_adapter(n)])
    return float(loss.detach()), grads.double(), model


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_an_fp8_base_trains_its_adapters_as_a_bf16_base_within_the_stated_bound(family, tmp_path, capsys):
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from knapray.models.fp8 import base_bytes
    from knapray.testing.reference import reference_config
    from knapray.weights.checks import checkpoint_family
    from knapray.weights.source import open_pretrained

    path = _tiny(family, tmp_path)
    source = open_pretrained(path)
    cfg = dataclasses.replace(reference_config(source, checkpoint_family(source, family)), pretrained=path,
                              lora=LoraConfig(rank=4, alpha=4, targets=("attention",)))
    ref_loss, ref_grads, _ = _loss_and_grads(cfg, "fp32")
    results = {}
    for base in ("bf16", "fp8"):
        loss, grads, model = _loss_and_grads(cfg, base)
        results[base] = (abs(loss - ref_loss) / abs(ref_loss), float((grads - ref_grads).norm() / ref_grads.norm()),
                         base_bytes(model))
    fp8_layers = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    with capsys.disabled():
        for base, (dl, dg, nbytes) in results.items():
            print(f"\n{family} {base:4s} base: loss off fp32's {dl:.2e}, adapter gradients {dg:.2e}, "
                  f"frozen base {nbytes} bytes", end="")
    (bf_loss, bf_grads, bf_bytes), (f8_loss, f8_grads, f8_bytes) = results["bf16"], results["fp8"]
    assert fp8_layers and all(n.startswith(("double_blocks.", "single_blocks.")) for n in fp8_layers)
    # The fp8 base moves the result more than bf16 does (it is coarser), within the bound.
    assert f8_loss <= bf_loss + FP8_BOUND["loss"] and f8_grads <= bf_grads + FP8_BOUND["grads"]
    assert f8_grads > bf_grads  # the float8 weights are what the layers computed with
    assert f8_bytes < bf_bytes


def test_flux_dev_base_at_about_half_its_bf16_bytes_and_the_memory_model_counts_it(capsys):
    """On the meta device, FLUX.1-dev's shape with adapters on its attention: the frozen
    base's bytes as held, fp8 against bf16, and the memory model's parameter bytes for the
    same run on one GPU."""
    pytest.importorskip("peft")
    from knapray.config.run import load_config
    from knapray.models.families import adapter_counts, build_model, fp8_base_layers
    from knapray.models.fp8 import base_bytes
    from knapray.models.lora import hold_base_in
    from knapray.planning.costs.memory import memory_model_for_run

    held = {}
    for base in ("compute", "fp8"):
        cfg = load_config("jobs/configs/flux_dev_lora.yaml", [f"model.lora.base_dtype={base}", "scaling.num_workers=1",
                                                               "parallel.precision=bf16"])
        with torch.device("meta"):
            model = build_model(cfg.model)
        hold_base_in(model, torch.bfloat16, fp8_base_layers(cfg.model))
        mem = memory_model_for_run(cfg, trainable=adapter_counts(cfg.model))
        held[base] = (base_bytes(model), mem.breakdown(4096).params)
    (bf16, bf16_model), (fp8, fp8_model) = held["compute"], held["fp8"]
    with capsys.disabled():
        print(f"\nFLUX.1-dev's frozen base, LoRA on attention: bf16 {bf16 / 2**30:.2f} GiB, fp8 {fp8 / 2**30:.2f} GiB "
              f"({fp8 / bf16:.3f})", end="")
    assert 0.5 < fp8 / bf16 < 0.52, (fp8, bf16)  # the blocks are nearly all of it
    assert bf16 > 23e9  # 12B weights
    # The memory model's parameter bytes move by the same amount (adapters and small fp32
    # tensors beside the base are the same in both).
    assert abs((bf16_model - fp8_model) - (bf16 - fp8)) <= 0.01 * (bf16 - fp8), (bf16_model, fp8_model, bf16, fp8)


def test_an_fp8_base_where_it_cannot_run_is_one_line():
    from knapray.config.run import load_config
    from knapray.driver.preflight import RunError, check_lora

    with pytest.raises(ValueError, match=r"lora.base_dtype must be one of \['compute', 'fp8'\], got 'int8'"):
        LoraConfig(rank=4, base_dtype="int8")
    cfg = load_config("jobs/configs/flux_dev_lora.yaml", ["model.lora.base_dtype=fp8", "parallel.precision=fp32"])
    with pytest.raises(RunError, match="model.lora.base_dtype=fp8 .* not fp32"):
        check_lora(cfg)
