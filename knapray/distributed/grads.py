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


@torch.no_grad()
def global_grad_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` taken whole, the same 0-d float32 tensor on every rank: a
    DTensor gradient (FSDP's shards, HSDP's replicated shards) counts its local tensor, whose
    squares are summed over each mesh dimension it is sharded on (replicas count once), one
    all-reduce per such set of groups; a plain gradient counts whole (a replicated
    parameter's gradient is the same on every rank).

    The norm of ``torch.nn.utils.get_total_norm`` and ``full_tensor``, computed on the local
    tensors: DTensor's dispatch of the foreach ops over hundreds of gradients costs seconds
    of host time at its first step (its sharding propagation: 12 of a 64-rank dry run's 83 s)
    and a wrap per tensor every step. A gradient with a Partial placement (not FSDP's) is
    left to DTensor."""
    from torch.distributed.tensor import DTensor, Partial

    local: dict[tuple, tuple[torch.device, list[torch.Tensor]]] = {}
    whole: list[torch.Tensor] = []  # squared norms already over every rank
    for g in grads:
        groups: tuple = ()
        if isinstance(g, DTensor):
            if any(isinstance(p, Partial) for p in g.placements):
                whole.append(torch.linalg.vector_norm(g, dtype=torch.float32).full_tensor().square())
                continue
            groups = tuple(g.device_mesh.get_group(d) for d, p in enumerate(g.placements) if p.is_shard())
            g = g.to_local()
        # the key is made on every rank alike (the parameters' order), an empty shard's too:
        # every rank joins every all-reduce
        _, tensors = local.setdefault(groups, (g.device, []))
        if g.numel():
            tensors.append(g)
    parts = [s.reshape(()) for s in whole]
    for groups, (device, tensors) in local.items():
        part = torch.zeros((), dtype=torch.float32, device=device)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.device, t.dtype), []).append(t)
        for (_, dtype), kind in by_kind.items():  # a half-precision gradient's norm taken in float32
            norms = torch._foreach_norm(kind, 2, dtype=torch.float32) if dtype in (torch.bfloat16, torch.float16) \
                else torch._foreach_norm(kind)
            part = part + torch.stack(norms).to(device=device, dtype=torch.float32).square().sum()
        for group in groups:
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
        parts.append(part)
    if not parts:
        return torch.zeros(())
    device = parts[0].device
    return torch.stack([p.to(device) for p in parts]).sum().sqrt()


@torch.no_grad()
def clip_by_norm_(grads: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale ``grads`` in place by ``max_norm / total`` where that is below 1 (torch's
    ``clip_grads_with_norm_``), a DTensor's through its local tensor; no host sync."""
    from torch.distributed.tensor import DTensor

    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        t = g.to_local() if isinstance(g, DTensor) else g
        if t.numel():
            by_kind.setdefault((t.device, t.dtype), []).append(t)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (device, dtype), tensors in by_kind.items():
        torch._foreach_mul_(tensors, coef.to(device=device, dtype=dtype))
