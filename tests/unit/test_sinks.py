"""Metric sinks: TensorBoard event files read back (tags, steps, values; a resumed run's
redone steps replace the old ones), W&B and MLflow through fake modules (what is called,
resume onto the same tracker run), skipped when not configured, refused when configured
but not installed, and the callback sink."""

from __future__ import annotations

import importlib.machinery
import logging
import math
import os
import sys
import types

import pytest

pytest.importorskip("tensorboard")  # a knapray dependency; the GPU machine has only torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from knapray.config.run import load_config
from knapray.worker.sinks import MLFLOW_ID_FILE, TENSORBOARD_DIR, WANDB_ID_FILE, MetricSinks, enabled_sinks, scalars_of


def _cfg(tmp_path, *overrides: str):
    return load_config(None, [f"run.storage={tmp_path}", "run.name=r", *overrides])


def _events(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(os.path.join(run_dir, TENSORBOARD_DIR))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(autouse=True)
def no_trackers(monkeypatch):
    """wandb and mlflow absent unless a test installs a fake; no tracking URI from the env."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _fake_module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # "installed" for find_spec
    for attr, value in attrs.items():
        setattr(module, attr, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _fake_wandb(monkeypatch, calls: list) -> None:
    class Run:
        config = types.SimpleNamespace(update=lambda d, **kw: calls.append(("config.update", d, kw)))

        def log(self, values, step):
            calls.append(("log", dict(values), step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    _fake_module(monkeypatch, "wandb", init=init)


def _fake_mlflow(monkeypatch, calls: list) -> None:
    def start_run(run_id=None, run_name=None):
        calls.append(("start_run", run_id, run_name))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id or "mlrun42"))

    def record(name):
        return lambda *args, **kwargs: calls.append((name, *args, *(kwargs.items())))

    _fake_module(monkeypatch, "mlflow", start_run=start_run, set_tracking_uri=record("set_tracking_uri"),
                 set_experiment=record("set_experiment"), log_params=record("log_params"),
                 log_metrics=record("log_metrics"), end_run=record("end_run"))


def test_tensorboard_event_files_hold_the_scalars(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    assert enabled_sinks(cfg) == ["tensorboard"]
    with MetricSinks(cfg) as sinks:
        for step in range(3):
            sinks.log(step, {"train/loss": 1.0 / (step + 1), "train/lr": 1e-3 * step, "tokens_per_s": 100 + step})
    events = _events(cfg.run_dir)
    assert set(events) == {"train/loss", "train/lr", "tokens_per_s"}
    assert [s for s, _ in events["train/loss"]] == [0, 1, 2]
    assert [v for _, v in events["train/loss"]] == pytest.approx([1.0, 0.5, 1 / 3])
    assert events["train/lr"] == [(0, 0.0), (1, pytest.approx(1e-3)), (2, pytest.approx(2e-3))]
    assert [v for _, v in events["tokens_per_s"]] == [100.0, 101.0, 102.0]
    assert not os.path.exists(os.path.join(cfg.run_dir, WANDB_ID_FILE))


def test_resumed_run_replaces_the_redone_steps(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    with MetricSinks(cfg) as sinks:
        for step in range(5):
            sinks.log(step, {"loss": float(step)})
    with MetricSinks(cfg, start_step=3) as sinks:  # resumed from the checkpoint after step 2
        for step in range(3, 6):
            sinks.log(step, {"loss": 10.0 + step})
    assert _events(cfg.run_dir)["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]


def test_resume_in_the_same_second_past_a_counter_of_nine(tmp_path, monkeypatch) -> None:
    """The event file's name ends in a per-process counter, not padded: ``...9`` sorts after
    ``...10``. A resumed run in the same process and second would have its purge read first."""
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    test_resumed_run_replaces_the_redone_steps(tmp_path)
    names = sorted(os.listdir(os.path.join(tmp_path, "r", TENSORBOARD_DIR)))
    assert [n.rsplit(".", 1)[1] for n in names] == ["9", "10"]


def test_log_checks_values_and_close(tmp_path) -> None:
    sinks = MetricSinks(_cfg(tmp_path))
    for bad, words in [({"loss": "1"}, "metric 'loss': expected a real number, got '1' (str)"),
                       ({"ok": True}, "metric 'ok': expected a real number, got True (bool)"),
                       ({"": 1.0}, "metric tag must be a non-empty string, got ''")]:
        with pytest.raises(ValueError) as info:
            sinks.log(0, bad)
        assert str(info.value) == words
    sinks.log(0, {"loss": math.nan})  # logged as it is
    sinks.close()
    sinks.close()
    with pytest.raises(RuntimeError, match="after close"):
        sinks.log(1, {"loss": 1.0})
    assert math.isnan(_events(_cfg(tmp_path).run_dir)["loss"][0][1])


def test_callbacks_get_every_log(tmp_path) -> None:
    got = []
    with MetricSinks(_cfg(tmp_path), callbacks=(lambda step, s: got.append((step, s)),)) as sinks:
        sinks.log(4, {"loss": 2, "lr": 0.5})
    assert got == [(4, {"loss": 2.0, "lr": 0.5})] and type(got[0][1]["loss"]) is float


def test_scalars_of_a_record() -> None:
    record = {"step": 3, "loss": 0.5, "tokens": 10, "compute_s": [1.0, 2.0], "topology": "g1n2",
              "peak_mem_gib": None, "resumed": False}
    assert scalars_of(record) == {"loss": 0.5, "tokens": 10.0}


def test_wandb_when_configured(tmp_path, monkeypatch) -> None:
    calls: list = []
    _fake_wandb(monkeypatch, calls)
    assert enabled_sinks(_cfg(tmp_path)) == ["tensorboard"]  # installed, not configured: off
    cfg = _cfg(tmp_path, "metrics.wandb_project=knap")
    assert enabled_sinks(cfg) == ["tensorboard", "wandb"]
    with MetricSinks(cfg) as sinks:
        sinks.log(7, {"loss": 0.25})
    (init, kwargs), update, log, finish = calls
    run_id = open(os.path.join(cfg.run_dir, WANDB_ID_FILE)).read().strip()
    assert init == "init" and kwargs == {"project": "knap", "name": "r", "id": run_id, "resume": "allow",
                                         "dir": cfg.run_dir}
    assert len(run_id) == 16
    assert update == ("config.update", cfg.to_dict(), {"allow_val_change": True})
    assert log == ("log", {"loss": 0.25}, 7) and finish == ("finish",)
    calls.clear()
    with MetricSinks(load_config(None, [f"run.storage={tmp_path}", "run.name=r", "metrics.wandb_project=knap",
                                       "optim.lr=0.5"]), start_step=8):
        pass
    assert calls[0][1]["id"] == run_id  # a resumed run logs on to the same W&B run
    assert calls[1][1]["optim"]["lr"] == 0.5


def test_mlflow_when_configured_by_config_or_env(tmp_path, monkeypatch) -> None:
    calls: list = []
    _fake_mlflow(monkeypatch, calls)
    assert enabled_sinks(_cfg(tmp_path)) == ["tensorboard"]
    cfg = _cfg(tmp_path, "metrics.mlflow_tracking_uri=file:///tmp/mlruns", "metrics.mlflow_experiment=exp")
    with MetricSinks(cfg) as sinks:
        sinks.log(2, {"loss": 0.5, "lr": 0.001})
    assert calls[:3] == [("set_tracking_uri", "file:///tmp/mlruns"), ("set_experiment", "exp"),
                         ("start_run", None, "r")]
    params = {k: v for c in calls if c[0] == "log_params" for k, v in c[1].items()}
    assert params["optim.lr"] == "0.001" and params["run.name"] == "r" and params["optim.betas"] == "(0.9, 0.999)"
    assert all(len(c[1]) <= 100 for c in calls if c[0] == "log_params")
    assert calls[-2:] == [("log_metrics", {"loss": 0.5, "lr": 0.001}, ("step", 2)), ("end_run",)]
    assert open(os.path.join(cfg.run_dir, MLFLOW_ID_FILE)).read().strip() == "mlrun42"

    calls.clear()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    env_cfg = _cfg(tmp_path)  # the same run directory: resumes the MLflow run, no params again
    assert enabled_sinks(env_cfg) == ["tensorboard", "mlflow"]
    MetricSinks(env_cfg, start_step=3).close()
    assert calls == [("set_tracking_uri", "http://tracker:5000"), ("set_experiment", "knapray"),
                     ("start_run", "mlrun42", None), ("end_run",)]


def test_configured_but_not_installed(tmp_path, monkeypatch, caplog) -> None:
    with pytest.raises(RuntimeError, match=r"metrics.wandb_project='knap' but the wandb package is not installed: "
                                           r"pip install 'knapray\[wandb\]', or set metrics.wandb_project=''"):
        enabled_sinks(_cfg(tmp_path, "metrics.wandb_project=knap"))
    with pytest.raises(RuntimeError, match=r"metrics.mlflow_tracking_uri='http://x' but the mlflow package"):
        MetricSinks(_cfg(tmp_path, "metrics.mlflow_tracking_uri=http://x"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://x")
    with caplog.at_level(logging.WARNING, logger="knapray.worker.sinks"):
        assert enabled_sinks(_cfg(tmp_path)) == ["tensorboard"]
    assert "MLFLOW_TRACKING_URI is set but mlflow is not installed" in caplog.text


def test_tensorboard_auto_on_off_where_it_is_not_installed(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with caplog.at_level(logging.WARNING, logger="knapray.worker.sinks"):
        assert enabled_sinks(_cfg(tmp_path)) == []  # auto: the run goes on without it
    assert "the tensorboard package is not installed" in caplog.text
    got = []
    with MetricSinks(_cfg(tmp_path), callbacks=(lambda step, s: got.append(step),)) as sinks:
        sinks.log(0, {"loss": 1.0})
    assert got == [0] and not os.path.exists(os.path.join(tmp_path, "r", TENSORBOARD_DIR))
    with pytest.raises(RuntimeError, match=r"metrics.tensorboard='on' but the tensorboard package is not installed"):
        enabled_sinks(_cfg(tmp_path, "metrics.tensorboard=on"))
    monkeypatch.delitem(sys.modules, "tensorboard")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="knapray.worker.sinks"):
        assert enabled_sinks(_cfg(tmp_path, "metrics.tensorboard=off")) == []
        assert enabled_sinks(_cfg(tmp_path, "metrics.tensorboard=on")) == ["tensorboard"]
    assert not caplog.text
    with MetricSinks(_cfg(tmp_path, "metrics.tensorboard=off")) as sinks:
        sinks.log(0, {"loss": 1.0})
    assert not os.path.exists(os.path.join(tmp_path, "r", TENSORBOARD_DIR))
