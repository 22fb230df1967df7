"""Models built on the meta device and initialized after sharding (``materialize``) hold the
weights ``MMDiT(cfg)`` (FLUX.2's model: no biases, a shared modulation) draws on the CPU
from the same seed, bit for bit, sharded or not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from knapray.models import MMDiT, MMDiTConfig, dit_config
from knapray.models.families import get_family
from knapray.models.families.flux2 import small_config as flux2_small
from knapray.testing.parity import parity_config

CONFIGS = {
    "mmdit": parity_config(),
    "dit": dit_config(hidden_size=32, num_heads=4, rope_axes_dim=(4, 2, 2)),
    "no-pooled-no-qknorm": MMDiTConfig(hidden_size=32, num_heads=4, rope_axes_dim=(4, 2, 2), pooled_dim=0,
                                       qk_norm=False, depth_double=1, depth_single=1),
    "flux2": flux2_small(64),
}


def _reference(cfg: MMDiTConfig, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(seed)
    model = get_family(cfg.family).model_cls(cfg)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, torch.rand(4)  # and the RNG after


@pytest.mark.parametrize("name", list(CONFIGS))
def test_meta_model_materialized_equals_the_cpu_built_one(name):
    from knapray.config.parallel import ParallelConfig
    from knapray.worker.parallelize import materialize, parallelize

    cfg = CONFIGS[name]
    ref, ref_after = _reference(cfg, seed=7)
    torch.manual_seed(7)
    with torch.device("meta"):
        model = get_family(cfg.family).model_cls(cfg)
    parallelize(model, ParallelConfig(activation_checkpointing="full"))
    materialize(model, "cpu")
    got = dict(model.named_parameters())
    assert list(got) == list(ref)
    for n, value in ref.items():
        assert got[n].device.type == "cpu" and torch.equal(got[n], value), n
    assert torch.equal(torch.rand(4), ref_after)  # the RNG is where the CPU build leaves it


def _sharded_worker(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    from knapray.distributed.parallel_dims import ParallelDims
    from knapray.config.parallel import ParallelConfig
    from knapray.worker.parallelize import materialize, parallelize

    out = {}
    for fsdp in ("full", "hybrid"):  # one world, two models (each builds its own mesh)
        torch.manual_seed(11)
        with torch.device("meta"):
            model = MMDiT(parity_config())
        parallelize(model, ParallelConfig(fsdp=fsdp),
                    ParallelDims(world_size=world, gpus_per_node=1 if fsdp == "hybrid" else None))
        materialize(model, "cpu")
        out[fsdp] = {
            "local": {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in model.named_parameters()},
            "full": {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy()
                     for n, p in model.named_parameters()},
            "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        }
    return out


@pytest.mark.dist
def test_sharded_meta_init_equals_the_cpu_built_model_on_two_gloo_ranks():
    ref, _ = _reference(parity_config(), seed=11)
    total = sum(v.numel() for v in ref.values())
    res = run_distributed(_sharded_worker, 2)
    for fsdp in ("full", "hybrid"):
        for r in res:
            assert r[fsdp]["sharded"]
            for n, value in ref.items():
                np.testing.assert_array_equal(r[fsdp]["full"][n], value.numpy(), err_msg=f"{fsdp} {n}")
    # full: each rank holds its half of every parameter, not the model
    assert sum(res[0]["full"]["local"].values()) + sum(res[1]["full"]["local"].values()) == total
    assert sum(res[0]["full"]["local"].values()) < 0.6 * total


def test_flux_meta_init_equals_the_cpu_built_model():
    """The Flux family inherits the MMDiT's replayed init (its guidance MLP drawn as the other
    conditioning MLPs): a meta-built FluxTransformer materialized equals one built on the CPU."""
    from knapray.models.families import build_model
    from knapray.models.families.flux import FluxConfig
    from knapray.worker.parallelize import materialize

    cfg = FluxConfig(family="flux", hidden_size=32, num_heads=2, depth_double=1, depth_single=1, in_channels=4,
                     text_dim=8, pooled_dim=8, rope_axes_dim=(4, 6, 6), guidance_embeds=True)
    torch.manual_seed(3)
    cpu = build_model(cfg)
    after_cpu = torch.rand(3)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = build_model(cfg)
    materialize(meta, "cpu")
    assert torch.equal(torch.rand(3), after_cpu)  # the RNG ends where the CPU build leaves it
    for (name, a), (_, b) in zip(cpu.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), name
    assert meta.guidance_in is not None
