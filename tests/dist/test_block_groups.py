"""Per-step topologies on groups created once: 4 gloo ranks (one node of 4), four steps whose
lengths make the per-step planner (``plan_from_gathered`` with ``per_step_node``, as the
coordinator and the trainer's local fallback call it) choose different partitions, one of
them the run's static base topology (not made of aligned blocks, so it runs on its own
groups); each step runs as a balanced forward + backward on the groups ``StepGroups``
looks up, and is compared with the single-process reference. And a short CPU training run
(2 gloo ranks, ``balance.topology: per-step``, local plans) that trains on more than one
topology and logs each step's."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from knapray.models import MMDiT
from knapray.models.flow import flow_loss
from knapray.coordinator import plan_from_gathered
from knapray.testing.parity import parity_config
from knapray.planning import Topology
from knapray.planning.costs.cost import CostModel
from knapray.testing.batches import concat_batches, mix_batches

WORLD, GPN = 4, 4
STEPS = {
    # Small images everywhere: bags of one (Ulysses would only add traffic).
    "images": ("g4b3i256f1s0", 8),
    # One video on rank 0 against small images: it needs a larger bag.
    "video": ("g1b1i512f34s1,g3b2i256f1s0", 4),
    # Short videos on ranks 1 and 2: two bags of two.
    "pairs": ("g1b3i256f1s0,g2b1i512f12s1,g1b3i256f1s0", 4),
    # Mid-size images on ranks 1 and 2: the base's bag of ranks 1..2 wins.
    "base": ("g1b3i256f1s0,g2b1i1024f1s0,g1b3i256f1s0", 8),
}
COST = CostModel(gpus_per_node=GPN)  # Flux-size constants decide the partitions
BASE = Topology((1, 2, 1))
"""The run's static topology: its bag of ranks 1..2 is no aligned block (``auto`` may choose such)."""


def _model() -> MMDiT:
    torch.manual_seed(0)
    model = MMDiT(parity_config(4))
    model.init_weights(std=0.1)
    return model


def _batches(name: str):
    mix, scale = STEPS[name]
    return mix_batches(mix, parity_config(4), scale=scale, seed=1, world_size=WORLD)


def _worker(rank: int, world: int) -> dict:
    from knapray.distributed import BagGroups
    from knapray.distributed.block_groups import BlockGroups, StepGroups
    from knapray.distributed.grads import allreduce_gradients
    from knapray.worker.balanced import balanced_forward

    blocks = BlockGroups.build(GPN, num_heads=4)
    groups = StepGroups(BagGroups.build(BASE, num_heads=4), blocks)
    model = _model()
    out = {"blocks": sorted(blocks.groups)}
    for name in STEPS:
        batches = _batches(name)
        lens = [b.seq_lens.tolist() for b in batches]
        plan = plan_from_gathered(lens, BASE, COST, per_step_node=GPN)
        bag_group, route_group = groups.for_topology(plan.topology)
        tokens = sum(b.x_img.shape[0] for b in batches)
        model.zero_grad(set_to_none=True)
        pred = balanced_forward(model, batches[rank], plan, rank, bag_group=bag_group, route_group=route_group)
        loss = flow_loss(pred, batches[rank].targets, tokens)
        loss.backward()
        allreduce_gradients(model.parameters())
        # numpy, not tensors: tensors cross the result queue through shared memory that
        # the worker's exit can take away before the parent reads them.
        out[name] = {
            "bags": plan.topology.bags,
            "on_base": bag_group is groups.base.bag_group and bag_group is not None,
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
    assert bags == {"images": [1, 1, 1, 1], "video": [4], "pairs": [2, 2], "base": [1, 2, 1]}
    # Ranks 1 and 2 ran the base step on the base's own bag group (ranks 1..2).
    assert [r["base"]["on_base"] for r in results] == [False, True, True, False]
    assert not any(r[name]["on_base"] for r in results for name in ("images", "video", "pairs"))
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


def test_a_static_run_refuses_a_step_on_another_topology():
    from knapray.distributed import BagGroups
    from knapray.distributed.block_groups import StepGroups

    groups = StepGroups(BagGroups.build(Topology((1,))))  # a world of one: no process group
    assert groups.for_topology(Topology((1,))) == (None, None)
    with pytest.raises(ValueError, match="not on the run's topology g1n1, and no block groups were built"):
        groups.for_topology(Topology((1, 1)))


# ---- a training run ------------------------------------------------------------------------

def _train_per_step(rank: int, world: int, corpus: str, run_root: str):
    from dist_utils import TINY_MMDIT, local_trainer

    trainer = local_trainer(rank, world, corpus, run_root, "perstep", TINY_MMDIT + [
        "balance.topology=per-step", "balance.planner=cost", "balance.cost={d_model: 3072}",
        "balance.live_fit=false", "run.max_steps=6",
    ])
    summary = trainer.train()
    return str(trainer.topology), summary["step_topologies"], [r["loss"] for r in summary["records"]]


@pytest.mark.dist
def test_a_per_step_training_run_trains_on_several_topologies(tmp_path):
    import json
    import math
    import os

    from dist_utils import build_tiny_corpus

    from knapray.driver.report import summarize

    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b2i256f1s0,g1b1i512f34s1", steps=7)
    results = run_distributed(_train_per_step, 2, corpus, str(tmp_path / "runs"))
    assert all(r[0] == results[0][0] for r in results)  # one base topology everywhere
    assert all(r[1:] == results[0][1:] for r in results)  # every rank ran the same topologies and losses
    with open(os.path.join(tmp_path, "runs", "perstep", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 6 and all(r["planned_by"] == "local" and math.isfinite(r["loss"]) for r in records)
    summary = summarize(records)
    assert summary["distinct_topologies"] >= 2, summary["topologies"]
    assert summary["topologies"] == results[0][1] and sum(summary["topologies"].values()) == 6


def _train_overlap(rank: int, world: int, corpus: str, run_root: str):
    """The same 4 steps planned without and with ``balance.overlap`` (a static g2n1)."""
    from dist_utils import TINY_MMDIT, local_trainer

    out = {}
    for name, extra in (("plain", []), ("overlap", ["balance.overlap=true"])):
        trainer = local_trainer(rank, world, corpus, run_root, name, TINY_MMDIT + [
            "balance.topology=g2n1", "balance.planner=cost", "balance.cost={d_model: 3072}",
            "balance.live_fit=false", "run.max_steps=4", *extra,
        ])
        summary = trainer.train()
        out[name] = [(r["loss"], r["whole_on_shared"], r["topology"]) for r in summary["records"]]
    return out


@pytest.mark.dist
def test_a_training_run_with_overlapping_groups(tmp_path):
    """2 gloo ranks on one bag of 2, a clip and small images a step: with ``balance.overlap``
    the images run whole on either rank beside its half of the clip (the step records say
    how many), the same plan on both ranks; every step's loss (the same model and batches)
    equals the run's without overlap."""
    from dist_utils import build_tiny_corpus

    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b3i256f1s0,g1b1i512f34s1", steps=5)
    results = run_distributed(_train_overlap, 2, corpus, str(tmp_path / "runs"))
    assert results[0] == results[1]  # every rank planned and logged the same
    plain, over = results[0]["plain"], results[0]["overlap"]
    assert len(plain) == len(over) == 4 and all(w == 0 for _, w, _ in plain)
    assert sum(w for _, w, _ in over) > 0, over
    # The same function on other ranks: every step's loss as without overlap (1.4935012459754944
    # both ways at step 1, its 4 images whole, when measured), so the runs do not drift apart.
    assert [loss for loss, _, _ in over] == pytest.approx([loss for loss, _, _ in plain], rel=1e-5)
