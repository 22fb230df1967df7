"""Which worlds a run may get and where its workers are, without starting Ray: elastic
sizes in whole nodes, the shipped cluster config's pre-flight over every one of them,
node layouts a run cannot use, the start timeout and coordinator placement the launcher
sets, finished runs, and the one-line reasons of known worker failures."""

from __future__ import annotations

import pathlib

import pytest

from knapray.config.run import ConfigError, load_config
from knapray.driver.launch import (ELASTIC_START_TIMEOUT_S, coordinator_resources, preemption_watcher, run_complete,
                                   worker_start_timeout)
from knapray.driver.run_dir import check_world
from knapray.worker.trainer import TopologyError, check_node_layout

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "jobs" / "configs"


def test_elastic_range_moves_in_whole_nodes():
    flux = load_config(str(CONFIGS / "flux_cluster.yaml"))
    assert flux.world_sizes() == [16, 24, 32, 40, 48, 56, 64]
    for world in flux.world_sizes():  # hybrid FSDP, bags_of:8, nodes of 8: every one fits
        check_world(flux, world)
    # Without a node size Ray Train may pick any size in the range; a fixed run has one.
    sets = ["scaling.num_workers=6", "scaling.min_workers=3"]
    assert load_config(None, sets).world_sizes() == [3, 4, 5, 6]
    assert load_config(None, ["scaling.num_workers=6"]).world_sizes() == [6]
    with pytest.raises(ConfigError, match=r"grows and shrinks by whole nodes: scaling.min_workers=12 and "
                                          r"scaling.num_workers=64 must be multiples of 8, e.g. scaling.min_workers=16"):
        load_config(str(CONFIGS / "flux_cluster.yaml"), ["scaling.min_workers=12"])


def test_hybrid_fsdp_refuses_nodes_that_are_not_whole_shards():
    flux = load_config(str(CONFIGS / "flux_cluster.yaml"))
    check_node_layout(flux, (8, 8, 16))
    with pytest.raises(TopologyError, match=r"20 workers are on nodes of \[8, 8, 4\] ranks.*multiple of 8"):
        check_node_layout(flux, (8, 8, 4))
    check_node_layout(load_config(None, []), (3, 1))  # no hybrid sharding: bags are re-planned instead


def test_start_timeout_and_coordinator_placement():
    elastic = load_config(None, ["scaling.num_workers=4", "scaling.min_workers=2"])
    fixed = load_config(None, ["scaling.num_workers=4"])
    assert worker_start_timeout(elastic, {}) == ELASTIC_START_TIMEOUT_S == 10.0
    assert worker_start_timeout(elastic, {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30"}) is None  # the user's
    assert worker_start_timeout(fixed, {}) is None  # Ray's default: may wait for the autoscaler
    assert worker_start_timeout(load_config(None, ["scaling.worker_start_timeout_s=25"]), {}) == 25.0
    assert coordinator_resources("head") == {"node:__internal_head__": 0.001}
    assert coordinator_resources("any") == {}
    assert coordinator_resources("coordinator_slot") == {"coordinator_slot": 0.001}
    with pytest.raises(ConfigError, match="balance.coordinator_node"):
        load_config(None, ["balance.coordinator_node=''"])


def test_the_preemption_watcher_is_off_on_the_single_machine_ray_knapray_started():
    """Ray Train's preemption watcher (an actor beside every fit) polls for nodes being
    drained: off where knapray started the Ray on this machine, unless the environment says."""
    assert preemption_watcher({}, single_machine=True) == "0"
    assert preemption_watcher({"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "1"}, single_machine=True) is None
    assert preemption_watcher({}, single_machine=False) is None  # a cluster joined: Ray's default


def test_a_run_is_complete_when_its_checkpoint_says_so():
    two_epochs = load_config(None, ["data.epochs=2"])
    assert run_complete(two_epochs, {"step": 40, "epoch": 2})
    assert not run_complete(two_epochs, {"step": 40, "epoch": 1})  # e.g. saved just before the epoch's end
    assert run_complete(load_config(None, ["run.max_steps=10"]), {"step": 9, "epoch": 0})
    assert not run_complete(load_config(None, ["run.max_steps=10", "data.epochs=3"]), {"step": 8, "epoch": 0})


@pytest.mark.ray
def test_known_worker_failures_are_one_line():
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from knapray.coordinator import StepFailed
    from knapray.commands.train import known_failure

    layout = TopologyError("no topology for 4 workers on nodes of [3, 1] ranks: ...")
    wrapped = UserExceptionWithTraceback(layout, "Traceback ...\nTopologyError: no topology ...")  # as Ray Train 2.60 has it
    error = WorkerGroupError("...", {0: wrapped, 1: layout, 2: StepFailed("step 3 cannot be trained: rank 1: x")})
    assert known_failure(error) == ("no topology for 4 workers on nodes of [3, 1] ranks: ...; "
                                    "step 3 cannot be trained: rank 1: x")
    assert known_failure(WorkerGroupError("...", {0: layout, 1: RuntimeError("boom")})) is None  # a traceback then
