"""Autograd-aware all-to-all with uneven splits along dim 0.

Uses ``dist.all_to_all_single`` with split sizes (the list form ``dist.all_to_all`` fails
on gloo when sizes differ). Split sizes are given by the caller on both sides: every rank
derives them from the same plan, so no sizes are exchanged.

A group of one rank needs no collective: the input comes back as it is (no copy), and
torch.distributed need not be initialized.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable


def _group_size(group: dist.ProcessGroup | None) -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _check_splits(
    n_rows: int, send_splits: Sequence[int], recv_splits: Sequence[int], group: dist.ProcessGroup | None
) -> tuple[list[int], list[int]]:
    send, recv = [int(s) for s in send_splits], [int(s) for s in recv_splits]
    if len(send) != len(recv) or not send:
        raise ValueError(
            f"send_splits and recv_splits need one entry per group rank, got {len(send)} and {len(recv)}"
        )
    if min(send) < 0 or min(recv) < 0:
        raise ValueError(f"split sizes must be >= 0, got send {send}, recv {recv}")
    if sum(send) != n_rows:
        raise ValueError(f"send_splits {send} sum to {sum(send)}, but the input has {n_rows} rows")
    size = _group_size(group)
    if size != len(send):
        where = "torch.distributed is not initialized (a world of 1)" if not dist.is_initialized() else (
            f"the group has {size} ranks" if size > 0 else "this rank is not in the group"
        )
        raise ValueError(f"{len(send)} split sizes given, but {where}")
    if size == 1 and send != recv:
        raise ValueError(f"a group of one rank receives what it sends; got send {send}, recv {recv}")
    return send, recv


@dataclass
class CommTime:
    """Time spent inside all-to-alls while a ``comm_timer`` is active."""

    wall_s: float = 0.0
    """Wall-clock seconds of CPU tensors' exchanges (waiting for peers included)."""
    cpu_s: float = 0.0
    """CPU seconds of the calling thread (packing buffers; gloo's transfers run on its own
    threads), subtracted from the thread time of a step to get its compute time."""
    calls: int = 0
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    """CUDA tensors: an event pair around each exchange on the stream it ran on. Nothing
    waits for them here; ``device_s`` reads them once the step is over."""

    def device_s(self) -> float:
        """Seconds of GPU stream time inside the recorded exchanges (waits for them)."""
        total = 0.0
        for start, end in self.events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total


# A process-wide slot, not a context variable: on GPU, autograd runs backward on its own
# threads, which would not see a context variable set by the training thread.
_ACTIVE: list[CommTime] = []


@contextlib.contextmanager
def comm_timer() -> Iterator[CommTime]:
    """Measure every all-to-all of this module run in the block (forward and backward).
    Instrumentation only: it changes nothing about what is exchanged, and adds no host
    synchronization (CUDA exchanges are timed with events)."""
    acc = CommTime()
    _ACTIVE.append(acc)
    try:
        yield acc
    finally:
        _ACTIVE.remove(acc)


def _exchange(
    x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """No autograd: rows of ``x`` cut by ``send_splits`` go to the group's ranks in order;
    returns the rows received, grouped by source rank. (sum(send), *T) -> (sum(recv), *T)."""
    acc = _ACTIVE[-1] if _ACTIVE else None
    if acc is not None:
        if x.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            w0, c0 = time.perf_counter(), time.thread_time()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group
    )
    if acc is not None:
        if x.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            acc.events.append((start, end))
        else:
            acc.wall_s += time.perf_counter() - w0
            acc.cpu_s += time.thread_time() - c0
        acc.calls += 1
    return out


class AllToAllVarsize(torch.autograd.Function):
    """Forward: rows ``x[sum(send[:j]) : sum(send[:j+1])]`` go to group rank ``j``; the
    output holds ``recv[i]`` rows from each group rank ``i``, in rank order.
    Backward: the reverse exchange (send and recv splits swapped) of the output gradient,
    so each input row gets the gradient of the row it became."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits = (send_splits, recv_splits)
        ctx.group = group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send_splits, recv_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits, ctx.group), None, None, None


def all_to_all_varsize(
    x: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """(sum(send_splits), *T) -> (sum(recv_splits), *T), any dtype and trailing shape.

    ``send_splits[j]`` rows go to group rank ``j``; ``recv_splits[i]`` rows come from group
    rank ``i`` (they must match what rank ``i`` sends here). Differentiable for float
    inputs (see ``AllToAllVarsize``). Every rank of the group must call it, also with 0 rows.
    """
    if x.dim() == 0:
        raise ValueError("all_to_all_varsize needs a tensor with a row dimension, got a scalar")
    send, recv = _check_splits(x.shape[0], send_splits, recv_splits, group)
    if len(send) == 1:
        return x
    return AllToAllVarsize.apply(x, send, recv, group)


# ---- several tensors in one exchange -----------------------------------------------


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with exactly row-major strides, as a dtype view needs. ``contiguous()`` is not
    enough: it keeps odd strides of empty tensors and of dimensions of size 1."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.append(step)
        step *= size
    if t.numel() and t.stride() == tuple(reversed(strides)):
        return t
    return t.new_empty(t.shape).copy_(t)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """(N, *T) any dtype -> (N, prod(T) * itemsize) uint8, the same bits."""
    n, cols = t.shape[0], math.prod(t.shape[1:])
    # (N, *T) -> (N, cols) -> (N, cols * itemsize): a bit-cast, exact for every dtype
    return _row_major(t.reshape(n, cols)).view(torch.uint8)


def _from_bytes(buf: torch.Tensor, layout: Sequence[tuple[torch.dtype, torch.Size]]) -> list[torch.Tensor]:
    """Inverse of concatenating ``_as_bytes`` columns: (M, B) uint8 -> tensors (M, *T)."""
    out, offset = [], 0
    for dtype, trailing in layout:
        width = math.prod(trailing) * torch.empty((), dtype=dtype).element_size()
        # (M, width) uint8 -> (M, cols) dtype -> (M, *T); a row-major copy aligns the columns
        piece = _row_major(buf[:, offset : offset + width]).view(dtype)
        out.append(piece.reshape(buf.shape[0], *trailing))
        offset += width
    return out


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    # [(N, *T_i)] -> (N, sum_i bytes_i) uint8
    return torch.cat([_as_bytes(t) for t in tensors], dim=1)


class AllToAllPacked(torch.autograd.Function):
    """Several tensors with the same rows in ONE exchange.

    Forward: each tensor is bit-cast to bytes per row, the byte columns are concatenated
    into one (N, B) uint8 buffer, exchanged like ``AllToAllVarsize``, and cut back into
    tensors of the original dtypes. Integers and bools arrive bit-exact.
    Backward: the gradients of the floating-point tensors (zeros where a gradient is
    absent) are packed the same way and sent back in one reverse exchange. Integer and
    bool outputs are non-differentiable.

    Every rank of the group must pass tensors of the same dtypes and trailing shapes in
    the same order: the receiver cuts the byte columns by its own layout.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        send_splits: list[int],
        recv_splits: list[int],
        group: dist.ProcessGroup | None,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        layout = [(t.dtype, t.shape[1:]) for t in tensors]
        ctx.splits = (send_splits, recv_splits)
        ctx.group = group
        ctx.layout = layout
        ctx.device = tensors[0].device
        ctx.float_index = [i for i, t in enumerate(tensors) if _differentiable(t)]
        outs = _from_bytes(_exchange(_pack(tensors), send_splits, recv_splits, group), layout)
        ctx.mark_non_differentiable(*(o for o in outs if not _differentiable(o)))
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        send_splits, recv_splits = ctx.splits
        result: list[torch.Tensor | None] = [None] * len(ctx.layout)
        if ctx.float_index:
            n_out = sum(recv_splits)
            pieces = []
            for i in ctx.float_index:
                dtype, trailing = ctx.layout[i]
                g = grads[i]
                if g is None:
                    g = torch.zeros((n_out, *trailing), dtype=dtype, device=ctx.device)
                pieces.append(g.to(dtype))
            back = _exchange(_pack(pieces), recv_splits, send_splits, ctx.group)
            for i, g in zip(ctx.float_index, _from_bytes(back, [ctx.layout[i] for i in ctx.float_index])):
                result[i] = g
        return (None, None, None, *result)


def all_to_all_packed(
    tensors: Sequence[torch.Tensor],
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, ...]:
    """Like ``all_to_all_varsize`` for several tensors sharing dim 0, in one collective
    (see ``AllToAllPacked``): [(sum(send), *T_i)] -> [(sum(recv), *T_i)], dtypes kept."""
    if not tensors:
        raise ValueError("all_to_all_packed needs at least one tensor")
    n = tensors[0].shape[0]
    for t in tensors:
        if t.dim() == 0 or t.shape[0] != n or t.device != tensors[0].device:
            raise ValueError(
                "all_to_all_packed: every tensor needs the same number of rows and device, got "
                f"{[(tuple(x.shape), str(x.device)) for x in tensors]}"
            )
    send, recv = _check_splits(n, send_splits, recv_splits, group)
    if len(send) == 1:
        return tuple(tensors)
    return AllToAllPacked.apply(send, recv, group, *tensors)
