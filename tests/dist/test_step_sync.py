"""The training step's own collectives: values by name on the training device, Python
objects only on an explicitly created gloo group, never an implicit default group.

Under a NCCL-only process group (what Ray Train gives GPU workers) a CPU tensor in a
collective fails with "No backend type associated with device type cpu"; the spy test
below runs the whole training loop on 2 gloo ranks and checks every collective it issues.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import build_tiny_corpus, run_distributed
from knapray.distributed.step_sync import StepSync
from knapray.worker.timing import StepTimer

TINY_MODEL = [
    "model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[2,2,4]",
    "model.depth_double=1", "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16",
]


def test_world_of_one_needs_no_process_group():
    sync = StepSync.build("cpu")
    sums, per_rank = sync.sum_over_ranks(summed={"a": 2, "b": torch.tensor(1.5)}, per_rank={"t": 0.25})
    assert sums == {"a": 2.0, "b": 1.5} and per_rank == {"t": [0.25]}
    assert sync.gather_objects({"x": 1}) == [{"x": 1}]
    assert sync.broadcast_object("spec") == "spec"


def test_non_scalar_is_refused():
    with pytest.raises(ValueError, match="scalars"):
        StepSync.build("cpu").sum_over_ranks(summed={"a": torch.ones(2)})


def _sums(rank: int, world: int):
    sync = StepSync.build("cpu")
    out = sync.sum_over_ranks(
        summed={"tokens": 10 * (rank + 1), "loss": torch.tensor(0.5 * rank, requires_grad=True)},
        per_rank={"compute_s": 1.0 + rank, "comm_s": 0.1 * rank},
    )
    backend = dist.get_backend(sync.meta_group)
    objs = sync.gather_objects(("rank", rank))
    spec = sync.broadcast_object(f"spec-of-{rank}", src=0)
    return out, backend, objs, spec


def test_sums_and_gathers_over_three_ranks():
    results = run_distributed(_sums, 3)
    for (sums, per_rank), backend, objs, spec in results:
        assert sums == {"tokens": 60.0, "loss": 1.5}
        assert per_rank == {"compute_s": [1.0, 2.0, 3.0], "comm_s": pytest.approx([0.0, 0.1, 0.2])}
        assert backend == "gloo"
        assert objs == [("rank", 0), ("rank", 1), ("rank", 2)]
        assert spec == "spec-of-0"


def test_cpu_step_timer_measures_thread_time():
    a = torch.randn(256, 256)
    with StepTimer("cpu") as timer:
        for _ in range(20):
            a = (a @ a).tanh()
    took = timer.result()
    assert took.clock == "thread_time" and took.compute_s > 0 and took.comm_s == 0.0


# ---- every collective of the training loop ------------------------------------------------

TENSOR_COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather", "all_gather_into_tensor",
                      "reduce_scatter_tensor", "broadcast")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "barrier", "gather_object")


def _spy_loop(rank: int, world: int, corpus: str, run_root: str):
    """Run the training loop with every torch.distributed collective wrapped by a spy."""
    from dist_utils import local_trainer

    calls = []

    def wrap(name, fn):
        def spy(*args, **kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            group = kwargs.get("group")
            calls.append((name, [str(t.device) for t in tensors], group is None,
                          None if group is None else dist.get_backend(group),
                          group is dist.group.WORLD))
            return fn(*args, **kwargs)
        return spy

    for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
        setattr(dist, name, wrap(name, getattr(dist, name)))
    trainer = local_trainer(rank, world, corpus, run_root, "spy", TINY_MODEL + [
        "balance.topology=g2n1", "run.max_steps=3", "checkpoint.every=2",
    ])
    summary = trainer.train()
    ctx = trainer.ctx
    return calls, str(ctx.device(False)), summary["steps"]


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"), "g1b3i128f1s0,g1b2i64f1s0,g1b1i256f2s0", steps=3)


@pytest.mark.dist
def test_every_loop_collective_names_its_group_and_uses_the_loop_device(tiny_corpus, tmp_path):
    for calls, device, steps in run_distributed(_spy_loop, 2, tiny_corpus, str(tmp_path)):
        assert steps == 3
        names = {c[0] for c in calls}
        # the loop did agree, route, reduce gradients and gather objects (the checkpoint)
        assert {"all_reduce", "all_to_all_single", "all_gather_object"} <= names, names
        for name, devices, implicit, backend, _world in calls:
            assert not implicit, f"{name} ran on the implicit default group"
            if name in TENSOR_COLLECTIVES:
                assert devices and set(devices) == {device}, (name, devices)
            else:
                assert backend == "gloo", (name, backend)
