"""knapray.indexing: row gathers whose backward is right in bf16, eager and compiled.

The per-token modulation gather (many tokens -> one sequence's row) summed its backward in
bf16: 4 sequences x 4,096 tokens came out 20% too small, always. ``gather_rows`` sums in
fp32 and rounds once; ``permute_rows`` / ``split_rows`` / ``merge_rows`` move every row once
and take the inverse gather back. Every caller's index pair is checked to be a true inverse.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from knapray.indexing import gather_rows, merge_rows, permute_rows, split_rows, sum_rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _long_gather(dtype=torch.bfloat16):
    """4 sequences x 4,096 tokens of positive gradients (the sums that lose most in bf16)."""
    gen = torch.Generator().manual_seed(0)
    index = torch.arange(4).repeat_interleave(4096)
    grad = (torch.rand(index.numel(), 16, generator=gen) + 0.5).to(dtype)
    truth = grad.double().reshape(4, 4096, 16).sum(1)
    return index, grad, truth


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_gather_rows_backward_sums_in_fp32(compiled: bool) -> None:
    index, grad, truth = _long_gather()
    table = torch.zeros(4, 16, dtype=torch.bfloat16, requires_grad=True)
    fn = torch.compile(gather_rows, backend="inductor", dynamic=True) if compiled else gather_rows
    fn(table, index).backward(grad)
    # Rounded once to bf16 (2**-9 relative); bf16 accumulation is ~0.2 off here.
    assert _rel(table.grad, truth) < 4e-3
    # torch's own gather loses it (the bug this module exists for), eagerly on the CPU:
    plain = torch.zeros(4, 16, dtype=torch.bfloat16, requires_grad=True)
    plain[index].backward(grad)
    assert _rel(plain.grad, truth) > 0.05


def test_gather_rows_forward_and_fp64_backward_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(5, 3, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    index = torch.tensor([4, 0, 0, 2, 4, 4, 1])
    out = gather_rows(table, index)
    assert torch.equal(out, table[index])
    g = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    out.backward(g)
    ref = torch.zeros_like(table).index_add(0, index, g)
    torch.testing.assert_close(table.grad, ref, rtol=0, atol=1e-15)
    assert torch.autograd.gradcheck(lambda t: gather_rows(t, index), (table.detach().requires_grad_(),))


def test_sum_rows_on_no_rows_and_no_tokens() -> None:
    assert sum_rows(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64), 2).tolist() == [[0.0] * 3] * 2
    assert sum_rows(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64), 0).shape == (0, 3)


def test_permutations_and_their_backward_are_gathers() -> None:
    gen = torch.Generator().manual_seed(2)
    order = torch.randperm(9, generator=gen)
    inverse = torch.argsort(order)
    x = torch.randn(9, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    y = permute_rows(x, order, inverse)
    assert torch.equal(y, x[order])
    assert torch.autograd.gradcheck(lambda t: permute_rows(t, order, inverse), (x,))

    is_first = torch.tensor([True, False, False, True, False, True, True, False, False])
    first, second = torch.nonzero(is_first).flatten(), torch.nonzero(~is_first).flatten()
    unorder = torch.argsort(torch.cat((first, second)))
    a, b = split_rows(x, first, second, unorder)
    assert torch.equal(a, x[is_first]) and torch.equal(b, x[~is_first])
    # Fresh tensors, not views at an offset: a compiled block guards on storage offsets.
    assert a._base is None and b._base is None and b.storage_offset() == 0
    assert torch.equal(merge_rows(a, b, first, second, unorder), x)
    assert torch.autograd.gradcheck(lambda t: split_rows(t, first, second, unorder), (x,))
    assert torch.autograd.gradcheck(lambda s, t: merge_rows(s, t, first, second, unorder),
                                    (a.detach().requires_grad_(), b.detach().requires_grad_()))


def _is_inverse(order: torch.Tensor, inverse: torch.Tensor) -> bool:
    n = order.numel()
    return inverse.numel() == n and torch.equal(order[inverse], torch.arange(n)) and torch.equal(
        inverse[order], torch.arange(n))


def test_every_callers_index_pair_is_a_true_inverse() -> None:
    """The index pairs handed to ``permute_rows`` and ``split_rows`` (not checked per call,
    on the hot path) for a plan with bags, empty ranks and chunks without text."""
    from knapray.distributed.router import RoutePlan
    from knapray.distributed.ulysses import UlyssesLayout
    from knapray.models.blocks import TokenStreams
    from knapray.planning import Topology, WorkloadModel, plan_balance

    rng = np.random.default_rng(0)
    lens = [[int(n) for n in rng.integers(1, 300, size=k)] for k in (5, 0, 3, 1)]
    plan = plan_balance(lens, Topology.parse("g2n1+g1n2"), WorkloadModel(d_model=64))
    for rank in range(4):
        rp = RoutePlan.build(plan, rank)
        assert _is_inverse(rp.send_index, rp.home_index)
        lay = UlyssesLayout.build(plan, rank)
        assert _is_inverse(lay.seq_order, lay.rank_order)
    # Groups that overlap: a rank's own whole sequences beside its share of the bag's.
    from knapray.planning.search.overlap import whole_on

    over = whole_on(plan, {0: 1, 2: 0, 6: 1})
    for rank in range(4):
        lay = UlyssesLayout.build(over, rank)
        assert _is_inverse(lay.seq_order, lay.rank_order)
        if rank < 2:  # the bag of 2's ranks hold whole sequences of their own
            assert _is_inverse(lay.rows, lay.rows_inverse) and _is_inverse(lay.solo.seq_order, lay.solo.rank_order)
    for mask in (np.array([True, False, True, True, False]), np.zeros(4, bool), np.ones(3, bool), np.zeros(0, bool)):
        host = TokenStreams.from_host_mask(mask, "cpu")
        dev = TokenStreams.from_mask(torch.from_numpy(mask))
        for s in (host, dev):
            assert _is_inverse(torch.cat((s.txt_idx, s.img_idx)), s.unorder)

