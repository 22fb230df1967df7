"""Running statistics: what the data and the hardware look like, recent steps only.

Length histogram and recent per-rank lengths (for ``"auto"`` topology selection),
imbalance / plan-time / plan-wait samples, and per-rank moving averages of measured step
times. With a ``LiveFit`` (``planner: cost``) every step's plan features wait here until
every rank has reported its compute seconds, then feed the fit, which gives the cost model
its coefficients and the per-rank speed factors; without one (``planner: workload``) the
speed factors are moving averages of planned work per measured second. They describe the
data and the machines, not a run, so they survive new runs; they are bounded in size.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from knapray.planning import BalancePlan
from knapray.planning.fitting.livefit import LiveFit, RankFeatures

log = logging.getLogger(__name__)

HIST_BINS = 48  # log2 length bins: bin k holds lengths in [2^k, 2^(k+1))
RECENT = 1024  # samples kept for running means and percentiles
WORK_STEPS = 64  # steps whose planned per-rank work is kept for speed estimates
EMAS = ("compute_s", "comm_s", "wait_plan_s", "work", "work_time")
_SAMPLES = ("baseline_imbalance", "imbalance", "moved_fraction", "plan_ms", "wait_s")


class RunningStats:
    def __init__(self, history_steps: int, ema_alpha: float, world_size: int = 0,
                 live: LiveFit | None = None) -> None:
        self._alpha = ema_alpha
        self.live = live
        """Re-fits the cost model from measured times (``planner: cost``), or None."""
        self._fit_pending: OrderedDict[int, tuple[RankFeatures, np.ndarray]] = OrderedDict()
        """Planned steps' features and the compute seconds reported so far (NaN: not yet)."""
        self.length_hist = np.zeros(HIST_BINS, dtype=np.int64)
        self.length_history: deque[list[list[int]]] = deque(maxlen=history_steps)
        """Recent planned steps' per-rank lengths (W, n_r)."""
        self._samples = {name: deque(maxlen=RECENT) for name in _SAMPLES}
        self._work_by_step: OrderedDict[int, np.ndarray] = OrderedDict()
        self.steps_planned = 0
        self.unledgered_steps = 0
        self.reset_ranks(world_size)

    def reset_ranks(self, world_size: int) -> None:
        """Per-rank averages only mean something for one world: start them over."""
        self._ema = {k: np.full(world_size, np.nan) for k in EMAS}
        self._fit_pending = OrderedDict()

    @property
    def ranks(self) -> int:
        return self._ema["compute_s"].size

    def record_plan(self, step: int, plan: BalancePlan, lens: list[list[int]]) -> None:
        self.steps_planned += 1
        self._work_by_step[step] = plan.rank_work.copy()
        while len(self._work_by_step) > WORK_STEPS:
            self._work_by_step.popitem(last=False)
        if self.live is not None and plan.world_size == self.ranks:
            self._fit_pending[step] = (RankFeatures.of_plan(plan), np.full(plan.world_size, np.nan))
            while len(self._fit_pending) > WORK_STEPS:
                self._fit_pending.popitem(last=False)
        if plan.num_sequences:
            bins = np.minimum(np.log2(plan.seq_lens).astype(np.int64), HIST_BINS - 1)
            self.length_hist += np.bincount(bins, minlength=HIST_BINS)
            self.length_history.append(lens)
        for name, value in (("baseline_imbalance", plan.baseline_imbalance), ("imbalance", plan.imbalance),
                            ("moved_fraction", plan.moved_token_fraction), ("plan_ms", plan.plan_time_ms)):
            self._samples[name].append(value)

    def report_timing(self, step: int, rank: int, compute_s: float, comm_s: float, wait_plan_s: float) -> None:
        """Measured seconds of one rank's step: model compute, communication, waiting for the plan."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not in [0, {self.ranks})")
        times = {"compute_s": compute_s, "comm_s": comm_s, "wait_plan_s": wait_plan_s}
        for name, value in times.items():
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"step {step}, rank {rank}: {name} must be a finite number >= 0, got {value!r}")
            self._ema_update(name, rank, float(value))
        self._samples["wait_s"].append(float(wait_plan_s))
        work = self._work_by_step.get(step)
        if work is not None and work[rank] > 0 and compute_s > 0:
            # Ratio of averages, not average of ratios: robust to steps with little work.
            self._ema_update("work", rank, float(work[rank]))
            self._ema_update("work_time", rank, float(compute_s))
        pending = self._fit_pending.get(step)
        if pending is not None:
            features, seconds = pending
            seconds[rank] = float(compute_s)
            if np.all(np.isfinite(seconds)):  # every rank has reported the step
                del self._fit_pending[step]
                self.live.observe(step, features, seconds)

    def _ema_update(self, name: str, rank: int, value: float) -> None:
        arr = self._ema[name]
        arr[rank] = value if np.isnan(arr[rank]) else (1 - self._alpha) * arr[rank] + self._alpha * value

    def speed_factors(self) -> np.ndarray:
        """(W,) each rank's speed relative to the median rank; 1.0 where none is known yet. A
        rank twice as slow gets ~0.5. From the live fit if there is one, else planned work
        per measured compute second."""
        if self.live is not None:
            speeds = self.live.speeds
            return speeds if speeds is not None and speeds.size == self.ranks else np.ones(self.ranks)
        speed = self._ema["work"] / self._ema["work_time"]
        known = np.isfinite(speed) & (speed > 0)
        factors = np.ones(self.ranks)
        if known.any():
            factors[known] = speed[known] / float(np.median(speed[known]))
        return factors

    def summary(self) -> dict:
        """JSON-friendly summary of recent planning and timing."""

        def mean(name: str) -> float | None:
            xs = self._samples[name]
            return float(np.mean(xs)) if len(xs) else None

        def pct(name: str, q: float) -> float | None:
            xs = self._samples[name]
            return float(np.percentile(xs, q)) if len(xs) else None

        def per_rank(name: str) -> list[float | None]:
            return [None if np.isnan(v) else float(v) for v in self._ema[name]]

        return {
            "steps_planned": self.steps_planned,
            "mean_baseline_imbalance": mean("baseline_imbalance"),
            "mean_imbalance": mean("imbalance"),
            "mean_moved_token_fraction": mean("moved_fraction"),
            "plan_ms_p50": pct("plan_ms", 50),
            "plan_ms_p95": pct("plan_ms", 95),
            "wait_plan_s_mean": mean("wait_s"),
            "wait_plan_s_p95": pct("wait_s", 95),
            "compute_s_ema": per_rank("compute_s"),
            "comm_s_ema": per_rank("comm_s"),
            "wait_plan_s_ema": per_rank("wait_plan_s"),
            "speed_factors": self.speed_factors().tolist() if self.ranks else [],
            "length_histogram": {int(2**k): int(c) for k, c in enumerate(self.length_hist) if c},
            "unledgered_steps": self.unledgered_steps,
            **({"live_fit": self.live.summary()} if self.live is not None else {}),
        }

    # ---- persistence (plain JSON) ---------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "length_hist": self.length_hist.tolist(),
            "length_history": [list(map(list, s)) for s in self.length_history],
            "samples": {k: [float(x) for x in v] for k, v in self._samples.items()},
            "ema": {k: [None if np.isnan(x) else float(x) for x in v] for k, v in self._ema.items()},
            "steps_planned": self.steps_planned,
            "unledgered_steps": self.unledgered_steps,
            **({"live_fit": self.live.to_json()} if self.live is not None else {}),
        }

    def load_json(self, state: dict[str, Any]) -> None:
        """Restore ``to_json``'s output; per-rank averages only if they are for this world
        size (or none is set yet). Raises ``ValueError``/``KeyError``/``TypeError`` if malformed."""
        hist = np.asarray(state["length_hist"], dtype=np.int64)
        if hist.shape != (HIST_BINS,):
            raise ValueError(f"length histogram of shape {hist.shape}, expected ({HIST_BINS},)")
        history = [[[int(x) for x in rank] for rank in step] for step in state["length_history"]]
        samples = {k: [float(x) for x in state["samples"][k]] for k in _SAMPLES}
        ema = {k: np.asarray([np.nan if x is None else float(x) for x in state["ema"][k]]) for k in EMAS}
        self.length_hist = hist
        self.length_history = deque(history, maxlen=self.length_history.maxlen)
        self._samples = {k: deque(v, maxlen=RECENT) for k, v in samples.items()}
        sizes = {v.size for v in ema.values()}
        if len(sizes) == 1 and self.ranks in (0, *sizes):
            self._ema = ema
        self.steps_planned = int(state["steps_planned"])
        self.unledgered_steps = int(state["unledgered_steps"])
        if self.live is not None and state.get("live_fit") is not None:
            if not self.live.load_json(state["live_fit"], world_size=self.ranks or None):
                log.warning("saved live cost fit not restored: it was fitted for another model or profile")
