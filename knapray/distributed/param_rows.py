"""Which rows of a full parameter this rank holds: the whole tensor for a plain one, an FSDP2
DTensor's own shard of dim 0 otherwise. What loading pretrained weights and drawing first
values (LoRA adapters) need to write only their own rows, the same for every sharding."""

from __future__ import annotations

import math

import torch


def shard_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(local tensor, first row, rows) of ``param`` within the full parameter: the whole
    tensor for a plain one; an FSDP2 DTensor's own shard of dim 0."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.data, 0, param.shape[0]
    start, rows = 0, param.shape[0]
    coordinate = param.device_mesh.get_coordinate()
    for axis, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if not (placement.is_shard() and placement.dim == 0):
            raise ValueError(f"cannot load into a parameter placed as {param.placements}: only Shard(0) "
                             "(FSDP2) and Replicate are supported")
        chunk = math.ceil(rows / param.device_mesh.size(axis))
        first = min(coordinate[axis] * chunk, rows)
        start, rows = start + first, min(chunk, rows - first)
    local = param.to_local()
    if local.shape[0] != rows:
        raise ValueError(f"a DTensor's local shard has {local.shape[0]} rows where its placement gives {rows}")
    return local, start, rows
