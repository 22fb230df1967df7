"""What a step reports: ``StepRecord`` (one line of ``metrics.jsonl``), the writer that
appends rank 0's records to the run directory, and the reader every resume and report
shares (torn last lines cut, a resumed run's later steps dropped)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from knapray.nofollow import open_nofollow
from knapray.run_files import RunDir, RunError


@dataclass
class StepRecord:
    step: int
    loss: float
    loss_rel: float
    """Loss over the loss of predicting zero velocity on the same batch."""
    tokens: int
    seconds: float
    imbalance: float
    baseline_imbalance: float
    compute_s: list[float]
    comm_s: list[float]
    wait_plan_s: float
    planned_by: str
    rank_work: list[float]
    baseline_rank_work: list[float]
    topology: str = ""
    flops: float = 0.0
    """Model FLOPs of the step over all ranks (``knapray.models.flops``)."""
    clock: str = ""
    """What measured compute_s / comm_s: ``cuda_events`` or ``thread_time``."""
    peak_mem_gib: float | None = None
    """Rank 0's peak allocated device memory so far (CUDA only)."""
    epoch: int = 0
    lr: float = 0.0
    """Learning rate the step trained with."""
    peak_tflops: float | None = None
    """The GPU's dense bf16 peak (for MFU); None on CPU or an unknown GPU."""
    recompiles: int = 0
    """torch.compile recompilations so far in this process (0 without compile)."""
    node_sizes: list[int] | None = None
    """Ranks per node, in rank order, where the workers really ran (no bag crosses one)."""
    attention: str = ""
    """The kernel rank 0's bag ran attention on this step (``knapray.attention.choose_backend``)."""
    attention_reason: str = ""
    whole_on_shared: int = 0
    """Sequences the step ran whole on a rank that also served a bag of several (overlapping
    groups, ``balance.overlap``)."""
    predicted_compute_s: list[float] | None = None
    """Per-rank compute seconds (fixed cost included) the cost model that planned the step
    predicted (``planner: cost``; the live re-fit's model once it has replaced the prior).
    ``prediction_error`` is their mean relative error against ``compute_s``;
    ``step_prediction_error`` that of the slowest rank's (the step's compute time)."""

    def to_json(self) -> dict:
        compute = np.asarray(self.compute_s)
        return {
            "step": self.step,
            "epoch": self.epoch,
            "lr": self.lr,
            "loss": self.loss,
            "loss_rel": self.loss_rel,
            "tokens": self.tokens,
            "step_s": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0,
            "imbalance_planned": self.imbalance,
            "baseline_imbalance_planned": self.baseline_imbalance,
            "compute_s": self.compute_s,
            "compute_max_over_mean": float(compute.max() / compute.mean()) if compute.mean() > 0 else 1.0,
            "comm_s": self.comm_s,
            "wait_plan_s": self.wait_plan_s,
            "wait_plan_frac": self.wait_plan_s / self.seconds if self.seconds > 0 else 0.0,
            "planned_by": self.planned_by,
            "rank_work": self.rank_work,
            "baseline_rank_work": self.baseline_rank_work,
            "world_size": len(self.rank_work),
            "topology": self.topology,
            "whole_on_shared": self.whole_on_shared,
            "node_sizes": self.node_sizes,
            "model_tflops": self.flops / self.seconds / 1e12 if self.seconds > 0 else 0.0,
            "model_tflops_per_gpu": self.flops / self.seconds / 1e12 / len(self.rank_work) if self.seconds > 0 else 0.0,
            # The same FLOPs over the slowest rank's forward + backward (compute and
            # communication, CUDA events on GPU): what the blocks achieve, without the
            # optimizer step and the host's batch preparation.
            "model_tflops_fwd_bwd_per_gpu": _fwd_bwd_tflops(self.flops, self.compute_s, self.comm_s),
            "clock": self.clock,
            "peak_mem_gib": self.peak_mem_gib,
            "recompiles": self.recompiles,
            "attention": self.attention,
            "attention_reason": self.attention_reason,
            "predicted_compute_s": self.predicted_compute_s,
            "prediction_error": _prediction_error(self.predicted_compute_s, self.compute_s),
            "predicted_step_compute_s": max(self.predicted_compute_s) if self.predicted_compute_s else None,
            "measured_step_compute_s": max(self.compute_s) if self.compute_s else None,
            "step_prediction_error": _step_error(self.predicted_compute_s, self.compute_s),
            "mfu": (self.flops / self.seconds / 1e12 / len(self.rank_work) / self.peak_tflops
                    if self.peak_tflops and self.seconds > 0 else None),
        }


def _fwd_bwd_tflops(flops: float, compute_s: list[float], comm_s: list[float]) -> float:
    busy = max((c + m for c, m in zip(compute_s, comm_s)), default=0.0)
    return flops / busy / 1e12 / len(compute_s) if busy > 0 else 0.0


def _prediction_error(predicted: list[float] | None, measured: list[float]) -> float | None:
    """Mean over ranks of |predicted - measured| / measured compute seconds."""
    if not predicted:
        return None
    pairs = [(p, m) for p, m in zip(predicted, measured) if m > 0]
    return float(np.mean([abs(p - m) / m for p, m in pairs])) if pairs else None


def _step_error(predicted: list[float] | None, measured: list[float]) -> float | None:
    """|predicted - measured| / measured of the step's compute time (the slowest rank's)."""
    if not predicted or not measured or max(measured) <= 0:
        return None
    return abs(max(predicted) - max(measured)) / max(measured)


class MetricsFile:
    """``<run dir>/metrics.jsonl``, appended by rank 0 after every step."""

    def __init__(self, run_dir: str) -> None:
        self.path = RunDir(run_dir).metrics

    def append(self, record: dict) -> None:
        with open_nofollow(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


@dataclass(frozen=True)
class MetricsScan:
    """``metrics.jsonl`` read and checked (``scan_metrics``)."""

    records: list[dict]
    torn_at: int | None = None
    """Byte offset of a torn last line (None: there is none)."""
    torn: str | None = None
    """One line saying so, naming the file."""


def scan_metrics(run_dir: str) -> MetricsScan:
    """Rank 0's step records. A last line without its newline that is not a record is torn
    (a crash mid-append leaves exactly that): left out, and reported in ``torn``; it is the
    writer's to cut (``truncate_metrics``). Any other line that is not
    a JSON object with integer ``step`` and ``epoch`` is ``RunError`` naming the file and
    the line: every reader (the resume's rewrite, the step count, summary.json) needs them."""
    path = RunDir(run_dir).metrics
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return MetricsScan([])
    except OSError as e:
        raise RunError(f"run file {path}: cannot be read ({e.strerror})") from None
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with its newline
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record, why = _metrics_record(line)
        if why is not None:
            raise RunError(f"run file {path}: line {number} is not a step record ({why}); fix or delete that line "
                           "(the steps it held then go uncounted in summary.json)")
        records.append(record)
    if tail.strip():
        record, why = _metrics_record(tail)
        if why is None:  # whole but for its newline: the next rewrite adds it
            records.append(record)
        else:
            return MetricsScan(records, len(data) - len(tail),
                               f"run file {path}: dropped a torn last line {len(lines) + 1} ({len(tail)} bytes, "
                               f"{why}), as a crash while writing it leaves it")
    return MetricsScan(records)


def _metrics_record(line: bytes) -> tuple[dict | None, str | None]:
    """(the record, None) or (None, why the line is not one)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except ValueError:
        return None, "not JSON"
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object"
    for key in ("step", "epoch"):
        value = record.get(key)
        if type(value) is not int or value < 0:
            return None, f"{key} is {value!r}" if key in record else f"no {key}"
    return record, None


def read_metrics(run_dir: str) -> list[dict]:
    """The records of ``metrics.jsonl`` (``scan_metrics``: a torn last line left out)."""
    return scan_metrics(run_dir).records


def truncate_metrics(run_dir: str, from_step: int) -> None:
    """A resumed run redoes the steps after its checkpoint: drop their old lines (and a torn
    last line a worker killed mid-append left)."""
    path = RunDir(run_dir).metrics
    if not os.path.exists(path):
        return
    scan = scan_metrics(run_dir)
    keep = [r for r in scan.records if r["step"] < from_step]
    if len(keep) == len(scan.records) and scan.torn_at is None:
        return  # nothing to drop: the file stays as it is (a tail reading it sees no rewrite)
    tmp = path + ".tmp"
    with open_nofollow(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, path)


def most_used_first(counts: dict[str, int]) -> dict[str, int]:
    """``{topology: steps}`` ordered by steps, most first (ties by name)."""
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
