"""Packed-sequence DiTs (knapray's MMDiT here, the other families in ``families/``):
architecture only (no process groups, attention injected)."""

from knapray.models.config import DiTConfig, MMDiTConfig, dit_config
from knapray.models.flow import add_noise, flow_inputs, flow_loss, sample_timesteps
from knapray.models.mmdit import MMDiT
from knapray.models.packing import PackedBatch, grid_positions, pack_samples, patchify, unpatchify

__all__ = [
    "DiTConfig",
    "MMDiT",
    "MMDiTConfig",
    "PackedBatch",
    "add_noise",
    "dit_config",
    "flow_inputs",
    "flow_loss",
    "grid_positions",
    "pack_samples",
    "patchify",
    "sample_timesteps",
    "unpatchify",
]
