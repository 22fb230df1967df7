"""ParallelDims: the device layout checked without a process group, and the run's process
groups handed out in one order (a group out of order is an error on every rank, not a hang)."""

from __future__ import annotations

import pytest

from knapray.distributed.parallel_dims import STAGES, ParallelDims
from knapray.planning import Topology


def test_checked_without_a_process_group():
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        ParallelDims(world_size=0)
    with pytest.raises(ValueError, match="device_type must be cuda or cpu, got 'tpu'"):
        ParallelDims(device_type="tpu")
    assert ParallelDims(world_size=16, gpus_per_node=8).mesh_shape("hybrid") == ((2, 8), ("replicate", "shard"))
    assert ParallelDims(world_size=16).mesh_shape("full") == ((16,), ("shard",))


def test_groups_come_in_one_order():
    assert STAGES == ("step_sync", "fsdp_mesh", "step_groups")
    dims = ParallelDims.local()
    sync = dims.step_sync("cpu")  # one process, no process group: a local StepSync
    assert sync.world_size == 1
    groups = dims.step_groups(Topology.parse("g1n1", world_size=1), num_heads=4)
    assert groups is not None
    with pytest.raises(RuntimeError, match="process groups out of order: fsdp_mesh after step_groups"):
        dims.fsdp_mesh("full")
    with pytest.raises(RuntimeError, match="step_sync after step_groups"):
        dims.step_sync("cpu")


def test_a_stage_may_be_skipped_but_not_repeated():
    dims = ParallelDims.local()
    dims.step_groups(Topology.parse("g1n1", world_size=1), num_heads=4)  # no sync group, no mesh: allowed
    with pytest.raises(RuntimeError, match="step_groups after step_groups"):
        dims.step_groups(Topology.parse("g1n1", world_size=1), num_heads=4)


def test_the_run_sections_parallel_is_what_parallelize_applies():
    from knapray.config.run import load_config
    from knapray.config.parallel import ParallelConfig

    cfg = load_config(None, ["parallel.fsdp=full", "parallel.activation_checkpointing=every_k", "parallel.ac_every=3",
                             "parallel.compile=true", "parallel.compile_backend=aot_eager"])
    assert cfg.parallel == ParallelConfig(fsdp="full", activation_checkpointing="every_k", ac_every=3, compile=True,
                                          compile_backend="aot_eager")
    # One rank shards nothing; any other world applies the section as it is.
    assert cfg.parallel.for_world(1).fsdp == "none" and cfg.parallel.for_world(8) == cfg.parallel
    assert cfg.parallel.checkpointed(6) == (False, False, True, False, False, True)
