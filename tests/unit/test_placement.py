"""What a run asks of each worker against what its Ray cluster has or can add (issue 43,
item 1): a config that asks for GPUs on a machine without them was "pre-flight passed", then
waited at step 0 for good. Now pre-flight (and ``--check``) refuses in one line what can
never be placed, before Ray starts; ``scaling.start_timeout_s`` bounds the wait for the rest."""

from __future__ import annotations

import math
import pathlib

import pytest

from dist_utils import build_tiny_corpus
from knapray.cli import main
from knapray.config.run import ConfigError, load_config
from knapray.driver.placement import Capacity, NodeType, check_placement, worker_request
from knapray.driver.run_dir import RunError

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = str(REPO / "jobs" / "configs" / "demo.yaml")
TINY = ["model.hidden_size=32", "model.num_heads=4", "model.rope_axes_dim=[2,2,4]", "model.depth_double=1",
        "model.depth_single=1", "model.text_dim=16", "model.pooled_dim=16", "data.samples_per_step=1",
        "balance.topology=g1n2", "scaling.num_workers=2", "run.name=r"]


@pytest.fixture(autouse=True)
def no_gpus_no_ray(monkeypatch):
    """This machine as the issue met it: no GPU; and a check that started Ray fails here."""
    from knapray.driver import placement

    monkeypatch.setattr(placement, "local_gpus", lambda: 0)
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "init", lambda *a, **k: (_ for _ in ()).throw(AssertionError("Ray started")))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return build_tiny_corpus(tmp_path_factory.mktemp("corpus"), "g1b2i64f1s0", steps=2, shards=1)


def _train(argv: list[str], capsys) -> tuple[int, list[str], list[str]]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out.strip().splitlines(), out.err.strip().splitlines()


def _argv(corpus: str, storage, *sets: str) -> list[str]:
    argv = ["train", "--config", DEMO]
    for s in [*TINY, f"data.corpus={corpus}", f"run.storage={storage}", *sets]:
        argv += ["--set", s]
    return argv


@pytest.mark.parametrize("check", [True, False], ids=["--check", "the run"])
def test_gpus_asked_of_a_machine_without_them_is_one_line_before_ray_starts(check, corpus, tmp_path, capsys):
    argv = _argv(corpus, tmp_path / "runs", "scaling.use_gpu=true", "scaling.cpus_per_worker=8")
    code, out, err = _train(argv + (["--check"] if check else []), capsys)
    assert code == 2, (out, err)
    assert len(err) == 1 and "Traceback" not in err[0], err
    line = err[0]
    assert line.startswith("knapray train: error: scaling: a worker asks Ray for {'CPU': 8, 'GPU': 1}"), line
    assert "the embedded Ray on this machine" in line and "GPU: 1 asked, at most 0 on a node" in line, line
    assert "scaling.use_gpu=false" in line, line  # what would be valid
    assert not (tmp_path / "runs").exists()


def test_a_resource_no_node_has_and_a_group_larger_than_the_machine(corpus, tmp_path, capsys):
    code, _, err = _train(_argv(corpus, tmp_path, "scaling.resources_per_worker={slot: 1}") + ["--check"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "slot: 1 asked, at most 0 on a node" in err[0] and "ray start --resources" in err[0], err
    # --num-cpus 1 holds one worker of 0.5 CPU... two: the group of 4 (0.5 each) needs 2.
    code, _, err = _train(_argv(corpus, tmp_path, "scaling.num_workers=4", "balance.topology=g1n4")
                          + ["--num-cpus", "1", "--check"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "4 workers (scaling.num_workers) of {'CPU': 0.5} each never fit at once" in err[0], err
    assert "holds at most 2" in err[0] and "--num-cpus" in err[0], err


def test_what_fits_passes_and_check_says_so(corpus, tmp_path, capsys):
    code, out, err = _train(_argv(corpus, tmp_path) + ["--check"], capsys)
    assert code == 0, err
    assert any("workers: 2 x {'CPU': 0.5} fit the embedded Ray on this machine" in line for line in out), out


def _cfg(*sets: str):
    return load_config(None, list(sets))


def test_worker_request_is_what_ray_train_asks_for():
    assert worker_request(_cfg()) == {"CPU": 0.5}
    assert worker_request(_cfg("scaling.use_gpu=true", "scaling.cpus_per_worker=8")) == {"CPU": 8, "GPU": 1}
    # resources_per_worker adds to them and may override (Ray Train's ScalingConfig does the same)
    assert worker_request(_cfg("scaling.use_gpu=true", "scaling.resources_per_worker={GPU: 2, slot: 1}")) == \
        {"CPU": 0.5, "GPU": 2, "slot": 1}


CPU_HEAD = {"CPU": 8, "memory": 1e10}
GPU_NODE = {"CPU": 96, "GPU": 8}


def test_an_autoscaler_that_can_add_the_node_is_enough():
    gpu8 = _cfg("scaling.use_gpu=true", "scaling.cpus_per_worker=8", "scaling.num_workers=16")
    cluster = Capacity("the Ray cluster at h:6379", nodes=(CPU_HEAD,),
                       node_types=(NodeType("head", CPU_HEAD, 1), NodeType("gpu", GPU_NODE, 4)))
    check_placement(gpu8, cluster, [16])  # 4 nodes of 8 GPUs may come
    with pytest.raises(RunError) as e:
        check_placement(gpu8, Capacity("the Ray cluster at h:6379", nodes=(CPU_HEAD,),
                                       node_types=(NodeType("head", CPU_HEAD, 1), NodeType("gpu", GPU_NODE, 1))),
                        [16])
    assert "16 workers (scaling.num_workers) of {'CPU': 8, 'GPU': 1} each never fit at once" in str(e.value)
    assert "holds at most 8" in str(e.value) and "with every node its autoscaler may add" in str(e.value)
    unbounded = Capacity("x", nodes=(), node_types=(NodeType("gpu", GPU_NODE, -1),))
    check_placement(gpu8, unbounded, [16])


def test_an_elastic_run_needs_room_for_its_smallest_group():
    elastic = _cfg("scaling.num_workers=8", "scaling.min_workers=2", "scaling.cpus_per_worker=2")
    check_placement(elastic, Capacity("x", nodes=({"CPU": 4},)), [2, 3, 4, 5, 6, 7, 8])
    with pytest.raises(RunError, match=r"2 workers \(scaling.min_workers\)"):
        check_placement(elastic, Capacity("x", nodes=({"CPU": 3},)), [2, 3, 4, 5, 6, 7, 8])


def test_every_resource_on_some_node_but_none_with_all_of_them():
    cfg = _cfg("scaling.use_gpu=true", "scaling.cpus_per_worker=8")
    with pytest.raises(RunError) as e:
        check_placement(cfg, Capacity("x", nodes=({"CPU": 64}, {"CPU": 4, "GPU": 8})), [4])
    assert "no node has all of it" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad", ["-1", ".inf", ".nan", "1e8"])
def test_start_timeout_is_checked_like_the_other_timeouts(bad):
    with pytest.raises(ConfigError) as e:
        _cfg(f"scaling.start_timeout_s={bad}")
    assert str(e.value).startswith("config scaling.start_timeout_s: expected ")
    assert _cfg("scaling.start_timeout_s=0").scaling.start_timeout_s == 0  # 0: wait for good
    default = _cfg().scaling.start_timeout_s
    assert 60 <= default <= 3600 and math.isfinite(default)
