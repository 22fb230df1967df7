"""Row gathers whose backward is right in half precision, eager and compiled alike.

A packed step gathers rows by token index in two ways, and torch's own backward of both is
an atomic scatter-add into a zero-filled buffer (``index_select``'s ``index_add``, advanced
indexing's ``index_put(accumulate=True)``):

- ``gather_rows(table, index)``: many tokens read one row (each token its sequence's
  modulation or conditioning vector). The backward sums thousands of token gradients into
  each row. In the tensor's own dtype, bf16 under autocast or FSDP's bf16 parameters, every
  addition rounds to 8 bits: inductor's ``atomic_add<BFloat16>``, CUDA's bf16 ``index_add``
  and the CPU's eager kernels all lose 20-40% of a long sequence's gradient. Here the
  backward adds into an fp32 buffer and rounds once.
- ``permute_rows(x, order, inverse)``, ``split_rows`` and ``merge_rows``: every row read
  exactly once (Ulysses' and the router's shuffles; the text/image streams' split and
  merge). Nothing is summed, but the scatter still zero-fills and writes with atomics;
  the backward here is the inverse permutation's gather. Each output is a fresh tensor,
  never a view at an offset (a compiled block guards on its inputs' storage offsets, and
  an offset of 0 or 1, say after zero text rows, would specialize it).

Both are ``torch.autograd.Function``s that dynamo traces (forward and backward land in the
compiled graphs), so inductor fuses the forward gathers into their consumers as before.
"""

from __future__ import annotations

from typing import Any

import torch

_HALF = (torch.bfloat16, torch.float16)


def sum_rows(values: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """out[r] = sum of values[i] over every i with index[i] == r: values (N, *F), index (N,)
    int64 in [0, rows) -> (rows, *F) in values' dtype, accumulated in fp32 (at least) and
    rounded to values' dtype once.

    An ``index_add`` into an fp32 buffer: compiled, inductor fuses the upcast (and whatever
    produced ``values``) into fp32 atomic adds, so the (N, F) gradient is never written out
    in fp32; eager, the upcast is a copy. (A one-hot (rows, N) @ (N, F) product would be
    deterministic but must read a materialized (N, F) gradient, and inductor would save the
    one-hot from the forward instead of the index.)"""
    acc = torch.float32 if values.dtype in _HALF else values.dtype
    out = torch.zeros((rows, *values.shape[1:]), dtype=acc, device=values.device)
    return out.index_add(0, index, values.to(acc)).to(values.dtype)


class _GatherRows(torch.autograd.Function):
    """forward: table[index]; backward: each row's gradient summed over its tokens in fp32."""

    @staticmethod
    def forward(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return table.index_select(0, index)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        table, index = inputs
        ctx.save_for_backward(index)
        ctx.rows = table.shape[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        return sum_rows(grad, index, ctx.rows), None


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table (S, *F), index (N,) int64 in [0, S) -> (N, *F) = table[index]; the backward
    accumulates the (up to N) gradients of each row in fp32 (``sum_rows``)."""
    return _GatherRows.apply(table, index)


class _PermuteRows(torch.autograd.Function):
    """forward: x[order]; backward: grad[inverse] (a gather, not a zero-fill and scatter)."""

    @staticmethod
    def forward(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, order)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x (N, *F) -> x[order], where ``order`` (N,) is a permutation of range(N) and
    ``inverse`` its inverse (``inverse[order[i]] == i``; the caller has both, from the host).
    The backward gathers by ``inverse``. Not checked per call (it is on the hot path):
    ``tests/unit/test_indexing.py`` checks every caller's pair."""
    return _PermuteRows.apply(x, order, inverse)


class _SplitRows(torch.autograd.Function):
    """forward: (x[first], x[second]); backward: cat(grads)[unorder]."""

    @staticmethod
    def forward(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor, unorder: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return x.index_select(0, first), x.index_select(0, second)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(inputs[3])

    @staticmethod
    def backward(ctx: Any, grad_first: torch.Tensor, grad_second: torch.Tensor) -> tuple:
        (unorder,) = ctx.saved_tensors
        return torch.cat((grad_first, grad_second)).index_select(0, unorder), None, None, None


class _MergeRows(torch.autograd.Function):
    """forward: cat(a, b)[unorder]; backward: (grad[first], grad[second])."""

    @staticmethod
    def forward(a: torch.Tensor, b: torch.Tensor, first: torch.Tensor, second: torch.Tensor,
                unorder: torch.Tensor) -> torch.Tensor:
        return torch.cat((a, b)).index_select(0, unorder)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[2], inputs[3])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        first, second = ctx.saved_tensors
        return grad.index_select(0, first), grad.index_select(0, second), None, None, None


def split_rows(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor, unorder: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, *F) -> (x[first], x[second]), where ``first`` and ``second`` partition
    range(N) and ``unorder`` gathers cat(first, second) back into range(N) order."""
    return _SplitRows.apply(x, first, second, unorder)


def merge_rows(a: torch.Tensor, b: torch.Tensor, first: torch.Tensor, second: torch.Tensor,
               unorder: torch.Tensor) -> torch.Tensor:
    """``split_rows``' inverse: rows a (len(first), *F) and b (len(second), *F) -> (N, *F)
    with a's rows at ``first`` and b's at ``second``."""
    return _MergeRows.apply(a, b, first, second, unorder)
