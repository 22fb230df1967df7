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
