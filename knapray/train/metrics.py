"""What a step reports: ``StepRecord`` (one line of ``metrics.jsonl``) and the writer that
appends rank 0's records to the run directory."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from knapray.nofollow import open_nofollow


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
        self.path = os.path.join(run_dir, "metrics.jsonl")

    def append(self, record: dict) -> None:
        with open_nofollow(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
