"""Data-parallel gradient reduction.

The loss of every rank is its local sum divided by the *global* token count, so the
single-process gradient is the SUM of the ranks' gradients (not the mean DDP takes).

Only for replicated parameters (``parallelize(fsdp="none")``): FSDP reduce-scatters sharded
gradients itself during backward, with the same summed semantics.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def allreduce_gradients(
    params: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup | None = None,
    extras: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Sum every parameter's gradient over ``group`` (None: the world) in one collective,
    and return ``extras`` (a 1-D float tensor: loss, timings, ...) summed in the same one.

    A parameter this rank did not use (``grad is None``, e.g. text weights on a rank whose
    chunks hold no text) takes part with zeros, so every rank sends the same buffer layout.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.requires_grad]
    sharded = [i for i, p in enumerate(params) if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"{len(sharded)} parameters are sharded DTensors (e.g. shape {tuple(params[sharded[0]].shape)}, "
            f"placements {params[sharded[0]].placements}): FSDP already summed their gradients during "
            "backward (ParallelModel.reduce_gradients knows which path applies)"
        )
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return extras
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    parts = [g.reshape(-1).to(torch.float32) for g in grads]
    if extras is not None:
        parts.append(extras.reshape(-1).to(device=parts[0].device if parts else extras.device, dtype=torch.float32))
    if not parts:
        return extras
    # One flat buffer: one collective instead of one per tensor.
    flat = torch.cat(parts)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
        offset += n
    return flat[offset:].cpu() if extras is not None else None
