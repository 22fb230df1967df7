"""``knapray sample``'s arguments: sizes are WIDTHxHEIGHT, requests pair captions with sizes
(one for all, one each, or one caption at every size), and every argument is checked
against the run before any weights load. From a user's own images to a sampled grid
(ingest with a VAE + T5 + CLIP, train, sample, decoded by the same VAE) is the README's
recipe, run by tests/ray/test_readme_commands.py."""

from __future__ import annotations

import numpy as np
import pytest

from knapray.cli import main
from knapray.inference.requests import pair_requests, parse_size
from knapray.models.sampling import flow_timesteps


def test_sizes_and_time_grid():
    assert parse_size("768x512") == (768, 512)  # (width, height)
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        parse_size("big")
    ts = flow_timesteps(4)
    assert ts[0] == 1.0 and ts[-1] == 0.0 and np.all(np.diff(ts) < 0)
    shifted = flow_timesteps(4, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0 and shifted[2] > ts[2]


def test_requests_pair_captions_with_sizes():
    a, b = (512, 512), (768, 384)
    assert pair_requests(["cat"], [a, b]) == [("cat", a), ("cat", b)]  # one caption at every size
    assert pair_requests(["cat", "dog"], [a]) == [("cat", a), ("dog", a)]
    assert pair_requests(["cat", "dog"], [a, b]) == [("cat", a), ("dog", b)]
    with pytest.raises(ValueError, match="2 requests .* and 3 --size"):
        pair_requests(["cat", "dog"], [a, b, a])


@pytest.fixture
def run_dir(tmp_path):
    from dist_utils import sampling_run_dir

    return sampling_run_dir(tmp_path)


@pytest.mark.parametrize("extra, names", [
    (["--size", "500x512"], ["--size 500x512", "multiples of 16", "nearest valid: 496x512 or 512x512"]),
    (["--caption", "b", "--size", "512x512", "--size", "512x512", "--size", "64x64"], ["2 requests", "3 --size"]),
    (["--size", "512"], ["WIDTHxHEIGHT"]),
    (["--checkpoint", "/nonexistent/step-1"], ["/nonexistent/step-1", "no .metadata"]),
    (["--device", "cuda"], ["--device cuda", "no CUDA device"]),  # this machine has none
])
def test_arguments_are_checked_before_anything_loads(run_dir, extra, names, monkeypatch, capsys):
    import knapray.driver.gang as gang
    import knapray.driver.trained as trained

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded before the arguments were checked")

    monkeypatch.setattr(gang, "sample_local", refuse)
    monkeypatch.setattr(trained, "load_weights", refuse)
    code = main(["sample", "--run", str(run_dir), "--caption", "a", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    for name in names:
        assert name in err[0], (name, err[0])


@pytest.mark.parametrize("command", [["sample", "--caption", "a fox"], ["export", "--out", "exported"]])
@pytest.mark.parametrize("damage, needle", [
    (b"{nope", "is not JSON"), (b"[]", "holds a list"),
    (b'{"format_version": 2, "model": {"hidden_size": "wide"}}', "model.hidden_size"),
    (b'{"model": {}}', "run format 1")])
def test_sample_and_export_read_a_damaged_config_json_in_one_line(command, damage, needle, tmp_path, capsys):
    """The run's config.json is read as pre-flight reads it (knapray.driver.run_dir)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_bytes(damage)
    code = main([command[0], "--run", str(run), *command[1:]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert str(run / "config.json") in err[0] and needle in err[0], err[0]


@pytest.mark.parametrize("field, value, words", [
    ("shift", 500.0, "shift: 500.0; a number in (0, 100]"),
    ("shift", 0.0, "shift: 0.0; a number in (0, 100]"),
    ("guidance", -1.0, "guidance: -1.0; a number in [0, 100]"),
    ("steps", 0, "steps: 0; an integer in [1, "),
])
def test_a_job_out_of_bounds_names_the_field_and_its_range(field, value, words):
    """What ``knapray serve`` answers a bad request with (``inference.jobs.RunRules``)."""
    from dataclasses import replace

    from knapray.inference.jobs import Job, RunRules

    rules = RunRules(down=8, patch=(2, 2), text_encoder=False)
    rules.check(Job(None, 64, 64, shift=2.0, guidance=3.0))  # in bounds: no error
    with pytest.raises(ValueError) as e:
        rules.check(replace(Job(None, 64, 64), **{field: value}))
    assert str(e.value).startswith(words), str(e.value)


@pytest.mark.parametrize("visible, rank, want", [(None, 2, "cuda:2"), ("5", 2, "cuda:0"), ("0,1,2,3", 3, "cuda:3")])
def test_each_local_sampling_rank_sets_its_own_cuda_device(run_dir, monkeypatch, visible, rank, want):
    """``knapray sample --world-size N`` on one machine: rank r on cuda:r, made the current
    device before anything lands on one (Wan's all_gather_object uses the current device);
    under Ray each actor sees one GPU, device 0."""
    import torch

    import knapray.driver.gang as gang
    import knapray.worker.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "check_checkpoint", lambda path: None)  # the stand-in run has no weights
    made = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.append(str(d)))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    r = gang.SamplerRank(str(run_dir), None, rank, 4, "g1n4", device="cuda", load=False)
    assert r.device == want and made == [want]


def _drawn(frames):
    """What ``driver.gang.sample_local`` hands back, for a run without weights."""
    from types import SimpleNamespace

    return lambda what, world: SimpleNamespace(latents=[], frames=frames, ema=False, recompiles=0, topology=None,
                                               bags=None)


def test_out_dir_holds_every_request_at_full_resolution_and_the_grid(run_dir, tmp_path, monkeypatch, capsys):
    """A 512x512 and a 768x384 request come out as two files of their own sizes, pixel for
    pixel what the ranks decoded, beside the titled grid; ``--out FILE.png`` is the grid alone."""
    from PIL import Image

    import knapray.driver.gang as gang
    import knapray.worker.checkpoint as checkpoint

    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (1, 512, 512, 3), dtype=np.uint8),
              rng.integers(0, 256, (1, 384, 768, 3), dtype=np.uint8)]
    monkeypatch.setattr(checkpoint, "check_checkpoint", lambda path: None)  # the stand-in run has no weights
    monkeypatch.setattr(gang, "sample_local", _drawn(frames))
    argv = ["sample", "--run", str(run_dir), "--caption", "a red bicycle", "--size", "512x512", "--size", "768x384"]
    out = tmp_path / "bicycles"
    assert main([*argv, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["grid.png", "request_0.png", "request_1.png"]
    for i, want in enumerate(frames):
        got = np.asarray(Image.open(out / f"request_{i}.png").convert("RGB"))
        assert np.array_equal(got, want[0]), i
    assert "request_0.png 512x512" in said and "request_1.png 768x384" in said, said
    assert main([*argv, "--out", str(tmp_path / "grid.png")]) == 0
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".png"] == ["grid.png"]


def test_out_dir_must_be_new_or_empty_before_anything_loads(run_dir, tmp_path, monkeypatch, capsys):
    import knapray.driver.gang as gang
    import knapray.worker.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "check_checkpoint", lambda path: None)
    monkeypatch.setattr(gang, "sample_local", lambda *a: pytest.fail("sampled into a folder that holds files"))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "request_0.png").write_bytes(b"")
    assert main(["sample", "--run", str(run_dir), "--caption", "a", "--out", str(tmp_path / "old")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "not empty" in err[0], err


@pytest.mark.parametrize("av", [True, False])
def test_a_clip_is_an_mp4_with_pyav_else_an_animated_png(tmp_path, monkeypatch, av):
    import importlib.util

    from knapray.inference.images import save_requests

    if av:
        pytest.importorskip("av")
    else:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "av" else real(name, *a))
    clip = np.random.default_rng(1).integers(0, 256, (5, 48, 64, 3), dtype=np.uint8)
    names = save_requests(str(tmp_path), [clip], ["a clip\n64x48"])
    name = names[0]
    assert name == ("request_0.mp4" if av else "request_0.png") and (tmp_path / "grid.png").exists()
    if av:
        import av as pyav

        with pyav.open(str(tmp_path / name)) as f:
            got = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
        assert len(got) == 5 and got[0].shape == (48, 64, 3)
    else:
        from PIL import Image

        with Image.open(tmp_path / name) as im:
            assert im.n_frames == 5 and im.size == (64, 48)
            im.seek(2)
            assert np.array_equal(np.asarray(im.convert("RGB")), clip[2])


@pytest.mark.parametrize("text", ["512X512", "512 x 512", "５１２x512", "+512x512"])
def test_a_size_has_one_spelling(text):
    with pytest.raises(ValueError) as e:
        parse_size(text)
    assert "WIDTHxHEIGHT" in str(e.value) and "512x512" in str(e.value) and "\n" not in str(e.value)


def test_a_validation_size_has_the_same_spelling():
    from knapray.config.run import ConfigError
    from knapray.driver.preflight import load_run_config

    with pytest.raises(ConfigError, match="validation.sizes.*512X512"):
        load_run_config(None, ["metrics.validation.sizes=[512X512]"])


def test_sampling_ranks_each_have_a_gpu_of_their_own_or_are_refused_before_anything_starts(run_dir, monkeypatch,
                                                                                            capsys):
    """``--world-size 4`` on a machine with 2 GPUs put two ranks on one GPU (NCCL refuses it)
    or a rank on a device that is not there, after the processes had started; ``auto`` is
    cuda where there is a GPU. Refused in one line, and ``knapray serve`` on an embedded Ray
    (whose gang's actors would otherwise wait for GPUs for good) the same way."""
    import knapray.driver.gang as gang
    import knapray.driver.placement as placement
    from knapray.commands.flags import gang_device

    assert gang_device("auto", 4, 0, "here") == "cpu" and gang_device("auto", 2, 2, "here") == "cuda"
    assert gang_device("cpu", 8, 2, "here") == "cpu" and gang_device("cuda", 1, 1, "here") == "cuda"
    with pytest.raises(ValueError, match=r"^--device cuda: here has no CUDA device"):
        gang_device("cuda", 1, 0, "here")
    with pytest.raises(ValueError, match=r"^--world-size 4: each rank takes a GPU of its own, and here has 2; "
                                         r"--world-size 2 or fewer, or --device cpu$"):
        gang_device("auto", 4, 2, "here")

    def refuse(*args, **kwargs):
        raise AssertionError("ranks started before the devices were checked")

    monkeypatch.setattr(gang, "sample_local", refuse)
    monkeypatch.setattr(placement, "local_gpus", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for command in (["sample", "--run", str(run_dir), "--caption", "a"], ["serve", "--run", str(run_dir)]):
        code = main([*command, "--world-size", "4", "--device", "cuda"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "--world-size 4: each rank takes a GPU of its own" in err[0], err
    monkeypatch.setattr(placement, "local_gpus", lambda: 0)
    assert main(["serve", "--run", str(run_dir), "--device", "cuda"]) == 2
    assert "--device cuda: the embedded Ray on this machine has no CUDA device" in capsys.readouterr().err


def test_a_cluster_that_never_holds_the_gangs_gpus_is_refused(monkeypatch):
    """On a cluster joined through $RAY_ADDRESS the gang's ranks (a GPU and a CPU each) are
    checked against its nodes and the node types its autoscaler reported; one that reports
    none may still add nodes, and is let wait."""
    import knapray.driver.placement as placement
    from knapray.commands.serve import check_cluster_gpus
    from knapray.driver.serving import ServeOptions

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    nodes = ({"CPU": 8.0}, {"CPU": 8.0, "GPU": 1.0})

    def cluster(*types, unknown=False):
        monkeypatch.setattr(placement, "cluster_capacity", lambda ray, where: placement.Capacity(
            where, nodes=nodes, node_types=tuple(types), autoscaler_unknown=unknown))

    four = ServeOptions(run="r", world_size=4, device="cuda")
    cluster(placement.NodeType("gpu1", {"CPU": 4.0, "GPU": 1.0}, 2))
    with pytest.raises(ValueError, match=r"^--world-size 4: each rank of the gang takes a GPU and a CPU, and "
                                         r"the Ray cluster at \$RAY_ADDRESS holds 3 such ranks at once"):
        check_cluster_gpus(None, four)
    check_cluster_gpus(None, ServeOptions(run="r", world_size=3, device="cuda"))
    check_cluster_gpus(None, ServeOptions(run="r", world_size=4, device="cpu"))
    cluster(placement.NodeType("gpu8", {"CPU": 64.0, "GPU": 8.0}, -1))  # no bound: it may add enough
    check_cluster_gpus(None, four)
    cluster(unknown=True)
    check_cluster_gpus(None, four)
    cluster()  # no GPU anywhere and none reported to come: auto is cpu there
    nodes = ({"CPU": 8.0},)
    check_cluster_gpus(None, ServeOptions(run="r", world_size=4, device="auto"))


def test_a_rank_prepares_one_batch_at_a_time(run_dir, monkeypatch):
    """The gang sends the next arrivals' ``prepare`` to rank 0 before the last one's ended (its
    actor runs calls at once); one's end moves the text encoder to the host (``encoders:
    offload``) or drops it while the other encodes. Two at once on one rank run one after the
    other: never two inside at the same time."""
    import threading
    import time

    import knapray.driver.gang as gang
    import knapray.inference.prepare as prepare
    import knapray.worker.checkpoint as checkpoint
    from knapray.inference.jobs import Job

    monkeypatch.setattr(checkpoint, "check_checkpoint", lambda path: None)  # the stand-in run has no weights
    rank = gang.SamplerRank(str(run_dir), None, 0, 1, "g1n1", load=False)
    inside, most = [0], [0]

    def resolve(*args, **kwargs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.2)
        inside[0] -= 1
        return []

    monkeypatch.setattr(prepare, "resolve_jobs", resolve)
    monkeypatch.setattr(gang.SamplerRank, "unconditional", None)
    job = Job(caption=None, width=64, height=64, like=0)
    threads = [threading.Thread(target=rank.prepare, args=([job],)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1


def test_every_gang_restart_is_counted_even_one_broken_again_between_two_looks():
    """serve's restarts metric: a gang that restarted twice between two looks (broken at
    both) counts two, from the gang's own count."""
    from types import SimpleNamespace

    from knapray.driver.serving import RestartWatch

    gang, watch = SimpleNamespace(broken=False, restarts=0), RestartWatch()
    assert watch.look(gang) == 0
    gang.broken = True
    assert watch.look(gang) == 0
    gang.restarts = 2  # restarted, broken again, restarted, broken again: all before this look
    assert watch.look(gang) == 2 and watch.look(gang) == 0
    gang.restarts, gang.broken = 3, False
    assert watch.look(gang) == 1
