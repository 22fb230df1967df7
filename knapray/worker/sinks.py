"""Where rank 0 sends each step's scalars: TensorBoard event files in the run directory
(``metrics.tensorboard``: by default whenever the package is installed), Weights & Biases and
MLflow when configured, and callbacks. ``metrics.jsonl`` (``report``) has every step
whatever the sinks.

``MetricSinks`` lives on rank 0 only. A callback that is a barrier over all ranks
(``ray.train.report``) must not be one of its callbacks: the trainer calls that on every
rank itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import numbers
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from knapray.nofollow import open_nofollow
from knapray.config.run import TrainConfig

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb-run-id"
MLFLOW_ID_FILE = "mlflow-run-id"
MLFLOW_PARAMS_PER_CALL = 100  # the tracking server's limit for one batch

Callback = Callable[[int, dict[str, float]], None]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def mlflow_tracking_uri(cfg: TrainConfig) -> str:
    """``metrics.mlflow_tracking_uri``, else the ``MLFLOW_TRACKING_URI`` environment variable."""
    return cfg.metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")


def enabled_sinks(cfg: TrainConfig) -> list[str]:
    """The sinks a run with ``cfg`` logs to, e.g. ["tensorboard", "wandb"]. A sink set in
    the config whose package is missing is an error naming the key (call this early, before
    workers start); MLflow set by the environment alone is skipped then, with a warning."""
    sinks = []
    if cfg.metrics.tensorboard != "off":
        if _installed("tensorboard"):
            sinks.append("tensorboard")
        elif cfg.metrics.tensorboard == "on":
            raise RuntimeError("metrics.tensorboard='on' but the tensorboard package is not installed: "
                               "pip install tensorboard (a knapray dependency: make setup), or set "
                               "metrics.tensorboard=auto|off")
        else:
            logger.warning("the tensorboard package is not installed: no TensorBoard event files "
                           "(metrics.jsonl has every step); pip install tensorboard to get them")
    if cfg.metrics.wandb_project:
        if not _installed("wandb"):
            raise RuntimeError(f"metrics.wandb_project={cfg.metrics.wandb_project!r} but the wandb package is not "
                               "installed: pip install 'knapray[wandb]', or set metrics.wandb_project=''")
        sinks.append("wandb")
    if mlflow_tracking_uri(cfg):
        if _installed("mlflow"):
            sinks.append("mlflow")
        elif cfg.metrics.mlflow_tracking_uri:
            raise RuntimeError(f"metrics.mlflow_tracking_uri={cfg.metrics.mlflow_tracking_uri!r} but the mlflow package "
                               "is not installed: pip install 'knapray[mlflow]', or set metrics.mlflow_tracking_uri=''")
        else:
            logger.warning("MLFLOW_TRACKING_URI is set but mlflow is not installed: not logging to MLflow")
    return sinks


def scalars_of(record: Mapping[str, Any], skip: tuple[str, ...] = ("step",)) -> dict[str, float]:
    """The real-number entries of a metrics record (e.g. a ``metrics.jsonl`` line), lists,
    strings, booleans and None left out."""
    return {
        k: float(v) for k, v in record.items()
        if k not in skip and isinstance(v, numbers.Real) and not isinstance(v, bool)
    }


def _read_id(path: str) -> str | None:
    """The tracker run id a previous start of this run kept at ``path``, if any."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _write_id(path: str, run_id: str) -> None:
    with open_nofollow(path, "w") as f:
        f.write(run_id + "\n")


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as {"optim.lr": "0.001", ...} (MLflow params are strings)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


def _wait_past_the_newest_event_file(tb_dir: str) -> None:
    """Sleep (under a second) until the clock's second is past every event file's in ``tb_dir``.

    TensorBoard reads a directory's event files in name order, and a name is
    ``events.out.tfevents.<second>.<host>.<pid>.<counter>`` with the counter not padded: two
    files of one process in one second can sort in the wrong order (``...9`` after ``...10``),
    and then the resumed run's purge of the redone steps is read before the steps it purges.
    A later second always sorts later.
    """
    newest = -1
    try:
        names = os.listdir(tb_dir)
    except FileNotFoundError:
        return
    for name in names:
        parts = name.split(".")
        if name.startswith("events.out.tfevents.") and len(parts) > 3 and parts[3].isdigit():
            newest = max(newest, int(parts[3]))
    if newest > time.time() + 2:
        return  # a name from a clock ahead of this one: not worth waiting for
    while int(time.time()) <= newest:
        time.sleep(newest + 1 - time.time() + 0.01)


class MetricSinks:
    """``log(step, scalars)`` to every sink, ``close()`` at the end of the run.

    ``start_step``: the first step this run logs. On a resumed run TensorBoard drops the
    events the previous run wrote from that step on (steps redone after its last
    checkpoint), so every step shows once; W&B ignores (with a warning) the steps it has
    already seen, so it keeps the previous run's values of those steps.
    """

    def __init__(self, cfg: TrainConfig, *, start_step: int = 0, callbacks: tuple[Callback, ...] = ()) -> None:
        self.names = enabled_sinks(cfg)
        self.callbacks = tuple(callbacks)
        run_dir = cfg.run_dir
        os.makedirs(run_dir, exist_ok=True)
        self._tb = None
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = os.path.join(run_dir, TENSORBOARD_DIR)
            _wait_past_the_newest_event_file(tb_dir)
            self._tb = SummaryWriter(tb_dir, purge_step=start_step or None)
        self._wandb = self._mlflow = None
        # A tracker run's id is kept in the run directory: a resumed run logs on to the same run.
        if "wandb" in self.names:
            wandb = importlib.import_module("wandb")
            path = os.path.join(run_dir, WANDB_ID_FILE)
            run_id = _read_id(path) or uuid.uuid4().hex[:16]
            _write_id(path, run_id)
            self._wandb = wandb.init(project=cfg.metrics.wandb_project, name=cfg.run.name, id=run_id,
                                     resume="allow", dir=run_dir)
            # A resumed run may change settings (lr, topology...): the run shows the latest.
            self._wandb.config.update(cfg.to_dict(), allow_val_change=True)
        if "mlflow" in self.names:
            mlflow = importlib.import_module("mlflow")
            mlflow.set_tracking_uri(mlflow_tracking_uri(cfg))
            mlflow.set_experiment(cfg.metrics.mlflow_experiment)
            path = os.path.join(run_dir, MLFLOW_ID_FILE)
            run_id = _read_id(path)
            if run_id is None:
                run = mlflow.start_run(run_name=cfg.run.name)
                _write_id(path, run.info.run_id)
                # Params are write-once in MLflow: logged by the run's first start only, as a
                # resumed run with, say, another lr would be refused.
                params = list(_flat(cfg.to_dict()).items())
                for i in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
                    mlflow.log_params(dict(params[i : i + MLFLOW_PARAMS_PER_CALL]))
            else:
                mlflow.start_run(run_id=run_id)
            self._mlflow = mlflow
        self._closed = False

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log ``scalars`` ({tag: number}) at ``step``; non-finite values are logged as they
        are (a nan loss is worth seeing)."""
        if self._closed:
            raise RuntimeError("MetricSinks.log after close()")
        values: dict[str, float] = {}
        for tag, value in scalars.items():
            if not isinstance(tag, str) or not tag:
                raise ValueError(f"metric tag must be a non-empty string, got {tag!r}")
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"metric {tag!r}: expected a real number, got {value!r} ({type(value).__name__})")
            values[tag] = float(value)
        if self._tb is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics(values, step=step)
        for callback in self.callbacks:
            callback(step, dict(values))

    def images(self, step: int, images: Mapping[str, "np.ndarray"]) -> None:
        """Images ({tag: (H, W, 3) floats in [0, 1]}) at ``step``: TensorBoard only (W&B and
        MLflow get the run directory's PNG files from ``validation/``)."""
        if self._tb is not None:
            for tag, image in images.items():
                self._tb.add_image(tag, image, global_step=step, dataformats="HWC")
            self._tb.flush()

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()

    def __enter__(self) -> "MetricSinks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
