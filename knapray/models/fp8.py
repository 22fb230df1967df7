"""A frozen linear layer held in float8: ``model.lora.base_dtype: fp8``.

A LoRA run trains adapters only; the base's block weights are read, never written. Held in
float8 (e4m3) with one scale per output channel they take 1 byte a weight instead of bf16's
2, and are turned back into the compute dtype inside the layer's matrix product, one layer
at a time.

- **Scales.** Each output row's scale is the power of two that brings the row's largest
  magnitude to at most e4m3's 448 (``quantize_rows``): the scaled values round to e4m3 (3
  mantissa bits), and multiplying them back by a power of two is exact in bf16 and fp32,
  so the only error is e4m3's rounding, at most 2^-4 of a value in e4m3's normal range.
  A row is quantized from its own values alone, so a rank holding some rows of a sharded
  weight quantizes its rows by itself.
- **Where.** Every linear layer of the family's blocks (its ``all-linear`` LoRA preset:
  attention, MLP and modulation): the base layer under an adapter, or the plain layer
  where none is. Embedders and the final layer keep the compute dtype (``hold_base_in``).
- **Memory in backward.** ``_Fp8Linear`` saves the float8 weight and its scales for the
  backward pass (the input's gradient needs the weight), not the dequantized copy autograd
  would keep for every layer until backward: the base stays at 1 byte a weight through the
  step. Under FSDP2 the sharded weight is float8 and gathered in the compute dtype (its
  mixed precision casts float8 exactly); the scales are a parameter sharded with it.

Only a pretrained base is quantized (``load_pretrained`` quantizes rows as it reads them);
the config refuses ``fp8`` without ``model.pretrained``.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""e4m3's largest finite magnitude."""
SCALE = "weight_scale"
"""The scales' parameter name beside ``weight``."""


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (out, in) as float8 values and per-row power-of-two fp32 scales (out,), with
    ``w ~= values * scales[:, None]`` (rows of zeros get scale 1)."""
    amax = w.detach().abs().amax(dim=1).float()
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX))), torch.ones_like(amax))
    return (w.float() / scale[:, None]).to(FP8), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values * scale[:, None]`` in ``dtype`` (exact: the scale is a power of two)."""
    return values.to(dtype) * scale.to(dtype)[:, None]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def input_for(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype of ``linear``'s weight (a layer whose input does not follow
    autocast, e.g. beside bf16-held weights), except for a float8 layer, which casts its
    input to its compute dtype itself."""
    dtype = linear.weight.dtype
    return x if dtype == FP8 else x.to(dtype)


def _linear(x, values, scale, bias, dtype):
    return F.linear(x.to(dtype), dequantize(values, scale, dtype), None if bias is None else bias.to(dtype))


class _Fp8Linear(torch.autograd.Function):
    """``x @ dequantize(w, s).T + b`` in the compute dtype (autocast's, else the input's),
    saving the float8 weight, not its dequantized copy, for the input's gradient. The weight,
    scales and bias are frozen: no gradient for them."""

    @staticmethod
    def forward(ctx, x, values, scale, bias):
        dtype = _compute_dtype(x)
        if torch.amp.is_autocast_available(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                y = _linear(x, values, scale, bias, dtype)
        else:  # (the meta device of a dry run: no autocast there)
            y = _linear(x, values, scale, bias, dtype)
        ctx.save_for_backward(values, scale)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        values, scale = ctx.saved_tensors
        grad_x = grad.to(ctx.dtype) @ dequantize(values, scale, ctx.dtype)
        return grad_x.to(ctx.x_dtype), None, None, None


class Fp8Linear(nn.Module):
    """A frozen ``nn.Linear`` held in float8 with per-output-channel scales (module
    docstring). Parameter names as ``nn.Linear``'s (``weight``, ``bias``) plus
    ``weight_scale``; the bias keeps its dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *, device=None,
                 bias_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device),
                                 requires_grad=False) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear) -> "Fp8Linear":
        """An empty float8 layer of ``linear``'s shape, on its device (meta included)."""
        bias = linear.bias
        return cls(linear.in_features, linear.out_features, bias is not None, device=linear.weight.device,
                   bias_dtype=bias.dtype if bias is not None else torch.float32)

    @classmethod
    def of(cls, linear: nn.Linear) -> "Fp8Linear":
        """``linear``'s values quantized (a module with real weights, as the tests build)."""
        layer = cls.like(linear)
        values, scale = quantize_rows(linear.weight)
        with torch.no_grad():
            layer.weight.copy_(values)
            layer.weight_scale.copy_(scale)
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp8Linear.apply(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, per-row scales"


def hold_in_fp8(model: nn.Module, patterns: tuple[str, ...], suffix: str = "") -> list[str]:
    """Replace the linear layers whose module names, less ``suffix`` (LoRA's ``.base_layer``,
    where an adapter wraps the layer), match ``patterns`` in full by empty ``Fp8Linear``
    layers (call on the meta device, before ``parallelize``; the weights come from
    ``load_pretrained``). Adapter layers (``.lora_``) are left alone. Returns the replaced
    layers' names."""
    done = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or ".lora_" in name:
            continue
        plain = name.removesuffix(suffix) if suffix else name
        if not any(re.fullmatch(p, plain) for p in patterns):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.like(module))
        done.append(name)
    return done


def is_scale(name: str) -> bool:
    """A float8 layer's scales (no checkpoint holds them: computed from the weight)."""
    return name.endswith("." + SCALE)


def base_bytes(model: nn.Module) -> int:
    """Bytes of the frozen parameters as held (float8 weights, their scales, the rest)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
