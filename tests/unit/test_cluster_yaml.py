"""cluster.yaml against Ray's own launcher schema, offline (no cloud calls)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")
# The GPU machine has no Ray: skip there. (Not importorskip("ray"): with tests/ on the path,
# tests/ray/ imports as an empty namespace package named ray.)
pytest.importorskip("ray.autoscaler")
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


@pytest.fixture()
def raw() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def check(config: dict) -> dict:
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_config_passes_ray_validation(raw: dict) -> None:
    prepared = check(raw)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_head_is_cpu_only_and_workers_are_8_gpu_nodes(raw: dict) -> None:
    types = check(raw)["available_node_types"]
    head = types[raw["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and head["resources"]["CPU"] > 0
    workers = {k: v for k, v in types.items() if k != raw["head_node_type"]}
    assert len(workers) >= 2
    markets = set()
    for name, node in workers.items():
        assert node["resources"]["GPU"] == 8, name
        assert node["resources"]["CPU"] >= 8, name
        assert 0 <= node["min_workers"] <= node["max_workers"], name
        markets.add(node["node_config"].get("InstanceMarketOptions", {}).get("MarketType", "on-demand"))
    assert markets == {"on-demand", "spot"}
    # An on-demand floor keeps training alive when every spot node is reclaimed.
    assert any(
        v["min_workers"] >= 1 and "InstanceMarketOptions" not in v["node_config"]
        for v in workers.values()
    )


def test_autoscaling_bounds_and_idle_timeout(raw: dict) -> None:
    prepared = check(raw)
    types = prepared["available_node_types"]
    assert prepared["max_workers"] >= sum(v.get("min_workers", 0) for v in types.values())
    assert prepared["max_workers"] >= max(v["max_workers"] for v in types.values())
    assert raw["idle_timeout_minutes"] > 0


def test_setup_installs_pinned_torch_before_knapray(raw: dict) -> None:
    prepared = check(raw)
    assert "~/knapray" in prepared["file_mounts"]
    worker = prepared["worker_setup_commands"]
    torch_at = next(i for i, c in enumerate(worker) if "torch==" in c)
    knapray_at = next(i for i, c in enumerate(worker) if '-e ".[gpu]"' in c)
    assert torch_at < knapray_at
    head = prepared["head_setup_commands"]
    assert any("torch==" in c for c in head)
    assert not any("[gpu]" in c for c in head), "the CPU head has no GPU to run FA4 on"


def test_shared_storage_is_mounted_on_every_node_type_where_flux_cluster_expects_it(raw: dict) -> None:
    """Runs and data on shared storage, the same paths on every node and in every container:
    checkpoints come from every rank, the ledger from the head, the corpus is read everywhere."""
    prepared = check(raw)
    mount = " ".join(prepared["initialization_commands"])
    for path in ("/mnt/shared", "/mnt/data"):
        assert f"mountpoint -q {path} || sudo mount -t nfs4" in mount, path
        assert f"-v {path}:{path}" in prepared["docker"]["run_options"], path
    for name, node in prepared["available_node_types"].items():
        # A node type's own initialization_commands would replace the shared ones.
        assert "initialization_commands" not in node, name
        assert not node.get("docker"), name
    flux = yaml.safe_load((CLUSTER_YAML.parent / "jobs" / "configs" / "flux_cluster.yaml").read_text())
    assert flux["run"]["storage"].startswith("/mnt/shared/") and flux["data"]["corpus"].startswith("/mnt/data/")


def test_head_node_type_must_exist(raw: dict) -> None:
    raw["head_node_type"] = "no_such_type"
    with pytest.raises(ValueError, match="head_node_type"):
        check(raw)


def test_unknown_top_level_key_is_rejected(raw: dict) -> None:
    raw["max_gpus"] = 96
    with pytest.raises(jsonschema.ValidationError, match="max_gpus"):
        check(raw)


def test_node_type_without_resources_is_rejected(raw: dict) -> None:
    del raw["available_node_types"]["gpu_h100_spot"]["resources"]
    with pytest.raises(jsonschema.ValidationError, match="resources"):
        check(raw)


def test_max_workers_below_sum_of_min_workers_is_rejected(raw: dict) -> None:
    raw["available_node_types"]["gpu_h100_spot"]["min_workers"] = raw["max_workers"]
    with pytest.raises(ValueError, match="max_workers"):
        check(raw)
