"""Packed-sequence DiT / MMDiT: architecture only (no process groups, attention injected)."""

from knapray.models.config import MMDiTConfig, dit_config
from knapray.models.flow import add_noise, flow_inputs, flow_loss, sample_timesteps
from knapray.models.mmdit import MMDiT
from knapray.models.packing import PackedBatch, grid_positions, pack_samples, patchify, unpatchify

__all__ = [
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
