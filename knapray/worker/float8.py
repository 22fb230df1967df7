"""FP8 matmuls for full training: ``parallel.fp8: true`` (torchao's float8 training).

Which layers: the linear layers of the family's transformer blocks (attention and MLP
projections) over image tokens or all tokens, not their modulation (``*.mod.lin``: adaLN's
scales and shifts, a few thousand rows that every token's output depends on), not the
layers of text tokens alone (``TEXT_ONLY``) and nothing outside the blocks (embedders, the
final layer), and only where both sizes are multiples of 16 (what the float8 matmul takes). ``float8_layers`` is that rule alone: pure, for the config check, the
memory model and the tests.

How: each such ``nn.Linear`` becomes torchao's ``Float8Linear`` before compile, checkpointing
and FSDP wrap the blocks (``parallelize``). Its forward casts the input and the weight to
float8 e4m3 with a scale (``tensorwise``: one per tensor; ``rowwise``: one per row of each
operand, closer to the bf16 result) and runs the float8 matmul; the input gradient's matmul runs
in float8 too (e5m2 for the output's gradient with ``tensorwise``), the weight gradient's in
bf16 (``_config``: it contracts over the step's token count, which float8 takes in multiples of
16 only): two of a layer's three matmuls. The master weights, gradients and optimizer state stay
fp32; the embedders, modulation and final layer compute in the run's bf16.

Under FSDP2 with ``tensorwise`` the sharded weights are cast to float8 *before* the all-gather
(``enable_fsdp_float8_all_gather``): half the bytes of a bf16 gather on the wire and in the
gathered block; after each optimizer step the trainer computes the next step's scales for all
of them at once (``after_optimizer_step``). ``rowwise`` gathers in bf16 (its scales are per
row of the matmul's operand, not of the stored shard).

torchao is optional (``pip install -e '.[fp8]'``): imported here only when a run asks for it.
"""

from __future__ import annotations

import dataclasses
import re

import torch.nn as nn

from knapray.quiet_imports import load_torchao_quietly

SCALINGS = ("tensorwise", "rowwise")
BLOCK_LINEAR = re.compile(r"^(double_blocks|single_blocks)\.\d+\.")
MODULATION = re.compile(r"(^|\.)mod\.")
TEXT_ONLY = re.compile(r"\.txt\.|\.attn2\.to_[kv]$")
"""Layers that see text tokens only (Flux's text stream, Wan's cross-attention keys and
values): their token count is unbacked in the compiled blocks (``parallelize.TEXT_AXES``),
which torchao's layout checks cannot guard on, and text is a small share of a step's work."""
MULTIPLE = 16
"""The float8 matmul's operands: both sizes of the weight a multiple of this."""


def is_float8_layer(name: str, module: nn.Module) -> bool:
    """Whether ``parallel.fp8`` runs ``module`` (named ``name`` in the model) in float8."""
    return (isinstance(module, nn.Linear) and bool(BLOCK_LINEAR.match(name)) and not MODULATION.search(name)
            and not TEXT_ONLY.search(name) and module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0)


def float8_layers(model: nn.Module) -> list[str]:
    """The names of the layers ``parallel.fp8`` converts (a model on any device, meta too)."""
    return [name for name, m in model.named_modules() if is_float8_layer(name, m)]


def check_available() -> str | None:
    """None where torchao's float8 training imports; else one line saying what to install."""
    try:
        load_torchao_quietly()
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as e:  # ImportError, or a torchao built for another torch
        return (f"parallel.fp8 needs torchao's float8 training (pip install -e '.[fp8]'): "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return None


def convert(model: nn.Module, scaling: str, *, fsdp: bool) -> list[str]:
    """Swap the ``float8_layers`` of ``model`` for torchao's ``Float8Linear`` in place
    (before ``parallelize`` compiles, checkpoints and shards the blocks); returns their names.
    ``fsdp``: the model will be sharded (``tensorwise`` then gathers its weights in float8)."""
    if scaling not in SCALINGS:
        raise ValueError(f"parallel.fp8_scaling must be one of {list(SCALINGS)}, got {scaling!r}")
    load_torchao_quietly()
    from torchao.float8 import convert_to_float8_training

    _no_truth_test_of_the_scale()
    config = _config(scaling, fsdp)
    names = float8_layers(model)
    chosen = set(names)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    for name in names:
        _empty_input_as_zero_rows(model.get_submodule(name))
    return names


def _config(scaling: str, fsdp: bool):
    """torchao's config for ``scaling``, with the weight gradient's matmul in high precision.
    That matmul contracts over the step's tokens, which the float8 kernel takes in multiples
    of 16 only: torchao would pad them (``pad_inner_dim``) inside its backward, and compiled
    with dynamic token counts inductor fixed the padded copy's stride at the count it traced
    (a Ulysses bag's next step failed its stride assertion). The forward and the input
    gradient contract over the layer's own widths (multiples of 16 by the rule): float8."""
    from torchao.float8 import Float8LinearConfig  # torchao: loaded by ``convert``, the one caller
    from torchao.float8.config import CastConfig, ScalingType

    if scaling == "rowwise":
        config = Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    else:
        base = Float8LinearConfig.from_recipe_name("tensorwise")

        def off(operand):  # in high precision, its float8 dtype kept where the other matmul casts it
            return CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=operand.target_dtype)

        config = dataclasses.replace(base, cast_config_input_for_grad_weight=off(base.cast_config_input),
                                     cast_config_grad_output_for_grad_weight=off(base.cast_config_grad_output))
    return dataclasses.replace(config, pad_inner_dim=False, enable_fsdp_float8_all_gather=gathers_in_float8(scaling, fsdp))


def _empty_input_as_zero_rows(layer: nn.Module) -> None:
    """A rank without tokens still runs every layer (FSDP's collectives need every rank's
    gradients, zeros included), and a float8 scale of zero rows fails (a max over nothing):
    an empty input runs as ``MULTIPLE`` rows of zeros and the output is cut back to none, so
    the weight's gradient is the zeros FSDP expects, whatever the weight's form (plain, or
    gathered in float8)."""
    import torch.nn.functional as F

    fp8_forward = layer.forward

    def forward(x):
        if x.numel():
            return fp8_forward(x)
        zeros = F.pad(x.reshape(0, x.shape[-1]), (0, 0, 0, MULTIPLE))
        out = fp8_forward(zeros)
        return out[:0].reshape(*x.shape[:-1], out.shape[-1])

    layer.forward = forward


def gathers_in_float8(scaling: str, fsdp: bool) -> bool:
    """Whether FSDP gathers the float8 layers' weights in float8 (``convert``'s rule)."""
    return fsdp and scaling == "tensorwise"


def after_optimizer_step(model: nn.Module) -> None:
    """The next step's float8 scales of every FSDP-sharded float8 weight, in one pass (one
    all-reduce of their amaxes) rather than one per weight inside each all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # torchao: loaded by ``convert``

    precompute_float8_dynamic_scale_for_fsdp(model)


def _no_truth_test_of_the_scale() -> None:
    """torchao's FSDP weight wrapper (``WeightWithDynamicFloat8CastTensor``, 0.18) flattens
    itself with ``if self._precomputed_scale:``: the truth of a device tensor, a host sync
    each time the weight is flattened once its scale is precomputed (the FSDP memory
    tracker of ``knapray dryrun`` does it every step, where a fake tensor cannot be read at
    all). Replaced, where it is so, by the same flattening with ``is not None``."""
    import inspect

    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight  # loaded by ``convert``

    try:
        source = inspect.getsource(Weight.__tensor_flatten__)
    except (OSError, TypeError):
        return
    if "if self._precomputed_scale:" not in source:
        return

    def __tensor_flatten__(self):
        tensors = ["_tensor"] + (["_precomputed_scale"] if self._precomputed_scale is not None else [])
        return tensors, {"mm_config": self._linear_mm_config, "dtype": self._dtype}

    Weight.__tensor_flatten__ = __tensor_flatten__
