"""Per-step topologies on groups created once: 4 gloo ranks (one node of 4), two steps whose
lengths make ``plan_step`` choose different partitions, each run as a balanced forward +
backward on the aligned-block groups and compared with the single-process reference."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from knapray.models import MMDiT
from knapray.models.flow import flow_loss
from knapray.parity import parity_config
from knapray.planning.cost import CostModel
from knapray.planning.pertopo import plan_step
from knapray.testing.batches import concat_batches, mix_batches

WORLD, GPN = 4, 4
STEPS = {
    # Small images everywhere: bags of one (Ulysses would only add traffic).
    "images": ("g4b3i256f1s0", 8),
    # One video on rank 0 against small images: it needs a larger bag.
    "video": ("g1b1i512f34s1,g3b2i256f1s0", 4),
}
COST = CostModel(gpus_per_node=GPN)  # Flux-size constants decide the partitions


def _model() -> MMDiT:
    torch.manual_seed(0)
    model = MMDiT(parity_config(4))
    model.init_weights(std=0.1)
    return model


def _batches(name: str):
    mix, scale = STEPS[name]
    return mix_batches(mix, parity_config(4), scale=scale, seed=1, world_size=WORLD)


def _worker(rank: int, world: int) -> dict:
    from knapray.distributed.block_groups import BlockGroups
    from knapray.distributed.grads import allreduce_gradients
    from knapray.train.balanced import balanced_forward

    blocks = BlockGroups.build(GPN, num_heads=4)
    model = _model()
    out = {"blocks": sorted(blocks.groups)}
    for name in STEPS:
        batches = _batches(name)
        lens = [b.seq_lens.tolist() for b in batches]
        choice = plan_step(lens, COST)
        tokens = sum(b.x_img.shape[0] for b in batches)
        model.zero_grad(set_to_none=True)
        pred = balanced_forward(model, batches[rank], choice.plan, rank, bag_group=blocks.bag_group(choice.topology))
        loss = flow_loss(pred, batches[rank].targets, tokens)
        loss.backward()
        allreduce_gradients(model.parameters())
        # numpy, not tensors: tensors cross the result queue through shared memory that
        # the worker's exit can take away before the parent reads them.
        out[name] = {
            "bags": choice.topology.bags,
            "out": pred.detach().numpy().copy(),
            "loss": float(loss.detach()),
            "grads": {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()},
        }
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.dist
def test_per_step_partitions_on_block_groups_match_the_reference():
    results = run_distributed(_worker, WORLD)
    # Every rank is in the node's block of 4, one block of 2, and one group per bag size.
    assert results[0]["blocks"] == [(0, 2), (0, 4)] and results[3]["blocks"] == [(0, 4), (2, 2)]
    bags = {name: results[0][name]["bags"] for name in STEPS}
    assert all(r[name]["bags"] == bags[name] for r in results for name in STEPS)  # same plan everywhere
    assert bags["images"] == [1, 1, 1, 1] and max(bags["video"]) > 1
    for name in STEPS:
        batches = _batches(name)
        full = concat_batches(batches)
        model = _model()
        ref = model(full)
        ref_loss = flow_loss(ref, full.targets, full.x_img.shape[0])
        ref_loss.backward()
        out = torch.cat([torch.from_numpy(r[name]["out"]) for r in results])
        assert _rel(out, ref.detach()) < 1e-5
        assert abs(sum(r[name]["loss"] for r in results) - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
        for n, p in model.named_parameters():
            assert _rel(torch.from_numpy(results[0][name]["grads"][n]), p.grad) < 1e-5, n
            assert (results[1][name]["grads"][n] == results[0][name]["grads"][n]).all()  # all-reduced
