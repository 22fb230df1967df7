"""The own-images recipe trains what it says (issue 43, item 6): a run's length is chosen from
the corpus's size and printed (``data.epochs: 0`` trains ``run.max_steps`` steps, as many
epochs as they take; a run that its epochs end far short of ``run.max_steps`` says so);
``--set key=null`` takes the value the run would have without the key (the pretrained
checkpoint's width, the corpus's); the README says how ``knapray`` gets on PATH."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dist_utils import TINY_MMDIT, build_tiny_corpus, local_trainer
from knapray.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    ray = pytest.importorskip("ray")

    def refuse(*args, **kwargs):
        raise AssertionError("pre-flight started Ray")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """12 samples, as the README's 12 pictures: 2 steps of demo.yaml's 4 workers x 2."""
    return build_tiny_corpus(tmp_path_factory.mktemp("pictures"), "g4b3i64f1s0", steps=1)


def _check(pictures: str, tmp_path, *sets: str, capsys) -> list[str]:
    argv = ["train", "--config", str(REPO / "jobs/configs/demo.yaml"), "--set", f"data.corpus={pictures}",
            "--set", f"run.storage={tmp_path}", "--set", "run.name=pictures", "--check"]
    for s in sets:
        argv += ["--set", s]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out.splitlines()


def test_the_check_says_how_many_steps_and_epochs_the_run_trains(pictures, tmp_path, capsys):
    """demo.yaml on 12 pictures was 2 steps without a word; data.epochs=0 trains run.max_steps."""
    out = _check(pictures, tmp_path, capsys=capsys)
    steps = [line for line in out if "steps:" in line]
    assert len(steps) == 1 and "2 steps" in steps[0] and "data.epochs=1" in steps[0], out
    note = [line for line in out if "note:" in line]
    assert len(note) == 1 and "2 steps" in note[0] and "run.max_steps=24" in note[0] and "data.epochs=0" in note[0], out
    out = _check(pictures, tmp_path, "data.epochs=0", "run.max_steps=200", capsys=capsys)
    steps = [line for line in out if "steps:" in line]
    assert len(steps) == 1 and "200 steps" in steps[0] and "100 epochs of 12 samples" in steps[0], out
    assert not any("note:" in line for line in out), out


def test_epochs_zero_without_max_steps_is_one_line(pictures, tmp_path, capsys):
    argv = ["train", "--config", str(REPO / "jobs/configs/demo.yaml"), "--set", f"data.corpus={pictures}",
            "--set", "data.epochs=0", "--set", "run.max_steps=0", "--check"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.epochs=0" in err[0] and "run.max_steps" in err[0], err


def test_epochs_zero_trains_max_steps_over_as_many_epochs_as_they_take(tmp_path):
    corpus = build_tiny_corpus(tmp_path / "corpus", "g1b3i64f1s0", steps=1)  # 3 samples: 2 steps an epoch
    trainer = local_trainer(0, 1, corpus, str(tmp_path / "runs"), "epochs0",
                            [*TINY_MMDIT, "balance.topology=g1n1", "data.epochs=0", "run.max_steps=5"])
    summary = trainer.train()
    assert summary["steps"] == 5 and summary["epoch"] == 2, summary
    with open(trainer.run_dir + "/metrics.jsonl") as f:
        epochs = [json.loads(line)["epoch"] for line in f if line.strip()]
    assert epochs == [0, 0, 1, 1, 2], epochs


def test_set_null_takes_the_pretrained_checkpoints_width(tmp_path):
    """flux_dev_lora.yaml pins FLUX.1-dev's widths; another checkpoint's are taken with
    --set model.KEY=null (it was "None disagrees with model.pretrained")."""
    pytest.importorskip("diffusers")
    from flux_utils import save_tiny_flux
    from knapray.driver.preflight import load_run_config

    path = save_tiny_flux(tmp_path / "tiny", heads=2, head_dim=16, axes=(4, 6, 6), double=1, single=1, guidance=True,
                          text_dim=24, pooled_dim=20)
    pinned = ["in_channels", "hidden_size", "num_heads", "depth_double", "depth_single", "text_dim", "pooled_dim",
              "rope_axes_dim"]
    cfg = load_run_config(str(REPO / "jobs/configs/flux_dev_lora.yaml"),
                          [f"model.pretrained={path}", f"data.corpus={tmp_path / 'none'}",
                           *(f"model.{key}=null" for key in pinned)])
    m = cfg.model
    assert (m.hidden_size, m.num_heads, m.depth_double, m.depth_single, m.text_dim, m.pooled_dim, m.in_channels) == \
        (32, 2, 1, 1, 24, 20, 4), m
    assert m.lora.rank == 16  # the rest of the file stands


def test_set_null_takes_the_corpus_width_and_the_default(pictures):
    from knapray.config.run import load_config
    from knapray.driver.preflight import load_run_config

    cfg = load_run_config(str(REPO / "jobs/configs/demo.yaml"),
                          [f"data.corpus={pictures}", "model.text_dim=4096", "model.text_dim=null"])
    assert cfg.model.text_dim == 16  # the corpus's
    assert load_config(str(REPO / "jobs/configs/demo.yaml"), ["model.hidden_size=null"]).model.hidden_size == \
        load_config(None, []).model.hidden_size


def test_the_readme_says_how_knapray_gets_on_path():
    """make run installs knapray into .venv, which is not on PATH: the README says so before
    its first knapray command."""
    text = (REPO / "README.md").read_text()
    first = re.search(r"^knapray (ingest|train|sample|plan|synthetic) ", text, re.M)
    assert first is not None
    before = text[: first.start()]
    assert "source .venv/bin/activate" in before and ".venv/bin/knapray" in before, before[-1500:]
