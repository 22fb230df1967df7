"""Model FLOPs of the transformer blocks, the numerator of model TFLOP/s and MFU.

Per block and forward pass, a sequence of ``L`` tokens costs ``(8 + 4·r)·L·d²`` FLOPs in
its projections and MLP (q, k, v and output projections 4·d² multiply-adds per token, an
MLP of ratio ``r`` 2·r·d²; Flux's single-stream blocks fuse the same matrices) and
``4·L²·d`` in attention (``QKᵀ`` and ``PV``). A gated (SwiGLU) MLP (``cfg.gated_mlp``:
FLUX.2's) has three ``d x r·d`` matrices, not two: ``(8 + 6·r)·L·d²``. A training step is forward + backward, three
forward passes' worth. Embeddings, modulation and the final layer are left out (well
under 1% at Flux's size), and so is recomputation: activation checkpointing adds hardware
FLOPs, not model FLOPs.
"""

from __future__ import annotations

from collections.abc import Iterable

from knapray.models.config import DiTConfig

TRAIN_PASSES = 3.0


def hardware_passes(recomputed_fraction: float) -> float:
    """Forward-pass equivalents a training step executes when ``recomputed_fraction`` of the
    blocks (by FLOPs; every block of a model has the same) is checkpointed: forward +
    backward (3) plus the recomputed forwards, which model FLOPs do not credit."""
    if not 0 <= recomputed_fraction <= 1:
        raise ValueError(f"recomputed_fraction must be in [0, 1], got {recomputed_fraction!r}")
    return TRAIN_PASSES + recomputed_fraction


def model_tflops_bar(plain_bar: float, recomputed_fraction: float) -> float:
    """The model-TFLOP/s bar of a run that recomputes ``recomputed_fraction`` of its blocks,
    from the bar of the same run without checkpointing: the device does the same work per
    second, of which model FLOPs count 3 of every ``hardware_passes`` passes:
    ``bar = plain_bar * 3 / (3 + recomputed_fraction)`` (full checkpointing: 3/4)."""
    return plain_bar * TRAIN_PASSES / hardware_passes(recomputed_fraction)


def _linear_coefficient(cfg: DiTConfig) -> float:
    """FLOPs per token and d² of a block's projections and MLP: 8 + 4·r, or 8 + 6·r with a
    gated MLP (its gate, value and output matrices). ``gated_mlp`` is read with a default:
    callers pass config-like objects too."""
    return 8 + (6 if getattr(cfg, "gated_mlp", False) else 4) * cfg.mlp_ratio


def formula(cfg: DiTConfig) -> str:
    return (
        f"model FLOPs = 3 (fwd+bwd) x {cfg.depth_double + cfg.depth_single} blocks x "
        f"sum over sequences of ({_linear_coefficient(cfg):g}*L*d^2 + 4*L^2*d), d={cfg.hidden_size}"
    )


def model_flops(seq_lens: Iterable[int], cfg: DiTConfig, passes: float = TRAIN_PASSES) -> float:
    """FLOPs of ``passes`` passes of every block over whole sequences of ``seq_lens``."""
    d = float(cfg.hidden_size)
    linear, attn = 0.0, 0.0
    for length in seq_lens:
        n = float(length)
        linear += n
        attn += n * n
    per_pass = _linear_coefficient(cfg) * linear * d * d + 4.0 * attn * d
    return passes * (cfg.depth_double + cfg.depth_single) * per_pass


def attention_share(seq_lens: Iterable[int], cfg: DiTConfig) -> float:
    """The attention core's share (``4*L^2*d``) of the blocks' model FLOPs on ``seq_lens``:
    what ``selective`` checkpointing does not recompute."""
    total = model_flops(seq_lens, cfg, passes=1)
    attn = (cfg.depth_double + cfg.depth_single) * 4.0 * sum(float(n) ** 2 for n in seq_lens) * cfg.hidden_size
    return attn / total if total else 0.0


PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H100 PCIE": 756.0, "H100 NVL": 835.0, "H800": 989.0,
                    "A100": 312.0, "A800": 312.0, "L40S": 362.0, "B200": 2250.0, "GH200": 989.0}
"""Dense bf16 peak per GPU (vendor figures, no sparsity), for MFU."""


def peak_tflops(device_name: str) -> float | None:
    """The bf16 peak of a GPU by its name (``torch.cuda.get_device_name``); None if unknown."""
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # GH200 before H200, H100 PCIE before H100
        if key in device_name.upper():
            return PEAK_BF16_TFLOPS[key]
    return None
